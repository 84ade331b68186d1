"""Pilot tests of what a first-time operator meets in the dashboard: the edit flow, names, legend, the
transfers' ids and sizes, a selection that stays on its prefix, the layout at 80x24 and the empty heat panel."""

from __future__ import annotations

import dataclasses
import io

from rich.console import Console
from textual.widgets import DataTable, Input, Label, OptionList, Static

from btbctl.engine.chains import MIN_PREFIX_ID_CHARS, check_prefix_id, short_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.dashboard import FleetSnapshot, PrefixRow, TransferRow
from btbctl.engine.policies import POLICIES
from btbctl.tui.app import HelpScreen, PolicyScreen, help_text
from btbctl.tui.widgets.fmt import human_bytes
from btbctl.tui.widgets.panels import ConstantsPanel, PrefixPanel
from tui_helpers import press, running_app, small_source, wait_for


def _plain(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


async def test_edit_focuses_the_first_field_shown_and_escape_leaves_without_sending():
    src = small_source()
    src.advance_to(4.0)
    async with running_app(src, (80, 24)) as (app, pilot):
        await press(pilot, "2")  # the fleet panel: where Escape must bring the focus back
        await wait_for(pilot, lambda: app.focused is app.query_one("#p2"))
        await press(pilot, "e")
        first = app.query_one(f"#const-{BtbConstants.keys()[0]}", Input)
        await wait_for(pilot, lambda: app.focused is first)
        # the footer keeps hints while editing: how to send, leave and move on
        shown = {b.binding.description for b in app.screen.active_bindings.values() if b.binding.show}
        assert {"send", "leave editing", "next field"} <= shown
        # q and e are text in a field, not quit / edit
        await press(pilot, "q", "e")
        await wait_for(pilot, lambda: first.value.endswith("qe"))
        assert app.is_running
        await press(pilot, "escape")
        await wait_for(pilot, lambda: app.focused is app.query_one("#p2"))
        assert first.value == "32" and src.constants.prefix_blocks == 32  # nothing sent, the value in force shown
        assert "nothing sent" in app.query_one(ConstantsPanel).message
        await press(pilot, "q")
        await wait_for(pilot, lambda: not app.is_running)


async def test_constants_are_labelled_with_their_config_names():
    src = small_source()
    async with running_app(src, (80, 24)) as (app, pilot):
        labels = [str(lbl.render()).strip() for lbl in app.query(".const-label").results(Label)]
        assert labels == list(BtbConstants.keys())
        ids = [inp.id for inp in app.query(".const-input").results(Input)]
        assert ids == [f"const-{k}" for k in BtbConstants.keys()]
        assert "Valid: an integer in [1," in str(app.query_one("#const-threshold").tooltip)


async def test_help_explains_every_column_and_constant():
    text = help_text()
    for column in ("arr/X", "hold", "cp", "trend", "len", "via", "util", "HBM GB", "KV", "route", "size", "state"):
        assert f"[b]{column}[/b]" in text, column
    for key in BtbConstants.keys():
        assert f"[b]{key}[/b]" in text
    assert "escape" in text and "GB (1e9 bytes" in text
    src = small_source()
    async with running_app(src, (80, 24)) as (app, pilot):
        await press(pilot, "question_mark")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))


async def test_policy_picker_shows_whole_summaries_wrapped_at_words():
    src = small_source()
    async with running_app(src, (80, 24)) as (app, pilot):
        await press(pilot, "c")
        # pushed is not yet composed: wait for the list itself and all its options
        await wait_for(
            pilot,
            lambda: (
                isinstance(app.screen, PolicyScreen)
                and bool(app.screen.query(OptionList))
                and app.screen.query_one(OptionList).option_count == len(POLICIES)
            ),
        )
        ol = app.screen.query_one(OptionList)
        for i, name in enumerate(POLICIES):
            prompt = str(ol.get_option_at_index(i).prompt)
            assert prompt == f"{name}  {POLICIES[name].summary}".rstrip()
        names = list(POLICIES)
        longest = max(names, key=lambda n: len(POLICIES[n].summary))
        ol.highlighted = names.index(longest)  # scrolled into view
        # the last word of the longest summary is on screen whole (wrapped, not cut mid-word)
        await wait_for(pilot, lambda: POLICIES[longest].summary.split()[-1] in app.export_screenshot())


def _prefix(pid: str, arrivals: int) -> PrefixRow:
    return PrefixRow(pid, 8192, arrivals, 2, 1, 0, arrivals >= 2)


def _snap(prefixes, **kw) -> FleetSnapshot:
    consts = BtbConstants(prefix_blocks=32).as_dict()
    return FleetSnapshot(now_s=1.0, connected=True, message="test", prefixes=tuple(prefixes), constants=consts, **kw)


