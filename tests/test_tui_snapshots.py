"""Snapshot tests of the main screen (pytest-textual-snapshot) at 80x24 and 160x48: a simulation frozen at a fixed
fleet time of a fixed-seed trace, one snapshot applied, the view paused so nothing changes under the camera.

* ``test_main_screen``: t = 8 s of a trace of three bursts, the second one under way.
* ``test_main_screen_after_a_burst_and_30s_of_quiet``: one burst of 64 requests over 3 s (t = 2..5 s), then 30 s
  with no arrival: the heat row shows 0 arrivals in the window, the TTFT panel states its last 60 s (the burst's
  p50/p95, a gap since), the copies name the prefix the heat panel shows."""

from __future__ import annotations

import pytest

from btbctl.tui.app import build_app
from tui_helpers import small_source

#: The second scenario: one burst, the time its last request arrives and the quiet after it.
ONE_BURST = {"bursts": 1, "burst_size": 64, "spread_s": 3.0, "decoys": 0, "decoy_start_s": 1.0, "decoy_end_s": 2.0}
BURST_END_S = 5.0
QUIET_S = 30.0


def _app(t_s: float = 8.0, **trace):
    src = small_source(**trace)
    src.advance_to(t_s)
    return build_app(src, poll_hz=50)


async def _settle(pilot):
    app = pilot.app
    for _ in range(200):
        if app.applied >= 1:
            break
        await pilot.pause(0.02)
    app.paused = True  # freeze: no further snapshots (and sparklines) after the first
    await pilot.pause(0.05)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen(snap_compare, size):
    assert snap_compare(_app(), terminal_size=size, run_before=_settle)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_main_screen_after_a_burst_and_30s_of_quiet(snap_compare, size):
    assert snap_compare(_app(BURST_END_S + QUIET_S, **ONE_BURST), terminal_size=size, run_before=_settle)
