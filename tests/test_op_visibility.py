"""What an operator sees without a dashboard, unit by unit: the request-line budget on an injected clock, a worker's
request lines, doctor's GPU check, bench's short-prefix warning, the events a foreground `up` echoes, and the order
in which a run directory is chosen (--run-dir, --fleet, BTBCTL_RUN_DIR, BTBCTL_FLEET)."""

from __future__ import annotations

import logging

import pytest
from aiohttp.test_utils import TestClient, TestServer

from btbctl.engine.logfmt import LineBudget, parse_line


def test_line_budget_lets_a_burst_through_then_a_rate_and_counts_what_it_held():
    now = [0.0]
    b = LineBudget(per_s=2.0, burst=3, clock=lambda: now[0])
    assert [b.allow() for _ in range(5)] == [(True, 0), (True, 0), (True, 0), (False, 0), (False, 0)]
    now[0] = 0.5  # one line's worth refilled
    assert b.allow() == (True, 2) and b.allow() == (False, 0)
    now[0] = 100.0  # a long quiet refills at most the burst
    assert [b.allow()[0] for _ in range(4)] == [True, True, True, False]


async def test_worker_writes_a_request_line_per_request_within_its_budget(caplog):
    from btbctl.engine.worker.config import make_config
    from btbctl.engine.worker.core import Worker
    from btbctl.engine.worker.http import build_app

    cfg = make_config(model_path="qwen3-8b", tp_size=1, zero_delay=True, port=0, page_size=16)
    worker = Worker(cfg)
    now = [0.0]
    worker.request_lines = LineBudget(per_s=1.0, burst=3, clock=lambda: now[0])
    client = TestClient(TestServer(build_app(worker)))
    await client.start_server()
    await worker.start()
    worker.ready = True
    prompt = "the same long system prompt " * 40
    try:
        with caplog.at_level(logging.INFO, logger="btbctl.worker"):
            for i in range(5):
                body = {"text": prompt, "rid": f"r{i}", "sampling_params": {"max_new_tokens": 2}}
                async with client.post("/generate", json=body) as r:
                    assert r.status == 200, await r.text()
            now[0] = 1.0
            async with client.post("/generate", json={"text": prompt, "rid": "last"}) as r:
                assert r.status == 200
    finally:
        await client.close()
        await worker.stop()
    lines = [parse_line(r.getMessage()) for r in caplog.records if r.getMessage().startswith("event=request ")]
    assert [ln["rid"] for ln in lines] == ["r0", "r1", "r2", "last"]
    first, second = lines[0], lines[1]
    assert int(first["prompt_tokens"]) > 100 and first["cached_tokens"] == "0"
    assert int(second["cached_tokens"]) > 0  # the same prompt again: its prefix is cached
    assert float(first["ttft_s"]) >= 0 and float(first["e2e_s"]) >= float(first["ttft_s"])
    assert lines[-1]["held"] == "2" and "held" not in first


def _doctor_with(tmp_path, monkeypatch, smi_lines: list[str] | None) -> dict:
    """What ``btbctl doctor --format json`` answers for a local fleet asking for GPUs 0 and 1, with a PATH whose
    nvidia-smi lists ``smi_lines`` (None: no nvidia-smi at all); in this process (the probe is a child)."""
    import os

    from btbctl.engine.launcher.cluster import load_cluster
    from btbctl.engine.launcher.doctor import doctor
    from test_ssh_fleet import write_cluster

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.unlink(missing_ok=True)
    if smi_lines is not None:
        smi.write_text("#!/bin/sh\n" + "".join(f"echo '{ln}'\n" for ln in smi_lines))
        smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    cfg = write_cluster(tmp_path / "c.toml", [], [{"name": "w", "count": 2, "tp_size": 1, "gpu_ids": [0, 1]}])
    return doctor(load_cluster(str(cfg)))


def test_doctor_flags_no_gpus_when_gpu_ids_are_asked_for(tmp_path, monkeypatch):
    res = _doctor_with(tmp_path, monkeypatch, None)
    assert res["ok"] is False
    assert "gpus: none (no nvidia-smi), but workers ask for gpu_ids [0, 1]" in res["hosts"][0]["problems"]
    res = _doctor_with(tmp_path, monkeypatch, ["GPU 0: NVIDIA H100 (UUID: GPU-x)"])
    assert "gpus: 1 (ids 0..0), but workers ask for gpu_ids [0, 1]" in res["hosts"][0]["problems"]
    res = _doctor_with(tmp_path, monkeypatch, ["GPU 0: NVIDIA H100 (UUID: a)", "GPU 1: NVIDIA H100 (UUID: b)"])
    assert not [p for p in res["hosts"][0]["problems"] if p.startswith("gpus")]


