"""Error answers of the worker's HTTP API: :class:`ApiError`, the JSON error body and the middleware that turns
every failure into one (4xx for bad input and unknown routes, 500 without a traceback for bugs)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from btbctl.engine.errors import api_error_body
from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES

#: The worker's logger (request lines, refusals, internal errors).
log = logging.getLogger("btbctl.worker")

#: Largest request body accepted, bytes (the gateway's default limit too: :mod:`btbctl.engine.limits`).
MAX_BODY_BYTES = MAX_REQUEST_BODY_BYTES


class ApiError(Exception):
    """An error answer: HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        self.status = status
        self.message = message
        self.headers = headers
        super().__init__(message)


def error_response(status: int, message: str, headers: dict | None = None) -> web.Response:
    """``{"error": {...}}`` (:func:`btbctl.engine.errors.api_error_body`) with HTTP ``status``."""
    return web.json_response(api_error_body(status, message), status=status, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Answer :class:`ApiError` and aiohttp's 4xx with the JSON error body; log anything else, answer 500."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message, e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body larger than {MAX_BODY_BYTES} bytes",
        }.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, msg, headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal error (see the worker's log)")


__all__ = ["ApiError", "MAX_BODY_BYTES", "error_response", "errors_middleware", "log"]
