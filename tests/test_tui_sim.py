"""Pilot tests of the dashboard against a live simulation (SimSource)."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
from rich.console import Console
from textual.widgets import DataTable, Input, OptionList, Static

from btbctl.tui.app import HelpScreen, PolicyScreen, ReplicateScreen
from btbctl.tui.widgets.panels import ConstantsPanel
from tui_helpers import press, running_app, small_source, wait_for


def _text(widget: Static) -> str:
    r = widget.render()
    return getattr(r, "plain", None) or str(r)


def _rich_text(widget: Static, width: int = 80) -> str:
    """What a Static holding a rich renderable shows, as plain text."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(widget.content)
    return console.export_text()


async def test_panels_fill_from_the_simulation():
    src = small_source()
    src.advance_to(8.0)

    async with running_app(src, (80, 24)) as (app, pilot):
        snap = app.snapshot
        assert snap.connected and snap.now_s == 8.0
        table = app.query_one("#prefix-table", DataTable)
        assert table.row_count == len(snap.prefixes) > 0
        # the hottest prefix is first, with its arrivals against the threshold
        first = table.get_row_at(0)
        assert first[0] == snap.prefixes[0].short_id
        assert str(first[2]) == f"{snap.prefixes[0].arrivals_in_window}/2"
        assert [w.name for w in snap.workers] == ["w0", "w1", "w2", "w3"]
        # the fleet panel shows every worker as up and every GPU
        fleet = [ln.split() for ln in _rich_text(app.query_one("#fleet-body", Static)).splitlines()]
        assert {f[0]: f[1] for f in fleet if f and f[0] in ("w0", "w1", "w2", "w3")} == dict.fromkeys(
            ["w0", "w1", "w2", "w3"], "up"
        )
        assert {f[0] for f in fleet if f and "/gpu" in f[0]} == {g.name for g in snap.gpus}
        assert len(snap.gpus) == 16 and all(g.total_bytes == 80e9 for g in snap.gpus)
        assert any(x.state == "done" for x in snap.transfers)  # BTB copied the first burst's prefix
        assert [p.t_s for p in snap.ttft] == sorted(p.t_s for p in snap.ttft) and snap.ttft
        head = str(app.query_one("#p4").border_title)
        assert head.startswith("4 TTFT last 60s") and "p95" in head
        assert "req/s" in str(app.query_one("#p4").border_subtitle)
        assert app.query_one(ConstantsPanel).border_title == "5 Constants | policy btb"
        assert app.query_one("#const-threshold", Input).value == "2"
        assert app.query_one("#const-prefix_blocks", Input).value == "32"


async def test_editing_threshold_changes_the_engine_and_bad_values_are_refused():
    src = small_source()
    src.advance_to(4.0)

    async with running_app(src, (100, 30)) as (app, pilot):
        await press(pilot, "e")  # the first field, prefix_blocks; tab: the next, threshold
        await wait_for(pilot, lambda: app.focused is app.query_one("#const-prefix_blocks"))
        await press(pilot, "tab")
        inp = app.query_one("#const-threshold", Input)
        await wait_for(pilot, lambda: inp.has_focus)
        inp.value = ""
        await press(pilot, "5", "enter")
        await wait_for(pilot, lambda: src.sim.detector.constants.threshold == 5)
        assert src.constants.threshold == 5
        await wait_for(pilot, lambda: "threshold = 5 confirmed" in app.query_one(ConstantsPanel).message)
        # refused before sending: the engine keeps 5
        inp.value = ""
        await press(pilot, "0", "enter")
        await wait_for(pilot, lambda: "must be an integer in [1," in app.query_one(ConstantsPanel).message)
        inp.value = "x"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "must be an integer, got 'x'" in app.query_one(ConstantsPanel).message)
        assert src.sim.detector.constants.threshold == 5
        # the next snapshot reports the engine's value
        await wait_for(pilot, lambda: app.snapshot.constants["threshold"] == 5)
        assert app.snapshot.prefixes[0].threshold == 5


async def test_engine_refusal_is_shown():
    src = small_source()
    src.advance_to(4.0)

    def refuse(**changes):
        from btbctl.engine.errors import ConfigError

        raise ConfigError("window_s", "refused by the fleet: too short for its clock")

    src.set_constants_sync = refuse

    async with running_app(src, (100, 30)) as (app, pilot):
        inp = app.query_one("#const-window_s", Input)
        inp.focus()
        inp.value = "0.5"
        await press(pilot, "enter")
        await wait_for(pilot, lambda: "refused by the fleet" in app.query_one(ConstantsPanel).message)
        assert src.constants.window_s == 1.0


