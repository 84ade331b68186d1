"""`status` probes the node agents' ports, and `btbctl restart NAME` restarts one process of a fleet in place.

The fast tests write a run state by hand around small stand-in processes; the live one (slow) runs an ``l3`` fleet of
emulated workers."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher import fleet
from btbctl.engine.launcher.local import spawn, stop_groups
from btbctl.engine.launcher.rundir import RunDir, RunState
from launcher_helpers import FREE_PORTS, cli, cli_json, wait_gone


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_args):
        pass


@pytest.fixture
def health_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def sleepers(tmp_path):
    started = []

    def start(name: str):
        p = spawn(name, [sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / f"{name}.log")
        started.append(p)
        return p

    yield start
    stop_groups([(p.pid, p.popen) for p in started], grace_s=1.0)


def _state(rd: RunDir, *recs) -> None:
    rd.prepare()
    rd.save(
        RunState(run_dir=str(rd.path), created_at=time.time(), detached=True, replication="l3", processes=list(recs))
    )


def test_status_probes_the_agents_copy_port_and_marks_its_workers(tmp_path, health_server, sleepers):
    """An agent whose process runs and whose control API answers, but whose copy port is closed, is a problem;
    its workers say their agent is down (the old status only looked at the agent's pid)."""
    rd = RunDir(tmp_path / "run")
    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen()
    peer_addr = f"127.0.0.1:{peer.getsockname()[1]}"
    agent = sleepers("agent-local").record("agent", "agent")
    agent.url = health_server
    agent.extra = {"peer": peer_addr, "control": health_server[7:]}
    worker = sleepers("worker-0").record("worker", "emulated")
    worker.url = health_server
    _state(rd, agent, worker)

    st = fleet.status(rd)
    assert st["agents"][0]["healthy"] and st["agents"][0]["problem"] is None
    assert st["workers"][0]["replication"] == "l3" and st["workers"][0]["agent_down"] is None
    assert not [p for p in st["problems"] if "agent-local" in p]

    peer.close()  # the copy port dies, the rest of the agent runs on
    st = fleet.status(rd)
    a = st["agents"][0]
    assert a["alive"] and not a["healthy"] and f"copy port {peer_addr}" in a["problem"]
    assert st["verdict"] == "degraded" and any(p.startswith("agent-local: copy port") for p in st["problems"])
    w = st["workers"][0]
    assert w["replication"] == "l3 (agent down)" and w["agent_down"] == "agent-local"
    assert "agent-local is down" in w["health_error"]


def test_restart_unknown_or_remote_name_is_one_line(tmp_path, sleepers):
    rd = RunDir(tmp_path / "run")
    gw = sleepers("gateway").record("gateway", "gateway")
    remote = sleepers("worker-1").record("worker", "emulated")
    remote.host = "gpu2"
    _state(rd, gw, remote)
    proc = cli("restart", "nope", "--run-dir", str(rd.path), check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "valid names: gateway, worker-1" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("restart", "worker-1", "--run-dir", str(rd.path), check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "runs on host gpu2" in proc.stderr and "not supported" in proc.stderr
    empty = cli("restart", "gateway", "--run-dir", str(tmp_path / "none"), check=False)
    assert empty.returncode == 2 and "no fleet is recorded" in empty.stderr


_SERVER = """
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (os.environ.get("WHO", "") + " " + str(os.getpid())).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_restart_a_worker_keeps_its_port_env_and_the_others(tmp_path, sleepers):
    """A worker (a command override) is stopped and started again with its recorded argv and environment on its
    port; its new pid is recorded, the other processes are untouched, its old log is kept, one event line."""
    rd = RunDir(tmp_path / "run")
    rd.prepare()
    port = fleet.free_port()
    argv = [sys.executable, "-c", _SERVER, str(port)]
    w = spawn("worker-0", argv, rd.log_path("worker-0"), env={"WHO": "w0"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while not fleet.health_ok(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = w.record("worker", "command")
    rec.url = url
    other = sleepers("worker-1").record("worker", "emulated")
    _state(rd, rec, other)
    try:
        proc = cli("restart", "worker-0", "--run-dir", str(rd.path), "--grace-s", "2", "--format", "json")
        res = json.loads(proc.stdout)
        assert res["old_pid"] == w.pid and res["pid"] != w.pid and res["url"] == url
        assert wait_gone([w.pid]) == []
        events = [ln for ln in proc.stderr.splitlines() if ln.startswith("event=process_restart")]
        assert len(events) == 1 and "name=worker-0" in events[0] and f"pid={res['pid']}" in events[0]
        state = rd.load()
        new = next(p for p in state.processes if p.name == "worker-0")
        assert new.pid == res["pid"] and new.url == url and new.argv == argv and new.env == {"WHO": "w0"}
        assert next(p for p in state.processes if p.name == "worker-1").pid == other.pid  # untouched
        import urllib.request

        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.read().decode() == f"w0 {res['pid']}"  # the same port, the same environment
        assert Path(str(rd.log_path("worker-0")) + ".before-restart").exists()
    finally:
        state = rd.load()
        for p in state.processes if state else []:
            if p.name == "worker-0":
                try:
                    os.killpg(p.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        w.popen.wait(timeout=5)


L3_FLEET = """
[replication]
mode = "l3"
arena_mib = 64

[[workers]]
kind = "emulated"
count = 2
zero_delay = true
"""


@pytest.mark.slow
def test_stopped_agent_degrades_status_and_restart_brings_each_process_back(tmp_path, run_dir):
    cfg = tmp_path / "l3.toml"
    cfg.write_text(L3_FLEET)
    st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS)
    try:
        assert st["verdict"] == "up" and st["agents"][0]["healthy"]
        state = RunDir(run_dir).load()
        agent = state.agents()[0]
        workers = {p.name: p.pid for p in state.workers()}
        os.kill(agent.pid, signal.SIGSTOP)  # stopped: its pid is alive, its control API does not answer
        proc = cli("status", "--run-dir", str(run_dir), "--format", "json", check=False)
        bad = json.loads(proc.stdout)
        assert proc.returncode == 1 and not bad["agents"][0]["healthy"]
        assert all(w["replication"] == "l3 (agent down)" for w in bad["workers"])
        human = " ".join(cli("status", "--run-dir", str(run_dir), check=False).stdout.split())  # however it wraps
        assert "does not answer /health" in human and "btbctl restart agent-local" in human

        res = cli_json("restart", "agent-local", "--run-dir", str(run_dir), "--grace-s", "1")
        assert res["old_pid"] == agent.pid and res["stop"] == "killed"
        st2 = cli_json("status", "--run-dir", str(run_dir))
        assert st2["verdict"] == "up" and st2["agents"][0]["peer"] == st["agents"][0]["peer"]
        assert st2["agents"][0]["control_url"] == st["agents"][0]["control_url"]
        assert {p.name: p.pid for p in RunDir(run_dir).load().workers()} == workers  # untouched

        res = cli_json("restart", "worker-1", "--run-dir", str(run_dir))
        assert res["url"] == st["workers"][1]["url"] and res["pid"] != workers["worker-1"]
        cli("tune", "--run-dir", str(run_dir), "window_s=7")
        res = cli_json("restart", "gateway", "--run-dir", str(run_dir))
        assert res["url"] == st["gateway_url"]
        assert cli_json("tune", "--run-dir", str(run_dir))["constants"]["window_s"] == 7
        deadline = time.monotonic() + 15
        while True:
            proc = cli("status", "--run-dir", str(run_dir), "--format", "json", check=False)
            if proc.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        st3 = json.loads(proc.stdout)
        assert proc.returncode == 0 and st3["control_url"] == st["control_url"]
        assert [w["url"] for w in st3["workers"]] == [w["url"] for w in st["workers"]]
    finally:
        cli("down", "--run-dir", str(run_dir), "--grace-s", "2", check=False)


@pytest.mark.parametrize("text", ["[]", "null", "3"])
def test_restart_gateway_replica_settings_not_an_object(tmp_path, text):
    """A gateway-1.json that parses but is not a JSON object is damaged: one-line error, nothing stopped or
    started."""
    from btbctl.engine.launcher.fleet import restart_gateway_replica
    from btbctl.engine.launcher.rundir import ProcessRecord

    (tmp_path / "gateway-1.json").write_text(text, encoding="utf-8")
    rec = ProcessRecord(
        name="gateway-1",
        role="gateway",
        kind="gateway",
        pid=1,
        pgid=1,
        start_time="0",
        argv=[],
        log="x",
        url="http://127.0.0.1:9",
    )
    stops: list[int] = []
    with pytest.raises(BtbctlError, match="cannot read the settings of gateway-1"):
        restart_gateway_replica(RunDir(tmp_path), rec, lambda: stops.append(1) or "stopped", 1.0)
    assert stops == []
