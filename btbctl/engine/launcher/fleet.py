"""``up``, ``down`` and ``status`` for a fleet on this machine and on ``[[hosts]]`` reached over SSH.

Workers whose ``host`` names a ``[[hosts]]`` entry are started through :mod:`~btbctl.engine.launcher.ssh`, every
host in parallel, each bounded by its ``start_timeout_s``; the rest start here. ``up`` is all or nothing: if any
worker on any host fails, everything started on every host is stopped again (unless ``keep_partial``) and the
error names the host and the cause. ``down`` stops remote workers by their recorded process group on their host
and reports the ones it could not reach (they stay recorded, so a later ``down`` can retry).

``up`` (:func:`up`) refuses to start over a live run in the same run directory (a stale one is cleaned), writes fresh
tokens, starts every worker of the cluster file in its own session, waits until all are ready, then starts the gateway
in front of them (``python -m btbctl gateway --config <run dir>/gateway.json``) and waits for it. ``state.json`` is
rewritten after every step, so a fleet that failed half way (or whose ``up`` was killed) can still be stopped with
``down``. If a step fails, everything started so far is stopped and the state removed before the error is raised.

In replication mode ``l3`` each host's node agent starts before that host's workers, whose HiCache flags name its
socket (:mod:`~btbctl.engine.launcher.agents`), and the gateway gets every agent's control URL and which worker
uses which agent.

``down`` (:func:`down`) stops the gateway first, then the workers, then the agents, each by process group (SIGTERM,
then SIGKILL after a grace period), and only processes that are provably the ones ``up`` started
(:func:`~btbctl.engine.launcher.rundir.record_is_ours`).

``status`` (:func:`status`) reports the gateway's view of the fleet (``GET /control/fleet``), falling back to
probing each worker's ``/health`` when the gateway does not answer.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from btbctl.engine.control.client import ControlClient
from btbctl.engine.control.schema import WORKER_NUMBERS
from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.cluster import ClusterFile, WorkerInstance, hicache_args, kv_events_ref, worker_argv
from btbctl.engine.launcher.local import Started, health_ok, spawn, stop_groups, stop_records, wait_ready
from btbctl.engine.launcher.rundir import (
    LOCK_FILE,
    ProcessRecord,
    RunDir,
    RunState,
    check_fleet_name,
    group_members,
    holding_lock,
    is_same_process,
    process_start_time,
    record_is_ours,
    runs_root,
)
from btbctl.engine.netaddr import hostport
from btbctl.engine.wording import plural

Log = Callable[[str], None]


def _nolog(_msg: str) -> None:
    pass


def connect_host(host: str) -> str:
    """The address to connect to for a server bound to ``host`` (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def _url(host: str, port: int) -> str:
    h = connect_host(host)
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"http://{h}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; another process may take it before use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((connect_host(host).strip("[]"), 0))
        return s.getsockname()[1]


def check_no_live_run(rd: RunDir, log: Log = _nolog) -> None:
    """Raise :class:`BtbctlError` if ``rd`` records a fleet that is still running (or workers on other hosts,
    which only ``down`` may forget); remove a stale record."""
    state = rd.load()
    if state is None:
        return
    live = rd.live_processes(state) + [p for p in state.processes if p.host]
    if live or rd.owner_alive(state):
        where = state.gateway_url or ", ".join(p.url or p.name for p in live) or "starting"
        suffix = rd.selector()
        gw = state.gateway()
        if state.complete and gw is not None and gw not in live and any(p.role == "worker" for p in live):
            raise BtbctlError(
                f"the workers recorded in {rd.path} are running but the gateway is not; restart it in front of "
                f"them with `btbctl up --gateway-only{suffix}` (or stop everything with `btbctl down{suffix}`)"
            )
        raise BtbctlError(
            f"a fleet is already running from {rd.path} ({where}); stop it with `btbctl down{suffix}` "
            f"(or name another fleet: --fleet NAME)"
        )
    log(f"removing stale state of a fleet that is no longer running ({rd.state_path})")
    rd.clear()


def gateway_argv(config_path: str, python: str | None = None) -> list[str]:
    """The gateway's command line: ``python -m btbctl gateway --config CONFIG.json``."""
    return [python or sys.executable, "-m", "btbctl", "gateway", "--config", config_path]


def write_gateway_config(rd: RunDir, data: dict, name: str = "gateway") -> str:
    """Write the settings of gateway ``name`` to ``<run dir>/<name>.json`` (mode 0600); return the path."""
    path = rd.path / f"{name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return str(path)


def _port_free(host: str, port: int) -> bool:
    """Whether a TCP listener could bind ``host:port`` now (0: always)."""
    if not port:
        return True
    h = connect_host(host).strip("[]") if host not in ("0.0.0.0", "::", "[::]", "") else host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds (reuse_address=True)
        try:
            s.bind((h, port))
        except OSError:
            return False
    return True


def check_ports(cluster: ClusterFile, port: int | None = None, control_port: int | None = None) -> None:
    """Refuse before anything starts when a fixed port of this machine is taken: the gateway's data and control
    ports and the fixed HTTP and transfer ports of the local workers. Raises :class:`BtbctlError` naming each."""
    gw = cluster.gateway
    wanted = [
        ("gateway data-plane port (--port)", gw.host, gw.port if port is None else port),
        (
            "gateway control port (--control-port)",
            gw.control_host,
            gw.control_port if control_port is None else control_port,
        ),
    ]
    if gw.register_host and gw.register_port and any(h is not None for h in cluster.agent_hosts()):
        wanted.append(("gateway registration port ([gateway] register_port)", gw.register_host, gw.register_port))
    first = list(wanted)  # gateway 0's ports; gateway i's are numbered from them
    for i in range(1, gw.replicas):
        for what, host, p in first:
            wanted.append((f"{what.split(' (')[0]} of gateway-{i}", host, _replica_port(p, i)))
    for inst in cluster.instances():
        if cluster.host_of(inst.spec) is None:
            wanted.append((f"{inst.name} port", inst.spec.host, inst.port))
            wanted.append((f"{inst.name} transfer port", inst.spec.host, inst.transfer_port))
    seen: dict[tuple[str, int], str] = {}
    busy = []
    for what, host, p in wanted:
        if not p:
            continue
        if (connect_host(host), p) in seen:
            busy.append(f"{what} {p} is also the {seen[(connect_host(host), p)]}")
            continue
        seen[(connect_host(host), p)] = what
        if not _port_free(host, p):
            busy.append(f"{what} {host}:{p} is in use")
    if busy:
        raise BtbctlError("cannot start the fleet: " + "; ".join(busy) + " (nothing was started)")


def free_gateway_ports(
    cluster: ClusterFile, port: int | None, control_port: int | None, log: Log = _nolog
) -> tuple[int | None, int | None]:
    """``(port, control_port)`` for ``up``: each one not given whose cluster-file port is in use becomes 0 (the
    gateway binds a free one and reports it in its ready line), said in one ``log`` line; given ones stay."""
    gw = cluster.gateway
    out = []
    for given, host, fixed, what in (
        (port, gw.host, gw.port, "data-plane"),
        (control_port, gw.control_host, gw.control_port, "control"),
    ):
        if given is None and fixed and not _port_free(host, fixed):
            log(f"gateway {what} port {host}:{fixed} is in use; this fleet takes a free one")
            given = 0
        out.append(given)
    return out[0], out[1]


@holding_lock()
def up(
    cluster: ClusterFile,
    rd: RunDir,
    *,
    detach: bool,
    policy: str | None = None,
    port: int | None = None,
    control_port: int | None = None,
    cluster_path: str | None = None,
    log: Log = _nolog,
    should_stop: Callable[[], bool] | None = None,
    keep_partial: bool = False,
    pick_free_ports: bool = False,
) -> tuple[RunState, list[Started]]:
    """Start the fleet of ``cluster`` and record it in ``rd``.

    Args:
        cluster: the validated cluster file.
        rd: the run directory.
        detach: recorded in the state (``up -d``); the processes run in their own sessions either way.
        policy: routing policy instead of ``cluster.gateway.policy``.
        port / control_port: gateway ports instead of the cluster file's (0 = pick free ones).
        cluster_path: the cluster file (None: the built-in default fleet); recorded, resolved to an absolute path,
            in the state and the gateway's settings, and matched with ``tuned.json``'s to reapply a tuning.
        log: receives one-line progress messages.
        should_stop: polled while waiting; True aborts like Ctrl-C.
        keep_partial: on failure, leave what started running and recorded (for a look; ``down`` stops it).
        pick_free_ports: the gateway's ports not given as ``port``/``control_port`` whose cluster-file value is
            taken are picked free (:func:`free_gateway_ports`; a named fleet beside others); the ones used are in
            ``state.json`` (``gateway_url``, ``control_url``), where every other command finds them.

    Returns:
        The complete state and the processes started on this machine (local workers first, the gateway last);
        remote workers are in ``state.processes`` (``host`` set).

    Raises:
        BtbctlError: another ``up``/``down`` holds ``rd`` (:meth:`RunDir.locked`), a live run exists in ``rd``,
            ``tuned.json`` is damaged (nothing is started or touched then), a process could not start or was not
            ready in time (everything started is stopped again and the state removed). For a remote worker it is an
            :class:`~btbctl.engine.launcher.ssh.SshFailure` naming the host and the cause.
    """
    from btbctl.engine.policies import live_policy_error

    cluster_path = resolve_cluster_path(cluster_path)
    policy_given = policy is not None
    policy = policy or cluster.gateway.policy
    why = live_policy_error(policy)
    if why is not None:
        raise BtbctlError(why)
    check_no_live_run(rd, log)
    tuned = _tuning_for(rd, cluster_path, log)  # a damaged record fails here, before anything starts
    if pick_free_ports:
        port, control_port = free_gateway_ports(cluster, port, control_port, log)
    check_ports(cluster, port, control_port)
    kept = rd.archive_logs()  # a fresh fleet starts fresh logs; the last run's stay readable
    rd.prepare()
    if kept is not None:
        log(f"kept the last run's logs in {kept} (`btbctl logs --previous`)")
    rd.new_tokens()
    state = RunState(
        run_dir=str(rd.path),
        created_at=time.time(),
        detached=detach,
        owner_pid=None if detach else os.getpid(),
        owner_start_time=None if detach else process_start_time(os.getpid()),
        cluster_file=cluster_path,
        policy=policy,
        replication=cluster.replication_mode,
    )
    rd.save(state)
    started: list[Started] = []
    pool = None
    try:
        instances = [i for i in cluster.instances() if cluster.host_of(i.spec) is None]
        remote = [i for i in cluster.instances() if cluster.host_of(i.spec) is not None]
        agent_plans = {}
        credentials: dict[str, tuple[str, str]] = {}  # agent -> (credentials text, control token)
        # l3: the agents register with every gateway, so the gateways' ports are fixed now: this machine's agent
        # registers on their control API, the agents of [[hosts]] on their registration listener
        control_ports: list[int] = []
        gateway_controls: list[str] = []
        reg = Registration()
        if cluster.replication_mode == "l3":
            from btbctl.engine.launcher import agents as agents_mod

            rd.new_agent_secret()
            control_ports = _control_ports(cluster, control_port)
            control_port = control_ports[0]
            gateway_controls = [_reachable(_url(cluster.gateway.control_host, p)) for p in control_ports]
            reg = _registration(cluster)
            plans = agents_mod.plan_agents(cluster, rd, gateways=gateway_controls, host_gateways=reg.host_gateways)
            agent_plans = {(p.host.name if p.host else None): p for p in plans}
            credentials = rd.write_agent_credentials([p.name for p in plans], [p.name for p in plans if p.host is None])
            local_agent = agent_plans.get(None)
            if local_agent is not None:
                aproc = spawn(
                    local_agent.name, local_agent.argv, rd.log_path(local_agent.name), env=cluster.replication.env
                )
                started.append(aproc)
                state.processes.append(aproc.record("agent", "agent"))
                rd.save(state)
                log(f"started {local_agent.name} (pid {aproc.pid})")
                agents_mod.wait_local_ready(aproc, cluster.replication.ready_timeout_s, should_stop=should_stop)
                _update(state, aproc)
                rd.save(state)
                log(f"{local_agent.name} ready (control {aproc.url}, peer {aproc.extra['peer']})")
        pending: list[tuple[WorkerInstance, Started, str | None]] = []
        for inst in instances:
            spec = inst.spec
            wport = inst.port
            tport = inst.transfer_port
            expect_ready_line = spec.kind == "emulated" and spec.command is None
            worker_url = None
            if agent_plans:
                # its store names this URL to the agent, which announces it: the URL the gateway knows it by
                wport = wport or free_port(spec.host)
                worker_url = _reachable(_url(spec.host, wport))
            if not wport and not expect_ready_line:
                wport = free_port(spec.host)
            l3 = hicache_args(cluster, spec, inst.entry, agent_plans[None].socket, worker_url) if agent_plans else None
            argv = worker_argv(inst, wport, tport, token_file=str(rd.worker_token_path), l3=l3)
            proc = spawn(inst.name, argv, rd.log_path(inst.name), env=inst.env())
            started.append(proc)
            kind = "command" if spec.command is not None else spec.kind
            state.processes.append(proc.record("worker", kind))
            rd.save(state)
            health = None if expect_ready_line else _url(spec.host, wport)
            pending.append((inst, proc, health))
            log(f"started {inst.name} ({kind}, pid {proc.pid})")
        remote_urls: dict[str, str] = {}
        if remote:
            from btbctl.engine.launcher import ssh

            pool = ssh.SshPool()
            remote_urls = _start_remote(cluster, remote, rd, state, pool, log, should_stop, agent_plans, credentials)
        for inst, proc, health in pending:
            wait_ready(proc, inst.spec.effective_ready_timeout_s, health_url=health, should_stop=should_stop)
            if proc.url is None:  # pragma: no cover - wait_ready sets it
                raise BtbctlError(f"{inst.name} reported no URL")
            proc.url = _reachable(proc.url)
            _update(state, proc)
            rd.save(state)
            log(f"{inst.name} ready at {proc.url}")
        local_urls = {inst.name: p.url for inst, p, _ in pending}
        urls = [local_urls.get(i.name) or remote_urls[i.name] for i in cluster.instances()]
        gw = cluster.gateway
        gcfg = cluster.gateway_config(
            urls,
            policy=policy,
            port=port,
            control_port=control_port,
            token_file=str(rd.token_path),
            worker_token_file=str(rd.worker_token_path),
        )
        gcfg.update(_replication_config(cluster, rd))
        if reg.hosts:
            gcfg.update(register_hosts=reg.hosts, register_port=reg.ports[0])
        if tuned is not None:
            where = "the default fleet" if cluster_path is None else "this cluster file"
            applied_policy = _apply_tuning(gcfg, tuned, where, rd, log, keep_policy=policy_given)
            if applied_policy:
                state.policy = policy = applied_policy
        gcfg["worker_names"] = [i.name for i in cluster.instances()]
        kv_refs = [kv_events_ref(i) for i in cluster.instances()]
        if any(kv_refs):
            gcfg["kv_events"] = kv_refs
        gcfg["log_file"] = str(rd.log_path("gateway"))
        gcfg["tuned_file"] = str(rd.tuned_path)
        gcfg["cluster_file"] = cluster_path
        from btbctl.engine.config import validate
        from btbctl.engine.gateway.config import GatewayConfig

        if gw.replicas > 1 and not gcfg.get("redis_url"):
            gcfg["redis_url"] = _start_redis(rd, state, started, gw.ready_timeout_s, log)
        validate(GatewayConfig, gcfg, None, "gateway")  # fail here, with the key named, rather than in the child
        started.append(_start_gateway(rd, state, write_gateway_config(rd, gcfg), gw.ready_timeout_s, should_stop))
        log(f"gateway ready at {state.gateway_url} (control {state.control_url}, policy {policy})")
        for i in range(1, gw.replicas):
            started.append(
                _start_gateway_replica(
                    rd,
                    state,
                    gcfg,
                    i,
                    gw.ready_timeout_s,
                    should_stop,
                    log,
                    control_ports[i] if control_ports else None,
                    reg.ports[i] if reg.ports else None,
                )
            )
        if agent_plans:
            _wait_registered(cluster, gateway_controls, rd, agent_plans, log, should_stop)
    except BaseException as exc:
        if keep_partial and not isinstance(exc, KeyboardInterrupt):
            log("--keep-partial: leaving what started running; `btbctl down` stops it")
            if pool is not None:
                pool.close()
            raise
        live = [p for p in started if p.popen.poll() is None or group_members(p.pid)]
        if live:
            stop_groups([(p.pid, p.popen) for p in live], grace_s=5.0)
        remote_recs = [p for p in state.processes if p.host]
        if remote_recs:
            from btbctl.engine.launcher import ssh

            pool = pool or ssh.SshPool()
            stopped = ssh.stop_records(pool, remote_recs, 5.0)
            unreached = [(r, why) for r, (res, why) in zip(remote_recs, stopped, strict=True) if res == "unreachable"]
            for r, why in unreached:
                log(f"could not stop {r.name} on host {r.host}: {why}")
            if unreached:
                state.processes = [r for r, _ in unreached]
                state.complete = False
                rd.save(state)
                pool.close()
                raise
        if pool is not None:
            pool.close()
        rd.clear()
        raise
    if pool is not None:
        pool.close()
    return state, started


def resolve_cluster_path(path: str | None) -> str | None:
    """The absolute path (symlinks resolved) of the cluster file ``path`` as typed, relative to the current
    directory; None (the built-in default fleet) stays None."""
    return None if path is None else str(Path(path).expanduser().resolve())


def describe_tuning(constants: dict, policy: str | None) -> str:
    """``policy btb, threshold 3``: what a tuning sets, for a message."""
    parts = ([f"policy {policy}"] if policy else []) + [f"{k} {v}" for k, v in constants.items()]
    return ", ".join(parts) or "nothing"


def _apply_tuning(gcfg: dict, tuned: dict, where: str, rd: RunDir, log: Log, keep_policy: bool = False) -> str | None:
    """Merge the recorded tuning ``tuned`` into the gateway settings ``gcfg`` (its policy too unless
    ``keep_policy``: one given on the command line wins) and say so in one line naming ``where`` it was confirmed;
    returns the policy it applied, if any."""
    constants = tuned.get("constants") or {}
    policy = None if keep_policy else tuned.get("policy")
    gcfg["constants"] = {**(gcfg.get("constants") or {}), **constants}
    if policy:
        gcfg["policy"] = policy
    log(f"applying the tuning last confirmed on {where} ({describe_tuning(constants, policy)}; {rd.tuned_path})")
    return policy


def _tuning_for(rd: RunDir, cluster_path: str | None, log: Log) -> dict | None:
    """``rd``'s recorded tuning when it was made for ``cluster_path`` (resolved; None: the default fleet), else
    None (saying in one line which file it was made for). Raises :class:`BtbctlError` for a damaged record."""
    tuned = rd.load_tuned()
    if tuned is None:
        return None
    made_for = tuned.get("cluster_file")
    if made_for != cluster_path:

        def name(p: str | None) -> str:
            return "the default fleet" if p is None else f"cluster file {p}"

        log(f"not applying the tuning in {rd.tuned_path}: it was made for {name(made_for)}, not {name(cluster_path)}")
        return None
    return tuned


#: Name of the gateway's own output (its ready line, and a crash's traceback) in the logs folder; its log proper,
#: rotated, is ``gateway.log``.
GATEWAY_OUT = "gateway.out"


def _start_gateway(
    rd: RunDir, state: RunState, config_path: str, timeout_s: float, should_stop: Callable[[], bool] | None
) -> Started:
    """Start the gateway on ``config_path``, record it in ``state`` (replacing an earlier gateway record), wait
    until it is ready and record its URLs; ``state.complete`` once done."""
    gproc = spawn("gateway", gateway_argv(config_path), rd.log_path(GATEWAY_OUT))
    state.processes = [p for p in state.processes if p.role != "gateway"]
    state.processes.append(gproc.record("gateway", "gateway"))
    rd.save(state)
    try:
        wait_ready(gproc, timeout_s, should_stop=should_stop)
    except BaseException:
        if gproc.popen.poll() is None or group_members(gproc.pid):
            stop_groups([(gproc.pid, gproc.popen)], grace_s=5.0)
        raise
    _update(state, gproc)
    state.gateway_url = _reachable(gproc.url)
    state.control_url = gproc.extra.get("control")
    if state.control_url:
        state.control_url = _reachable(state.control_url)
    if not state.control_url:
        raise BtbctlError(f"the gateway's ready line named no control URL (log {gproc.log})")
    state.complete = True
    rd.save(state)
    return gproc


#: Name of the ``redis-server`` ``up`` starts for a fleet of several gateways (its record's role and log name).
REDIS_NAME = "redis"


def _start_redis(rd: RunDir, state: RunState, started: list[Started], timeout_s: float, log: Log) -> str:
    """Start a ``redis-server`` for the fleet's gateways on a free loopback port (no persistence), record it in
    ``state`` (``down`` stops it after the workers) and return its URL once it answers ``PING``. Raises
    :class:`BtbctlError` when ``redis-server`` is not on PATH or does not answer within ``timeout_s``."""
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        raise BtbctlError(
            "gateway.replicas > 1 needs redis-server on PATH (apt-get install redis-server) "
            "or gateway.settings.redis_url"
        )
    port = free_port("127.0.0.1")
    argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(rd.path)]
    proc = spawn(REDIS_NAME, argv, rd.log_path(REDIS_NAME))
    started.append(proc)
    proc.url = f"redis://127.0.0.1:{port}/0"
    state.processes.append(proc.record(REDIS_NAME, REDIS_NAME))
    rd.save(state)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if proc.popen.poll() is not None:
            raise BtbctlError(f"redis-server exited with status {proc.popen.returncode} (log {proc.log})")
        if time.monotonic() >= deadline:
            raise BtbctlError(
                f"redis-server did not answer on 127.0.0.1:{port} within {timeout_s:g} s (log {proc.log})"
            )
        time.sleep(0.05)
    log(f"redis ready at {proc.url} (shared by the fleet's gateways)")
    return proc.url


