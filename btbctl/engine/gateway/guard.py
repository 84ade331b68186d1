"""The gateway's descriptor budget; its connection guards are :mod:`btbctl.engine.netguard`'s (re-exported here).

Of the descriptor limit ``fd_reserve`` descriptors are kept for everything else (listeners, health probes, copies,
the control API, log files); the rest is split by :func:`fd_budget`: each proxied request holds two sockets (the
client's and the upstream one), so by default a third of the budget goes to requests in flight and two thirds to
client connections (every request in flight has its client connection, and as many more connections can be read
and answered 503 or wait idle between keep-alive requests).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from btbctl.engine.logfmt import log_event
from btbctl.engine.netaddr import browser_refusal
from btbctl.engine.netguard import (
    ConnectionGuard,
    RateLimiter,
    install_accept_error_limiter,
    is_local_exhaustion,
    listen_http,
    nofile_target,
    overload_parts,
    overloaded,
    raise_nofile,
)

log = logging.getLogger(__name__)


def fd_budget(nofile: int, reserve: int) -> tuple[int, int]:
    """``(max requests in flight, max client connections)`` for a descriptor limit ``nofile`` keeping ``reserve``
    for everything else (see the module docstring); each at least 1."""
    budget = max(3, nofile - reserve)
    inflight = max(1, budget // 3)
    return inflight, max(1, budget - inflight)


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
        body = {"error": {"message": message, "type": "forbidden", "code": 403}}
        return web.Response(status=403, text=json.dumps(body), content_type="application/json")

    return middleware


__all__ = [
    "ConnectionGuard",
    "RateLimiter",
    "fd_budget",
    "install_accept_error_limiter",
    "is_local_exhaustion",
    "listen_http",
    "nofile_target",
    "overload_parts",
    "overloaded",
    "raise_nofile",
]
