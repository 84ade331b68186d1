"""The gateway's own resource guards: its descriptor budget, its listeners' connection caps and head timeouts,
and rate-limited logging of repeated errors.

**Descriptors.** At start the gateway raises its ``RLIMIT_NOFILE`` soft limit to the hard limit
(:func:`raise_nofile`). Of that limit ``fd_reserve`` descriptors are kept for everything else (listeners, health
probes, copies, the control API, log files); the rest is split by :func:`fd_budget`: each proxied request holds
two sockets (the client's and the upstream one), so by default a third of the budget goes to requests in flight
and two thirds to client connections (every request in flight has its client connection, and as many more
connections can be read and answered 503 or wait idle between keep-alive requests).

**Connections.** :class:`ConnectionGuard` watches one listener (an aiohttp ``web.Server``): a connection that has
not delivered a complete request head within ``header_timeout_s`` (a fresh or half-sent one) is closed, and when
the cap is reached a new connection closes the oldest one that is not serving a request (half-sent or idle
keep-alive; one that never served a request only once it was open half of ``header_timeout_s``: a burst's
fresh connections have their request heads in flight and must not evict each other), so idle connections can
never starve real clients for long. When no connection can go, the new one's request is answered 503 with
``Retry-After`` and the connection closes.

**Local exhaustion.** :func:`is_local_exhaustion` tells the gateway's own ``EMFILE``/``ENFILE`` (no descriptor left
to connect upstream) from a worker failing: the former is answered 503 and never blamed on a worker.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
from collections.abc import Callable
from typing import Any

from aiohttp import web

from btbctl.engine.logfmt import RateLimiter, log_event
from btbctl.engine.netaddr import browser_refusal

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


def fd_budget(nofile: int, reserve: int) -> tuple[int, int]:
    """``(max requests in flight, max client connections)`` for a descriptor limit ``nofile`` keeping ``reserve``
    for everything else (see the module docstring); each at least 1."""
    budget = max(3, nofile - reserve)
    inflight = max(1, budget // 3)
    return inflight, max(1, budget - inflight)


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
    __slots__ = ("busy", "served", "timer", "transport", "over_cap", "opened")

    def __init__(self, transport: Any, opened: float) -> None:
        self.transport = transport
        self.opened = opened
        self.busy = 0
        self.served = 0
        self.timer: asyncio.TimerHandle | None = None
        self.over_cap = False


class ConnectionGuard:
    """Connection cap and request-head timeout of one aiohttp listener (see the module docstring).

    Install with :meth:`install` on the runner's ``web.Server`` after ``runner.setup()``, and put
    :attr:`middleware` first in the application's middlewares (it marks connections busy while a request runs).

    Args:
        name: the listener, for logs (``data``, ``control``).
        max_connections: open connections at most (beyond: the oldest idle one is closed, else 503).
        header_timeout_s: a connection without a complete request head for this long is closed.
        retry_after_s: ``Retry-After`` of the 503 answers.
        limiter: rate limiter of the log lines.
        on_reject: called once per connection closed or answered 503 here, with the reason
            (``header_timeout``, ``evicted``, ``over_cap``).
    """

    def __init__(
        self,
        name: str,
        *,
        max_connections: int,
        header_timeout_s: float,
        retry_after_s: int,
        limiter: RateLimiter,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.name = name
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.retry_after_s = retry_after_s
        self.limiter = limiter
        self.on_reject = on_reject
        self.conns: dict[Any, _Conn] = {}  # insertion order: oldest first
        self.closed = {"header_timeout": 0, "evicted": 0, "over_cap": 0}
        self._sweeper: asyncio.TimerHandle | None = None

    def _sweep(self) -> None:
        """Every :data:`SWEEP_INTERVAL_S`: back to the cap, oldest idle connections first. A burst of idle connections
        accepted at once is all too young to evict at its own accept; left alone it would hold the descriptors
        (and block ``accept()``) until the head timeout."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while len(self.conns) > self.max_connections and self._evict(now):
            pass
        self._sweeper = loop.call_later(SWEEP_INTERVAL_S, self._sweep)

    def close(self) -> None:
        """Stop the sweeps (the listener is gone)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def install(self, server: web.Server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self._made(handler, transport)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            self._lost(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
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

    def _made(self, handler: Any, transport: Any) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if len(self.conns) >= self.max_connections:
            self._evict(now)
        c = _Conn(transport, now)
        if len(self.conns) >= self.max_connections:
            c.over_cap = True
        self.conns[handler] = c
        c.timer = loop.call_later(self.header_timeout_s, self._head_due, handler)

    def _evict(self, now: float) -> bool:
        """Close the oldest connection not serving a request (one that never served any only once it is half of
        ``header_timeout_s`` old); whether one went."""
        old = now - self.header_timeout_s / 2
        victim = next((h for h, c in self.conns.items() if not c.busy and (c.served or c.opened <= old)), None)
        if victim is None:
            return False
        self._close(victim)
        self._reject("evicted")
        return True

    def _close(self, handler: Any) -> None:
        c = self.conns.pop(handler, None)
        if c is None:
            return
        if c.timer is not None:
            c.timer.cancel()
        c.transport.abort()

    def _head_due(self, handler: Any) -> None:
        c = self.conns.get(handler)
        if c is not None and not c.busy and not c.served:
            c.timer = None
            self._close(handler)
            self._reject("header_timeout")

    def _lost(self, handler: Any) -> None:
        c = self.conns.pop(handler, None)
        if c is not None and c.timer is not None:
            c.timer.cancel()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        c = self.conns.get(request.protocol)
        if c is None:
            return await handler(request)
        if c.over_cap:  # a request head arrived: an idle connection may have become old enough to go for it
            c.over_cap = len(self.conns) > self.max_connections and not self._evict(asyncio.get_running_loop().time())
        if c.over_cap:
            self._reject("over_cap")
            if (request.content_length or 0) <= _DRAIN_BYTES:  # read a small body first: closing on unread
                try:  # bytes resets the connection, and the client might miss the answer
                    await asyncio.wait_for(request.read(), 1.0)
                except (asyncio.TimeoutError, OSError, web.HTTPException):
                    pass
            return overloaded(self.retry_after_s, f"the gateway's {self.name} listener is at its connection cap")
        c.busy += 1
        if c.timer is not None:
            c.timer.cancel()
            c.timer = None
        try:
            return await handler(request)
        finally:
            c.busy -= 1
            c.served += 1


def host_refusal(request: web.Request, bind_host: str) -> str | None:
    """:func:`~btbctl.engine.netaddr.browser_refusal` of ``request`` to a listener bound to ``bind_host``."""
    return browser_refusal(request.headers.get("Host"), request.headers.get("Origin"), request.method, bind_host)


def host_guard(
    listener: str,
    bind_host: str,
    limiter: RateLimiter,
    on_refuse: Callable[[str], None] | None = None,
) -> Any:
    """A middleware answering 403 to the requests :func:`host_refusal` refuses; each is counted (``on_refuse``
    with the reason) and logged as ``request_refused`` at most once per listener, reason and interval."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        why = host_refusal(request, bind_host)
        if why is None:
            return await handler(request)
        if on_refuse is not None:
            on_refuse(why)
        ok, held = limiter.allow(f"{listener}:{why}")
        if ok:
            log_event(
                log,
                "request_refused",
                logging.WARNING,
                listener=listener,
                reason=why,
                peer=request.remote,
                host=request.headers.get("Host"),
                origin=request.headers.get("Origin"),
                repeats_held=held or None,
            )
        message = (
            "Host is not this listener's address (only loopback names are served here)"
            if why == "host"
            else "cross-origin write refused (its Origin is another site)"
        )
        import json

        body = {"error": {"message": message, "type": "forbidden", "code": 403}}
        return web.Response(status=403, text=json.dumps(body), content_type="application/json")

    return middleware


def overloaded(retry_after_s: int, message: str) -> web.Response:
    """A 503 ``{"error": ...}`` answer with ``Retry-After`` that closes the connection."""
    import json

    body = {"error": {"message": message, "type": "overloaded", "code": 503}}
    return web.Response(
        status=503,
        text=json.dumps(body),
        content_type="application/json",
        headers={"Retry-After": str(retry_after_s), "Connection": "close"},
    )


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
