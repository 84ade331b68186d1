"""The dashboard tells the truth: heat decays on the gateway's clock with no new traffic, the TTFT panel states its
window (p50/p95 over it, units on both axes, idle time as gaps, no time beyond the gateway's clock), modelled HBM
counts the KV a worker holds (cached prefixes too) and says where each figure came from, and a copy of a deeper
chain is shown and logged under the id of the hot prefix it is for.

Time is injected: the gateway's clock is moved forward (its ``t0``), the event bus ticks on an injected clock, the
panels render snapshots built here."""

from __future__ import annotations

import asyncio
import io
import logging
import math
from types import SimpleNamespace

from pydantic import BaseModel
from rich.console import Console
from textual.widgets import DataTable, Static

from btbctl.engine.chains import short_id
from btbctl.engine.costmodel import GPUS, MODELS
from btbctl.engine.dashboard import FleetSnapshot, TtftPoint
from btbctl.engine.dashboard.control_source import ControlApiSource
from btbctl.engine.gateway.events import EventBus
from btbctl.engine.gateway.reports import Reports
from btbctl.engine.gateway.state import WorkerState
from btbctl.engine.logfmt import parse_line
from btbctl.tui.app import build_app, help_text
from btbctl.tui.widgets.panels import TtftPanel
from gateway_fakes import GatewayEnv
from tui_helpers import running_app, small_source, wait_for

TEXT = "a shared system prompt " * 8  # 184 bytes: 46 pseudo-tokens, 11 blocks of 4
PREFIX_BLOCKS = 2


def _plain(w: Static, width: int = 200) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(w.content)
    return console.export_text()


# -- 1. heat decays on the clock ----------------------------------------------------------------------------------


class _Heat(BaseModel):
    n: int


def test_the_event_bus_sends_aging_types_while_they_change_and_once_after():
    from btbctl.engine.gateway.events import AGE_EVERY_S

    now = [0.0]
    heat = [5]
    bus = EventBus(clock=lambda: now[0])
    bus.register("prefixes", lambda: _Heat(n=heat[0]))
    bus.age("prefixes", lambda _t: heat[0] > 0)
    bus.tick()  # nobody listens: nothing is asked
    q = bus.subscribe()
    bus.flush()  # the full picture a new listener gets
    assert q.get_nowait()[0] == "prefixes"
    sent = []
    for step in range(40):  # 4 s of bus ticks (0.1 s) with no new event; the heat leaves the window at 2 s
        now[0] = step * 0.1
        heat[0] = 5 if now[0] < 2.0 else 0
        bus.tick()
        bus.flush()
        while not q.empty():
            sent.append((now[0], q.get_nowait()[1]))
    # one event per AGE_EVERY_S while it changes, then one saying 0, then nothing
    assert [t for t, _ in sent] == [0.0, 1.0, 2.0] and AGE_EVERY_S == 1.0
    assert sent[-1][1] == '{"n":0}'


async def test_heat_decays_on_the_dashboard_with_no_new_traffic():
    constants = {"prefix_blocks": PREFIX_BLOCKS, "threshold": 3, "window_s": 1.0, "replicas": 1}
    async with GatewayEnv(2, policy="round_robin", constants=constants) as env:
        for i in range(6):  # a burst of one prefix
            status, _ = await env.post("/generate", {"text": TEXT + str(i)})
            assert status == 200
        app = build_app(ControlApiSource(env.control, "test-token"), poll_hz=10)
        async with app.run_test(size=(160, 48)) as pilot:
            table = app.query_one("#prefix-table", DataTable)
            # following the event stream: nothing is polled from here on
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.prefixes)
            await wait_for(pilot, lambda: app.snapshot.feed == "stream")
            first = app.snapshot.prefixes[0]
            assert first.arrivals_in_window in (0, 6)  # the real clock may already have aged it past 1 s
            env.gw.clock.t0 -= 30.0  # 30 s of quiet on the gateway's clock: no request, no copy, no event
            await wait_for(
                pilot,
                lambda: (
                    app.snapshot.now_s >= 30.0
                    and app.snapshot.prefixes[0].arrivals_in_window == 0
                    and not app.snapshot.prefixes[0].hot
                ),
                timeout_s=5.0,
            )
            await wait_for(pilot, lambda: str(table.get_row_at(0)[2]) == "0/3")
            assert table.get_row_at(0)[0] == first.short_id


# -- 2. the TTFT panel --------------------------------------------------------------------------------------------


