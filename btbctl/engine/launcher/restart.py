"""``btbctl restart NAME``: stop one process of a detached fleet and start it again in place, from the run directory.

The process is found by its recorded name (``worker-0``, ``agent-local``, ``gateway``), stopped by process group
(SIGTERM, SIGKILL after the grace period; only when it is provably ours), started again with the recorded argv and
environment on the same ports, and waited for; then its new pid replaces the old one in ``state.json`` (written
atomically). The others keep running, and with them their caches.
The previous log moves to ``<name>.log.before-restart``.

* A worker comes back on its recorded HTTP and transfer ports (a port the worker picked itself at ``up`` is pinned
  in its argv); the gateway's health prober sees it come back.
* A node agent comes back on its recorded control and copy ports and socket (its arena starts empty).
* The gateway comes back as ``up --gateway-only`` starts it: same ports, tokens and settings, the last ``tune``
  reapplied.

A process on a ``[[hosts]]`` machine is refused (one line): ``down`` and ``up`` restart those.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from urllib.parse import urlsplit

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.local import Started, spawn, stop_groups, wait_ready
from btbctl.engine.launcher.rundir import ProcessRecord, RunDir, RunState, group_members, holding_lock, record_is_ours
from btbctl.engine.logfmt import format_event

Log = Callable[[str], None]

#: Seconds a restarted worker or agent has to become ready when the cluster file names no timeout.
DEFAULT_READY_TIMEOUT_S = 120.0


def _nolog(_msg: str) -> None:
    pass


def _pin(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with the value after ``flag`` replaced by ``value`` (unchanged when either is missing)."""
    if value is None or flag not in argv:
        return list(argv)
    out = list(argv)
    i = out.index(flag)
    if i + 1 < len(out):
        out[i + 1] = value
    return out


def _port_of(hostport: str | None) -> str | None:
    """The port of ``HOST:PORT`` as text, None when it is not one (or is port 0)."""
    from btbctl.engine.replication.transport import TransferError, parse_address

    try:
        return str(parse_address(hostport or "")[1])
    except TransferError:
        return None


def restart_argv(rec: ProcessRecord) -> list[str]:
    """The argv that starts ``rec`` again on the ports it has now: a port of ``0`` (picked by the process at
    ``up``) is replaced by the one it reported ready on."""
    argv = list(rec.argv)
    if rec.role == "agent":
        extra = rec.extra or {}
        if "--peer" in argv and extra.get("peer") and _port_of(extra["peer"]):
            argv = _pin(argv, "--peer", extra["peer"])
        if "--control" in argv and extra.get("control") and _port_of(extra["control"]):
            argv = _pin(argv, "--control", extra["control"])
        return argv
    if rec.role == "worker" and rec.kind == "emulated":
        port = urlsplit(rec.url).port if rec.url else None
        if "--port" in argv and port:
            argv = _pin(argv, "--port", str(port))
        tport = _port_of((rec.extra or {}).get("transfer"))
        if "--transfer-port" in argv and tport:
            argv = _pin(argv, "--transfer-port", tport)
    return argv


def _ready_timeout(state: RunState, rec: ProcessRecord) -> float:
    """The ready timeout the cluster file gives ``rec`` (workers: their spec's; agents: the replication section's),
    else :data:`DEFAULT_READY_TIMEOUT_S`."""
    try:
        from btbctl.engine.launcher.cluster import default_cluster, load_cluster

        cluster = load_cluster(state.cluster_file) if state.cluster_file else default_cluster()
        if rec.role == "agent":
            return cluster.replication.ready_timeout_s
        for inst in cluster.instances():
            if inst.name == rec.name:
                return inst.spec.effective_ready_timeout_s
    except (BtbctlError, OSError, ValueError):
        pass
    return DEFAULT_READY_TIMEOUT_S


#: Suffix of the log a restarted process had before (not a number: :func:`spawn` removes numbered rotations of
#: an earlier run, and the new process's own rotations take those names).
PREVIOUS_LOG_SUFFIX = ".before-restart"


def _rotate(log_path: str) -> None:
    """Keep the previous log of a restarted process as ``<log>.before-restart`` (the new one starts empty: its
    ready line is read from its head)."""
    try:
        os.replace(log_path, log_path + PREVIOUS_LOG_SUFFIX)
    except FileNotFoundError:
        pass


def _stop(rec: ProcessRecord, grace_s: float) -> str:
    """Stop ``rec``'s group if it is ours: ``stopped``, ``killed`` or ``gone``."""
    if not record_is_ours(rec):
        return "gone"
    killed = stop_groups([(rec.pgid, None)], grace_s)
    return "killed" if killed.get(rec.pgid) else "stopped"


