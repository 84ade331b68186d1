"""Run directory and process launcher: permissions, state, process identity, readiness, stopping by group."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.fleet import check_no_live_run, down, free_port
from btbctl.engine.launcher.local import same_btbctl_env, spawn, stop_group, stop_record, wait_ready
from btbctl.engine.launcher.rundir import (
    ProcessRecord,
    RunDir,
    RunState,
    default_run_dir,
    group_members,
    is_same_process,
    process_start_time,
    record_is_ours,
)

STANDIN = str(Path(__file__).with_name("_standin.py"))


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _alive(pid: int) -> bool:
    return process_start_time(pid) is not None


def test_default_run_dir_is_under_the_user_state_dir(monkeypatch):
    import platformdirs

    monkeypatch.delenv("BTBCTL_RUN_DIR", raising=False)
    assert default_run_dir() == Path(platformdirs.user_state_dir("btbctl")) / "runs" / "default"
    monkeypatch.setenv("BTBCTL_RUN_DIR", "/somewhere/else")
    assert default_run_dir() == Path("/somewhere/else")


def test_tokens_and_state_are_private(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.prepare()
    assert _mode(rd.path) == 0o700
    control, worker = rd.new_tokens()
    assert _mode(rd.token_path) == 0o600 and _mode(rd.worker_token_path) == 0o600
    assert len(control) >= 40 and len(worker) >= 40 and control != worker
    assert rd.read_token() == control
    control2, _ = rd.new_tokens()
    assert control2 != control and rd.read_token() == control2
    state = RunState(
        run_dir=str(rd.path),
        created_at=1.0,
        detached=True,
        policy="btb",
        processes=[
            ProcessRecord(
                "worker-0",
                "worker",
                "emulated",
                123,
                123,
                "99",
                ["x"],
                "l",
                url="http://127.0.0.1:1",
                extra={"transfer": "127.0.0.1:2"},
            )
        ],
    )
    rd.save(state)
    assert _mode(rd.state_path) == 0o600
    back = rd.load()
    assert back.as_dict() == state.as_dict()
    rd.clear()
    assert rd.load() is None and not rd.token_path.exists()
    with pytest.raises(BtbctlError, match="cannot read the control token"):
        rd.read_token()


def test_corrupt_state_is_a_clear_error(tmp_path):
    rd = RunDir(tmp_path)
    rd.prepare()
    rd.state_path.write_text("{not json")
    with pytest.raises(BtbctlError, match="unreadable run state"):
        rd.load()


def test_process_identity_tells_reused_pids_and_zombies_apart():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        st = process_start_time(p.pid)
        assert st
        assert is_same_process(p.pid, st)
        assert not is_same_process(p.pid, "1")  # same pid, other start time = another process
        rec = ProcessRecord("x", "worker", "emulated", p.pid, p.pid, st, [], "")
        assert record_is_ours(rec)
        assert not record_is_ours(ProcessRecord("x", "worker", "emulated", p.pid, p.pid, "1", [], ""))
        assert group_members(p.pid) == [p.pid]
    finally:
        p.kill()
    time.sleep(0.2)  # now a zombie until reaped: counts as gone
    assert process_start_time(p.pid) is None
    assert group_members(p.pid) == []
    p.wait()


def test_wait_ready_by_ready_line_and_by_health(tmp_path):
    a = spawn("a", [sys.executable, STANDIN], tmp_path / "a.log", env={"STANDIN_READY_LINE": "1"})
    port = free_port()
    b = spawn("b", [sys.executable, STANDIN, "--port", str(port)], tmp_path / "b.log")
    try:
        wait_ready(a, 20.0)
        assert a.url.startswith("http://127.0.0.1:")
        wait_ready(b, 20.0, health_url=f"http://127.0.0.1:{port}")
        assert b.url == f"http://127.0.0.1:{port}"
        assert _mode(tmp_path / "a.log") == 0o600
    finally:
        stop_group(a.pid, 5.0, popen=a.popen)
        stop_group(b.pid, 5.0, popen=b.popen)
    assert not _alive(a.pid) and not _alive(b.pid)


def test_wait_ready_reports_an_early_exit_with_the_log_tail(tmp_path):
    p = spawn("bad", [sys.executable, STANDIN], tmp_path / "bad.log", env={"STANDIN_EXIT": "3"})
    with pytest.raises(BtbctlError, match=r"bad exited with status 3 before it was ready .*asked to fail"):
        wait_ready(p, 20.0)


def test_wait_ready_times_out(tmp_path):
    p = spawn("slow", [sys.executable, STANDIN], tmp_path / "slow.log", env={"STANDIN_DELAY_S": "30"})
    try:
        with pytest.raises(BtbctlError, match=r"slow was not ready after 0.5 s"):
            wait_ready(p, 0.5)
        assert p.popen.poll() is None  # it gave up while the process was still starting (it waits 30 s)
    finally:
        stop_group(p.pid, 5.0, popen=p.popen)


#: The ready timeout of the port-busy tests: far longer than they take when the busy line is noticed (about a
#: second), so a wait that ignored it fails them with "not ready after 30 s".
BUSY_WAIT_S = 30.0


def _script(tmp_path: Path, name: str, code: str):
    """``python -c CODE`` spawned as ``name``, its log in ``tmp_path``."""
    return spawn(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def _wait_logged(p, text: str, bound_s: float = 20.0) -> None:
    """Wait (at most ``bound_s``) until ``p``'s log holds ``text``, so what comes next sees it printed."""
    deadline = time.monotonic() + bound_s
    while text not in p.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert text in p.log.read_text()


