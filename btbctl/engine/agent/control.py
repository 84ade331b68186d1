"""The agent's control API (HTTP/JSON, bound to loopback by default): what the gateway's ``l3`` executor and
operators call.

All routes but ``GET /health`` and ``GET /metrics`` need ``Authorization: Bearer <control token>``; on an address
beyond loopback (an agent the gateway reaches from another machine) ``/metrics`` needs it too, and the agent
refuses to start there without a token. Keys are SGLang
page keys (:func:`btbctl.sglang_l3.keys.page_keys`); ``namespaces`` (optional) restricts to some namespace ids,
by default every namespace this node knows (each TP rank of a worker registers its own).

* ``POST /v1/has {"keys", "namespaces"?}`` -> ``{"keys": n, "namespaces": {ns: leading run}, "complete": [ns]}``
* ``POST /v1/expect {"copy_id", "keys"?, "ttl_s"?}`` -> ``{"copy_id", "token"}``: this agent accepts one inbound
  copy with that id (and only of those keys) from a peer presenting the token.
* ``POST /v1/push {"copy_id", "keys", "namespaces"?, "targets": [{"addr", "token"}], "fanout": "chain"|"tree"|"star"}``
  -> 202 and the source record: pushes the pages of every selected namespace that holds all the keys (by default
  every complete one) to the targets' peer ports, arranged by ``fanout``.
* ``GET /v1/copies/{copy_id}`` -> ``{"records": [record]}`` (roles ``source`` and/or ``target``; ``state`` is a
  :class:`~btbctl.engine.copies.CopyState` value); 404 when unknown.
* ``POST /v1/copies/{copy_id}/cancel`` -> ``{"cancelled": bool}``.
* ``POST /v1/pin {"keys", "namespaces"?, "ttl_s"}`` / ``POST /v1/unpin {"keys", "namespaces"?}``: hold a hot
  prefix's pages against eviction.
* ``GET /v1/info``: agent id, peer address, arena use, namespaces.

Errors: ``{"error": one line}`` with 400 (bad input), 401/403 (token), 404, 409 (pages not held), 507 (no room).
"""

from __future__ import annotations

import hmac
import json

from aiohttp import web

from btbctl.engine.agent.pages import NoRoom
from btbctl.engine.agent.peer import FANOUTS, fanout_plan
from btbctl.sglang_l3.keys import is_page_key

#: Largest control request body, bytes.
MAX_BODY_BYTES = 32 << 20
#: Most keys in one control request (a 4M-token prefix at page size 64).
MAX_KEYS = 1 << 16


class _Err(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def make_app(agent, open_metrics: bool = True) -> web.Application:
    """The aiohttp application serving ``agent`` (:class:`~btbctl.engine.agent.agent.Agent`); ``open_metrics``:
    ``/metrics`` without the token (loopback only)."""
    open_paths = ("/health", "/metrics") if open_metrics else ("/health",)

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            if request.path not in open_paths:
                _auth(request, agent.control_token)
            return await handler(request)
        except _Err as e:
            return web.json_response({"error": str(e)}, status=e.status)

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    h = _Handlers(agent)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/v1/info", h.info)
    app.router.add_post("/v1/has", h.has)
    app.router.add_post("/v1/expect", h.expect)
    app.router.add_post("/v1/push", h.push)
    app.router.add_get("/v1/copies/{copy_id}", h.copy)
    app.router.add_post("/v1/copies/{copy_id}/cancel", h.cancel)
    app.router.add_post("/v1/pin", h.pin)
    app.router.add_post("/v1/unpin", h.unpin)
    return app


def _auth(request: web.Request, token: str | None) -> None:
    if token is None:
        return
    h = request.headers.get("Authorization", "")
    if not h.startswith("Bearer "):
        raise _Err(401, "this route needs 'Authorization: Bearer <control token>'")
    if not hmac.compare_digest(h[7:].strip().encode(), token.encode()):
        raise _Err(403, "invalid control token")


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read() or b"null")
    except ValueError:
        raise _Err(400, "malformed JSON body") from None
    if not isinstance(body, dict):
        raise _Err(400, "body must be a JSON object")
    return body


