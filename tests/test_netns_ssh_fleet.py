"""The SSH launcher across real network hosts: two hosts of a namespace testbed (tests/netns.py), each running its
own sshd on its own address behind a shaped switch; `btbctl up -d` from the operator side starts one emulated
worker on each over SSH, the gateway here reaches them across the switch, a burst makes BTB copy the hot prefix's
KV blocks from one host to the other (taking at least the time the link's rate allows), `status` and `down` work,
and nothing is left running in either host. Needs root, iproute2 and sshd (skips with the reason otherwise)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from btbctl.engine.launcher.rundir import RunDir, group_members, process_start_time
from launcher_helpers import cli, force_cleanup, http_json, wait_gone
from netns import make_testbed, require_sshd, start_sshd  # noqa: F401 - fixture
from netns_fleet import host_entry
from test_ssh_fleet import FAST, write_cluster

pytestmark = [pytest.mark.netns, pytest.mark.slow]  # a whole fleet up and down over SSH: the slow stage

ROOT = Path(__file__).resolve().parents[1]
#: Slow enough that the link, not this machine's CPUs, sets a copy's pace (an unshaped copy between the emulated
#: workers runs at about 0.5 Gbit/s on 2 cores).
RATE_GBIT = 0.1
#: KV bytes of the emulated workers divided by 64 (FAST divides by 65536): one 4-block prefix of Llama-3.3-70B is
#: then 5.2 MB, 0.42 s at RATE_GBIT.
WORKER = {**FAST, "kv_bytes_scale": 64}


def only_sshd_left(host, sshd_pid: int, timeout_s: float = 10.0) -> list[int]:
    """Wait until the only process in ``host`` is its sshd listener; return the others still there."""
    deadline = time.monotonic() + timeout_s
    while True:
        others = [p for p in host.pids() if p != sshd_pid]
        if not others or time.monotonic() > deadline:
            return others
        time.sleep(0.1)


def wait_copy_done(control_url: str, timeout_s: float = 30.0) -> dict:
    """The first copy the gateway reports, once no copy is in flight and one is done."""
    deadline = time.monotonic() + timeout_s
    while True:
        tr = http_json(control_url.rstrip("/") + "/control/transfers")
        if tr["in_flight"] == 0 and tr["totals"]["done"] >= 1:
            done = [t for t in tr["transfers"] if t["state"] == "done"]
            if done:
                return done[0]
        assert time.monotonic() < deadline, f"no copy finished within {timeout_s} s: {tr}"
        time.sleep(0.1)


def test_up_status_down_across_two_namespace_hosts(make_testbed, tmp_path):  # noqa: F811
    require_sshd()
    tb = make_testbed(2, rate_gbit=RATE_GBIT)
    n0, n1 = tb.hosts
    servers = [start_sshd(h, tmp_path / "ssh") for h in tb.hosts]
    cfg = write_cluster(
        tmp_path / "c.toml",
        [host_entry(s) for s in servers],
        [{"name": "a", "host": n0.name, **WORKER}, {"name": "b", "host": n1.name, **WORKER}],
        policy="btb",  # the published rule copies a hot prefix on every burst; btb_plus only when a copy pays
    )
    run_dir = tmp_path / "run"
    try:
        st = json.loads(
            cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), "--format", "json", timeout=60).stdout
        )
        by_name = {w["name"]: w for w in st["workers"]}
        assert {n: (w["host"], w["healthy"]) for n, w in by_name.items()} == {
            "a-0": (n0.name, True),
            "b-0": (n1.name, True),
        }
        assert by_name["a-0"]["url"].startswith(f"http://{n0.address}:")
        assert by_name["b-0"]["url"].startswith(f"http://{n1.address}:")
        state = RunDir(run_dir).load()
        remote = {p.name: p for p in state.processes if p.host}
        assert set(remote) == {"a-0", "b-0"}
        # each worker really runs inside its host's namespace (same PID space: the recorded pid is visible here)
        assert remote["a-0"].pid in n0.pids() and remote["b-0"].pid in n1.pids()
        assert all(process_start_time(p.pid) == p.start_time for p in remote.values())

        status = json.loads(cli("status", "--run-dir", str(run_dir), "--format", "json").stdout)
        assert sorted(w["name"] for w in status["workers"]) == ["a-0", "b-0"]
        assert all(w["healthy"] and w["alive"] for w in status["workers"])
        human = cli("status", "--run-dir", str(run_dir)).stdout
        assert n0.name in human and n1.name in human

        # the gateway (here, on the operator side) routes a burst to both hosts across the switch
        bench = json.loads(
            cli(
                "bench",
                "--run-dir",
                str(run_dir),
                "--burst-size",
                "8",
                "--prefix-blocks",
                "4",
                "--spread-s",
                "0.2",
                "--format",
                "json",
                timeout=60,
            ).stdout
        )
        assert (bench["requests"], bench["ok"], bench["errors"]) == (8, 8, 0)
        # the burst made the prefix hot: its KV blocks went from one host to the other, paced by the links
        copy = wait_copy_done(st["control_url"])
        assert {urlparse(copy["source"]).hostname, urlparse(copy["target"]).hostname} == {n0.address, n1.address}
        seconds = copy["finished_s"] - copy["started_s"]
        floor = copy["bytes_total"] * 8 / (RATE_GBIT * 1e9)
        print(
            f"\ncopy of {copy['bytes_total'] / 1e6:.1f} MB across the testbed: {seconds:.3f} s "
            f"({copy['bytes_total'] * 8 / seconds / 1e9:.3f} Gbit/s; link {RATE_GBIT} Gbit/s)"
        )
        assert copy["bytes_total"] > 5e6 and seconds >= 0.85 * floor

        down = json.loads(cli("down", "--run-dir", str(run_dir), "--grace-s", "5", "--format", "json").stdout)
        assert sorted(down["stopped"] + down["killed"]) == ["a-0", "b-0", "gateway"]
        assert down["unreachable"] == []
        assert wait_gone([p.pid for p in state.processes]) == []
        assert all(not group_members(p.pgid) for p in remote.values())
        assert RunDir(run_dir).load() is None
        for host, server in zip(tb.hosts, servers, strict=True):
            assert only_sshd_left(host, server.proc.pid) == [], f"left running in {host.name}"
    finally:
        # safety net for a failed test: the remote groups (the testbed's close kills whatever else runs in the
        # hosts), then the local gateway
        state = RunDir(run_dir).load() if (run_dir / "state.json").exists() else None
        for p in state.processes if state else []:
            if p.host and (process_start_time(p.pgid) == p.start_time or group_members(p.pgid)):
                os.killpg(p.pgid, signal.SIGKILL)
        force_cleanup(run_dir)