def test_wait_ready_fails_at_once_when_its_port_is_taken_though_the_process_stays_up(tmp_path):
    """As SGLang does: uvicorn logs asyncio's bind error and the server process stays up (its scheduler children
    keep it), so only the log tells; the wait ends long before its timeout, naming the address."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        code = (
            "import asyncio, time\n"
            "try:\n"
            f"    asyncio.run(asyncio.start_server(lambda r, w: None, '127.0.0.1', {taken}))\n"
            "except OSError as e:\n"
            "    print('ERROR:    %s' % e, flush=True)\n"
            "time.sleep(600)\n"
        )
        p = _script(tmp_path, "sg-0", code)
        try:
            with pytest.raises(BtbctlError) as err:
                wait_ready(p, BUSY_WAIT_S, health_url=f"http://127.0.0.1:{taken}")
            busy = f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {taken}): "
            assert str(err.value) == (
                f"sg-0: port busy: 127.0.0.1:{taken} is taken by another process, so it cannot listen "
                f"(log {p.log}): {busy}address already in use"
            )
            assert p.popen.poll() is None  # still up: stopping it is the caller's
        finally:
            stop_group(p.pid, 5.0, popen=p.popen)
    assert not _alive(p.pid)


#: The emulated worker's error (it exits) when its IPv6 port is taken: asyncio's bind error names a 4-tuple.
EMULATED_BUSY_V6 = (
    "btbctl: error: cannot listen on ::1: error while attempting to bind on address ('::1', 7001, 0, 0): "
    "address already in use"
)


@pytest.mark.parametrize(
    ("line", "health", "where", "exits"),
    [
        ("OSError: [Errno 98] Address already in use", True, "HEALTH", False),
        ("OSError: [Errno 98] Address already in use", False, "a port it binds", False),
        (EMULATED_BUSY_V6, False, "[::1]:7001", True),
    ],
)
def test_a_port_busy_line_names_the_address_it_has(tmp_path, line, health, where, exits):
    """The address comes from the line when it names one, else from the health URL; a process that printed the
    line and exited is reported the same way (not as a plain early exit)."""
    port = free_port()
    then = "import sys; sys.exit(2)" if exits else "import time; time.sleep(600)"
    p = _script(tmp_path, "w-0", f"print({line!r}, flush=True)\n{then}")
    try:
        with pytest.raises(BtbctlError) as err:
            wait_ready(p, BUSY_WAIT_S, health_url=f"http://127.0.0.1:{port}" if health else None)
        where = f"127.0.0.1:{port}" if where == "HEALTH" else where
        assert str(err.value) == (
            f"w-0: port busy: {where} is taken by another process, so it cannot listen (log {p.log}): {line}"
        )
    finally:
        stop_group(p.pid, 5.0, popen=p.popen)


def test_a_port_busy_line_after_a_long_start_is_found_in_the_log_tail(tmp_path):
    """The busy line lands past the head read for the ready line (SGLang logs a lot while loading)."""
    filler = "x" * 99
    code = f"for i in range(1000): print({filler!r})\nprint('OSError: [Errno 98] Address already in use', flush=True)\n"
    p = _script(tmp_path, "w-0", code + "import time; time.sleep(600)")
    try:
        _wait_logged(p, "Address already in use")
        assert p.log.stat().st_size > 65536
        with pytest.raises(BtbctlError, match=r"^w-0: port busy: a port it binds is taken .*Address already in use$"):
            wait_ready(p, BUSY_WAIT_S)
    finally:
        stop_group(p.pid, 5.0, popen=p.popen)


def test_wait_ready_keeps_waiting_through_unrelated_log_lines(tmp_path):
    p = _script(
        tmp_path,
        "w-0",
        "print('loading weights: address space 4 GiB, port 30000', flush=True)\nimport time; time.sleep(600)",
    )
    try:
        _wait_logged(p, "loading weights")
        with pytest.raises(BtbctlError, match=r"^w-0 was not ready after 0.3 s .*loading weights"):
            wait_ready(p, 0.3)
        assert p.popen.poll() is None
    finally:
        stop_group(p.pid, 5.0, popen=p.popen)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH needs Python 3.11")
def test_a_btbctl_child_imports_this_btbctl_not_a_checkout_in_its_working_directory(tmp_path, monkeypatch):
    """``btbctl up`` run from a checkout starts its gateway and workers (``python -m btbctl ...``) on the btbctl it
    runs itself (the installed build, README "Compiled core"), not on the checkout ``-m`` would put first."""
    fake = tmp_path / "checkout" / "btbctl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("print('the checkout in the working directory')\n")
    monkeypatch.chdir(fake.parent)
    log = tmp_path / "child.log"
    proc = spawn("child", [sys.executable, "-m", "btbctl", "--version"], log)
    assert proc.popen.wait(timeout=60) == 0
    proc.writer.wait(timeout=10)
    assert log.read_text().startswith("btbctl "), log.read_text()
    # other programs, and btbctl under another interpreter, keep their environment
    env = {"PYTHONPATH": "/x"}
    assert same_btbctl_env(["python3.9", "-m", "btbctl"], env) is env
    assert same_btbctl_env([sys.executable, "-m", "sglang.launch_server"], env) is env
    mine = same_btbctl_env([sys.executable, "-m", "btbctl.engine.launcher.logcap"], env)
    assert mine["PYTHONSAFEPATH"] == "1" and mine["PYTHONPATH"].endswith(":/x")


def test_spawn_of_a_missing_program_is_a_user_error(tmp_path):
    with pytest.raises(BtbctlError, match="program not found: /no/such/program"):
        spawn("x", ["/no/such/program"], tmp_path / "x.log")


def test_stop_group_escalates_to_sigkill_and_takes_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    p = spawn(
        "stubborn",
        [sys.executable, STANDIN],
        tmp_path / "s.log",
        env={
            "STANDIN_READY_LINE": "1",
            "STANDIN_IGNORE_TERM": "1",
            "STANDIN_CHILD": "1",
            "STANDIN_CHILD_PID_FILE": str(pidfile),
        },
    )
    wait_ready(p, 20.0)
    child = int(pidfile.read_text())
    assert sorted(group_members(p.pid)) == sorted([p.pid, child])
    killed = stop_group(p.pid, grace_s=0.5, popen=p.popen)  # it ignores SIGTERM: only SIGKILL ends it
    assert killed
    assert p.popen.returncode == -signal.SIGKILL
    time.sleep(0.2)
    assert not _alive(child) and group_members(p.pid) == []


def test_records_of_other_processes_are_never_signalled(tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        rec = ProcessRecord("w", "worker", "emulated", victim.pid, victim.pid, "12345", [], "")
        assert stop_record(rec, 1.0) == "gone"
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_refuse_to_start_over_a_live_run_and_clean_a_stale_one(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.prepare()
    rd.new_tokens()
    p = spawn("worker-0", [sys.executable, STANDIN], rd.log_path("worker-0"), env={"STANDIN_READY_LINE": "1"})
    try:
        wait_ready(p, 20.0)
        state = RunState(
            run_dir=str(rd.path),
            created_at=time.time(),
            detached=True,
            complete=True,
            processes=[p.record("worker", "emulated")],
        )
        rd.save(state)
        with pytest.raises(BtbctlError, match="already running"):
            check_no_live_run(rd)
        # down stops exactly that process and forgets the run
        out = down(rd, grace_s=5.0)
        assert out["stopped"] == ["worker-0"] and out["gone"] == [] and out["killed"] == []
        p.popen.wait(5)
        assert rd.load() is None
    finally:
        if p.popen.poll() is None:
            p.popen.kill()
    # a stale record (process gone) does not block a new run and is removed
    rd.save(state)
    rd.new_tokens()
    check_no_live_run(rd)
    assert rd.load() is None and not rd.token_path.exists()
    res = down(rd)
    assert res["nothing"] is True and res["stopped"] == [] and res["gone"] == []


def test_up_hands_each_agent_only_its_own_node_credentials_and_control_token(tmp_path):
    from btbctl.engine.replication.credentials import Credentials, control_token, parse_credentials

    rd = RunDir(tmp_path / "run")
    rd.prepare()
    secret = rd.new_agent_secret()
    agents = ["agent-local", "agent-h1", "agent-h2"]
    files = rd.write_agent_credentials(agents, ["agent-local"])
    keys, token = rd.agent_credentials_path("agent-local"), rd.agent_control_token_path("agent-local")
    assert _mode(keys) == 0o600 and keys.read_text().strip() == files["agent-local"][0]
    assert _mode(token) == 0o600 and token.read_text().strip() == files["agent-local"][1]
    assert not rd.agent_credentials_path("agent-h1").exists()  # a host's files go to that host only
    assert all(secret not in text for pair in files.values() for text in pair)
    # each agent's control token is its own (the gateway derives them all from the fleet secret)
    assert len({t for _, t in files.values()}) == 3
    assert files["agent-h1"][1] == control_token(secret.encode(), "agent-h1")
    creds = {a: parse_credentials(files[a][0].encode(), a, a) for a in agents}
    fleet = Credentials.from_fleet_secret(secret.encode(), "agent-h2")
    # h1 can speak to h2 with the key h2 derives for h1 (and so can an agent holding the fleet secret), and with
    # nothing in its file can it produce the key h2 expects from agent-local
    assert creds["agent-h1"].as_sender("agent-h2") == creds["agent-h2"].as_target("agent-h1")
    assert creds["agent-h1"].as_sender("agent-h2") == fleet.as_target("agent-h1")
    forbidden = creds["agent-h2"].as_target("agent-local")
    assert forbidden not in (creds["agent-h1"].node_key, *creds["agent-h1"].links.values())
    rd.clear()
    assert not keys.exists() and not token.exists() and not rd.agent_secret_path.exists()


HOLD_LOCK = (
    "import sys, time\n"
    "from btbctl.engine.launcher.rundir import RunDir\n"
    "hold = RunDir(sys.argv[1]).locked()\n"
    "hold.__enter__()\n"
    "print('held', flush=True)\n"
    "time.sleep(60)\n"
)


def _hold_lock(rd: RunDir) -> subprocess.Popen:
    """Another process that holds ``rd``'s lock (as a running ``up`` does) until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(rd.path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _stale_fleet(rd: RunDir) -> tuple[RunState, dict[str, bytes]]:
    """A run directory as a first ``up`` leaves it mid-start: a state, tokens, a worker log; with their bytes."""
    rd.prepare()
    rd.new_tokens()
    state = RunState(run_dir=str(rd.path), created_at=1.0, detached=True, processes=[])
    rd.save(state)
    rd.log_path("worker-0").write_text("first run\n")
    files = [rd.state_path, rd.token_path, rd.worker_token_path, rd.log_path("worker-0")]
    return state, {str(p): p.read_bytes() for p in files}