def test_bench_warns_when_its_prefix_is_shorter_than_the_fleets():
    from btbctl.engine.launcher.bench import short_prefix_warning

    answer = {"constants": {"prefix_blocks": 256}, "prefix_tokens": 65536}
    why = short_prefix_warning(16, 256, answer)
    assert why is not None and "4,096 tokens" in why and "65,536" in why and "cannot fire" in why
    assert short_prefix_warning(256, 256, answer) is None
    assert short_prefix_warning(16, 256, {"constants": {"prefix_blocks": 16}, "prefix_tokens": 4096}) is None
    assert short_prefix_warning(16, 256, None) is None


def test_foreground_up_echoes_the_operations_events_that_follow(tmp_path):
    from btbctl.engine.launcher.logs import LogFollower, echo_line
    from btbctl.engine.logfmt import format_event

    log = tmp_path / "gateway.log"
    log.write_text(
        "ts=2026-01-02T03:04:05.000Z level=info logger=g " + format_event("worker_up", {"worker": "w0"}) + "\n"
    )
    follow = LogFollower(log)  # from the end: what came before the table is not repeated
    assert follow.poll() == []
    head = "ts=2026-01-02T03:04:06.123Z level=info logger=btbctl.engine.gateway.server "
    with open(log, "a") as f:
        f.write(head + format_event("detector_fired", {"prefix": "73af609f4596", "count": 3, "threshold": 2}) + "\n")
        f.write(head + format_event("gateway_limits", {"nofile": 10}) + "\n")
        f.write(head + format_event("copy_done", {"prefix": "73af", "source": "worker-0", "token": "yes"}))
    lines = follow.poll()
    assert len(lines) == 2  # the copy line is not complete yet
    shown = [s for s in map(echo_line, lines) if s]
    assert shown == ["03:04:06 detector_fired prefix=73af609f4596 count=3 threshold=2"]
    with open(log, "a") as f:
        f.write(" bytes=10\n")
    assert [echo_line(x) for x in follow.poll()] == ["03:04:06 copy_done prefix=73af source=worker-0 bytes=10"]
    log.write_text(head + format_event("worker_down", {"worker": "w1"}) + "\n")  # rotated: read from the start
    assert [echo_line(x) for x in follow.poll()] == ["03:04:06 worker_down worker=w1"]


def test_run_directory_order_and_fleet_names(tmp_path, monkeypatch):
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.rundir import RunDir, default_run_dir, select_fleet

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("BTBCTL_RUN_DIR", raising=False)
    monkeypatch.delenv("BTBCTL_FLEET", raising=False)
    runs = tmp_path / "btbctl" / "runs"
    try:
        assert default_run_dir() == runs / "default" and RunDir().selector() == ""
        monkeypatch.setenv("BTBCTL_FLEET", "b")
        assert default_run_dir() == runs / "b" and RunDir().selector() == " --fleet b"
        monkeypatch.setenv("BTBCTL_RUN_DIR", str(tmp_path / "x"))
        assert default_run_dir() == tmp_path / "x"  # the path wins over the variable's name
        select_fleet("a")
        assert default_run_dir() == runs / "a"  # and the flag over both
        assert RunDir(tmp_path / "y").path == tmp_path / "y"  # --run-dir over everything
        with pytest.raises(BtbctlError, match=r"--fleet: '\.\./up' is not a fleet name"):
            select_fleet("../up")
        select_fleet(None)
        monkeypatch.delenv("BTBCTL_RUN_DIR")
        monkeypatch.setenv("BTBCTL_FLEET", "a/b")
        with pytest.raises(BtbctlError, match="BTBCTL_FLEET"):
            default_run_dir()
    finally:
        select_fleet(None)


def test_doctor_names_the_running_fleet_that_holds_a_busy_port(tmp_path, monkeypatch):
    import socket

    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.cluster import load_cluster
    from btbctl.engine.launcher.doctor import doctor

    with socket.socket() as busy:  # the gateway port of a fleet that runs (the row list_fleets gives for it)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'[gateway]\nport = {port}\ncontrol_port = 0\n\n[[workers]]\nname = "w"\ncount = 1\n')
        running = {"name": "demo", "state": "running", "gateway_url": f"http://127.0.0.1:{port}", "control_url": None}
        monkeypatch.setattr(fleet, "list_fleets", lambda root=None: [running])
        problems = doctor(load_cluster(str(cfg)))["hosts"][0]["problems"]
        said = [p for p in problems if p.startswith(f"port {port}: ")]
        assert len(said) == 1 and "btbctl fleet demo holds it: `btbctl down --fleet demo`" in said[0], problems
        monkeypatch.setattr(fleet, "list_fleets", lambda root=None: [{**running, "state": "stopped"}])
        problems = doctor(load_cluster(str(cfg)))["hosts"][0]["problems"]
        said = [p for p in problems if p.startswith(f"port {port}: ")]
        assert len(said) == 1 and "fleet" not in said[0]  # someone else's: no fleet to blame
