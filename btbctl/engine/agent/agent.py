"""``btbctl agent``: one per node. Owns the node's page store, serves the local ``BtbL3Store`` instances, copies
pages to and from peer agents, and answers the control API.

Pieces: :class:`~btbctl.engine.agent.pages.PageStore` (the arena), :class:`~btbctl.engine.agent.local.LocalServer`
(Unix socket, threads), :class:`~btbctl.engine.agent.peer.PeerService` (TCP, threads),
:func:`~btbctl.engine.agent.control.make_app` (HTTP control and ``/metrics``, asyncio).

Transport: the peer data path is TCP (:mod:`btbctl.engine.agent.peer`). RDMA into the arena (registration in
slices below 4 GiB, WRITE planning, completions, verification before commit) lives in
:mod:`btbctl.engine.replication.rdma` and is tested against a fake device layer; ``--transport auto`` probes for a
device at start and logs why it uses TCP (no device here; where one exists, the pyverbs device layer for the
arena is still missing), ``--transport rdma`` refuses to start with that reason.

Registration (replication mode ``l3``): every ``register_interval_s`` the agent announces itself to each gateway
of ``--gateway`` (a control URL) and, with ``--gateway-service http://NAME:PORT``, to every address NAME resolves
to at that moment (a headless Service: one record per gateway pod), so that each of several gateways behind one
name holds its registration; a change of the resolved set is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from btbctl.engine.agent.events import AgentMetrics
from btbctl.engine.agent.local import LocalServer
from btbctl.engine.agent.pages import PageStore
from btbctl.engine.agent.peer import PeerService
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.fileio import ReadRefused, read_bounded
from btbctl.engine.logfmt import log_event
from btbctl.engine.netaddr import hostport, is_loopback
from btbctl.engine.replication.credentials import CredentialsError, parse_credentials

log = logging.getLogger("btbctl.agent")

#: Default Unix socket of the local stores (``btbctl.sglang_l3.store.DEFAULT_AGENT_SOCKET``).
DEFAULT_SOCKET = "/run/btbctl/agent.sock"
#: Smallest fleet secret, bytes (128 bits).
MIN_SECRET_BYTES = 16
TRANSPORTS = ("auto", "tcp", "rdma")


@dataclass
class AgentConfig:
    """Settings of one agent.

    Attributes:
        socket_path: Unix socket for the local stores.
        arena_bytes: byte budget of the page store.
        peer_host, peer_port: where peers connect (port 0 = ephemeral).
        control_host, control_port: the HTTP control API and ``/metrics`` (loopback by default).
        secret: the contents of ``--secret-file``: the fleet secret, or this node's credentials
            (:mod:`~btbctl.engine.replication.credentials`; then ``agent_id`` must be theirs or None).
        control_token: bearer token of the control API (None: no token; only sensible on a private loopback).
        agent_id: this agent's id (default: hostname and a random suffix).
        idle_timeout_s: peer connections silent this long are cut off.
        transport: ``auto``, ``tcp`` or ``rdma``.
        file_dir: file mode (:mod:`~btbctl.engine.agent.filedir`): copy SGLang's ``file`` backend pages in this
            directory instead of serving ``BtbL3Store`` (no local socket; the arena stages copies).
        header_timeout_s: a control connection without a complete request head for this long is closed, and so is
            one idle between keep-alive requests; also the copy port's authentication timeout.
        control_max_connections: open control connections without the control token at most (with it: a budget
            of as many of their own).
        control_max_per_peer: open control connections without the token of one peer address at most.
        peer_max_unauthenticated: copy-port connections still authenticating at most (a new one closes the oldest).
        peer_max_per_peer: copy-port connections of one peer address at most.
        gateways: control URLs of the gateways this agent registers with (``POST /control/agents``, signed with its
            node key; :mod:`~btbctl.engine.replication.registration`): its node, copy address, control URL and the
            workers connected to its socket, every ``register_interval_s``; empty: it registers nowhere (the
            gateway has it in its config).
        gateway_services: ``http://NAME:PORT`` URLs whose host name names every gateway (a headless Service, one
            address record per gateway pod): at each announcement NAME is resolved and every address gets one, as
            ``http://IP:PORT``, besides ``gateways``.
        register_interval_s: seconds between announcements; each holds for :data:`REGISTER_TTL_PERIODS` of them.
    """

    socket_path: str
    arena_bytes: int
    secret: bytes
    peer_host: str = "127.0.0.1"
    peer_port: int = 0
    control_host: str = "127.0.0.1"
    control_port: int = 0
    control_token: str | None = None
    agent_id: str | None = None
    idle_timeout_s: float = 10.0
    transport: str = "auto"
    file_dir: str | None = None
    header_timeout_s: float = 5.0
    control_max_connections: int = 64
    control_max_per_peer: int = 16
    peer_max_unauthenticated: int = 64
    peer_max_per_peer: int = 16
    gateways: tuple[str, ...] = ()
    gateway_services: tuple[str, ...] = ()
    register_interval_s: float = 5.0


#: An announcement holds this many registration periods (``ttl_s``): a gateway drops an agent that missed three.
REGISTER_TTL_PERIODS = 3
#: Timeout of one announcement, seconds.
REGISTER_TIMEOUT_S = 5.0

#: Resolves a host name and port to IP addresses (TCP), as :func:`resolve_tcp` does; raises :class:`OSError`.
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


def parse_gateway_service(url: str) -> tuple[str, int]:
    """The host name and port of a ``--gateway-service`` URL (``http://NAME:PORT``, no path). Raises
    :class:`ConfigError` naming the option."""
    from urllib.parse import urlsplit

    bad = ConfigError(
        "--gateway-service", f"{url!r} must be http://NAME:PORT, NAME naming every gateway (a headless Service)"
    )
    try:
        p = urlsplit(url)
        port = p.port
    except ValueError:
        raise bad from None
    if p.scheme != "http" or not p.hostname or not port or p.path not in ("", "/") or p.query or p.username:
        raise bad
    return p.hostname, port


async def resolve_tcp(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to for TCP (``loop.getaddrinfo``), sorted, without repeats. Raises
    :class:`OSError` (``socket.gaierror``) when it does not resolve."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return sorted({str(info[4][0]) for info in infos})


def read_secret(path: str, what: str = "secret file") -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped). Raises :class:`ConfigError` naming the file."""
    try:
        data = read_bounded(path, limit_bytes=1 << 16).strip()
    except ReadRefused as e:
        raise ConfigError(
            "--secret-file" if "secret" in what else "--control-token-file", f"cannot read {path}: {e}"
        ) from None
    except OSError as e:
        raise ConfigError(
            "--secret-file" if "secret" in what else "--control-token-file", f"cannot read {path}: {e.strerror or e}"
        ) from None
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(
            "--secret-file" if "secret" in what else "--control-token-file",
            f"{path} holds {len(data)} bytes; at least {MIN_SECRET_BYTES} are needed",
        )
    return data


class Agent:
    """A running agent (see the module docstring). Build with a config, then :meth:`start` in a running event loop
    and :meth:`close`."""

    def __init__(self, cfg: AgentConfig, resolve: Resolver = resolve_tcp) -> None:
        """``resolve``: how the names of ``gateway_services`` become addresses (tests give their own)."""
        if cfg.transport not in TRANSPORTS:
            raise ConfigError("--transport", f"unknown transport {cfg.transport!r}; valid: {', '.join(TRANSPORTS)}")
        if cfg.transport == "rdma":
            from btbctl.engine.replication.rdma import probe

            reason = probe() or "the agent's RDMA peer path needs a pyverbs device layer, not part of this build"
            raise BtbctlError(f"RDMA unavailable: {reason}; use --transport tcp")
        if cfg.arena_bytes < (1 << 20):
            raise ConfigError("--arena-mib", "the arena must be at least 1 MiB")
        if cfg.control_token is None and not is_loopback(cfg.control_host):
            raise ConfigError(
                "--control-token-file",
                f"the control API listens on {cfg.control_host}, beyond loopback: give --control-token-file",
            )
        self.cfg = cfg
        try:
            self.credentials = parse_credentials(
                cfg.secret, cfg.agent_id, "--secret-file", default_id=f"{socket.gethostname()}-{secrets.token_hex(3)}"
            )
        except CredentialsError as e:
            raise ConfigError("--secret-file", str(e)) from None
        self.agent_id = self.credentials.agent_id
        #: this process's incarnation: a restarted agent (same id, an empty page store) names a new one
        self.instance = secrets.token_hex(8)
        self._services = {url: parse_gateway_service(url) for url in cfg.gateway_services}
        self.resolve = resolve
        if cfg.gateways or cfg.gateway_services:
            if cfg.register_interval_s <= 0:
                raise ConfigError("--register-interval-s", f"must be > 0, got {cfg.register_interval_s}")
            for name, host in (("--peer", cfg.peer_host), ("--control", cfg.control_host)):
                if host in ("0.0.0.0", "::", ""):
                    raise ConfigError(
                        name,
                        f"with --gateway or --gateway-service, {name} must be an address other nodes reach "
                        f"(not {host or 'empty'})",
                    )
        self._announcer: asyncio.Task | None = None
        self.control_token = cfg.control_token
        self.store: PageStore | None = None
        self.metrics = AgentMetrics(lambda: self.store.stats())  # type: ignore[union-attr]
        self.local: LocalServer | None = None
        self.peers: PeerService | None = None
        self._runner = None
        self._guard = None
        self.control_port = 0
        self.peer_port = 0

    def event(self, name: str, fields: dict) -> None:
        self.metrics.event(name, fields)

    async def start(self) -> None:
        """Create the arena, bind the three endpoints. Raises :class:`BtbctlError` naming what failed."""
        from btbctl.engine.agent.control import make_app
        from btbctl.engine.netguard import ConnectionGuard, RateLimiter, listen_http, raise_nofile
        from btbctl.engine.replication.auth import bearer_ok

        cfg = self.cfg
        old_nofile, nofile = raise_nofile()
        if nofile != old_nofile:
            log_event(log, "nofile_raised", old=old_nofile, new=nofile)
        try:
            if cfg.file_dir is not None:
                from btbctl.engine.agent.filedir import FileDirStore

                self.store = FileDirStore(cfg.file_dir, cfg.arena_bytes, on_event=self.event)
            else:
                self.store = PageStore(cfg.arena_bytes, on_event=self.event)
        except OSError as e:
            raise BtbctlError(
                f"cannot create the arena of {cfg.arena_bytes} bytes or the file directory: {e.strerror or e}"
            ) from None
        from btbctl.engine.agent.peer import FAULT_ENV, SendFaults

        try:
            faults = SendFaults.from_env()
        except ValueError as e:
            raise ConfigError(FAULT_ENV, str(e)) from None
        if cfg.file_dir is None:
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(None, self.store.populate)
            fut.add_done_callback(
                lambda f: (
                    self.event("arena_populated", {"seconds": round(f.result(), 3)})
                    if not f.cancelled() and f.exception() is None
                    else None
                )
            )
        self.peers = PeerService(
            self.store,
            self.credentials,
            self.agent_id,
            self.event,
            self.metrics,
            cfg.peer_host,
            cfg.peer_port,
            idle_timeout_s=cfg.idle_timeout_s,
            faults=faults,
            auth_timeout_s=cfg.header_timeout_s,
            max_unauthenticated=cfg.peer_max_unauthenticated,
            max_per_peer=cfg.peer_max_per_peer,
        )
        try:
            self.peer_port = self.peers.start()
        except OSError as e:
            where = f"{cfg.peer_host}:{cfg.peer_port}"
            raise BtbctlError(f"cannot listen for peers on {where}: {e.strerror or e}") from None
        if cfg.file_dir is None:
            self.local = LocalServer(self.store, cfg.socket_path, on_event=self.event)
            try:
                self.local.start()
            except OSError as e:
                raise BtbctlError(f"cannot bind the local socket {cfg.socket_path}: {e.strerror or e}") from None
        token = cfg.control_token
        self._guard = ConnectionGuard(
            "agent_control",
            max_connections=cfg.control_max_connections,
            header_timeout_s=cfg.header_timeout_s,
            idle_timeout_s=cfg.header_timeout_s,
            retry_after_s=1,
            limiter=RateLimiter(),
            authorized=(lambda request: bearer_ok(request.headers.get("Authorization"), token))
            if token is not None
            else None,
            max_per_peer=cfg.control_max_per_peer,
        )
        try:
            self._runner, self.control_port = await listen_http(
                make_app(self, open_metrics=is_loopback(cfg.control_host), bind_host=cfg.control_host),
                cfg.control_host,
                cfg.control_port,
                self._guard,
            )
        except OSError as e:
            raise BtbctlError(
                f"cannot listen for control on {cfg.control_host}:{cfg.control_port}: {e.strerror or e}"
            ) from None
        from btbctl.engine.replication.rdma import probe

        rdma = probe() if cfg.transport == "auto" else "--transport tcp"
        self.event(
            "transport_selected",
            {
                "transport": "tcp",
                "rdma": "unavailable: " + rdma
                if rdma
                else "devices present; the arena's pyverbs device layer is not part of this build",
            },
        )
        self.event(
            "agent_started",
            {
                "agent": self.agent_id,
                "instance": self.instance,
                "peer": f"{cfg.peer_host}:{self.peer_port}",
                "control": f"{cfg.control_host}:{self.control_port}",
                "socket": cfg.socket_path,
                "arena_bytes": cfg.arena_bytes,
                "transport": "tcp",
            },
        )

        if cfg.gateways or cfg.gateway_services:
            self._announcer = asyncio.create_task(self._announce_forever())

    def announcement(self, sent_at: float) -> bytes:
        """The JSON body of this agent's announcement (:class:`~btbctl.engine.replication.registration.Announcement`)
        at Unix time ``sent_at``."""
        from btbctl.engine.replication.registration import Announcement

        cfg = self.cfg
        return Announcement(
            agent=self.agent_id,
            node=self.agent_id,
            peer_addr=hostport(cfg.peer_host, self.peer_port),
            control_url=f"http://{hostport(cfg.control_host, self.control_port)}",
            workers=tuple(self.local.workers() if self.local is not None else ()),
            ttl_s=REGISTER_TTL_PERIODS * cfg.register_interval_s,
            sent_at=sent_at,
            instance=self.instance,
        ).body()

    async def announce(self, session, gateway: str) -> str | None:
        """Send one announcement to ``gateway`` (a control URL); None when taken, else why not (one line)."""
        import aiohttp

        from btbctl.engine.replication.registration import REGISTER_PATH, SIGNATURE_HEADER, sign

        body = self.announcement(time.time())
        headers = {SIGNATURE_HEADER: sign(self.credentials.node_key, body), "Content-Type": "application/json"}
        try:
            async with session.post(gateway.rstrip("/") + REGISTER_PATH, data=body, headers=headers) as resp:
                if resp.status == 200:
                    return None
                text = (await resp.text())[:300]
                return f"HTTP {resp.status}: {text}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return f"{type(e).__name__}: {e}"

    async def _resolve_services(self, resolved: dict[str, tuple[bool, tuple[str, ...]]]) -> list[str]:
        """The control URLs (``http://IP:PORT``) of every gateway the ``gateway_services`` name now, updating
        ``resolved`` (per service URL: whether its last resolution succeeded, and the addresses in use). A change of
        a service's addresses is one ``gateway_service_resolved`` line (old and new); a failed resolution keeps
        the addresses of the last one (a gateway that is gone fails its announcement) and is one
        ``agent_announce_failed`` line naming the service, again only after a success."""
        urls: list[str] = []
        for service, (host, port) in self._services.items():
            ok_before, old = resolved.get(service, (True, ()))
            try:
                new = tuple(sorted(set(await self.resolve(host, port))))
            except OSError as e:
                if ok_before:
                    log_event(
                        log,
                        "agent_announce_failed",
                        logging.WARNING,
                        gateway_service=service,
                        error=f"cannot resolve {host}: {type(e).__name__}: {e}",
                        kept=",".join(old) or None,
                    )
                resolved[service] = (False, old)
            else:
                if not ok_before or service not in resolved or new != old:
                    self.event(
                        "gateway_service_resolved",
                        {
                            "gateway_service": service,
                            "addresses": ",".join(new) or None,
                            "old_addresses": ",".join(old) or None,
                            "added": ",".join(a for a in new if a not in old) or None,
                            "removed": ",".join(a for a in old if a not in new) or None,
                        },
                    )
                resolved[service] = (True, new)
            urls.extend(f"http://{hostport(ip, port)}" for ip in resolved[service][1])
        return urls

    async def _announce_forever(self) -> None:
        """Announce to every gateway (``gateways``, and every address of ``gateway_services`` resolved anew) each
        ``register_interval_s``; one line per change of outcome (or of the workers announced) per gateway, the
        outcome of a gateway no longer resolved forgotten (it is logged again if it comes back)."""
        import aiohttp

        from btbctl.engine.httpclient import client_session

        last: dict[str, tuple] = {}
        resolved: dict[str, tuple[bool, tuple[str, ...]]] = {}
        async with client_session(timeout=aiohttp.ClientTimeout(total=REGISTER_TIMEOUT_S)) as session:
            while True:
                workers = tuple(self.local.workers()) if self.local is not None else ()
                targets = list(self.cfg.gateways)
                targets += [u for u in await self._resolve_services(resolved) if u not in targets]
                for gw in list(last):
                    if gw not in targets:
                        del last[gw]
                for gw in targets:
                    why = await self.announce(session, gw)
                    now = (why is None, workers if why is None else None)
                    if last.get(gw) != now:
                        old = last.get(gw)
                        last[gw] = now
                        if why is None:
                            self.event(
                                "agent_announced",
                                {
                                    "gateway": gw,
                                    "workers": ",".join(workers) or None,
                                    "old_workers": ",".join(old[1] or ()) if old and old[0] else None,
                                    "ttl_s": round(REGISTER_TTL_PERIODS * self.cfg.register_interval_s, 6),
                                },
                            )
                        else:
                            log_event(log, "agent_announce_failed", logging.WARNING, gateway=gw, error=why)
                await asyncio.sleep(self.cfg.register_interval_s)

    async def close(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._announcer
        if self.store is not None:
            self.store.stop_waits()  # long-polls waiting for pages answer now, so the control API stops at once
        if self.local is not None:
            self.local.close()
        if self.peers is not None:
            self.peers.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._guard is not None:
            self._guard.close()
        if self.store is not None:
            self.store.close()

    # -- queries used by the control API ---------------------------------------------------------------------

    def known_namespaces(self) -> list[str]:
        assert self.store is not None
        if self.cfg.file_dir is not None:
            return self.store.suffixes()  # type: ignore[attr-defined]
        with self.store.lock:
            return sorted(set(self.store.namespaces) | self.store.seen_namespaces)

    def has(self, keys: list[str], namespaces: list[str]) -> dict:
        assert self.store is not None
        runs = {ns: self.store.leading_ready([self.store.name_of(ns, k) for k in keys]) for ns in namespaces}
        return {"keys": len(keys), "namespaces": runs, "complete": [ns for ns, n in runs.items() if n == len(keys)]}

    def provenance(self, keys: list[str], namespaces: list[str]) -> dict:
        """Per namespace, each key's page provenance here (``write:pid=<pid>``, ``copy:<copy id>``; None: not held)."""
        assert self.store is not None
        return {
            "keys": len(keys),
            "namespaces": {ns: self.store.provenance([self.store.name_of(ns, k) for k in keys]) for ns in namespaces},
        }

    def info(self) -> dict:
        assert self.store is not None
        return {
            "agent": self.agent_id,
            "instance": self.instance,
            "peer_addr": f"{self.cfg.peer_host}:{self.peer_port}",
            "control_port": self.control_port,
            "socket": self.cfg.socket_path,
            "transport": "tcp",
            "store": self.store.stats(),
            "namespaces": dict(self.store.namespaces),
            "seen_namespaces": sorted(self.store.seen_namespaces),
        }


def run(cfg: AgentConfig, ready_line: bool = True) -> None:
    """Run an agent until SIGINT/SIGTERM. Prints ``ready peer HOST:PORT control HOST:PORT socket PATH`` on stdout
    once listening."""

    async def main() -> None:
        agent = Agent(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        try:
            await agent.start()
            if ready_line:
                print(
                    f"ready peer {cfg.peer_host}:{agent.peer_port} control {cfg.control_host}:{agent.control_port} "
                    f"socket {cfg.socket_path}",
                    flush=True,
                )
            await stop.wait()
        finally:
            await agent.close()

    if not logging.getLogger().handlers:
        from btbctl.engine.logfmt import configure_logging

        configure_logging(logging.INFO)  # stderr, identical repeats held back
    if os.environ.get("BTBCTL_DEBUG", "") not in ("", "0"):
        logging.getLogger("btbctl").setLevel(logging.DEBUG)
    asyncio.run(main())


__all__ = [
    "Agent",
    "AgentConfig",
    "DEFAULT_SOCKET",
    "MIN_SECRET_BYTES",
    "TRANSPORTS",
    "Resolver",
    "is_loopback",
    "parse_gateway_service",
    "read_secret",
    "resolve_tcp",
    "run",
]
