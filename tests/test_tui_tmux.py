"""The dashboard's edit flow in a real terminal: ``btbctl tui --sim`` in a detached tmux session, driven with
``tmux send-keys`` and read with ``tmux capture-pane`` (e, type, Escape, q). Skipped where tmux is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)"),
]

#: Seconds to wait for each expected screen (a loaded 2-core machine starts the app in a few seconds).
STEP_S = 40.0


class Tmux:
    """One detached session on a private server socket (never the user's own tmux server)."""

    def __init__(self, cols: int, rows: int, command: str) -> None:
        self.socket = f"btbctl-test-{uuid.uuid4().hex[:8]}"
        self.session = "tui"
        self._tmux("new-session", "-d", "-s", self.session, "-x", str(cols), "-y", str(rows), command)

    def _tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)

    def keys(self, *keys: str) -> None:
        for key in keys:
            self._tmux("send-keys", "-t", self.session, key)
            time.sleep(0.2)

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.session).stdout

    def alive(self) -> bool:
        return self._tmux("has-session", "-t", self.session).returncode == 0

    def wait_for(self, cond, what: str) -> str:
        t0 = time.monotonic()
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() - t0 > STEP_S:
                raise AssertionError(f"{what} not seen within {STEP_S} s; screen:\n{text}")
            time.sleep(0.2)

    def kill(self) -> None:
        self._tmux("kill-server")


def _constants_line(screen: str) -> str:
    return next((ln for ln in screen.splitlines() if "prefix_blocks" in ln), "")


def test_edit_flow_in_tmux():
    cmd = f"{sys.executable} -c 'from btbctl.commands.app import main; main()' tui --sim --speed 2 --seed 7"
    t = Tmux(80, 24, cmd)
    try:
        t.wait_for(lambda s: "Prefix heat" in s and "prefix_blocks 256" in s, "the dashboard")
        t.keys("e")
        t.wait_for(lambda s: "leave editing" in s and "send" in s, "the edit hints in the footer")
        t.keys("q", "e")  # text in the field, not quit / edit
        t.wait_for(lambda s: "prefix_blocks qe" in _constants_line(s), "q and e typed into prefix_blocks")
        assert t.alive()
        t.keys("Escape")
        screen = t.wait_for(lambda s: "nothing sent" in s and "q quit" in s, "editing left")
        assert "prefix_blocks 256" in _constants_line(screen)  # the value in force, nothing applied
        t.keys("q")
        t0 = time.monotonic()
        while t.alive() and time.monotonic() - t0 < STEP_S:
            time.sleep(0.2)
        assert not t.alive(), f"q did not quit; screen:\n{t.screen()}"
    finally:
        t.kill()