def _start_gateway_replica(
    rd: RunDir,
    state: RunState,
    gcfg: dict,
    i: int,
    timeout_s: float,
    should_stop: Callable[[], bool] | None,
    log: Log,
    control_port: int | None = None,
    register_port: int | None = None,
) -> Started:
    """Start gateway ``i`` (>= 1) of the fleet with the first one's settings ``gcfg``, on ``port + 2i`` and
    ``control_port`` (default ``+ 2i`` of the first's; free ports where those are 0) and, with a registration
    listener, ``register_port``; its own log and settings file; record it (role ``gateway``) once ready."""
    name = f"gateway-{i}"
    cfg = dict(gcfg)
    cfg["port"] = _replica_port(gcfg.get("port"), i)
    cfg["control_port"] = _replica_port(gcfg.get("control_port"), i) if control_port is None else control_port
    if register_port is not None:
        cfg["register_port"] = register_port
    cfg["log_file"] = str(rd.log_path(name))
    gproc = spawn(name, gateway_argv(write_gateway_config(rd, cfg, name)), rd.log_path(f"{name}.out"))
    state.processes.append(gproc.record("gateway", "gateway"))
    rd.save(state)
    wait_ready(gproc, timeout_s, should_stop=should_stop)
    _update(state, gproc)
    rd.save(state)
    log(f"{name} ready at {_reachable(gproc.url or '')} (control {gproc.extra.get('control')})")
    return gproc


