"""Resource guards of every listener btbctl opens: the descriptor limit, connection caps with request-head and
idle timeouts, and rate-limited logging of repeated errors. Shared by the gateway, the node agent and the emulated
worker (one definition each).

**Descriptors.** At start a long-running server raises its ``RLIMIT_NOFILE`` soft limit to the hard limit
(:func:`raise_nofile`).

**Connections.** :class:`ConnectionGuard` watches one listener (aiohttp's ``web.Server``, or a :class:`GuardedServer`
that reports its connections itself): a connection that has not delivered a complete request head within
``header_timeout_s`` (a fresh or half-sent one) is closed, an idle keep-alive connection is closed after
``idle_timeout_s``, and when the cap is reached a new connection closes the oldest one that is not serving a request
(half-sent or idle keep-alive; one that never served a request only once it was open half of ``header_timeout_s``: a
burst's fresh connections have their request heads in flight and must not evict each other), so idle connections can
never starve real clients for long. When no connection can go, the new one's request is answered 503 with
``Retry-After`` and the connection closes.

*Authenticated budget.* With ``authorized`` (a check of a request's credentials), a connection whose request carries
valid credentials leaves the unauthenticated budget: it never counts against ``max_connections``, is never evicted
for an unauthenticated one, and is served even while unauthenticated connections fill the cap (up to
``max_connections`` such connections). *Per peer.* With ``max_per_peer``, one peer address holds at most that many
unauthenticated connections: a new one closes that peer's oldest one not serving a request (by the same rule as
at the cap), else its request is answered 503.

Every listener is opened by :func:`listen_http` (an aiohttp app, or a :class:`GuardedServer`: the gateway's data
plane) or declares its limits in :data:`LISTENERS` (the agent's threaded copy port): no listener without a
connection cap, a request-head timeout and an idle timeout.

**Local exhaustion.** :func:`is_local_exhaustion` tells this process's own ``EMFILE``/``ENFILE`` (no descriptor left
to connect upstream) from a peer failing: the former is answered 503 and never blamed on a worker.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from btbctl.engine.logfmt import RateLimiter, log_event

log = logging.getLogger(__name__)

#: Largest request body read (and dropped) before a 503 at the connection cap.
_DRAIN_BYTES = 64 * 1024
#: Seconds between the sweeps that bring the connections back to the cap.
SWEEP_INTERVAL_S = 0.5
#: Errors of the gateway's own process, not of the peer: no descriptor left (per process, system-wide).
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE})


def _raise_to(soft: int, hard: int) -> int:
    """The soft limit :func:`raise_nofile` asks for: the hard limit (at least ``soft`` and 1,048,576 when the
    hard limit is unlimited)."""
    return hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)


def nofile_target() -> int:
    """The ``RLIMIT_NOFILE`` soft limit :func:`raise_nofile` aims at (nothing is changed here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(soft, _raise_to(soft, hard))


def raise_nofile() -> tuple[int, int]:
    """Raise the ``RLIMIT_NOFILE`` soft limit to the hard limit (capped at 1,048,576 when the hard limit is
    unlimited); returns ``(old soft, new soft)``. Never fails: on refusal the old limit stays."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _raise_to(soft, hard)
    if soft == resource.RLIM_INFINITY or target <= soft:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def is_local_exhaustion(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it wraps) is this process running out of descriptors."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in _LOCAL_ERRNOS:
            return True
        inner = getattr(e, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(inner, OSError) and inner.errno in _LOCAL_ERRNOS:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


class _Conn:
    __slots__ = ("busy", "served", "timer", "transport", "over_cap", "opened", "peer", "authed")

    def __init__(self, transport: Any, opened: float) -> None:
        self.transport = transport
        self.opened = opened
        self.busy = 0
        self.served = 0
        self.timer: asyncio.TimerHandle | None = None
        self.over_cap = False
        self.authed = False
        peer = transport.get_extra_info("peername") if transport is not None else None
        self.peer = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class ConnectionGuard:
    """Connection cap, request-head and idle timeouts of one aiohttp listener (see the module docstring).

    Open the listener with :func:`listen_http`, which installs the guard and its middleware (first).

    Args:
        name: the listener, for logs (``data``, ``control``, ``agent_control``, ``worker_http``).
        max_connections: unauthenticated open connections at most (beyond: the oldest idle one is closed, else 503).
        header_timeout_s: a connection without a complete request head for this long is closed.
        idle_timeout_s: an idle keep-alive connection is closed after this long.
        retry_after_s: ``Retry-After`` of the 503 answers.
        limiter: rate limiter of the log lines.
        on_reject: called once per connection closed or answered 503 here, with the reason
            (``header_timeout``, ``evicted``, ``per_peer``, ``over_cap``).
        authorized: ``authorized(request)``: whether the request carries valid credentials (its connection then
            leaves the unauthenticated budget). None: no authenticated budget.
        max_per_peer: unauthenticated connections of one peer address at most (None: no per-peer cap).
    """

    def __init__(
        self,
        name: str,
        *,
        max_connections: int,
        header_timeout_s: float,
        idle_timeout_s: float,
        retry_after_s: int,
        limiter: RateLimiter,
        on_reject: Callable[[str], None] | None = None,
        authorized: Callable[[web.Request], bool] | None = None,
        max_per_peer: int | None = None,
    ) -> None:
        if max_connections < 1 or header_timeout_s <= 0 or idle_timeout_s <= 0:
            raise ValueError(f"listener {name}: a connection cap, a header timeout and an idle timeout are required")
        self.name = name
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.retry_after_s = retry_after_s
        self.limiter = limiter
        self.on_reject = on_reject
        self.authorized = authorized
        self.max_per_peer = max_per_peer
        self.conns: dict[Any, _Conn] = {}  # insertion order: oldest first
        self.authed = 0
        self.closed = {"header_timeout": 0, "evicted": 0, "per_peer": 0, "over_cap": 0}
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def unauthenticated(self) -> int:
        """Open connections that count against ``max_connections``."""
        return len(self.conns) - self.authed

    def _sweep(self) -> None:
        """Every :data:`SWEEP_INTERVAL_S`: back to the cap, oldest idle connections first. A burst of idle connections
        accepted at once is all too young to evict at its own accept; left alone it would hold the descriptors
        (and block ``accept()``) until the head timeout."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self.unauthenticated > self.max_connections and self._evict(now):
            pass
        self._sweeper = loop.call_later(SWEEP_INTERVAL_S, self._sweep)

    def close(self) -> None:
        """Stop the sweeps (the listener is gone)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def install(self, server: web.Server) -> None:
        """Watch the connections of aiohttp's ``server`` and start the sweeps."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self.connection_made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            self.connection_lost(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
        self.start_sweeps()

    def start_sweeps(self) -> None:
        """Start the sweeps back to the cap (a :class:`GuardedServer` calls it once it listens)."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_INTERVAL_S, self._sweep)

    def _reject(self, reason: str) -> None:
        self.closed[reason] += 1
        if self.on_reject is not None:
            self.on_reject(reason)
        ok, held = self.limiter.allow(f"{self.name}:{reason}")
        if ok:
            log_event(
                log,
                "connection_refused",
                logging.WARNING,
                listener=self.name,
                reason=reason,
                open=len(self.conns),
                cap=self.max_connections,
                repeats_held=held or None,
            )

    def connection_made(self, key: Any, transport: Any) -> None:
        """Connection ``key`` (its requests' ``protocol``: aiohttp's handler, or a :class:`GuardedServer`'s
        connection) opened on ``transport``."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        c = _Conn(transport, now)
        if self._peer_full(c.peer, 0):
            self._evict(now, c.peer)
        if self.unauthenticated >= self.max_connections:
            self._evict(now)
        c.over_cap = self.unauthenticated >= self.max_connections or self._peer_full(c.peer, 0)
        self.conns[key] = c
        c.timer = loop.call_later(self.header_timeout_s, self._head_due, key)

    def _peer_full(self, peer: str, extra: int) -> bool:
        """Whether ``peer`` holds ``max_per_peer`` + ``extra`` unauthenticated connections or more."""
        if self.max_per_peer is None:
            return False
        n = sum(1 for o in self.conns.values() if o.peer == peer and not o.authed)
        return n >= self.max_per_peer + extra

    def _evict(self, now: float, peer: str | None = None) -> bool:
        """Close the oldest unauthenticated connection (of ``peer``, when given) not serving a request (one that never
        served any only once it is half of ``header_timeout_s`` old); whether one went."""
        old = now - self.header_timeout_s / 2
        victim = next(
            (
                h
                for h, c in self.conns.items()
                if not c.busy and not c.authed and (c.served or c.opened <= old) and (peer is None or c.peer == peer)
            ),
            None,
        )
        if victim is None:
            return False
        self._close(victim)
        self._reject("evicted" if peer is None else "per_peer")
        return True

    def _close(self, handler: Any) -> None:
        c = self.connection_lost(handler)
        if c is not None:
            c.transport.abort()

    def _head_due(self, handler: Any) -> None:
        c = self.conns.get(handler)
        if c is not None and not c.busy and not c.served:
            c.timer = None
            self._close(handler)
            self._reject("header_timeout")

    def connection_lost(self, key: Any) -> _Conn | None:
        """Connection ``key`` closed: forgotten (its budget and timer); its record, None when it was not watched."""
        c = self.conns.pop(key, None)
        if c is None:
            return None
        if c.authed:
            self.authed -= 1
        if c.timer is not None:
            c.timer.cancel()
        return c

    def _authenticate(self, c: _Conn, request: web.Request) -> None:
        """Move ``c`` to the authenticated budget when ``request`` carries valid credentials and there is room."""
        if c.authed or self.authorized is None or self.authed >= self.max_connections:
            return
        if self.authorized(request):
            c.authed = True
            c.over_cap = False
            self.authed += 1

    @web.middleware
    async def middleware(self, request: Any, handler: Any) -> Any:
        """First middleware of the listener: the cap and the authenticated budget for each request. ``request``:
        aiohttp's, or a :class:`GuardedServer`'s (its ``protocol`` the key given to :meth:`connection_made`, with
        ``headers``, ``content_length`` and ``read()``); answers what ``handler`` does, or a 503."""
        c = self.conns.get(request.protocol)
        if c is None:
            return await handler(request)
        self._authenticate(c, request)
        if c.over_cap:  # a request head arrived: an idle connection may have become old enough to go for it
            now = asyncio.get_running_loop().time()
            c.over_cap = (self.unauthenticated > self.max_connections and not self._evict(now)) or (
                self._peer_full(c.peer, 1) and not self._evict(now, c.peer)
            )
        if c.over_cap:
            self._reject("over_cap")
            if (request.content_length or 0) <= _DRAIN_BYTES:  # read a small body first: closing on unread
                try:  # bytes resets the connection, and the client might miss the answer
                    await asyncio.wait_for(request.read(), 1.0)
                except Exception:  # noqa: BLE001 - a best-effort drain: too slow, too large or gone, the 503 follows
                    pass
            return overloaded(self.retry_after_s, f"the {self.name} listener is at its connection cap")
        c.busy += 1
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None
        try:
            return await handler(request)
        finally:
            c.busy -= 1
            c.served += 1


def overload_parts(retry_after_s: int, message: str) -> tuple[bytes, dict[str, str]]:
    """Body and headers of a 503 ``{"error": ...}`` answer with ``Retry-After`` that closes the connection."""
    body = {"error": {"message": message, "type": "overloaded", "code": 503}}
    headers = {"Content-Type": "application/json", "Retry-After": str(retry_after_s), "Connection": "close"}
    return json.dumps(body).encode(), headers


def overloaded(retry_after_s: int, message: str) -> web.Response:
    """:func:`overload_parts` as an aiohttp answer."""
    body, headers = overload_parts(retry_after_s, message)
    return web.Response(status=503, body=body, headers=headers)


def install_accept_error_limiter(loop: asyncio.AbstractEventLoop, limiter: RateLimiter) -> Callable[[], None]:
    """Rate-limit the event loop's logging of failed ``accept()`` calls (asyncio logs one with a traceback per
    failure, up to ``backlog`` times per event when descriptors run out; it already pauses accepting for a second
    and retries, so nothing is lost by logging one line per interval). Other errors go to the previous handler.
    Returns a function that restores it."""
    previous = loop.get_exception_handler()

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        msg = str(context.get("message", ""))
        if "accept" in msg or (exc is not None and is_local_exhaustion(exc)):
            ok, held = limiter.allow("accept")
            if ok:
                log_event(
                    log,
                    "accept_failed",
                    logging.WARNING,
                    error=f"{type(exc).__name__}: {exc}" if exc is not None else msg,
                    repeats_held=held or None,
                )
            return
        if previous is not None:
            previous(lp, context)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)

    return restore


