"""Snapshot tests of the main screen (pytest-textual-snapshot) at 80x24 and 160x48: a simulation frozen at
t = 8 s of a fixed-seed trace, one snapshot applied, the view paused so nothing changes under the camera."""

from __future__ import annotations

import pytest

from btbctl.tui.app import build_app
from tui_helpers import small_source


def _app():
    src = small_source()
    src.advance_to(8.0)
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
