"""Fleets that keep their history and their names, through the real commands on live emulated fleets: a named
fleet beside a busy port (free ports picked and recorded), `btbctl ls`, a control-API write (as the dashboard sends
it) that survives `down` + `up`, the last run's logs kept (`logs --previous`), `gateway_stop`, numbers in
`logs --json`, workers' request lines, bench's short-prefix warning, and a foreground `up` echoing events."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from btbctl.engine.launcher.rundir import RunDir
from launcher_helpers import ROOT, cli, force_cleanup, recorded_pids, wait_gone


def _cluster(path: Path, port: int, control_port: int) -> Path:
    path.write_text(
        "\n".join(
            [
                "[gateway]",
                f"port = {port}",
                f"control_port = {control_port}",
                "",
                "[btb]",
                "prefix_blocks = 8",
                "",
                "[[workers]]",
                "count = 2",
                "time_scale = 100.0",
                "ready_timeout_s = 30.0",
                "",
            ]
        )
    )
    return path


def _put_constants(run_dir: Path, body: dict) -> dict:
    """``PUT /control/constants`` with the run directory's token: what the dashboard sends, no CLI involved."""
    rd = RunDir(run_dir)
    req = urllib.request.Request(
        rd.load().control_url + "/control/constants",
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {rd.read_token()}"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        return json.loads(resp.read())


def _events(*args: str) -> list[dict]:
    out = cli("logs", "gateway", "-n", "0", "--json", *args).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture
def state_home(tmp_path, monkeypatch) -> Path:
    """A user state directory of the test's own (fleets live under it), no fleet named in the environment."""
    home = tmp_path / "state"
    monkeypatch.setenv("XDG_STATE_HOME", str(home))
    monkeypatch.delenv("BTBCTL_FLEET", raising=False)
    return home


@pytest.mark.slow
def test_a_named_fleet_keeps_its_tuning_and_its_logs_across_down_and_up(tmp_path, state_home, monkeypatch):
    with socket.socket() as busy, socket.socket() as busy2:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy2.bind(("127.0.0.1", 0))
        busy2.listen()
        cfg = _cluster(tmp_path / "c.toml", busy.getsockname()[1], busy2.getsockname()[1])
        run_dir = state_home / "btbctl" / "runs" / "alpha"
        try:
            up = cli("up", "-d", "-c", str(cfg), "--fleet", "alpha", "--format", "json")
            st = json.loads(up.stdout)
            assert "in use; this fleet takes a free one" in up.stderr and "down --fleet alpha" in up.stderr
            assert st["run_dir"] == str(run_dir)
            assert not st["gateway_url"].endswith(f":{busy.getsockname()[1]}")
            # every other command finds it by name, from the flag or the environment
            fleets = json.loads(cli("ls", "--format", "json").stdout)["fleets"]
            assert [(f["name"], f["state"], f["gateway_url"]) for f in fleets] == [
                ("alpha", "running", st["gateway_url"])
            ]
            monkeypatch.setenv("BTBCTL_FLEET", "alpha")
            assert json.loads(cli("status", "--format", "json").stdout)["gateway_url"] == st["gateway_url"]
            monkeypatch.delenv("BTBCTL_FLEET")

            assert _put_constants(run_dir, {"threshold": 5})["constants"]["threshold"] == 5
            bench = cli("bench", "--fleet", "alpha", "--burst-size", "4", "--prefix-blocks", "1", "--format", "json")
            assert "cannot fire" in bench.stderr and "prefix_blocks 8" in bench.stderr
            assert json.loads(bench.stdout)["ok"] == 4
            worker_lines = "".join(
                cli("logs", w, "--fleet", "alpha", "-n", "0").stdout for w in ("worker-0", "worker-1")
            )
            requests = [ln for ln in worker_lines.splitlines() if "event=request " in ln]
            assert len(requests) == 4 and all("prompt_tokens=" in r and "ttft_s=" in r for r in requests)

            pids = recorded_pids(run_dir)
            cli("down", "--fleet", "alpha")
            assert wait_gone(pids) == []
            ev = _events("--fleet", "alpha")
            write = next(e for e in ev if e.get("event") == "control_write" and e.get("key") == "threshold")
            assert (write["old"], write["new"]) == (2, 5)  # numbers stay numbers
            assert ev[-1]["event"] == "gateway_stop"
            assert json.loads(cli("ls", "--format", "json").stdout)["fleets"][0]["state"] == "stopped"

            again = cli("up", "-d", "-c", str(cfg), "--fleet", "alpha", "--format", "json")
            assert "kept the last run's logs" in again.stderr
            assert json.loads(cli("tune", "--fleet", "alpha", "--format", "json").stdout)["constants"]["threshold"] == 5
            previous = _events("--fleet", "alpha", "--previous")
            assert previous == ev  # the whole last run, as it was
            assert not [e for e in _events("--fleet", "alpha") if e.get("event") == "control_write"]
            assert set(cli("logs", "--fleet", "alpha", "--previous").stdout.split()) >= {"gateway", "worker-0"}
            assert "event=request " in cli("logs", "worker-0", "--fleet", "alpha", "--previous", "-n", "0").stdout + (
                cli("logs", "worker-1", "--fleet", "alpha", "--previous", "-n", "0").stdout
            )
            cli("down", "--fleet", "alpha")
        finally:
            force_cleanup(run_dir)


@pytest.mark.slow
def test_foreground_up_prints_the_events_that_follow_its_table(tmp_path, state_home):
    cfg = _cluster(tmp_path / "c.toml", 0, 0)
    run_dir = state_home / "btbctl" / "runs" / "beta"
    env = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
    env["BTBCTL_FLEET"] = "beta"
    proc = subprocess.Popen(
        [sys.executable, "-m", "btbctl", "up", "-c", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()

    def wait_for(text: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)

    try:
        wait_for("press Ctrl-C")
        _put_constants(run_dir, {"threshold": 4})
        wait_for("key=threshold")
        line = next(ln for ln in lines if "control_write" in ln and "key=threshold" in ln)
        assert "old=2 new=4" in line and line[:2].isdigit()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(timeout=5)
        force_cleanup(run_dir)
    assert proc.returncode in (0, 130)