async def test_replicating_a_prefix_shows_a_transfer_that_completes():
    src = small_source(policy="cache_aware")  # no automatic copies: every transfer is ours
    src.advance_to(6.0)

    async with running_app(src, (80, 24)) as (app, pilot):
        assert not app.snapshot.transfers
        target = next(p for p in app.snapshot.prefixes if p.holders == 1)
        table = app.query_one("#prefix-table", DataTable)
        row = [p.prefix_id for p in app.snapshot.prefixes].index(target.prefix_id)
        table.focus()
        table.move_cursor(row=row)
        await press(pilot, "r")
        await wait_for(pilot, lambda: isinstance(app.screen, ReplicateScreen) and isinstance(app.focused, Input))
        app.screen.query_one(Input).value = ""
        await press(pilot, "2", "enter")
        await wait_for(
            pilot, lambda: any(t.prefix_id == target.prefix_id and t.state == "running" for t in app.snapshot.transfers)
        )
        ours = [t for t in app.snapshot.transfers if t.prefix_id == target.prefix_id]
        assert len(ours) == 2 and all(t.bytes_total > 0 and t.source == "w" + t.source[1:] for t in ours)
        assert all(t.bytes_per_s > 0 and t.eta_s is not None for t in ours)
        src.advance_to(src.sim.now + max(t.eta_s for t in ours) + 0.5)
        await wait_for(
            pilot,
            lambda: [t.state for t in app.snapshot.transfers if t.prefix_id == target.prefix_id] == ["done", "done"],
        )
        row = next(p for p in app.snapshot.prefixes if p.prefix_id == target.prefix_id)
        assert row.holders == 3


def test_replicate_unknown_prefix_is_refused_with_a_reason():
    src = small_source(policy="cache_aware")
    src.advance_to(6.0)
    from btbctl.engine.dashboard import SourceError

    with pytest.raises(SourceError, match="unknown prefix"):
        src.replicate_sync("deadbeefdeadbeef", 1)
    with pytest.raises(SourceError, match="at least 8 hex digits"):
        src.replicate_sync("abc", 1)


async def test_policy_change_and_pause():
    src = small_source()
    src.advance_to(4.0)

    async with running_app(src, (80, 24)) as (app, pilot):
        await press(pilot, "p")
        await wait_for(pilot, lambda: app.paused and "PAUSED" in _text(app.query_one("#status")))
        n = app.applied
        await pilot.pause(0.3)
        assert app.applied == n
        await press(pilot, "p")
        await wait_for(pilot, lambda: app.applied > n)
        await press(pilot, "c")
        await wait_for(pilot, lambda: isinstance(app.screen, PolicyScreen) and isinstance(app.focused, OptionList))
        await press(pilot, "home", "enter")  # the first policy of the registry
        await wait_for(pilot, lambda: src.sim.policy_name == "round_robin")
        await wait_for(pilot, lambda: app.snapshot.policy == "round_robin")
        await press(pilot, "question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        await press(pilot, "escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await press(pilot, "3")
        await wait_for(pilot, lambda: app.focused is app.query_one("#p3"))


async def _key_to_update(app, key: str, done) -> float:
    """Seconds from a key event reaching the app to ``done()`` holding (the widget shows the change; the compositor
    paints it on its next refresh). The event is posted to the app as its driver would post it; unlike
    ``pilot.press`` this does not wait for the process to look idle, which never happens while a simulation thread
    is busy."""
    from textual import events

    t0 = time.perf_counter()
    ev = events.Key(key, key if len(key) == 1 else None)
    ev.set_sender(app)
    app.post_message(ev)
    while not done():
        if time.perf_counter() - t0 > 5.0:
            raise AssertionError(f"no update after pressing {key!r}")
        await asyncio.sleep(0.001)
    return time.perf_counter() - t0


@pytest.mark.speed
async def test_stays_responsive_while_replaying_1000_requests_per_second():
    """A speed test (``pytest -m speed``): key-to-update latency and replay rate on the wall clock."""
    # 20,000 requests over 20 s of trace time, replayed at 1x: 1,000 requests/s of wall time.
    src = small_source(paced=True, speed=1.0, bursts=1, burst_size=20000, spread_s=20.0, decoys=0, first_burst_s=0.5)
    latencies = []

    async with running_app(src, (160, 48), poll_hz=4) as (app, pilot):
        t_start, n_start = time.perf_counter(), src.submitted
        status = app.query_one("#status", Static)
        table = app.query_one("#prefix-table", DataTable)
        fleet = app.query_one("#p2")
        for i in range(10):
            want = not app.paused
            latencies.append(
                await _key_to_update(
                    app, "p", lambda want=want: app.paused == want and ("PAUSED" in _text(status)) == want
                )
            )
            target = fleet if i % 2 == 0 else table
            latencies.append(
                await _key_to_update(app, "2" if i % 2 == 0 else "1", lambda target=target: app.focused is target)
            )
            await asyncio.sleep(0.15)
        assert "PAUSED" not in _text(status)  # an even number of presses
        n_applied = app.applied
        await asyncio.sleep(1.0)
        rate = (src.submitted - n_start) / (time.perf_counter() - t_start)
        assert rate > 700, f"replayed only {rate:.0f} requests/s"
        assert app.applied > n_applied  # still rendering snapshots
        print(f"replay rate {rate:.0f} requests/s, {app.applied} snapshots rendered, {app.skipped} ticks skipped")

    latencies.sort()
    worst = latencies[-1]
    print(
        f"key->update latency: median {latencies[len(latencies) // 2] * 1000:.1f} ms, "
        f"max {worst * 1000:.1f} ms over {len(latencies)} presses"
    )
    # The median is the gate: on a shared CI machine a single press can land behind another process's burst of
    # CPU. The worst case is printed for the record.
    assert latencies[len(latencies) // 2] < 0.1, [round(x * 1000) for x in latencies]