class GuardedServer(Protocol):
    """A listener that is not aiohttp's but runs under a :class:`ConnectionGuard`: it reports each connection
    (:meth:`ConnectionGuard.connection_made`, :meth:`~ConnectionGuard.connection_lost`), runs the guard's middleware
    first, closes an idle keep-alive connection after ``guard.idle_timeout_s`` and starts the guard's sweeps."""

    async def listen(
        self,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int,
        access_log: logging.Logger | None,
        shutdown_timeout_s: float,
    ) -> tuple[Any, int]:
        """Listen; ``(an object whose ``cleanup()`` stops it, bound port)``. Raises OSError when it cannot bind."""


async def listen_http(
    app: web.Application | GuardedServer,
    host: str,
    port: int,
    guard: ConnectionGuard,
    *,
    access_log: logging.Logger | None = None,
    backlog: int = 1024,
    shutdown_timeout: float = 1.0,
    **runner_kwargs: Any,
) -> tuple[Any, int]:
    """Open a listener under ``guard`` (its cap, head timeout and idle timeout): an aiohttp ``app`` or a
    :class:`GuardedServer`. The guard's middleware goes first, idle keep-alive connections close after
    ``guard.idle_timeout_s``. Returns ``(runner, bound port)``; the caller awaits ``runner.cleanup()`` and closes
    the guard. Raises OSError when the address cannot be bound."""
    if not isinstance(app, web.Application):
        if runner_kwargs:
            raise TypeError(f"listen_http: {', '.join(runner_kwargs)} apply to an aiohttp app only")
        return await app.listen(
            host, port, guard, backlog=backlog, access_log=access_log, shutdown_timeout_s=shutdown_timeout
        )
    app.middlewares.insert(0, guard.middleware)
    runner = web.AppRunner(
        app,
        access_log=access_log,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=guard.idle_timeout_s,
        **runner_kwargs,
    )
    await runner.setup()
    assert runner.server is not None
    guard.install(runner.server)
    site = web.TCPSite(runner, host, port, backlog=backlog, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        guard.close()
        await runner.cleanup()
        raise
    return runner, int(runner.addresses[-1][1])


#: Every listener btbctl opens and where: the opener (:func:`listen_http` with a :class:`ConnectionGuard`, or the
#: class that enforces the three limits itself) and the names of its cap, head timeout and idle timeout. A test walks
#: the sources for listening calls and checks each is here.
LISTENERS: dict[str, dict[str, str]] = {
    "gateway data": {"module": "btbctl.engine.gateway.server", "opener": "listen_http"},
    "gateway control": {"module": "btbctl.engine.gateway.server", "opener": "listen_http"},
    "agent control": {"module": "btbctl.engine.agent.agent", "opener": "listen_http"},
    "agent copy port": {
        "module": "btbctl.engine.agent.peer",
        "opener": "PeerService",
        "cap": "max_unauthenticated",
        "header_timeout": "auth_timeout_s",
        "idle_timeout": "idle_timeout_s",
    },
    "worker http": {"module": "btbctl.engine.worker.server", "opener": "listen_http"},
    "worker transfer port": {
        "module": "btbctl.engine.replication.tcp",
        "opener": "TcpReceiver",
        "cap": "max_unauthenticated",
        "header_timeout": "auth_timeout_s",
        "idle_timeout": "idle_timeout_s",
    },
    "doctor registration check": {
        "module": "btbctl.engine.launcher.doctor",
        "opener": "_registration_listeners",
        "cap": "REACH_BACKLOG",
        "exempt": "lives for one `btbctl doctor` run and closes every connection as soon as it is accepted, reading "
        "nothing: bounded by its backlog, no head or idle timeout to keep",
    },
    "agent local socket": {
        "module": "btbctl.engine.agent.local",
        "opener": "LocalServer",
        "cap": "MAX_LOCAL_CONNECTIONS",
        "exempt": "an owner-only (0600) Unix socket of the node's own SGLang processes, which hold their "
        "connections for their lifetime: capped, no head or idle timeout",
    },
}