def _settings_again(rd: RunDir, name: str, url: str | None, control_url: str | None, log: Log) -> dict:
    """The settings gateway ``name`` ran with (``<run dir>/<name>.json``) for a start again: the last confirmed
    tuning applied, and the ports it was given as 0 at ``up`` (picked by the process) pinned to those of ``url`` and
    ``control_url``, so it comes back where it was. Raises :class:`BtbctlError` when the file is gone or damaged."""
    from urllib.parse import urlsplit

    path = rd.path / f"{name}.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(cfg, dict):
            raise ValueError(f"not a JSON object but {type(cfg).__name__}")
    except (OSError, ValueError) as e:
        raise BtbctlError(f"cannot read the settings of {name} {path}: {e}; restart the whole fleet") from None
    tuned = rd.load_tuned()
    if tuned is not None:
        _apply_tuning(cfg, tuned, "this fleet", rd, log)
    for key, at in (("port", url), ("control_port", control_url)):
        if at and not cfg.get(key):
            cfg[key] = urlsplit(at).port
    return cfg


def restart_gateway_replica(
    rd: RunDir, rec: ProcessRecord, stop: Callable[[], str], timeout_s: float, log: Log = _nolog
) -> tuple[ProcessRecord, str]:
    """Restart gateway replica ``rec`` (``gateway-1``, ...: ``[gateway] replicas``) with its settings (``<run
    dir>/<name>.json``) on the ports it had, the last confirmed tuning applied: the settings are read and checked
    first, then ``stop()`` ends the running one (its outcome is returned), then it is started and recorded once
    ready. Returns the new record and what ``stop()`` said.

    Raises:
        BtbctlError: its settings are gone or damaged (nothing was stopped); it did not become ready (it is left
            stopped).
    """
    from btbctl.engine.config import validate
    from btbctl.engine.gateway.config import GatewayConfig

    cfg = _settings_again(rd, rec.name, rec.url, (rec.extra or {}).get("control"), log)
    validate(GatewayConfig, cfg, None, "gateway")
    stopped = stop()
    gproc = spawn(rec.name, gateway_argv(write_gateway_config(rd, cfg, rec.name)), rd.log_path(f"{rec.name}.out"))
    try:
        wait_ready(gproc, timeout_s)
    except BaseException:
        if gproc.popen.poll() is None or group_members(gproc.pid):
            stop_groups([(gproc.pid, gproc.popen)], grace_s=5.0)
        raise
    state = rd.load()
    if state is None:
        raise BtbctlError(f"the run state of {rd.path} disappeared while {rec.name} restarted (pid {gproc.pid} runs)")
    new = gproc.record("gateway", "gateway")
    state.processes = [new if p.name == rec.name else p for p in state.processes]
    _update(state, gproc)
    rd.save(state)
    log(f"{rec.name} ready at {_reachable(gproc.url or '')} (control {gproc.extra.get('control')}, pid {gproc.pid})")
    return new, stopped