def _no_spawn(monkeypatch) -> None:
    """Make starting any process of a fleet fail the test (a regression must not leave a fleet running)."""
    from btbctl.engine.launcher import fleet

    def refuse(name, *_a, **_k):
        raise AssertionError(f"{name} was started")

    monkeypatch.setattr(fleet, "spawn", refuse)


def test_a_second_up_or_down_while_one_holds_the_run_dir_is_refused_and_touches_nothing(tmp_path, monkeypatch):
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.cluster import default_cluster
    from btbctl.engine.launcher.restart import restart
    from launcher_helpers import FREE_PORTS, cli

    _no_spawn(monkeypatch)
    rd = RunDir(tmp_path / "run")
    _, before = _stale_fleet(rd)
    holder = _hold_lock(rd)
    try:
        busy = f"another btbctl up/down is working on fleet run \\(run dir {rd.path}, pid {holder.pid}\\)"
        with pytest.raises(BtbctlError, match=busy):  # first, so that a lock not held never starts a fleet below
            with rd.locked():
                pass
        with pytest.raises(BtbctlError, match=busy):
            fleet.up(default_cluster(), rd, detach=True, port=0, control_port=0)
        with pytest.raises(BtbctlError, match=busy):
            down(rd, grace_s=1.0)
        with pytest.raises(BtbctlError, match=busy):
            fleet.up_gateway_only(rd)
        with pytest.raises(BtbctlError, match=busy):
            restart(rd, "gateway")
        proc = cli("up", "-d", "--run-dir", str(rd.path), *FREE_PORTS, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "try again when it has finished" in proc.stderr
        assert "Traceback" not in proc.stderr
        # nothing of the first was touched: no stale-state cleanup, no log rotation, no new tokens
        assert {p: Path(p).read_bytes() for p in before} == before
        assert not rd.previous_logs_dir.exists()
    finally:
        holder.kill()
        holder.wait(5)
    # the kernel releases the lock of a process that died (no clean exit): the run directory is free again
    with rd.locked():
        with rd.locked():  # re-entrant in one process (restart of the gateway runs up --gateway-only)
            pass
    assert down(rd)["stopped"] == []


def test_down_of_a_run_dir_that_does_not_exist_creates_nothing(tmp_path):
    rd = RunDir(tmp_path / "nowhere")
    assert down(rd)["nothing"] is True
    assert not rd.path.exists()


def _write_tuned(rd: RunDir, body: str) -> None:
    rd.prepare()
    rd.tuned_path.write_text(body)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ('{"constants": {"threshold": 3}, "pol', "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"constants": {"bogus": 1}}', "constants.bogus: unknown key; valid keys: prefix_blocks, threshold"),
        ('{"constants": {"threshold": 0}}', "constants.threshold: must be an integer in"),
        ('{"constants": {}, "policy": "nope"}', "policy: unknown policy 'nope'; valid: "),
    ],
)
def test_a_damaged_tuned_json_stops_up_before_anything_starts_naming_the_file(tmp_path, monkeypatch, body, says):
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.cluster import default_cluster

    _no_spawn(monkeypatch)
    rd = RunDir(tmp_path / "run")
    _write_tuned(rd, body)
    rd.log_path("worker-0").write_text("last run\n")
    with pytest.raises(BtbctlError) as err:
        fleet.up(default_cluster(), rd, detach=True, port=0, control_port=0)
    msg = str(err.value)
    assert msg.startswith(f"{rd.tuned_path}: ") and says in msg and f"delete {rd.tuned_path}" in msg
    assert "\n" not in msg
    assert rd.load() is None and not rd.previous_logs_dir.exists()  # nothing started, the last logs stay


