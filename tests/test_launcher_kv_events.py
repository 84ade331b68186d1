"""``btbctl up`` of an emulated fleet whose workers publish KV events (marker ``slow``: a whole fleet up and down):
every worker gets ``--kv-events-config`` on its own ports, the gateway subscribes to each, and with its routing
inference off (``routing_holdings = false``) the fleet view's held blocks after a request come from the events."""

from __future__ import annotations

import socket
import time

import pytest

from launcher_helpers import cli, cli_json, force_cleanup, http_json, recorded_pids, wait_gone

pytestmark = pytest.mark.slow


def _four_free_ports() -> int:
    """A port P with P and P + 1..3 free now (two workers, two ports each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 3 > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + 4):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise AssertionError("no 4 consecutive free ports")


def test_up_wires_each_workers_kv_events_to_the_gateway(tmp_path):
    base = _four_free_ports()
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        f"""
[gateway]
port = 0
control_port = 0
page_size = 16

[gateway.settings]
routing_holdings = false

[[workers]]
kind = "emulated"
count = 2
model = "qwen3-8b"
tp_size = 1
page_size = 16
zero_delay = true
kv_events = "tcp://127.0.0.1:{base}"
"""
    )
    run = tmp_path / "run"
    try:
        up = cli_json("up", "-d", "-c", str(cluster), "--run-dir", str(run), timeout=180)
        ids = list(range(1000, 1064))
        ans = http_json(f"{up['gateway_url']}/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
        assert ans["meta_info"]["prompt_tokens"] == 64
        deadline = time.monotonic() + 20
        while True:
            fleet = http_json(f"{up['control_url']}/control/fleet")
            held = sorted(w["held_blocks"] for w in fleet["workers"])
            if held == [0, 4]:
                break
            assert time.monotonic() < deadline, f"held blocks {held}"
            time.sleep(0.1)
        log = (run / "logs" / "gateway.log").read_text()
        assert log.count("event=kv_events_connected") == 2
        assert f"endpoint=tcp://127.0.0.1:{base + 2}" in log and f"replay_endpoint=tcp://127.0.0.1:{base + 3}" in log
        pids = recorded_pids(run)
        cli("down", "--run-dir", str(run), timeout=60)
        assert wait_gone(pids, 30) == []
    finally:
        force_cleanup(run)