@holding_lock(create=False)
def up_gateway_only(rd: RunDir, log: Log = _nolog, timeout_s: float = 60.0) -> RunState:
    """Start the gateway again in front of the workers recorded in ``rd`` (after it died), with the settings it
    had (``<run dir>/gateway.json``), the same tokens and ports, and the constants and policy last set with
    any confirmed control-API write (``<run dir>/tuned.json``). Its log is appended to.

    Raises:
        BtbctlError: another ``up``/``down`` holds ``rd``; ``tuned.json`` is damaged; nothing is recorded; the
            gateway still runs; a recorded worker is no longer running (the
            fleet is broken: ``down`` and ``up``); the settings are gone; the gateway did not become ready (the
            workers are left running).
    """
    state = rd.load()
    if state is None:
        raise BtbctlError(f"no fleet is recorded in {rd.path}; start one with `btbctl up`")
    gw = state.gateway()
    if gw is not None and record_is_ours(gw):
        raise BtbctlError(f"the gateway of {rd.path} is still running (pid {gw.pid}); nothing to restart")
    if rd.owner_alive(state):
        raise BtbctlError(
            f"a foreground `btbctl up` (pid {state.owner_pid}) holds {rd.path}; restart it there (Ctrl-C, then up)"
        )
    gone = [p.name for p in state.workers() if not p.host and not record_is_ours(p)]
    if gone or not state.workers():
        raise BtbctlError(
            f"worker(s) {', '.join(gone) or 'none'} of {rd.path} are no longer running; restart the whole fleet "
            f"(`btbctl down`, then `btbctl up`)"
        )
    gcfg = _settings_again(rd, "gateway", state.gateway_url, state.control_url, log)
    gcfg["log_file"] = str(rd.log_path("gateway"))
    gcfg["tuned_file"] = str(rd.tuned_path)
    gcfg.setdefault("cluster_file", state.cluster_file)
    from btbctl.engine.config import validate
    from btbctl.engine.gateway.config import GatewayConfig

    validate(GatewayConfig, gcfg, None, "gateway")
    gproc = _start_gateway(rd, state, write_gateway_config(rd, gcfg), timeout_s, None)
    state.detached = True
    rd.save(state)
    log(f"gateway ready at {state.gateway_url} (control {state.control_url}, pid {gproc.pid})")
    return state