def test_a_damaged_tuned_json_is_one_line_and_exit_2_from_the_command(tmp_path):
    from launcher_helpers import FREE_PORTS, cli

    rd = RunDir(tmp_path / "run")
    _write_tuned(rd, '{"constants": {"bogus": 1}}')
    proc = cli("up", "-d", "--run-dir", str(rd.path), *FREE_PORTS, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert str(rd.tuned_path) in proc.stderr and "constants.bogus: unknown key" in proc.stderr
    assert "started worker" not in proc.stderr + proc.stdout


def test_a_tuning_is_matched_on_the_resolved_cluster_file(tmp_path, monkeypatch):
    from btbctl.engine.launcher.fleet import _tuning_for, describe_tuning, resolve_cluster_path

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "c.toml").write_text("")
    (b / "c.toml").write_text("")
    rd = RunDir(tmp_path / "run")
    rd.prepare()
    monkeypatch.chdir(a)
    tuned_for_a = resolve_cluster_path("c.toml")
    assert tuned_for_a == str(a / "c.toml")
    rd.save_tuned({"threshold": 3}, "btb", tuned_for_a)
    lines: list[str] = []
    # the same file named by its absolute path, or from another directory by a relative one: reapplied
    assert _tuning_for(rd, resolve_cluster_path(str(a / "c.toml")), lines.append)["constants"] == {"threshold": 3}
    monkeypatch.chdir(b)
    assert _tuning_for(rd, resolve_cluster_path("../a/c.toml"), lines.append) is not None
    assert lines == []
    # another file typed the same way: not reapplied, and one line names both
    assert _tuning_for(rd, resolve_cluster_path("c.toml"), lines.append) is None
    skipped = (
        f"not applying the tuning in {rd.tuned_path}: it was made for cluster file {a / 'c.toml'}, "
        f"not cluster file {b / 'c.toml'}"
    )
    assert lines == [skipped]
    assert _tuning_for(rd, None, lines.append) is None and "not the default fleet" in lines[-1]
    rd.save_tuned({"threshold": 3}, "btb", None)
    assert _tuning_for(rd, None, lines.append) is not None
    assert describe_tuning({"threshold": 3, "window_s": 0.5}, "btb") == "policy btb, threshold 3, window_s 0.5"