@holding_lock(create=False)
def restart(rd: RunDir, name: str, grace_s: float = 10.0, timeout_s: float | None = None, log: Log = _nolog) -> dict:
    """Restart the process ``name`` of the fleet recorded in ``rd`` in place (see the module's text).

    Returns ``{"name", "role", "old_pid", "pid", "url", "stop": "stopped"|"killed"|"gone"}``; ``log`` receives one
    ``event=process_restart`` line.

    Raises:
        BtbctlError: another ``up``/``down`` holds ``rd`` (:meth:`RunDir.locked`); nothing is recorded; ``name`` is
            not recorded (the valid names are listed); it runs on another
            host; a foreground ``btbctl up`` holds the fleet; it did not become ready again (it is left stopped,
            its log quoted).
    """
    state = rd.load()
    if state is None:
        raise BtbctlError(f"no fleet is recorded in {rd.path}; start one with `btbctl up`")
    names = [p.name for p in state.processes]
    rec = next((p for p in state.processes if p.name == name), None)
    if rec is None:
        raise BtbctlError(f"no process named {name!r} in {rd.path}; valid names: {', '.join(names) or 'none'}")
    if rec.host:
        raise BtbctlError(
            f"{name} runs on host {rec.host}: restarting a process on another host is not supported; "
            f"`btbctl down` and `btbctl up` restart the fleet"
        )
    if rd.owner_alive(state):
        raise BtbctlError(
            f"a foreground `btbctl up` (pid {state.owner_pid}) holds {rd.path}; restart it there (Ctrl-C, then up)"
        )
    old_pid = rec.pid
    if rec.role == "gateway" and rec is not state.gateway():  # gateway-1, ...: [gateway] replicas
        from btbctl.engine.launcher.fleet import restart_gateway_replica

        # its settings are read and checked before it is stopped: a damaged file leaves it running
        new, stopped = restart_gateway_replica(rd, rec, lambda: _stop(rec, grace_s), timeout_s or 60.0)
    elif rec.role == "gateway":
        from btbctl.engine.launcher.fleet import up_gateway_only

        stopped = _stop(rec, grace_s)
        first = up_gateway_only(rd, timeout_s=timeout_s or 60.0).gateway()
        assert first is not None
        new = first
    else:
        stopped = _stop(rec, grace_s)
        new = _restart_one(rd, state, rec, timeout_s or _ready_timeout(state, rec))
    out = {"name": name, "role": rec.role, "old_pid": old_pid, "pid": new.pid, "url": new.url, "stop": stopped}
    log(format_event("process_restart", {**out, "run_dir": str(rd.path)}))
    return out


def _restart_one(rd: RunDir, state: RunState, rec: ProcessRecord, timeout_s: float) -> ProcessRecord:
    """Start the worker or agent ``rec`` again (already stopped), wait for it, and record its new pid."""
    argv = restart_argv(rec)
    _rotate(rec.log)
    from pathlib import Path

    proc = spawn(rec.name, argv, Path(rec.log), env=dict(rec.env or {}))
    try:
        if rec.role == "agent":
            from btbctl.engine.launcher.agents import wait_local_ready

            wait_local_ready(proc, timeout_s)
        else:
            expect_ready_line = rec.kind == "emulated"
            wait_ready(proc, timeout_s, health_url=None if expect_ready_line else rec.url)
    except BaseException:
        if proc.popen.poll() is None or group_members(proc.pid):
            stop_groups([(proc.pid, proc.popen)], grace_s=5.0)
        raise
    return _record(rd, rec, proc)


def _record(rd: RunDir, old: ProcessRecord, proc: Started) -> ProcessRecord:
    """Replace ``old`` by the restarted ``proc`` in the run state as it is on disk now (one atomic write)."""
    state = rd.load()
    if state is None:
        raise BtbctlError(f"the run state of {rd.path} disappeared while {old.name} restarted (pid {proc.pid} runs)")
    new = proc.record(old.role, old.kind)
    new.url = old.url if old.role == "worker" and old.url else (proc.url or old.url)
    if old.role == "worker":
        new.extra = {**(old.extra or {}), **(proc.extra or {})}
    state.processes = [new if p.name == old.name else p for p in state.processes]
    rd.save(state)
    return new


__all__ = ["DEFAULT_READY_TIMEOUT_S", "restart", "restart_argv"]