def _replica_port(base: int | None, i: int) -> int:
    """The port of gateway ``i`` of ``[gateway] replicas`` (0: the first) whose first gateway has ``base``:
    ``base + 2i``, or 0 (picked by the process) when ``base`` is."""
    return int(base) + 2 * i if base else 0


def _control_ports(cluster: ClusterFile, control_port: int | None) -> list[int]:
    """The control ports of the fleet's ``[gateway] replicas`` gateways, fixed before the agents that register with
    them start: ``control_port`` (or the cluster file's) numbered by :func:`_replica_port`; distinct free ports
    where it is 0."""
    gw = cluster.gateway
    return _fixed_ports(gw.control_port if control_port is None else control_port, [gw.control_host], gw.replicas)


def _fixed_ports(base: int, hosts: Sequence[str], n: int) -> list[int]:
    """``n`` ports of gateways ``0..n-1`` fixed before they start: ``base`` numbered by :func:`_replica_port`, or,
    where it is 0, distinct ports free on every address of ``hosts`` now."""
    if base:
        return [_replica_port(base, i) for i in range(n)]
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(hosts[0])
        if p not in ports and all(_port_free(h, p) for h in hosts[1:]):
            ports.append(p)
    return ports


@dataclass(frozen=True)
class Registration:
    """Where the node agents of ``[[hosts]]`` register (l3): the registration listener's addresses ``hosts``, the
    port of each gateway (``ports[i]``: gateway ``i``), and for each host by name the URLs its agent announces to
    (one per gateway). Empty without agents on hosts."""

    hosts: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    host_gateways: dict[str, list[str]] = field(default_factory=dict)


def _registration(cluster: ClusterFile) -> Registration:
    """The :class:`Registration` of an l3 fleet: each host's agent reaches this machine at ``[gateway]
    register_host``, else at the address this machine sends from towards that host. Raises :class:`BtbctlError`
    naming a host no address leads to."""
    gw = cluster.gateway
    remote = [h for h in cluster.agent_hosts() if h is not None]
    if not remote:
        return Registration()
    reach: dict[str, str] = {}
    for h in remote:
        try:
            reach[h.name] = cluster.register_address(h)
        except OSError as e:
            raise BtbctlError(
                f"host {h.name}: no route from this machine to {h.address} ({e.strerror or e}), so its node agent "
                "could not register; set [gateway] register_host to the address it reaches this machine at"
            ) from None
    hosts = sorted(set(reach.values()))
    ports = _fixed_ports(gw.register_port, hosts, gw.replicas)
    return Registration(
        hosts,
        ports,
        {name: [f"http://{hostport(addr, p)}" for p in ports] for name, addr in reach.items()},
    )


def _replication_config(cluster: ClusterFile, rd: RunDir) -> dict:
    """The gateway's replication settings: the mode, and in ``l3`` mode the agents' fleet secret file (it checks
    their registrations and derives each agent's token) and the fan-out. The agents are not named: they register
    (``POST /control/agents``)."""
    mode = cluster.replication_mode
    out: dict = {"replication": mode}
    if mode != "l3":
        return out
    out["agent_secret_file"] = str(rd.agent_secret_path)  # the gateway derives each agent's control token
    out["l3_fanout"] = cluster.replication.fanout
    return out


def _wait_registered(
    cluster: ClusterFile, control_urls: list[str], rd: RunDir, agent_plans: dict, log: Log, should_stop
) -> None:
    """Wait until every planned agent registered with each gateway of ``control_urls`` naming the workers it
    serves (each bounded by the replication section's ``ready_timeout_s``); one ``log`` line per gateway. Raises
    :class:`BtbctlError` naming the agent that did not and why."""
    from btbctl.engine.launcher import agents as agents_mod

    hosts = {ap.name: (ap.host.name if ap.host else None) for ap in agent_plans.values()}
    expect = {
        n: [i.name for i in cluster.instances() if (getattr(cluster.host_of(i.spec), "name", None)) == h]
        for n, h in hosts.items()
    }
    token = rd.token_path.read_text(encoding="utf-8").strip() if rd.token_path.exists() else None
    logs = {n: rd.log_path(n) for n in expect}
    for control_url in control_urls:
        got = agents_mod.wait_registered(
            control_url, token, expect, logs, cluster.replication.ready_timeout_s, should_stop=should_stop
        )
        log(
            f"agents registered with the gateway at {control_url}: "
            + "; ".join(f"{n} ({','.join(got[n]) or 'no workers'})" for n in expect)
        )