def test_rm_forgets_a_stopped_fleet_refuses_a_running_one_and_ls_hides_bare_locks(tmp_path):
    from btbctl.engine.launcher.fleet import list_fleets, remove_fleet

    root = tmp_path / "runs"
    (root / "old" / "logs").mkdir(parents=True)  # stopped: its logs remain
    (root / "old" / "logs" / "gateway.log").write_text("event=gateway_stop\n")
    (root / "bare").mkdir()
    (root / "bare" / ".lock").write_text("1")  # an up that stopped at its first checks
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        rd = RunDir(root / "live")
        rd.path.mkdir()
        rec = ProcessRecord("worker-0", "worker", "emulated", p.pid, p.pid, process_start_time(p.pid), [], "")
        rd.save(RunState(run_dir=str(rd.path), created_at=1.0, detached=True, processes=[rec], complete=True))
        assert {f["name"]: f["state"] for f in list_fleets(root)} == {"live": "running", "old": "stopped"}
        with pytest.raises(BtbctlError, match="fleet live is running; stop it first: btbctl down --fleet live"):
            remove_fleet("live", root)
        assert (root / "live" / "state.json").exists()
        assert remove_fleet("old", root) == root / "old" and not (root / "old").exists()
        with pytest.raises(BtbctlError, match="no fleet old"):
            remove_fleet("old", root)
        with pytest.raises(BtbctlError, match="not a fleet name"):
            remove_fleet("../live", root)
    finally:
        p.kill()
        p.wait()
