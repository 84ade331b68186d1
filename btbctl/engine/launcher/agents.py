"""The node agents of replication mode ``l3``: one ``btbctl agent`` per host that runs workers (SGLANG.md).

``up`` writes a fresh fleet secret into the run directory (0600; :meth:`RunDir.new_agent_secret`) and derives each
agent's node credentials and control token from it (:meth:`RunDir.write_agent_credentials`: the fleet secret stays
on this machine, where the gateway derives every agent's token; an agent's files let it speak to the other agents
only as itself and drive no other agent's control API), starts each host's agent before that host's workers (the
workers' HiCache flags name its socket), waits for its ready line (``ready peer HOST:PORT control HOST:PORT socket
PATH``) and for its control API's ``/health``, and records it (role ``agent``) so that ``down`` stops it after the
workers. On ``[[hosts]]`` the agent's credentials and token travel over the SSH session's stdin into the run folder
there, never on a command line (:mod:`~btbctl.engine.launcher.ssh`).

Addresses: the agent on this machine binds its control API to loopback and its peer port to
``replication.local_peer_host`` (loopback unless other hosts copy to it); an agent on a host binds both to the
host's ``bind_address``, since the gateway (here) drives its control API and other agents copy to it. Every route of
a control API beyond loopback needs the agent's token, ``/metrics`` included, and the peer port authenticates every
connection with the link key of the two agents (:mod:`~btbctl.engine.replication.credentials`) before anything else.

Registration: every agent announces itself and the workers connected to its socket to each gateway (signed with its
node key, :mod:`~btbctl.engine.replication.registration`), so no gateway setting names an agent. This machine's agent
posts to the gateways' control APIs; a host's agent to each gateway's registration-only listener
(``GatewayConfig.register_hosts``), at the address that host reaches this machine by, while the control APIs stay
on loopback.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.cluster import ClusterFile, agent_argv
from btbctl.engine.launcher.hosts import HostSpec
from btbctl.engine.launcher.local import Started, health_ok, log_head, not_ready
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.netaddr import hostport

#: An agent's ready line (``btbctl agent`` prints it once its three endpoints listen).
AGENT_READY = re.compile(r"^ready peer (\S+) control (\S+) socket (\S+)\s*$", re.MULTILINE)
#: Longest Unix socket path (``sun_path`` is 108 bytes on Linux, with its terminating NUL and some margin).
MAX_SOCKET_PATH = 100
#: File names of the secrets and the socket in a host's run folder (the agent and the workers run there).
REMOTE_SECRET = "agent.keys"
REMOTE_TOKEN = "agent.token"
REMOTE_SOCKET = "agent.sock"


@dataclass
class AgentPlan:
    """One agent to start.

    Attributes:
        name: ``agent-local`` or ``agent-<host name>``.
        host: its ``[[hosts]]`` entry, None for this machine.
        socket: its Unix socket as the workers of that host name it (relative to the host's run folder there).
        argv: its command line.
    """

    name: str
    host: HostSpec | None
    socket: str
    argv: list[str]


def local_socket_path(rd: RunDir) -> str:
    """The local agent's socket: ``<run dir>/agent.sock``, or, when that path is too long for a Unix socket, a
    file in a private (0700) folder of this user under the temporary directory, named after the run directory."""
    p = str(rd.path / "agent.sock")
    if len(p) <= MAX_SOCKET_PATH:
        return p
    d = Path(tempfile.gettempdir()) / f"btbctl-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or not d.is_dir() or d.is_symlink():
        raise BtbctlError(f"{d} must be a folder of this user with mode 0700 (it holds the agent's socket)")
    return str(d / (hashlib.sha256(str(rd.path).encode()).hexdigest()[:16] + ".sock"))


#: Seconds between an agent's announcements when ``up`` starts it registering (it is dropped after 3 missed).
REGISTER_INTERVAL_S = 2.0


def plan_agents(
    cluster: ClusterFile,
    rd: RunDir,
    gateways: Sequence[str] = (),
    host_gateways: Mapping[str, Sequence[str]] | None = None,
) -> list[AgentPlan]:
    """The agents of ``cluster`` (:meth:`ClusterFile.agent_hosts`): this machine's first, then one per host. Each
    registers (``--gateway``, every :data:`REGISTER_INTERVAL_S`) with every gateway at the URLs it reaches them by:
    ``gateways`` (their control APIs, from this machine) for the local agent, ``host_gateways[host name]`` (their
    registration listeners) for a host's; an agent given none registers nowhere."""
    rep = cluster.replication
    out = []
    for host in cluster.agent_hosts():
        if host is None:
            name, sock, urls = "agent-local", local_socket_path(rd), gateways
            argv = agent_argv(
                rep.python or sys.executable,
                secret_file=str(rd.agent_credentials_path(name)),
                token_file=str(rd.agent_control_token_path(name)),
                socket=sock,
                peer=hostport(rep.local_peer_host, rep.peer_port),
                control=hostport("127.0.0.1", rep.control_port),
                arena_mib=rep.arena_mib,
                agent_id=name,
            )
        else:
            name, sock, urls = f"agent-{host.name}", REMOTE_SOCKET, (host_gateways or {}).get(host.name, ())
            argv = list(host.command_prefix) + agent_argv(
                rep.python or host.python,
                secret_file=REMOTE_SECRET,
                token_file=REMOTE_TOKEN,
                socket=sock,
                peer=hostport(host.bind_address, rep.peer_port),
                control=hostport(host.bind_address, rep.control_port),
                arena_mib=rep.arena_mib,
                agent_id=name,
            )
        for url in urls:
            argv += ["--gateway", url]
        if urls:
            argv += ["--register-interval-s", f"{REGISTER_INTERVAL_S:g}"]
        out.append(AgentPlan(name, host, sock, argv))
    return out


def parse_ready(text: str) -> dict | None:
    """``{"peer", "control", "socket"}`` of the first agent ready line in ``text``, or None."""
    m = AGENT_READY.search(text)
    if m is None:
        return None
    return {"peer": m.group(1), "control": m.group(2), "socket": m.group(3)}


def control_url(control: str, reach: str | None = None) -> str:
    """The control API's base URL from the ``HOST:PORT`` an agent listens on (``reach`` replaces a wildcard
    host)."""
    host, _, port = control.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]") and reach:
        host = reach
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def wait_local_ready(proc: Started, timeout_s: float, should_stop=None, poll_s: float = 0.05) -> dict:
    """Wait for a local agent's ready line and its control API's ``/health``; returns ``{"peer", "control",
    "socket", "control_url"}`` and fills ``proc.url``/``proc.extra``.

    Raises:
        BtbctlError: it exited first (status and last log lines), or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        info = parse_ready(log_head(proc.log))
        if info is not None:
            url = control_url(info["control"])
            if health_ok(url):
                info["control_url"] = url
                proc.url = url
                proc.extra = dict(info)
                return info
        rc = proc.popen.poll()
        if rc is not None:
            raise not_ready(proc, rc, timeout_s)
        if time.monotonic() >= deadline:
            raise not_ready(proc, None, timeout_s)
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        time.sleep(poll_s)


def registered(control_url: str, token: str | None, timeout_s: float = 2.0) -> dict[str, list[str]]:
    """``{agent name: [worker names]}`` of the agents the gateway at ``control_url`` knows now (``GET
    /control/agents`` through :class:`~btbctl.engine.control.client.ControlClient`). Raises
    :class:`~btbctl.engine.control.client.ControlApiError` (no answer, an HTTP error, not the documented shape)."""
    from btbctl.engine.control.client import ControlClient

    with ControlClient(control_url, token, timeout_s=timeout_s) as client:
        answer = client.agents()
    return {a.name: list(a.workers) for a in answer.agents}


def wait_registered(
    control_url: str,
    token: str | None,
    expect: dict[str, list[str]],
    logs: dict[str, Path],
    timeout_s: float,
    should_stop=None,
    clock=time.monotonic,
    sleep=time.sleep,
) -> dict[str, list[str]]:
    """Wait until every agent of ``expect`` (``{agent name: [worker names it serves]}``) registered with the
    gateway at ``control_url`` naming those workers; returns what the gateway holds then.

    Raises:
        BtbctlError: one line naming the first agent not registered after ``timeout_s`` seconds and why (what the
            gateway holds for it, and the last ``agent_announce_failed`` line of its log in ``logs``).
    """
    from btbctl.engine.control.client import ControlApiError

    deadline = clock() + timeout_s
    got: dict[str, list[str]] = {}
    err = ""
    while True:
        try:
            got = registered(control_url, token)
            err = ""
        except ControlApiError as e:
            err = f"{control_url}/control/agents did not answer: {e}"
        missing = [n for n, ws in expect.items() if n not in got or not set(ws) <= set(got[n])]
        if not missing:
            return got
        if clock() >= deadline:
            name = missing[0]
            if err:
                why = err
            elif name not in got:
                why = "the gateway has no registration of it"
            else:
                why = f"it registered workers {','.join(got[name]) or 'none'}, not {','.join(expect[name])}"
            try:
                lines = logs[name].read_text(encoding="utf-8", errors="replace").splitlines()
            except (KeyError, OSError):
                lines = []
            failed = [ln for ln in lines if "agent_announce_failed" in ln]
            tail = f"; its log: {failed[-1].strip()[:300]}" if failed else ""
            raise BtbctlError(f"{name} did not register with the gateway within {timeout_s:g} s: {why}{tail}")
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        sleep(0.1)


__all__ = [
    "REGISTER_INTERVAL_S",
    "AGENT_READY",
    "AgentPlan",
    "REMOTE_SECRET",
    "REMOTE_SOCKET",
    "REMOTE_TOKEN",
    "control_url",
    "local_socket_path",
    "parse_ready",
    "plan_agents",
    "registered",
    "wait_local_ready",
    "wait_registered",
]