def _start_remote(
    cluster: ClusterFile,
    remote: list[WorkerInstance],
    rd: RunDir,
    state: RunState,
    pool,
    log: Log,
    should_stop: Callable[[], bool] | None,
    agent_plans: dict | None,
    credentials: dict[str, tuple[str, str]],
) -> dict[str, str]:
    """Start the workers of ``remote`` on their hosts (all hosts in parallel; in ``l3`` mode each host's agent
    first); record each as soon as it was launched; return ``{name: url}`` of the workers once every one is ready.
    Raises ``SshFailure``."""
    import secrets
    import threading

    from btbctl.engine.launcher import ssh

    plan: dict[str, tuple] = {}
    for inst in remote:
        host = cluster.host_of(inst.spec)
        plan.setdefault(host.name, (host, []))[1].append(inst)
    token = rd.worker_token_path.read_text(encoding="utf-8").strip()
    run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(state.created_at)) + "-" + secrets.token_hex(4)
    lock = threading.Lock()

    def on_started(w) -> None:
        with lock:
            state.processes.append(w.record())
            rd.save(state)
        log(f"started {w.name} on host {w.host.name} (pid {w.pid} there)")

    for host, insts in plan.values():
        log(f"starting {plural(len(insts), 'worker')} on host {host.name} ({host.address}:{host.port})")
    launches = {}
    if agent_plans:
        # ``credentials``: ``{agent name: (its secret file's text, its control token)}``, as derived for the local
        # agents' files; each host gets only its own agent's
        from btbctl.engine.launcher.agents import REMOTE_SECRET, REMOTE_TOKEN

        for name, ap in agent_plans.items():
            if name is None:
                continue
            launches[name] = ssh.AgentLaunch(
                name=ap.name,
                argv=ap.argv,
                files=[(REMOTE_SECRET, credentials[ap.name][0] + "\n"), (REMOTE_TOKEN, credentials[ap.name][1] + "\n")],
                l3_args=lambda inst, url, sock=ap.socket: hicache_args(cluster, inst.spec, inst.entry, sock, url),
                env=dict(cluster.replication.env),
                ready_timeout_s=cluster.replication.ready_timeout_s,
            )
    workers = ssh.start_all(
        pool,
        list(plan.values()),
        run_id=run_id,
        logs_dir=rd.logs_dir,
        token=token,
        on_started=on_started,
        should_stop=should_stop,
        agents=launches,
    )
    urls = {}
    with lock:
        for w in workers:
            rec = w.record()
            for i, p in enumerate(state.processes):
                if p.host == rec.host and p.pgid == rec.pgid:
                    state.processes[i] = rec
            if w.role == "worker":
                urls[w.name] = w.url
            log(f"{w.name} ready at {w.url} (host {w.host.name})")
        rd.save(state)
    return urls


def _reachable(url: str) -> str:
    """``url`` with a wildcard bind address (``0.0.0.0``, ``[::]``) replaced by loopback, so it can be connected
    to."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    if host in ("0.0.0.0", "::", ""):
        return f"{parts.scheme}://127.0.0.1:{parts.port}"
    return url


def _update(state: RunState, proc: Started) -> None:
    for rec in state.processes:
        if rec.pid == proc.pid:
            rec.url = proc.url
            rec.extra = dict(proc.extra)


def stop_started(started: list[Started], grace_s: float, log: Log = _nolog) -> None:
    """Stop processes this process started (the gateway, started last, first; then the workers together; then the
    node agents), reaping them."""
    gw = [p for p in started if p.name == "gateway" or p.name.startswith("gateway-")]
    agents = [p for p in started if p.name.startswith("agent-")]
    batches = [gw, [p for p in started if p not in gw and p not in agents], agents]
    for batch in batches:
        if not batch:
            continue
        live = []
        for proc in batch:
            if proc.popen.poll() is None or group_members(proc.pid):
                live.append(proc)
            else:
                log(f"{proc.name} had already exited (status {proc.popen.returncode})")
        killed = stop_groups([(p.pid, p.popen) for p in live], grace_s) if live else {}
        for proc in live:
            log(f"stopped {proc.name}" + (" (killed after the grace period)" if killed[proc.pid] else ""))


#: Seconds between two polls of the remote hosts in a foreground ``up`` (log streaming, exit detection).
REMOTE_POLL_S = 1.0


def supervise(
    rd: RunDir,
    state: RunState,
    started: list[Started],
    log: Log = _nolog,
    poll_s: float = 0.5,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Foreground ``up``: watch the processes until Ctrl-C (KeyboardInterrupt) or ``should_stop()``; echo the
    operations log's detector fires, copies, control writes and worker health changes as they happen
    (:func:`~btbctl.engine.launcher.logs.echo_line`); report a process that exits on its own; then stop everything
    (the gateway first) and remove the state."""
    reported: set[int] = set()
    remote = [p for p in state.processes if p.host]
    pool = None
    offsets: dict[str, int] = {}
    if remote:
        from btbctl.engine.launcher import ssh

        pool = ssh.SshPool()
    remote_gone: set[str] = set()
    last_remote = 0.0
    from btbctl.engine.launcher.logs import LogFollower, echo_line

    ops = LogFollower(rd.log_path("gateway"))  # from its end: the lines before the table were shown as progress
    try:
        while should_stop is None or not should_stop():
            for line in ops.poll():
                short = echo_line(line)
                if short is not None:
                    log(short)
            for proc in started:
                rc = proc.popen.poll()
                if rc is not None and proc.pid not in reported:
                    reported.add(proc.pid)
                    log(f"{proc.name} exited with status {rc} (log {proc.log})")
            if pool is not None and time.monotonic() - last_remote >= REMOTE_POLL_S:
                # stream the remote logs into the run directory and notice workers that exit
                last_remote = time.monotonic()
                for name, st in ssh.poll_records(pool, remote, offsets).items():
                    if st["state"] != "alive" and name not in remote_gone:
                        remote_gone.add(name)
                        log(f"{name} on its host: {st['error'] or st['state']}")
            if len(reported) == len(started):
                log("every process has exited")
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        log("stopping the fleet")
    finally:
        stop_started(started, grace_s=10.0, log=log)
        if pool is not None:
            try:
                for rec, (res, why) in zip(remote, ssh.stop_records(pool, remote, 10.0), strict=True):
                    log(f"{res} {rec.name} (host {rec.host})" + (f": {why}" if why else ""))
            finally:
                pool.close()
        rd.clear()


