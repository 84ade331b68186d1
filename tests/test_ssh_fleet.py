"""A fleet across two "hosts" (127.0.0.1 and 127.0.0.2) started through a real sshd on loopback: up, a burst
through the gateway, status, logs, down; and every start failure gives one line naming host and cause and leaves
nothing running."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import pytest

from btbctl.engine.launcher.rundir import RunDir, group_members, process_start_time
from launcher_helpers import cli, force_cleanup, wait_gone
from sshd_fixture import host_table

STANDIN = Path(__file__).with_name("_standin.py")

#: Fleets started and stopped over a real sshd: the slow stage (`pytest -m slow`).
pytestmark = pytest.mark.slow


def _toml(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def write_cluster(path: Path, hosts: list[dict], workers: list[dict], policy: str | None = None) -> Path:
    """A cluster file; ``policy``: the gateway's (None: the default)."""
    lines = ["[gateway]", "port = 0", "control_port = 0"]
    if policy is not None:
        lines.append(f"policy = {_toml(policy)}")
    lines += ["", "[btb]", "prefix_blocks = 4", ""]
    for h in hosts:
        lines.append("[[hosts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in h.items()]
        lines.append("")
    for w in workers:
        lines.append("[[workers]]")
        lines += [f"{k} = {_toml(v)}" for k, v in w.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


FAST = {"time_scale": 100.0, "kv_bytes_scale": 65536, "ready_timeout_s": 30.0}


def remote_leftovers(server) -> list[int]:
    """Processes (other than sshd's) whose working directory is under the fake remote homes of ``server``."""
    root = str(server.dir / "remote")
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd.startswith(root) and process_start_time(int(entry)) is not None:
            out.append(int(entry))
    return out


@pytest.fixture
def run_dir(tmp_path):
    rd = tmp_path / "run"
    yield rd
    # safety net: the "remote" workers of a failed test run on this machine; stop the groups still led by the
    # recorded process (or with members left), then the local ones
    state = RunDir(rd).load() if (rd / "state.json").exists() else None
    for p in state.processes if state else []:
        if p.host and (process_start_time(p.pgid) == p.start_time or group_members(p.pgid)):
            os.killpg(p.pgid, signal.SIGKILL)
    force_cleanup(rd)


@pytest.mark.slow
def test_two_hosts_up_burst_status_logs_down(sshd, tmp_path, run_dir):
    cfg = write_cluster(
        tmp_path / "c.toml",
        [host_table(sshd, "node-a", "127.0.0.1"), host_table(sshd, "node-b", "127.0.0.2")],
        [{"name": "a", "host": "node-a", "count": 1, **FAST}, {"name": "b", "host": "node-b", "count": 2, **FAST}],
    )
    up = cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), "--format", "json", timeout=60)
    st = json.loads(up.stdout)
    by_name = {w["name"]: w for w in st["workers"]}
    assert {n: (w["host"], w["healthy"]) for n, w in by_name.items()} == {
        "a-0": ("node-a", True),
        "b-0": ("node-b", True),
        "b-1": ("node-b", True),
    }
    assert by_name["a-0"]["url"].startswith("http://127.0.0.1:")
    assert by_name["b-0"]["url"].startswith("http://127.0.0.2:")
    state = RunDir(run_dir).load()
    remote = [p for p in state.processes if p.host]
    assert len(remote) == 3 and all(p.pid == p.pgid and p.start_time != "-" for p in remote)
    for p in remote:  # same machine: the recorded group is really running, led by the recorded process
        assert process_start_time(p.pid) == p.start_time

    bench = json.loads(
        cli(
            "bench",
            "--run-dir",
            str(run_dir),
            "--burst-size",
            "12",
            "--prefix-blocks",
            "4",
            "--spread-s",
            "0.3",
            "--format",
            "json",
            timeout=60,
        ).stdout
    )
    assert (bench["requests"], bench["ok"], bench["errors"]) == (12, 12, 0)

    status = json.loads(cli("status", "--run-dir", str(run_dir), "--format", "json").stdout)
    assert all(w["healthy"] and w["alive"] for w in status["workers"])
    human = cli("status", "--run-dir", str(run_dir)).stdout
    assert "node-b" in human and "node-a" in human

    logs = cli("logs", "b-1", "--run-dir", str(run_dir)).stdout
    assert "ready http://127.0.0.2:" in logs

    down = json.loads(cli("down", "--run-dir", str(run_dir), "--grace-s", "5", "--format", "json").stdout)
    assert sorted(down["stopped"] + down["killed"]) == ["a-0", "b-0", "b-1", "gateway"]
    assert down["unreachable"] == []
    assert wait_gone([p.pid for p in state.processes]) == []
    assert all(not group_members(p.pgid) for p in remote)
    assert remote_leftovers(sshd) == []
    assert RunDir(run_dir).load() is None


