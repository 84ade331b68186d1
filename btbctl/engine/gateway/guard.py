"""The gateway's descriptor budget; its connection guards are :mod:`btbctl.engine.netguard`'s (re-exported here).

Of the descriptor limit ``fd_reserve`` descriptors are kept for everything else (listeners, health probes, copies,
the control API, log files); the rest is split by :func:`fd_budget`: each proxied request holds two sockets (the
client's and the upstream one), so by default a third of the budget goes to requests in flight and two thirds to
client connections (every request in flight has its client connection, and as many more connections can be read
and answered 503 or wait idle between keep-alive requests).
"""

from __future__ import annotations

from btbctl.engine.netguard import (
    ConnectionGuard,
    RateLimiter,
    install_accept_error_limiter,
    is_local_exhaustion,
    listen_http,
    nofile_target,
    overloaded,
    raise_nofile,
)


def fd_budget(nofile: int, reserve: int) -> tuple[int, int]:
    """``(max requests in flight, max client connections)`` for a descriptor limit ``nofile`` keeping ``reserve``
    for everything else (see the module docstring); each at least 1."""
    budget = max(3, nofile - reserve)
    inflight = max(1, budget // 3)
    return inflight, max(1, budget - inflight)


__all__ = [
    "ConnectionGuard",
    "RateLimiter",
    "fd_budget",
    "install_accept_error_limiter",
    "is_local_exhaustion",
    "listen_http",
    "nofile_target",
    "overloaded",
    "raise_nofile",
]
