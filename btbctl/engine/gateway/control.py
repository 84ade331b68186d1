"""The control API: what the dashboard and the CLI read and steer (a listener apart from the data plane).

Bound to 127.0.0.1 by default. Writes (``PUT``/``POST``) need ``Authorization: Bearer <token>`` (the token ``up``
writes to a 0600 file; compared in constant time); without it: 401. Reads are open while the listener is on a
loopback address and need the token too otherwise. Every answer is JSON; errors are ``{"error": {"message",
...}}`` with a 4xx status. Times (``*_s``) are gateway seconds since start unless named otherwise.

========================================== ===========================================================================
route                                      answer
========================================== ===========================================================================
``GET /control/fleet``                     :func:`~btbctl.engine.gateway.server.fleet_report`
``GET /control/prefixes?top=10``           :func:`~btbctl.engine.gateway.server.prefixes_report` (top 1..1000)
``GET /control/transfers?limit=100``       :func:`~btbctl.engine.gateway.server.transfers_report`
``GET /control/ttft?window_s=60&step_s=1`` ``{"now_s", "window_s", "step_s", "series": [{"t_s", "n", "p50_s",
                                           "p95_s", "rps"}], "summary": {"n", "mean_s", "p50_s", "p95_s", "p99_s",
                                           "max_s"}}`` (at most 10,000 buckets)
``GET /control/constants``                 ``{"policy", "policies", "constants": {"prefix_blocks", "threshold",
                                           "window_s", "warm_replicas"}, "page_size", "prefix_tokens"}``
``PUT /control/constants``                 body: any of the four constants and/or ``"policy"``; all validated before
                                           any is applied; 400 ``{"error": {"key", "message", "valid"}}``; answers
                                           what the engine now holds (as GET)
``POST /control/replicate``                body ``{"prefix": <id or unambiguous leading hex, >= 8 digits>,
                                           "n": 1}``; 202 ``{"prefix", "source", "targets", "copy_ids", "copies",
                                           "skipped"}``; 404 unknown prefix, 400 ambiguous, 409 no holder/target
``GET /control/replications/{prefix}``     ``{"prefix", "prefix_blocks", "holders": [URL], "copies": [transfer
                                           rows]}``
``GET /control/events``                    Server-Sent Events: ``event: fleet|prefixes|transfers|ttft|constants``,
                                           ``data:`` the JSON snapshot (the ``ttft`` one is
                                           :func:`~btbctl.engine.gateway.server.ttft_event`); at most 10 per second
                                           per type; a ``: keepalive`` comment every 15 s
========================================== ===========================================================================
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING

from aiohttp import web

from btbctl.engine.constants import WARM_REPLICAS_ALIAS, BtbConstants
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.app import parse_json_object
from btbctl.engine.gateway.planner import ReplicateError
from btbctl.engine.chains import check_prefix_id
from btbctl.engine.policies import POLICIES

if TYPE_CHECKING:  # pragma: no cover
    from btbctl.engine.gateway.server import Gateway

#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE_S = 15.0
#: Largest body a control write accepts, bytes.
MAX_CONTROL_BODY = 64 * 1024


def _err(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": {"message": message, **extra}}, status=status)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback address (``localhost``, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class ControlApi:
    """Handlers of the control API bound to a gateway."""

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        self.open_reads = is_loopback(gw.config.control_host)

    # -- plumbing -----------------------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        write = request.method not in ("GET", "HEAD", "OPTIONS")
        if (write or not self.open_reads) and not self.gw.check_token(request.headers.get("Authorization")):
            return web.json_response({"error": {"message": "missing or wrong bearer token (Authorization: Bearer "
                                                           "<token>)"}}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _err(e.status, e.text if e.status == 413 else f"{e.reason}: {request.method} {request.path}")

    async def _json_body(self, request: web.Request) -> dict | web.Response:
        body = await request.read()
        try:
            return parse_json_object(body) if body else {}
        except ValueError as e:  # the message is for the client
            return _err(400, str(e))

    @staticmethod
    def _num_query(request: web.Request, name: str, default: float, lo: float, hi: float,
                   integer: bool = False) -> float | web.Response:
        raw = request.query.get(name)
        if raw is None:
            return default
        try:
            v = int(raw) if integer else float(raw)
        except ValueError:
            v = None
        if v is None or not lo <= v <= hi:
            kind = "an integer" if integer else "a number"
            return _err(400, f"{name}: must be {kind} in [{lo:g}, {hi:g}], got {raw!r}", key=name)
        return v

    def resolve_prefix(self, text: object) -> tuple[str, tuple] | web.Response:
        """A prefix id or an unambiguous leading part of one (>= 8 hex digits) -> ``(id, chain)``; else an
        error answer (400 bad or ambiguous, 404 unknown)."""
        try:
            s = check_prefix_id(text)
        except ValueError as e:
            return _err(400, f"prefix: {e}", key="prefix")
        chains = self.gw.state.chains
        if s in chains.parent:
            key = s
        else:
            cands = chains.find(s)
            if not cands:
                return _err(404, f"unknown prefix {s!r}: the gateway knows the prefixes of the requests it routed",
                            key="prefix")
            if len(cands) > 1:
                return _err(400, f"prefix {s!r} is ambiguous", key="prefix", candidates=cands)
            key = cands[0]
        chain = chains.chain_of(key) or self.gw.detector.prefix_of(key)
        if chain is None:
            return _err(404, f"prefix {key} is no longer tracked", key="prefix")
        return key, tuple(chain)

    # -- reads --------------------------------------------------------------------------------------------------

    async def fleet(self, request: web.Request) -> web.Response:
        from btbctl.engine.gateway.server import fleet_report

        return web.json_response(fleet_report(self.gw))

    async def prefixes(self, request: web.Request) -> web.Response:
        from btbctl.engine.gateway.server import prefixes_report

        top = self._num_query(request, "top", 10, 1, 1000, integer=True)
        if isinstance(top, web.Response):
            return top
        return web.json_response(prefixes_report(self.gw, int(top)))

    async def transfers(self, request: web.Request) -> web.Response:
        from btbctl.engine.gateway.server import transfers_report

        limit = self._num_query(request, "limit", 100, 1, 10000, integer=True)
        if isinstance(limit, web.Response):
            return limit
        return web.json_response(transfers_report(self.gw, int(limit)))

    async def ttft(self, request: web.Request) -> web.Response:
        window = self._num_query(request, "window_s", 60.0, 0.001, 86400.0)
        if isinstance(window, web.Response):
            return window
        step = self._num_query(request, "step_s", 1.0, 0.001, 86400.0)
        if isinstance(step, web.Response):
            return step
        if window / step > 10000:
            return _err(400, "window_s / step_s must be at most 10000 buckets", key="step_s")
        now = self.gw.clock()
        series = self.gw.state.ttft
        return web.json_response({"now_s": now, "window_s": window, "step_s": step,
                                  "series": series.series(now, window, step),
                                  "summary": series.summary(now, window)})

    async def get_constants(self, request: web.Request) -> web.Response:
        return web.json_response(self.gw.constants_report())

    async def replications(self, request: web.Request) -> web.Response:
        from btbctl.engine.gateway.server import transfer_row

        r = self.resolve_prefix(request.match_info["prefix"])
        if isinstance(r, web.Response):
            return r
        key, chain = r
        gw = self.gw
        now = gw.clock()
        ws = gw.state.workers
        return web.json_response({
            "prefix": key, "prefix_blocks": len(chain),
            "holders": [w.url for w in ws if w.held_blocks(chain) >= len(chain)],
            "copies": [transfer_row(gw, t, now) for t in gw.state.transfers.for_key(key)],
        })

    # -- writes -------------------------------------------------------------------------------------------------

    async def put_constants(self, request: web.Request) -> web.Response:
        obj = await self._json_body(request)
        if isinstance(obj, web.Response):
            return obj
        valid = [*BtbConstants.keys(), "policy"]
        for k in obj:
            if k not in valid and k != WARM_REPLICAS_ALIAS:
                return _err(400, f"{k}: unknown key", key=k, valid=valid)
        policy = obj.get("policy")
        if "policy" in obj and policy not in POLICIES:
            return _err(400, f"policy: unknown policy {policy!r}", key="policy", valid=list(POLICIES))
        updates = {k: v for k, v in obj.items() if k != "policy"}
        gw = self.gw
        try:
            gw.constants.with_updates(**updates)  # validate everything before applying anything
        except ConfigError as e:
            return _err(400, str(e), key=e.key, valid=BtbConstants.describe(e.key))
        if updates:
            gw.set_constants(updates)
        if policy is not None:
            gw.set_policy(policy)
        return web.json_response(gw.constants_report())

    async def replicate(self, request: web.Request) -> web.Response:
        obj = await self._json_body(request)
        if isinstance(obj, web.Response):
            return obj
        if "prefix" not in obj:
            return _err(400, "prefix: required", key="prefix")
        n = obj.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return _err(400, f"n: must be an integer >= 1, got {n!r}", key="n")
        r = self.resolve_prefix(obj["prefix"])
        if isinstance(r, web.Response):
            return r
        _, chain = r
        try:
            result = await self.gw.planner.replicate(chain, n)
        except ReplicateError as e:
            return _err(e.status, str(e))
        return web.json_response(result, status=202)

    # -- events -------------------------------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        bus = self.gw.bus
        q = bus.subscribe()
        try:
            await resp.write(b": connected\n\n")
            while True:
                try:
                    kind, text = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    await resp.write(b": keepalive\n\n")
                    continue
                if kind is None:
                    break
                await resp.write(f"event: {kind}\ndata: {text}\n\n".encode())
        except (ConnectionResetError, RuntimeError):
            pass
        finally:
            bus.unsubscribe(q)
        try:
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        return resp


def build_control_app(gw: "Gateway") -> web.Application:
    """The control-API :class:`aiohttp.web.Application` of ``gw``."""
    api = ControlApi(gw)
    app = web.Application(client_max_size=MAX_CONTROL_BODY, middlewares=[api.middleware])
    r = app.router
    r.add_get("/control/fleet", api.fleet)
    r.add_get("/control/prefixes", api.prefixes)
    r.add_get("/control/transfers", api.transfers)
    r.add_get("/control/ttft", api.ttft)
    r.add_get("/control/constants", api.get_constants)
    r.add_put("/control/constants", api.put_constants)
    r.add_post("/control/replicate", api.replicate)
    r.add_get("/control/replications/{prefix}", api.replications)
    r.add_get("/control/events", api.events)
    return app