@holding_lock(create=False)
def down(rd: RunDir, grace_s: float = 10.0, log: Log = _nolog) -> dict:
    """Stop exactly the processes recorded in ``rd`` (gateway first) and remove the state.

    When a foreground ``btbctl up`` still holds the fleet, it is asked (SIGINT, like Ctrl-C) to stop everything
    itself, and whatever it leaves is stopped here.

    Returns ``{"run_dir", "stopped": [name], "killed": [name], "gone": [name], "unreachable": [name],
    "errors": [line]}``: ``killed`` needed SIGKILL after ``grace_s``; ``gone`` had already exited (or its pid now
    belongs to another program and was left alone); ``unreachable`` are remote workers whose host could not be
    reached (``errors`` says why, one line each); they stay recorded in ``state.json`` for another ``down``.
    When nothing is recorded, returns the same keys, all empty, and ``"nothing": True``.

    Raises:
        BtbctlError: another ``up``/``down`` holds ``rd`` (:meth:`RunDir.locked`); ``state.json`` is damaged.
    """
    state = rd.load()
    if state is None:
        return {
            "run_dir": str(rd.path),
            "stopped": [],
            "killed": [],
            "gone": [],
            "unreachable": [],
            "errors": [],
            "nothing": True,
        }
    out = {"run_dir": str(rd.path), "stopped": [], "killed": [], "gone": [], "unreachable": [], "errors": []}
    by_owner: set[str] = set()
    if rd.owner_alive(state) and state.owner_pid != os.getpid():
        by_owner = {p.name for p in rd.live_processes(state)}
        # a foreground `up` holds this fleet: ask it to stop everything in order
        try:
            os.kill(state.owner_pid, 2)  # SIGINT, like Ctrl-C
            log(f"asked the foreground `btbctl up` (pid {state.owner_pid}) to stop")
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + grace_s + 15.0
        while time.monotonic() < deadline and is_same_process(state.owner_pid, state.owner_start_time):
            time.sleep(0.1)
    # the gateway first (no new requests reach the workers), then all workers together, then the node agents
    left = []
    for batch in (
        [p for p in state.processes if p.role == "gateway"],
        [p for p in state.processes if p.role == "worker"],
        [p for p in state.processes if p.role not in ("gateway", "worker")],
    ):
        local = [p for p in batch if not p.host]
        for rec, result in zip(local, stop_records(local, grace_s), strict=True):
            if result == "gone" and rec.name in by_owner:
                result = "stopped"  # the foreground `up` stopped it when asked
            out[result].append(rec.name)
        remote = [p for p in batch if p.host]
        if remote:
            from btbctl.engine.launcher import ssh

            with ssh.SshPool() as pool:
                for rec, (result, why) in zip(remote, ssh.stop_records(pool, remote, grace_s), strict=True):
                    out[result].append(rec.name)
                    if result == "unreachable":
                        left.append(rec)
                        out["errors"].append(f"{rec.name}: {why}")
    if left:
        state.processes = left
        state.complete = False
        rd.save(state)
    else:
        rd.clear()
    return out


def list_fleets(root: Path | None = None) -> list[dict]:
    """The fleets under ``root`` (default :func:`~btbctl.engine.launcher.rundir.runs_root`), one per folder, by
    name: ``[{"name", "run_dir", "gateway_url", "control_url", "state", "processes", "live"}]``. ``state`` is
    ``running`` (every recorded process alive), ``degraded`` (some), ``stopped`` (none, or nothing recorded: logs
    of an earlier run only) or ``unreadable`` (a damaged ``state.json``). Looks only at the run directories and
    the processes' identities (no network), so it is quick."""
    root = root if root is not None else runs_root()
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    out = []
    for folder in folders:
        try:
            if {p.name for p in folder.iterdir()} <= {LOCK_FILE}:
                continue  # only the lock of an up that stopped at its first checks: nothing to list
        except OSError:
            pass
        rd = RunDir(folder)
        row = {"name": folder.name, "run_dir": str(folder), "gateway_url": None, "control_url": None}
        try:
            state = rd.load()
        except BtbctlError:
            out.append({**row, "state": "unreadable", "processes": 0, "live": 0})
            continue
        if state is None:
            out.append({**row, "state": "stopped", "processes": 0, "live": 0})
            continue
        live = len(rd.live_processes(state)) + sum(1 for p in state.processes if p.host)
        total = len(state.processes)
        verdict = "stopped" if not live else ("running" if live == total and state.complete else "degraded")
        out.append(
            {
                **row,
                "gateway_url": state.gateway_url,
                "control_url": state.control_url,
                "state": verdict,
                "processes": total,
                "live": live,
            }
        )
    return out


def remove_fleet(name: str, root: Path | None = None) -> Path:
    """Forget the stopped fleet ``name``: delete its run directory under ``root`` (default
    :func:`~btbctl.engine.launcher.rundir.runs_root`) with its logs and tuning, holding its lock meanwhile.
    Returns the folder removed.

    Raises:
        BtbctlError: an invalid name, no such fleet, a process of it still running (``down`` first), another
            btbctl working on it, or the folder cannot be removed.
    """
    import shutil

    check_fleet_name(name, "NAME")
    folder = (root if root is not None else runs_root()) / name
    if not folder.is_dir():
        raise BtbctlError(f"no fleet {name} (nothing in {folder}); `btbctl ls` lists the fleets")
    rd = RunDir(folder)
    with rd.locked(create=False):
        try:
            state = rd.load()
        except BtbctlError:
            state = None  # a damaged record: nothing of it can be running under our watch
        if state is not None and (rd.live_processes(state) or any(p.host for p in state.processes)):
            raise BtbctlError(f"fleet {name} is running; stop it first: btbctl down --fleet {name}")
        try:
            shutil.rmtree(folder)
        except OSError as e:
            raise BtbctlError(f"cannot remove {folder}: {e.strerror or e}") from None
    return folder


