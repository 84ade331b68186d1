"""Helpers for the live launcher tests: run the CLI, read a fleet's state, make sure nothing is left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from btbctl.engine.httpclient import urlopen
from btbctl.engine.launcher.rundir import RunDir, group_members, process_start_time, record_is_ours

ROOT = Path(__file__).resolve().parents[1]
#: ``up`` on free data and control ports.
FREE_PORTS = ("--port", "0", "--control-port", "0")


def cli(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m btbctl ARGS`` and return the finished process (stdout/stderr as text)."""
    env = dict(os.environ)
    env.pop("BTBCTL_RUN_DIR", None)
    env.pop("BTBCTL_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "btbctl", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"btbctl {' '.join(args)} exited {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc


def cli_json(*args: str, timeout: float = 120.0):
    return json.loads(cli(*args, "--format", "json", timeout=timeout).stdout)


def recorded_pids(run_dir: Path) -> list[int]:
    state = RunDir(run_dir).load()
    return [p.pid for p in state.processes] if state else []


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return the ones still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if process_start_time(p) is not None or group_members(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def force_cleanup(run_dir: Path) -> None:
    """Teardown safety net: stop what a failed test left behind (only processes provably ours)."""
    rd = RunDir(run_dir)
    try:
        state = rd.load()
    except Exception:  # noqa: BLE001 - best effort in teardown
        return
    if state is None:
        return
    for rec in state.processes:
        if record_is_ours(rec):
            try:
                os.killpg(rec.pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    rd.clear()


def http_json(url: str, body=None, timeout: float = 10.0):
    """GET ``url`` (or POST ``body`` as JSON) without proxies; the answer's JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="GET" if body is None else "POST", headers={"Content-Type": "application/json"}
    )
    with urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())