async def test_selection_stays_on_its_prefix_when_the_list_resorts():
    ids = [f"{i:02x}" * 8 for i in (0xA1, 0xB2, 0xC3, 0xD4)]
    src = small_source()
    async with running_app(src, (80, 24), poll_hz=0.01) as (app, pilot):
        app.paused = True  # only the snapshots below
        app.apply_snapshot(_snap([_prefix(ids[0], 9), _prefix(ids[1], 7), _prefix(ids[2], 5), _prefix(ids[3], 3)]))
        table = app.query_one("#prefix-table", DataTable)
        table.focus()
        table.move_cursor(row=1)
        await pilot.pause(0.05)
        panel = app.query_one(PrefixPanel)
        assert panel.selected.prefix_id == ids[1]
        # b2 cools down and falls to the bottom: the highlight follows it
        app.apply_snapshot(_snap([_prefix(ids[0], 9), _prefix(ids[2], 5), _prefix(ids[3], 3), _prefix(ids[1], 1)]))
        await pilot.pause(0.05)
        assert table.cursor_row == 3 and panel.selected.prefix_id == ids[1]
        # it leaves the list: the cursor stays at its row, on the prefix shown there
        app.apply_snapshot(_snap([_prefix(ids[0], 9), _prefix(ids[2], 5), _prefix(ids[3], 3)]))
        await pilot.pause(0.05)
        assert panel.selected.prefix_id == ids[3] and table.cursor_row == 2


async def test_empty_heat_panel_says_why():
    src = small_source()
    async with running_app(src, (80, 24), poll_hz=0.01) as (app, pilot):
        app.paused = True
        app.apply_snapshot(_snap([]))
        await pilot.pause(0.05)
        hint = app.query_one("#prefix-empty", Static)
        assert hint.display and "no prefix of 32 blocks seen yet" in str(hint.render())
        app.apply_snapshot(_snap([_prefix("ab" * 8, 3)]))
        await pilot.pause(0.05)
        assert not hint.display


async def test_transfers_show_replicable_ids_size_and_duration():
    pid = "0123456789abcdef" * 4
    rows = (
        TransferRow("c1", pid, "w0", "w1", 5e8, 1.34e9, 2e9, 0.4, "running", duration_s=0.25),
        TransferRow("c2", pid, "w0", "w2", 1.34e9, 1.34e9, 0.0, None, "done", duration_s=0.7),
    )
    src = small_source()
    for size in ((80, 24), (160, 48)):
        async with running_app(src, size, poll_hz=0.01) as (app, pilot):
            app.paused = True
            app.apply_snapshot(_snap([], transfers=rows))
            await pilot.pause(0.05)
            body = _plain(app.query_one("#transfer-body", Static).content)
            shown = short_id(pid)
            assert shown in body and len(shown) >= MIN_PREFIX_ID_CHARS
            assert check_prefix_id(shown) == shown  # what `btbctl replicate --prefix` accepts
            assert human_bytes(1.34e9) == "1.3GB" and "1.3GB" in body
            assert "250ms" in body and "700ms" in body
            assert "size" in body and "time" in body


async def test_l3_copies_show_their_outcome_and_the_time_to_a_usable_replica():
    pid = "fedcba9876543210" * 4
    rows = (
        TransferRow(
            "c3",
            pid,
            "w0",
            "w1",
            0.0,
            0.0,
            0.0,
            None,
            "done",
            duration_s=1.59,
            proof_storage_tokens=16384,
            outcome="proved",
            usable_s=1.59,
            phases_s=(1.32, 0.0, 0.27),
        ),
        TransferRow("c4", pid, "w0", "w2", 0.0, 0.0, 0.0, None, "failed", error="not a copy", outcome="computed"),
    )
    async with running_app(small_source(), (160, 48), poll_hz=0.01) as (app, pilot):
        app.paused = True
        app.apply_snapshot(_snap([], transfers=rows))
        await pilot.pause(0.05)
        body = _plain(app.query_one("#transfer-body", Static).content)
        # the state ends the row; what it has to say beyond one word is on the line under it, whole
        lines = body.splitlines()
        proved = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("proved"))
        assert lines[proved + 1].strip().startswith("usable in 1.6s (source 1.3s, copy 0ms, proof 270ms)"), body
        assert "proof 16k from L3" in lines[proved + 1], body
        computed = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("computed"))
        assert lines[computed + 1].strip() == "not a copy" and "done" not in body.split("computed")[1], body


async def test_layout_at_80x24_shows_a_readable_chart_and_several_gpu_rows():
    src = small_source()
    src.advance_to(8.0)
    async with running_app(src, (80, 24)) as (app, pilot):
        await pilot.pause(0.1)
        small_plot = app.query_one("#ttft-plot").size.height
        gpu_rows = app.query_one("#p2").size.height - 1 - len(app.snapshot.workers) - 1
        assert small_plot >= 6, small_plot  # 4 rows of lines above the axis and its labels
        assert gpu_rows >= 2, gpu_rows
    async with running_app(src, (160, 48)) as (app, pilot):
        await pilot.pause(0.1)
        assert app.query_one("#ttft-plot").size.height > small_plot + 8
        assert app.query_one("#p2").size.height >= 1 + 4 + 1 + 16  # every worker and all 16 GPUs


def test_sizes_are_decimal_like_presets():
    assert human_bytes(80e9) == "80.0GB"  # an H100, as `btbctl presets` lists it (HBM GB = 1e9 bytes)
    assert human_bytes(999) == "999B" and human_bytes(1500) == "1.5kB"
    assert "duration_s" in {f.name for f in dataclasses.fields(TransferRow)}