def _ttft_snapshot(now_s: float) -> FleetSnapshot:
    """A burst whose first tokens came over 10 s, 50 s before ``now_s``, then silence: the latest bucket with a
    first token says 33 ms, the window's p95 is 1.954 s."""
    pts = []
    for i in range(60):
        t = now_s - 59 + i
        if i < 10:
            pts.append(TtftPoint(t, 0.4 + 0.15 * i, 0.6 + 0.15 * i, 6.4))
        elif i == 12:
            pts.append(TtftPoint(t, 0.033, 0.041, 1.0))
        else:
            pts.append(TtftPoint(t, math.nan, math.nan, 0.0))
    return FleetSnapshot(
        now_s=now_s,
        connected=True,
        message="test",
        ttft=tuple(pts),
        ttft_window_s=60.0,
        ttft_n=65,
        ttft_p50_s=1.1,
        ttft_p95_s=1.954,
        rps=0.0,
    )


def test_ttft_runs_split_at_idle_buckets_and_stop_at_now():
    from btbctl.tui.widgets.panels import ttft_runs

    snap = _ttft_snapshot(287.0)
    runs = ttft_runs(snap.ttft, snap.now_s, 60.0)
    assert [len(r) for r in runs] == [10, 1]
    late = (*snap.ttft, TtftPoint(300.0, 0.1, 0.1, 1.0))  # a bucket after the snapshot's clock is never drawn
    assert [len(r) for r in ttft_runs(late, snap.now_s, 60.0)] == [10, 1]


async def test_the_ttft_panel_states_its_window_units_and_gaps():
    snap = _ttft_snapshot(287.0)
    async with running_app(small_source(), (160, 48), poll_hz=0.01) as (app, pilot):
        app.paused = True
        panel = app.query_one(TtftPanel)
        plt = panel.query_one("#ttft-plot").plt
        drawn: list[list[float]] = []
        plot = plt.plot
        plt.plot = lambda xs, ys, **kw: drawn.append(list(xs)) or plot(xs, ys, **kw)
        app.apply_snapshot(snap)
        await pilot.pause(0.05)
        head = str(panel.border_title)
        # the window's percentiles, stated with it; not the latest bucket's 33 ms
        assert "last 60s" in head and "2.0s" in head and "33ms" not in head and "41ms" not in head, head
        assert "65 first tokens in 60s" in str(panel.border_subtitle)
        # each run of buckets with first tokens is its own line (p50 and p95): nothing drawn across the gap
        assert len(drawn) == 4 and sorted(len(xs) for xs in drawn) == [1, 1, 10, 10]
        assert all(-60.0 <= x <= 0.0 for xs in drawn for x in xs)  # seconds before now, never beyond it
        screen = app.export_screenshot()
        for label in ("-60s", "-30s", "now", "0.0s"):  # x: seconds before the gateway's now; y: seconds
            assert label in screen, label
    text = help_text()
    assert "last 60 s" in text and "gaps" in text


# -- 3. KV and HBM ------------------------------------------------------------------------------------------------


def _emulated_worker(used: int, cached: int | None) -> WorkerState:
    m = MODELS["llama-3.3-70b"]
    w = WorkerState(0, "http://127.0.0.1:1", "w0", healthy=True)
    w.info = {
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "weight_bytes": m.weight_bytes,
        "hbm_total_bytes": 4 * GPUS["h100"].hbm_bytes,
    }
    w.server_info = {"emulated": True}
    w.loads = {"used_tokens": used, "max_tokens": 400_000}
    if cached is not None:
        w.metrics = {"kv_cached_tokens": cached}
    return w


def test_modelled_hbm_counts_the_cached_prefixes_a_worker_holds():
    m = MODELS["llama-3.3-70b"]
    row = Reports(SimpleNamespace()).worker(_emulated_worker(0, 65536))  # idle, one 64k-token prefix cached
    assert row.hbm_used_bytes == m.weight_bytes + 65536 * m.kv_bytes_per_token
    assert row.kv_cached_tokens == 65536 and row.metrics_source == "modelled"
    assert row.kv_use is not None and row.kv_use > 0.15


async def test_the_fleet_panel_labels_where_kv_and_hbm_come_from():
    from btbctl.engine.dashboard import GPU_SOURCES

    async with running_app(small_source(), (160, 48), poll_hz=0.01) as (app, pilot):
        snap = app.snapshot
        assert {g.source for g in snap.gpus} <= set(GPU_SOURCES)
        rows = [ln.split() for ln in _plain(app.query_one("#fleet-body", Static)).splitlines()]
        assert {r[-1] for r in rows if r and r[0] in ("w0", "w1", "w2", "w3")} == {"model"}  # workers' KV
        assert {r[-1] for r in rows if r and "/gpu" in r[0]} == {"sim"}  # GPU rows' HBM
    legend = help_text()
    for source in GPU_SOURCES:  # every label the GPU rows can carry is explained
        assert f"{source} (" in legend, source
    assert "model (" in legend and "sglang (" in legend


# -- 4. one id per hot prefix -------------------------------------------------------------------------------------