def _fail_up(cfg: Path, run_dir: Path, server) -> str:
    proc = cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("btbctl: error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert RunDir(run_dir).load() is None
    assert remote_leftovers(server) == []
    return errors[0]


def _good_and(server, tmp_path, bad_host: dict, bad_worker: dict | None = None) -> Path:
    """A cluster with one healthy worker on node-a and one worker on the broken node-b."""
    return write_cluster(
        tmp_path / "c.toml",
        [host_table(server, "node-a", "127.0.0.1"), bad_host],
        [{"name": "a", "host": "node-a", **FAST}, {"name": "b", "host": "node-b", **FAST, **(bad_worker or {})}],
    )


def test_wrong_host_key(sshd, tmp_path, run_dir):
    bad = host_table(sshd, "node-b", "127.0.0.2", known_hosts=str(sshd.other_key_known_hosts))
    line = _fail_up(_good_and(sshd, tmp_path, bad), run_dir, sshd)
    assert f"host node-b (127.0.0.2:{sshd.port}): host key mismatch" in line


def test_unknown_host_names_the_keyscan_command(sshd, tmp_path, run_dir):
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    bad = host_table(sshd, "node-b", "127.0.0.2", known_hosts=str(empty))
    line = _fail_up(_good_and(sshd, tmp_path, bad), run_dir, sshd)
    assert "host node-b" in line and "unknown host key" in line
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.2 >> {shlex.quote(str(empty))}" in line


def test_unreachable_host(sshd, tmp_path, run_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        closed = s.getsockname()[1]
    bad = host_table(sshd, "node-b", "127.0.0.2", port=closed)
    line = _fail_up(_good_and(sshd, tmp_path, bad), run_dir, sshd)
    assert f"host node-b (127.0.0.2:{closed}): connection refused" in line


def test_worker_that_exits_at_once(sshd, tmp_path, run_dir):
    bad = host_table(sshd, "node-b", "127.0.0.2")
    worker = {"command": [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"], "port": 0}
    line = _fail_up(_good_and(sshd, tmp_path, bad, worker), run_dir, sshd)
    assert "host node-b" in line and "b-0: exited at once: status 3: no model here" in line


def test_command_not_found(sshd, tmp_path, run_dir):
    bad = host_table(sshd, "node-b", "127.0.0.2", python="/nonexistent/bin/python3")
    line = _fail_up(_good_and(sshd, tmp_path, bad), run_dir, sshd)
    assert "host node-b" in line and "b-0: command not found: /nonexistent/bin/python3" in line
    assert line.count("command not found") == 1


def test_health_timeout(sshd, tmp_path, run_dir):
    bad = host_table(sshd, "node-b", "127.0.0.2")
    worker = {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "ready_timeout_s": 1.5}
    line = _fail_up(_good_and(sshd, tmp_path, bad, worker), run_dir, sshd)
    assert "host node-b" in line and "b-0: health timeout: no answer on GET http://127.0.0.2:" in line


def test_port_already_taken(sshd, tmp_path, run_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        taken = s.getsockname()[1]
        bad = host_table(sshd, "node-b", "127.0.0.2")
        line = _fail_up(_good_and(sshd, tmp_path, bad, {"port": taken}), run_dir, sshd)
    assert "host node-b" in line and "b-0: port busy" in line and "127.0.0.2" in line


def test_port_taken_while_the_worker_stays_up(sshd, tmp_path, run_dir):
    """A server that logs its bind error and stays up (SGLang: its scheduler children keep it) fails `up` on that
    line, not after its ready timeout (10 min here); it and its child are stopped."""
    pid_file = tmp_path / "child.pid"
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        s.listen()
        taken = s.getsockname()[1]
        bad = host_table(sshd, "node-b", "127.0.0.2")
        worker = {
            "port": taken,
            "command": [sys.executable, str(STANDIN), "--host", "{host}", "--port", "{port}"],
            "env": {
                "STANDIN_STAY_UP_ON_BIND_ERROR": "1",
                "STANDIN_CHILD": "1",
                "STANDIN_CHILD_PID_FILE": str(pid_file),
            },
            "ready_timeout_s": 600.0,
        }
        line = _fail_up(_good_and(sshd, tmp_path, bad, worker), run_dir, sshd)
    assert "host node-b" in line and "b-0: port busy: ERROR:    [Errno 98]" in line
    assert f"bind on address ('127.0.0.2', {taken}): address already in use" in line
    assert wait_gone([int(pid_file.read_text())]) == []


def test_down_reports_an_unreachable_host_and_keeps_its_workers(sshd, tmp_path, run_dir):
    cfg = write_cluster(
        tmp_path / "c.toml",
        [host_table(sshd, "node-a", "127.0.0.1"), host_table(sshd, "node-b", "127.0.0.2")],
        [{"name": "a", "host": "node-a", **FAST}, {"name": "b", "host": "node-b", **FAST}],
    )
    cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), timeout=60)
    state_path = run_dir / "state.json"
    good = state_path.read_text()
    data = json.loads(good)
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        closed = s.getsockname()[1]
    for p in data["processes"]:
        if p.get("host") == "node-b":
            p["extra"]["ssh"]["port"] = closed
    state_path.write_text(json.dumps(data))
    proc = cli("down", "--run-dir", str(run_dir), "--grace-s", "5", check=False)
    assert proc.returncode == 2
    assert "unreachable b-0" in proc.stdout
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("btbctl: error:")]
    assert len(line) == 1 and f"b-0: host node-b (127.0.0.2:{closed}): connection refused" in line[0]
    left = RunDir(run_dir).load()
    assert [p.name for p in left.processes] == ["b-0"]
    b = left.processes[0]
    assert process_start_time(b.pid) == b.start_time  # still running, still recorded
    # the host is back: a second down stops it
    rec = json.loads(state_path.read_text())
    rec["processes"][0]["extra"]["ssh"]["port"] = sshd.port
    state_path.write_text(json.dumps(rec))
    again = json.loads(cli("down", "--run-dir", str(run_dir), "--format", "json").stdout)
    assert again["stopped"] + again["killed"] == ["b-0"]
    assert wait_gone([b.pid]) == [] and remote_leftovers(sshd) == []
