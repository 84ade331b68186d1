"""What every route group of the worker's HTTP API shares: the worker and its parts, the bearer-token check of
the routes that change state, and readiness."""

from __future__ import annotations

import logging

from aiohttp import web

from btbctl.engine.logfmt import log_event
from btbctl.engine.replication.auth import bearer_ok
from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.http.errors import ApiError, log


class Routes:
    """A group of route handlers (``async def handler(request) -> web.StreamResponse`` methods) on ``worker``."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.model = worker.model
        self.cfg = worker.cfg

    def auth(self, request: web.Request) -> None:
        """Pass a request that carries the worker's bearer token (any request when the worker has none).

        Raises:
            ApiError: 401 without an ``Authorization: Bearer`` header, 403 with a wrong token (each counted and
                logged as ``auth_failed``).
        """
        tok = self.cfg.btb_token
        if tok is None:
            return
        h = request.headers.get("Authorization", "")
        if not h.startswith("Bearer "):
            self._refused(request, "no_token")
            raise ApiError(
                401,
                "this route needs 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": 'Bearer realm="btbctl-worker"'},
            )
        if not bearer_ok(h, tok):
            self._refused(request, "wrong_token")
            raise ApiError(403, "invalid bearer token")

    def _refused(self, request: web.Request, reason: str) -> None:
        """Count a request refused for its token (``btbctl_worker_auth_failures_total{reason}``) and log it at
        most once per reason and interval."""
        self.w.metrics.auth_failures.labels(reason).inc()
        ok, held = self.w.refusal_limiter.allow(reason)
        if ok:
            log_event(
                log,
                "auth_failed",
                logging.WARNING,
                peer=request.remote,
                path=request.path,
                reason=reason,
                repeats_held=held or None,
            )

    def is_ready(self) -> bool:
        """Whether the worker serves: started, not stopping, its model driver alive."""
        return self.w.ready and self.model.alive


__all__ = ["Routes"]