async def test_a_deeper_copy_is_shown_and_logged_under_its_hot_prefix(caplog):
    caplog.set_level(logging.INFO, logger="btbctl")
    constants = {"prefix_blocks": PREFIX_BLOCKS, "threshold": 2, "window_s": 30.0, "replicas": 1}
    async with GatewayEnv(3, policy="round_robin", constants=constants) as env:
        for _ in range(2):  # the detector fires on the prefix_blocks-long prefix; two of three workers hold it
            status, _ = await env.post("/generate", {"text": TEXT})
            assert status == 200
        chain = env.fleet[0].chain_of("/generate", {"text": TEXT})
        deep, hot = chain[-1], chain[PREFIX_BLOCKS - 1]
        # a copy of the whole chain (as btb_plus copies the deepest hot prefix), asked for by its own id
        async with env.http.post(
            env.control + "/control/replicate", json={"prefix": deep, "n": 1}, headers=env.auth()
        ) as r:
            assert r.status == 202, await r.text()
        _, prefixes = await env.get_control("/control/prefixes")
        assert [p["id"] for p in prefixes["prefixes"]] == [hot]  # what `btbctl prefixes` lists
        for _ in range(250):
            _, tr = await env.get_control("/control/transfers")
            if tr["transfers"] and tr["transfers"][0]["state"] == "done":
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError(f"the copy never finished: {tr}")
        entry = tr["transfers"][0]
        assert entry["prefix"] == deep and entry["hot_prefix"] == hot
        assert entry["prefix_blocks"] == len(chain) and entry["prefix_tokens"] == len(chain) * env.gw.page_size
        _, rep = await env.get_control(f"/control/replications/{short_id(hot)}")  # what `btbctl prefixes` shows
        assert rep["prefix"] == hot and [c["copy_id"] for c in rep["copies"]] == [entry["copy_id"]]
        lines = [parse_line(r.getMessage()) or {} for r in caplog.records]
        fired = [ln for ln in lines if ln.get("event") == "detector_fired"]
        assert [ln["prefix"] for ln in fired] == [short_id(hot)]
        copies = [ln for ln in lines if ln.get("event", "").startswith("copy_")]
        assert {ln["event"] for ln in copies} >= {"copy_accepted", "copy_started", "copy_done"}
        for ln in copies:
            assert ln["prefix"] == deep and ln["hot_prefix"] == short_id(hot), ln  # keys kept, the id added
        assert all(
            ln["copied_tokens"] == str(entry["prefix_tokens"]) for ln in copies if ln["event"] != "copy_authorized"
        )
        app = build_app(ControlApiSource(env.control, "test-token"), poll_hz=10)
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.transfers)
            row = app.snapshot.transfers[0]
            assert row.prefix_id == hot and row.chain_id == deep and row.copied_tokens == entry["prefix_tokens"]
            body = _plain(app.query_one("#transfer-body", Static))
            heat = app.query_one("#prefix-table", DataTable).get_row_at(0)[0]
            assert heat == short_id(hot) and short_id(hot) in body and short_id(deep) not in body, body


def test_a_small_cached_prefix_does_not_read_as_an_empty_kv_cache():
    from btbctl.tui.widgets.panels import percent

    assert percent(304 / 447_998) == " <1%" and percent(0.0) == "  0%" and percent(0.154) == " 15%"


async def test_the_transfers_state_is_not_cut_at_160_columns():
    from btbctl.engine.dashboard import TransferRow

    pid = "fedcba9876543210" * 4
    rows = tuple(
        TransferRow(
            f"c{i}",
            pid,
            "w0",
            f"w{i}",
            2.7e9,
            2.7e9,
            1.1e9,
            None,
            "done",
            duration_s=2.4,
            proof_storage_tokens=65536,
            outcome="proved",
            usable_s=3.1,
            phases_s=(1.32, 1.5, 0.27),
        )
        for i in (1, 2, 3)
    )
    snap = FleetSnapshot(now_s=10.0, connected=True, message="test", transfers=rows)
    async with running_app(small_source(), (160, 48), poll_hz=0.01) as (app, pilot):
        app.paused = True
        app.apply_snapshot(snap)
        await pilot.pause(0.05)
        screen = app.export_screenshot()
        assert "…" not in screen  # nothing on the screen is cut
        assert screen.count("usable&#160;in&#160;3.1s") + screen.count("usable in 3.1s") == 3


def test_a_bench_results_copies_carry_the_hot_prefix():
    from btbctl.engine.launcher.bench import copies_during

    done = {"copy_id": "c1", "prefix": "deep", "hot_prefix": "hot", "state": "done", "finished_s": 5.0}
    older = {"copy_id": "c0", "prefix": "same", "state": "done", "finished_s": 6.0}  # a gateway before the field
    rows = copies_during({"now_s": 1.0}, {"now_s": 9.0, "transfers": [done, older]})
    assert [(r["prefix"], r["hot_prefix"]) for r in rows] == [("deep", "hot"), ("same", "same")]