def _keys(body: dict) -> list[str]:
    keys = body.get("keys")
    if not isinstance(keys, list) or not 1 <= len(keys) <= MAX_KEYS or not all(is_page_key(k) for k in keys):
        raise _Err(400, f"keys must be a list of 1..{MAX_KEYS} page keys (64 lowercase hex characters)")
    return keys


def _namespaces(body: dict, known: list[str]) -> list[str]:
    nss = body.get("namespaces")
    if nss is None:
        return known
    if not isinstance(nss, list) or not all(isinstance(n, str) for n in nss):
        raise _Err(400, "namespaces must be a list of namespace ids")
    return nss


class _Handlers:
    def __init__(self, agent) -> None:
        self.a = agent

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.a.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(self.a.info())

    async def has(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        return web.json_response(self.a.has(keys, _namespaces(body, self.a.known_namespaces())))

    async def expect(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body) if body.get("keys") is not None else None
        ttl = body.get("ttl_s", 300.0)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 86400:
            raise _Err(400, "ttl_s must be a number of seconds in (0, 86400]")
        try:
            token = self.a.peers.expect(body.get("copy_id"), keys, float(ttl))
        except ValueError as e:
            raise _Err(400 if "already" not in str(e) else 409, str(e)) from None
        return web.json_response({"copy_id": body["copy_id"], "token": token})

    async def push(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        fanout = body.get("fanout", "chain")
        if fanout not in FANOUTS:
            raise _Err(400, f"fanout must be one of {', '.join(FANOUTS)}")
        targets = body.get("targets")
        if (
            not isinstance(targets, list)
            or not targets
            or not all(
                isinstance(t, dict) and isinstance(t.get("addr"), str) and isinstance(t.get("token"), str)
                for t in targets
            )
        ):
            raise _Err(400, "targets must be a non-empty list of {addr, token}")
        known = self.a.known_namespaces()
        have = self.a.has(keys, _namespaces(body, known))
        nss = have["complete"] if body.get("namespaces") is None else _namespaces(body, known)
        missing = [ns for ns in nss if have["namespaces"].get(ns, 0) < len(keys)]
        if not nss or missing:
            raise _Err(
                409,
                f"this node does not hold all {len(keys)} pages"
                + (f" in namespace {missing[0]}" if missing else " in any namespace"),
            )
        names = [self.a.store.name_of(ns, k) for ns in nss for k in keys]
        try:
            rec = self.a.peers.push(body.get("copy_id"), names, fanout_plan(targets, fanout))
        except ValueError as e:
            raise _Err(400, str(e)) from None
        except NoRoom as e:
            raise _Err(409, str(e)) from None
        return web.json_response(rec.as_dict(), status=202)

    async def copy(self, request: web.Request) -> web.Response:
        recs = self.a.peers.book.find(request.match_info["copy_id"])
        if not recs:
            raise _Err(404, f"no copy {request.match_info['copy_id']!r} here")
        return web.json_response({"records": [r.as_dict() for r in recs]})

    async def cancel(self, request: web.Request) -> web.Response:
        return web.json_response({"cancelled": self.a.peers.cancel(request.match_info["copy_id"])})

    async def pin(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        ttl = body.get("ttl_s")
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 86400:
            raise _Err(400, "ttl_s must be a number of seconds in (0, 86400]")
        nss = _namespaces(body, self.a.known_namespaces())
        ready = self.a.store.pin_for([self.a.store.name_of(ns, k) for ns in nss for k in keys], float(ttl))
        return web.json_response({"pinned": len(keys) * len(nss), "ready": ready})

    async def unpin(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        nss = _namespaces(body, self.a.known_namespaces())
        self.a.store.unpin([self.a.store.name_of(ns, k) for ns in nss for k in keys])
        return web.json_response({"unpinned": len(keys) * len(nss)})


__all__ = ["MAX_BODY_BYTES", "MAX_KEYS", "make_app"]