def port_open(hostport: str | None, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``HOST:PORT`` (a wildcard host: loopback) opens within ``timeout_s``; it is
    closed again at once, before a byte is sent."""
    from btbctl.engine.replication.transport import TransferError, parse_address

    try:
        host, port = parse_address(hostport or "")
        with socket.create_connection((connect_host(host), port), timeout=timeout_s):
            return True
    except (OSError, TransferError):
        return False


def probe_agent(rec, alive: bool) -> str | None:
    """Why the node agent of ``rec`` does not serve, or None when it does: its process, its control API's
    ``/health``, its copy (peer) port taking a TCP connection."""
    if not alive:
        return "not running"
    bad = []
    if not rec.url or not health_ok(rec.url, timeout_s=2.0):
        bad.append(f"control API {rec.url or '-'} does not answer /health")
    peer = (rec.extra or {}).get("peer")
    if not port_open(peer, timeout_s=2.0):
        bad.append(f"copy port {peer or '-'} does not accept connections")
    return "; ".join(bad) or None


def status(rd: RunDir) -> dict:
    """The fleet recorded in ``rd``.

    Returns (keys stable)::

        {"verdict": "up" | "degraded", "problems": [line],
         "gateway_url", "control_url", "run_dir", "policy", "detached", "replication",
         "gateway": {"pid", "alive", "reachable"},
         "gateways": [{"name", "url", "control_url", "pid", "alive", "reachable"}],
         "workers": [{"name", "host", "url", "healthy", "alive", "pid", "kind", "inflight", "health_error",
                      "replication", "metrics_source", "running", "waiting", "kv_used_tokens", "kv_cached_tokens",
                      "kv_capacity_tokens", "kv_use", "host_tier_tokens", "host_tier_capacity_tokens",
                      "storage_hit_tokens_total", "storage_prefetched_tokens_total", "storage_backup_tokens_total",
                      "load_back_tokens_total", "metrics_note", "last_metrics_s", "metrics_age_s"}],
         "agents": [{"name", "host", "control_url", "peer", "alive", "pid", "healthy", "problem"}]}

    ``healthy`` is the gateway's verdict when its control API answers (and the process is alive), else whether the
    worker's ``/health`` answers 2xx; ``alive`` is whether the recorded process still runs; ``inflight`` is the
    gateway's count of requests in flight to it; ``health_error`` why it is unhealthy; ``replication`` how copies
    reach it (``l3``, ``push`` or ``none``: the gateway's view, else the fleet's mode). The worker's own numbers
    (``metrics_source`` ... ``last_metrics_s``: :data:`~btbctl.engine.control.schema.WORKER_NUMBERS`, see the
    control API's ``FleetWorker``; ``last_metrics_s`` is on the gateway's clock) are the gateway's, null when its
    control API does not answer; ``metrics_age_s`` is how long ago, seconds, the gateway last read them. ``agents``
    are the node agents of ``l3`` mode (empty otherwise); each is probed (:func:`probe_agent`: process, control
    ``/health``, a TCP connection to its copy port): ``healthy`` when all answer, else ``problem`` says what does
    not, the verdict is ``degraded``, and the workers that use it say so (``replication`` ``l3 (agent down)``,
    ``agent_down`` its name, ``health_error`` why). ``gateways`` lists every gateway of the fleet (``[gateway]
    replicas``; the first is ``gateway``), each ``reachable`` when its control API answers ``/control/constants``;
    one not running or not answering is a problem. Raises :class:`BtbctlError` when nothing is recorded.
    """
    state = rd.load()
    if state is None:
        raise BtbctlError(f"no fleet is running (nothing recorded in {rd.path}); start one with `btbctl up`")
    fleet = None
    if state.control_url:
        try:
            with ControlClient(state.control_url, timeout_s=3.0) as api:
                fleet = api.fleet()
        except BtbctlError:
            fleet = None
    by_url = {w.url.rstrip("/"): w for w in fleet.workers} if fleet is not None else {}
    remote_state: dict[str, dict] = {}
    remote = [p for p in state.processes if p.host and p.role in ("worker", "agent")]
    if remote:
        from btbctl.engine.launcher import ssh

        with ssh.SshPool() as pool:  # also brings the remote logs up to date in the run directory
            remote_state = ssh.poll_records(pool, remote)
    agents = []
    for rec in state.agents():
        rst = remote_state.get(rec.name)
        alive = rst["state"] == "alive" if rst is not None else record_is_ours(rec)
        problem = probe_agent(rec, alive)
        agents.append(
            {
                "name": rec.name,
                "host": rec.host or "local",
                "control_url": rec.url,
                "peer": (rec.extra or {}).get("peer"),
                "alive": alive,
                "pid": rec.pid,
                "healthy": problem is None,
                "problem": problem,
            }
        )
    agent_problem = {a["host"]: a["problem"] for a in agents}
    workers = []
    for rec in state.workers():
        rst = remote_state.get(rec.name)
        alive = rst["state"] == "alive" if rst is not None else record_is_ours(rec)
        g = by_url.get((rec.url or "").rstrip("/"))
        mode = state.replication or "push"
        if g is not None:
            healthy = g.healthy and alive
            inflight = g.load
            err = g.error
            mode = g.replication_mode or mode
        else:
            healthy = alive and rec.url is not None and health_ok(rec.url, timeout_s=2.0)
            inflight = None
            err = None if healthy else ("process exited" if not alive else "no answer on /health")
        if not alive:
            err = "process exited"  # not the gateway's last connection error (a traceback's worth of text)
        elif err:
            err = err.strip().splitlines()[0][:200]
        if rst is not None and rst["state"] == "unreachable":
            err = rst["error"]
        elif rst is not None and rst["state"].startswith("exit:"):
            err = f"process exited with status {rst['state'][5:]}"
        agent_down = None
        if mode == "l3" and agent_problem.get(rec.host or "local"):
            agent_down = f"agent-{rec.host}" if rec.host else "agent-local"
            mode = "l3 (agent down)"
            if alive:
                err = f"{agent_down} is down: no copies reach it" + (f"; {err}" if err else "")
        workers.append(
            {
                "name": rec.name,
                "host": rec.host or "local",
                "url": rec.url,
                "healthy": healthy,
                "alive": alive,
                "pid": rec.pid,
                "kind": rec.kind,
                "inflight": inflight,
                "health_error": err,
                "replication": mode,
                "agent_down": agent_down,
                **{k: getattr(g, k) if g is not None else None for k in WORKER_NUMBERS},
                "metrics_age_s": (
                    round(fleet.now_s - g.last_metrics_s, 3)
                    if fleet is not None and g is not None and g.last_metrics_s is not None
                    else None
                ),
            }
        )
    gw = state.gateway()
    gw_alive = bool(gw and record_is_ours(gw))
    problems = []
    if gw is None or not gw_alive:
        problems.append("the gateway is not running" + (" (`btbctl up --gateway-only` restarts it)" if workers else ""))
    elif fleet is None:
        problems.append("the gateway's control API does not answer")
    gateways = []
    for rec in (p for p in state.processes if p.role == "gateway"):
        first = rec is gw
        alive = gw_alive if first else record_is_ours(rec)
        control = state.control_url if first else (rec.extra or {}).get("control")
        reachable = fleet is not None if first else bool(alive and control and _control_answers(control))
        gateways.append(
            {
                "name": rec.name,
                "url": state.gateway_url if first else rec.url,
                "control_url": control,
                "pid": rec.pid,
                "alive": alive,
                "reachable": reachable,
            }
        )
        if not first and not alive:
            problems.append(f"{rec.name} is not running (`btbctl restart {rec.name}` restarts it)")
        elif not first and not reachable:
            problems.append(f"{rec.name}'s control API does not answer")
    problems += [f"{w['name']}: {w['health_error'] or 'unhealthy'}" for w in workers if not w["healthy"]]
    problems += [
        f"{a['name']}: {a['problem']} (`btbctl restart {a['name']}` restarts it)" for a in agents if a["problem"]
    ]
    return {
        "verdict": "up" if not problems else "degraded",
        "problems": problems,
        "gateway_url": state.gateway_url,
        "control_url": state.control_url,
        "run_dir": str(rd.path),
        "policy": fleet.policy if fleet is not None else state.policy,
        "detached": state.detached,
        "replication": state.replication or "push",
        "gateway": {
            "pid": gw.pid if gw else None,
            "alive": gw_alive,
            "reachable": fleet is not None,
        },
        "gateways": gateways,
        "workers": workers,
        "agents": agents,
    }


def _control_answers(control_url: str) -> bool:
    """Whether a gateway's control API answers ``GET /control/constants`` within 3 s."""
    try:
        with ControlClient(control_url, timeout_s=3.0) as api:
            api.constants()
    except BtbctlError:
        return False
    return True


__all__ = [
    "check_no_live_run",
    "free_gateway_ports",
    "list_fleets",
    "connect_host",
    "down",
    "free_port",
    "gateway_argv",
    "status",
    "stop_started",
    "supervise",
    "restart_gateway_replica",
    "up",
    "up_gateway_only",
]
