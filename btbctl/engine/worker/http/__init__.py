"""The emulated worker's HTTP API (aiohttp): SGLang 0.5's routes plus the ``/btb/*`` replication routes.

Shapes follow SGLang 0.5 (REFERENCE.md s5) and OpenAI; errors are JSON
``{"error": {"message", "type", "param": null, "code"}}`` (the gateway's shape,
:func:`btbctl.engine.errors.api_error_body`) with a 4xx status for bad input (413 above
:data:`~.errors.MAX_BODY_BYTES`, 400 for malformed JSON or fields, 404 unknown route, 405 wrong method, 401/403
token) and 500 without a traceback for bugs. See :mod:`btbctl.engine.worker` for the route list.

Times in responses and metrics are wall-clock seconds as a client sees them; with ``time_scale`` s, model seconds
are wall seconds x s (``/server_info`` reports ``time_scale``).

Modules, one concern each (imports point down this list, never up); :func:`build_app` here wires them:

* :mod:`.serving`: ``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``;
* :mod:`.btb`: the ``/btb/*`` routes (match, prefixes, info, push, expect, copies);
* :mod:`.ops`: health, info, version, models, loads, metrics, cache flush;
* :mod:`.base`: what the route groups share (the worker, the token check, readiness);
* :mod:`.stream`: server-sent events, token pacing, merging the choices' streams;
* :mod:`.output`: the synthetic output text and logprobs;
* :mod:`.parse`: request bodies and fields, checked;
* :mod:`.errors`: :class:`~.errors.ApiError`, the JSON error body, the error middleware.
"""

from __future__ import annotations

from aiohttp import web

from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.http.btb import BtbRoutes
from btbctl.engine.worker.http.errors import MAX_BODY_BYTES, errors_middleware
from btbctl.engine.worker.http.ops import OpsRoutes
from btbctl.engine.worker.http.serving import ServingRoutes

#: Where the application keeps its :class:`Worker`.
WORKER_KEY = web.AppKey("worker", Worker)


def build_app(worker: Worker) -> web.Application:
    """The aiohttp application of ``worker`` (routes listed in :mod:`btbctl.engine.worker`)."""
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)
    ops, serving, btb = OpsRoutes(worker), ServingRoutes(worker), BtbRoutes(worker)
    r = app.router
    r.add_get("/health", ops.health)
    r.add_get("/health_generate", ops.health_generate)
    for p in ("/server_info", "/get_server_info"):
        r.add_get(p, ops.server_info)
    for p in ("/model_info", "/get_model_info"):
        r.add_get(p, ops.model_info)
    r.add_get("/version", ops.version)
    r.add_get("/v1/models", ops.models)
    r.add_get("/v1/loads", ops.loads)
    r.add_get("/metrics", ops.metrics)
    r.add_route("GET", "/flush_cache", ops.flush_cache)
    r.add_route("POST", "/flush_cache", ops.flush_cache)
    r.add_post("/generate", serving.generate)
    r.add_post("/v1/completions", serving.completions)
    r.add_post("/v1/chat/completions", serving.chat)
    for p in ("/tokenize", "/v1/tokenize"):
        r.add_post(p, serving.tokenize)
    r.add_post("/btb/match", btb.btb_match)
    r.add_get("/btb/prefixes", btb.btb_prefixes)
    r.add_get("/btb/info", btb.btb_info)
    r.add_post("/btb/push", btb.btb_push)
    r.add_post("/btb/expect", btb.btb_expect)
    r.add_get("/btb/copies", btb.btb_copies)
    r.add_get("/btb/copies/{copy_id}", btb.btb_copy)
    app[WORKER_KEY] = worker
    return app


__all__ = ["WORKER_KEY", "build_app"]
