"""The agent's control API (HTTP/JSON, bound to loopback by default): what the gateway's ``l3`` executor and
operators call.

All routes but ``GET /health`` and ``GET /metrics`` need ``Authorization: Bearer <control token>``; on an address
beyond loopback (an agent the gateway reaches from another machine) ``/metrics`` needs it too, and the agent
refuses to start there without a token. Keys are SGLang
page keys (:func:`btbctl.sglang_l3.keys.page_keys`); ``namespaces`` (optional) restricts to some namespace ids,
by default every namespace this node knows (each TP rank of a worker registers its own).

* ``POST /v1/has {"keys", "namespaces"?}`` -> ``{"keys": n, "namespaces": {ns: leading run}, "complete": [ns]}``
* ``POST /v1/provenance {"keys", "namespaces"?}`` -> ``{"keys": n, "namespaces": {ns: [provenance or null per
  key]}}``: where each page held here came from (``write:pid=<pid>``: this node's worker process wrote it through,
  ``write`` in file mode; ``copy:<id>``: the verified peer copy ``id`` brought it). The gateway counts a warm-up only
  on pages of copies it ordered or of the node's own write-through.
* ``POST /v1/expect {"copy_id", "keys"?, "ttl_s"?}`` -> ``{"copy_id", "token"}``: this agent accepts one inbound
  copy with that id (and only of those keys) from a peer presenting the token.
* ``POST /v1/push {"copy_id", "keys", "namespaces"?, "targets": [{"addr", "token"}], "fanout": "chain"|"tree"|"star",
  "stream_s"?}`` -> 202 and the source record: pushes the pages of every selected namespace that holds all the keys
  (by default every complete one) to the targets' peer ports, arranged by ``fanout``. With ``stream_s`` (seconds)
  the pages need not be here yet: the copy trails the node's worker, each page sent as soon as its write-through
  lands (``namespaces`` then names the namespaces to send; their ``page_bytes`` give the sizes), and it fails when
  they are not all here within ``stream_s``.
* ``GET /v1/copies/{copy_id}?since=V&wait_s=S`` -> ``{"records": [record]}`` (roles ``source`` and/or ``target``;
  ``state`` is a :class:`~btbctl.engine.copies.CopyState` value; ``pages_ready``: pages the source holds so far;
  ``version``: bumped at each milestone); with ``since``, the answer waits up to ``wait_s`` (at most
  :data:`MAX_WAIT_S`) for a record's version to pass ``V``; 404 when unknown.
* ``POST /v1/wait {"keys", "namespaces"?, "wait_s"}`` -> ``/v1/has``'s answer once some namespace holds every key or
  ``wait_s`` (at most :data:`MAX_WAIT_S`) passed: a worker's write-through awaited without polling.
* ``POST /v1/copies/{copy_id}/cancel`` -> ``{"cancelled": bool}``.
* ``POST /v1/pin {"keys", "namespaces"?, "ttl_s"}`` / ``POST /v1/unpin {"keys", "namespaces"?}``: hold a hot
  prefix's pages against eviction.
* ``GET /v1/info``: agent id, its ``instance`` (new at every start), peer address, arena use, namespaces.

Errors: ``{"error": one line}`` with 400 (bad input), 401/403 (token), 404, 409 (pages not held), 507 (no room).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from btbctl.engine.agent.pages import NoRoom
from btbctl.engine.agent.peer import FANOUTS, MAX_STREAM_S, fanout_plan
from btbctl.engine.netaddr import browser_refusal
from btbctl.engine.replication.auth import bearer_ok
from btbctl.sglang_l3.keys import is_page_key

#: Largest control request body, bytes.
MAX_BODY_BYTES = 32 << 20
#: Most keys in one control request (a 4M-token prefix at page size 64).
MAX_KEYS = 1 << 16
#: Longest a long-poll (``/v1/copies/{id}?since=``, ``/v1/wait``) is held, seconds.
MAX_WAIT_S = 30.0
#: Long-polls held at once (each holds a thread); beyond, a long-poll is answered at once.
MAX_WAITERS = 64


class _Err(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        super().__init__(message)


def make_app(agent, open_metrics: bool = True, bind_host: str = "127.0.0.1") -> web.Application:
    """The aiohttp application serving ``agent`` (:class:`~btbctl.engine.agent.agent.Agent`); ``open_metrics``:
    ``/metrics`` without the token (loopback only); ``bind_host``: the listener's address (on loopback, a request
    whose ``Host`` is not a loopback name is refused, and on any address a cross-site write:
    :func:`~btbctl.engine.netaddr.browser_refusal`)."""
    open_paths = ("/health", "/metrics") if open_metrics else ("/health",)

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            why = browser_refusal(request.headers.get("Host"), request.headers.get("Origin"), request.method, bind_host)
            if why is not None:
                agent.event("request_refused", {"listener": "control", "peer": request.remote, "reason": why})
                raise _Err(403, f"refused: {'Host is not a loopback name' if why == 'host' else 'cross-origin write'}")
            if request.path not in open_paths:
                try:
                    _auth(request, agent.control_token)
                except _Err as e:
                    agent.event(
                        "auth_failed",
                        {"listener": "control", "peer": request.remote, "path": request.path, "reason": str(e)},
                    )
                    raise
            return await handler(request)
        except _Err as e:
            return web.json_response({"error": str(e)}, status=e.status)

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    h = _Handlers(agent)
    app.router.add_get("/health", h.health)
    app.router.add_get("/metrics", h.metrics)
    app.router.add_get("/v1/info", h.info)
    app.router.add_post("/v1/has", h.has)
    app.router.add_post("/v1/wait", h.wait)
    app.router.add_post("/v1/provenance", h.provenance)
    app.router.add_post("/v1/expect", h.expect)
    app.router.add_post("/v1/push", h.push)
    app.router.add_get("/v1/copies/{copy_id}", h.copy)
    app.router.add_post("/v1/copies/{copy_id}/cancel", h.cancel)
    app.router.add_post("/v1/pin", h.pin)
    app.router.add_post("/v1/unpin", h.unpin)

    async def stop_waits(app: web.Application) -> None:
        h.pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(stop_waits)
    return app


def _auth(request: web.Request, token: str | None) -> None:
    if token is None:
        return
    h = request.headers.get("Authorization", "")
    if not h.startswith("Bearer "):
        raise _Err(401, "this route needs 'Authorization: Bearer <control token>'")
    if not bearer_ok(h, token):
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


def _seconds(v: object, name: str, limit: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= limit:
        raise _Err(400, f"{name} must be a number of seconds in [0, {limit:g}]")
    return float(v)


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
        self.pool = ThreadPoolExecutor(MAX_WAITERS, thread_name_prefix="btbctl-agent-wait")
        self.waiters = 0

    async def _held(self, fn, *args):
        """Run the blocking wait ``fn(*args, timeout_s)`` in the long-poll pool; with :data:`MAX_WAITERS` waits held
        already, ``fn`` runs with no wait."""
        if self.waiters >= MAX_WAITERS:
            return fn(*args[:-1], 0.0)
        self.waiters += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            self.waiters -= 1

    async def health(self, request: web.Request) -> web.Response:
        """``ok``, or 503 naming the endpoint that does not accept connections (the copy port)."""
        peers = self.a.peers
        down = peers.port_down() if peers is not None else "not started"
        if down is not None:
            return web.Response(status=503, text=f"unhealthy: copy port {peers.port if peers else 0} down: {down}\n")
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.a.metrics.exposition(), content_type="text/plain", charset="utf-8")

    async def info(self, request: web.Request) -> web.Response:
        return web.json_response(self.a.info())

    async def has(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        return web.json_response(self.a.has(keys, _namespaces(body, self.a.known_namespaces())))

    async def provenance(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        return web.json_response(self.a.provenance(keys, _namespaces(body, self.a.known_namespaces())))

    async def wait(self, request: web.Request) -> web.Response:
        body = await _body(request)
        keys = _keys(body)
        wait_s = _seconds(body.get("wait_s", 0.0), "wait_s", MAX_WAIT_S)
        a = self.a

        def until_complete(timeout_s: float) -> dict:
            end = time.monotonic() + timeout_s
            while True:
                have = a.has(keys, _namespaces(body, a.known_namespaces()))
                left = end - time.monotonic()
                if have["complete"] or left <= 0 or not a.store.wait_landed(min(left, 0.05)):
                    return have

        return web.json_response(await self._held(until_complete, wait_s))

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
        stream_s = body.get("stream_s")
        if stream_s is not None:
            stream_s = _seconds(stream_s, "stream_s", MAX_STREAM_S)
            nss = _namespaces(body, known) if body.get("namespaces") is not None else known
            page_bytes = []
            for ns in nss:
                desc = self.a.store.namespaces.get(ns)
                size = desc.get("page_bytes") if isinstance(desc, dict) else None
                if not isinstance(size, int) or size < 1:
                    raise _Err(409, f"namespace {ns} is not registered here (no worker of this node uses it yet)")
                page_bytes.append(size)
            if not nss:
                raise _Err(409, "no namespace is registered here: no worker of this node has connected")
            sizes = [size for _ in keys for size in page_bytes]
        else:
            have = self.a.has(keys, _namespaces(body, known))
            nss = have["complete"] if body.get("namespaces") is None else _namespaces(body, known)
            missing = [ns for ns in nss if have["namespaces"].get(ns, 0) < len(keys)]
            if not nss or missing:
                raise _Err(
                    409,
                    f"this node does not hold all {len(keys)} pages"
                    + (f" in namespace {missing[0]}" if missing else " in any namespace"),
                )
            sizes = None
        # key-major: a page's TP ranks go together, as the ranks write it through together
        names = [self.a.store.name_of(ns, k) for k in keys for ns in nss]
        try:
            rec = self.a.peers.push(
                body.get("copy_id"), names, fanout_plan(targets, fanout), stream_s=stream_s or None, sizes=sizes
            )
        except ValueError as e:
            raise _Err(400, str(e)) from None
        except NoRoom as e:
            raise _Err(409, str(e)) from None
        return web.json_response(rec.as_dict(), status=202)

    async def copy(self, request: web.Request) -> web.Response:
        copy_id = request.match_info["copy_id"]
        since = request.query.get("since")
        if since is not None:
            try:
                v = int(since)
            except ValueError:
                raise _Err(400, "since must be an integer version") from None
            try:
                wait_s = min(float(request.query.get("wait_s", "5")), MAX_WAIT_S)
            except ValueError:
                raise _Err(400, "wait_s must be a number of seconds") from None
            recs = await self._held(self.a.peers.wait_change, copy_id, v, max(0.0, wait_s))
        else:
            recs = self.a.peers.book.find(copy_id)
        if not recs:
            raise _Err(404, f"no copy {copy_id!r} here")
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


__all__ = ["MAX_BODY_BYTES", "MAX_KEYS", "MAX_WAIT_S", "make_app"]
