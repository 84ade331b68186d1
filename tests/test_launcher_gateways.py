"""``[gateway] replicas = N``: ``btbctl up`` starts N gateways in front of the same workers and a redis-server they
share; ``down`` stops them all."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.logfmt import parse_line
from launcher_helpers import FREE_PORTS, cli, cli_json, recorded_pids, wait_gone
from redis_fixture import needs_redis

CLUSTER = """
[gateway]
replicas = 2
page_size = 16
policy = "btb"

[btb]
prefix_blocks = 4
threshold = 2
window_s = 30.0
replicas = 3

[[workers]]
count = 3
page_size = 16
"""


def _until(pred, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.05)


@pytest.mark.slow
@needs_redis
def test_up_starts_two_gateways_sharing_a_redis_and_down_stops_them(tmp_path, run_dir):
    cfg = tmp_path / "two.toml"
    cfg.write_text(CLUSTER)
    cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS)
    state = RunDir(run_dir).load()
    gws = [p for p in state.processes if p.role == "gateway"]
    assert [p.name for p in gws] == ["gateway", "gateway-1"]
    assert [p.name for p in state.processes if p.role == "redis"] == ["redis"]
    settings = json.loads((run_dir / "gateway-1.json").read_text())
    assert settings["redis_url"] == json.loads((run_dir / "gateway.json").read_text())["redis_url"]
    pids = recorded_pids(run_dir)
    controls = [state.control_url, gws[1].extra["control"]]
    with httpx.Client(timeout=30) as http:

        def shared() -> bool:
            return all("fleet_share_up" in (run_dir / "logs" / f"{g.name}.log").read_text() for g in gws)

        _until(shared)
        # a burst sent half to each gateway: hot on both, copies made once per target
        text = "a long shared system prompt, line after line. " * 8
        for i in range(6):
            r = http.post(gws[i % 2].url + "/generate", json={"text": text + f"q{i}", "sampling_params": {}})
            assert r.status_code == 200, r.text
            time.sleep(0.1)  # the news of each arrival reaches the other gateway before the next one

        def hot_rows() -> list[dict]:
            rows = [http.get(c + "/control/prefixes").json()["prefixes"] for c in controls]
            return rows if all(rs and rs[0]["hot"] for rs in rows) else []

        rows = _until(hot_rows)
        assert rows[0][0]["id"] == rows[1][0]["id"]
        logs = [(run_dir / "logs" / f"{g.name}.log").read_text() for g in gws]
        assert all("event=detector_fired" in text for text in logs)
        started = [
            fields["target_url"]
            for text in logs
            for line in text.splitlines()
            if (fields := parse_line(line)) and fields.get("event") == "copy_started"
        ]
        assert started and len(started) == len(set(started)), started  # one copy per target, fleet-wide
        # tuning one gateway reaches the other
        cli_json("tune", "--run-dir", str(run_dir), "threshold=5")
        _until(lambda: http.get(controls[1] + "/control/constants").json()["constants"]["threshold"] == 5)
    out = cli_json("down", "--run-dir", str(run_dir))
    assert {"gateway", "gateway-1", "redis"} <= set(out["stopped"] + out["killed"])
    assert wait_gone(pids) == []


@pytest.mark.slow
@needs_redis
def test_status_shows_every_gateway_and_restart_brings_a_second_one_back_on_its_ports(tmp_path, run_dir):
    cfg = tmp_path / "two.toml"
    cfg.write_text(CLUSTER)
    try:
        st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS)
        assert [(g["name"], g["alive"], g["reachable"]) for g in st["gateways"]] == [
            ("gateway", True, True),
            ("gateway-1", True, True),
        ]
        second = st["gateways"][1]
        assert second["url"] != st["gateway_url"] and second["control_url"] != st["control_url"]
        rec = next(p for p in RunDir(run_dir).load().processes if p.name == "gateway-1")
        # damaged settings: one line, and the running gateway-1 is left alone
        settings = run_dir / "gateway-1.json"
        good = settings.read_text()
        settings.write_text("{")
        bad = cli("restart", "gateway-1", "--run-dir", str(run_dir), check=False)
        assert bad.returncode != 0 and "cannot read the settings of gateway-1" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert wait_gone([rec.pid], 0.5) == [rec.pid]  # still running
        settings.write_text(good)
        os.killpg(rec.pgid, signal.SIGKILL)
        assert wait_gone([rec.pid]) == []
        st = json.loads(cli("status", "--run-dir", str(run_dir), "--format", "json", check=False).stdout)
        assert st["verdict"] == "degraded" and any("gateway-1 is not running" in p for p in st["problems"]), st
        human = cli("status", "--run-dir", str(run_dir), check=False).stdout
        assert "gateway-1" in human and "down" in human, human
        res = cli_json("restart", "gateway-1", "--run-dir", str(run_dir))
        assert res["old_pid"] == rec.pid and res["pid"] != rec.pid
        st = cli_json("status", "--run-dir", str(run_dir))
        assert st["verdict"] == "up", st["problems"]
        again = st["gateways"][1]
        assert (again["url"], again["control_url"], again["reachable"]) == (second["url"], second["control_url"], True)
        with httpx.Client(timeout=30) as http:  # it serves again
            r = http.post(again["url"] + "/generate", json={"text": "after the restart", "sampling_params": {}})
            assert r.status_code == 200, r.text
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
