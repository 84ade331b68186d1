"""The control API's handlers: what the dashboard and the CLI read and steer (a listener apart from the data
plane). The routes, their answers and their errors are described in ``docs/control-api.md``; every answer is a
model of :mod:`btbctl.engine.control.schema`, built by :mod:`~btbctl.engine.gateway.reports`.

Bound to 127.0.0.1 by default. Writes (``PUT``/``POST``) need ``Authorization: Bearer <token>`` (compared in
constant time); without it: 401. Reads are open while the listener is on a loopback address and need the token
too otherwise. Errors are ``{"error": {"message", ...}}`` with a 4xx status.

The handlers read through :class:`~btbctl.engine.gateway.reports.Reports`, write through :class:`Steering` and
stream from the :class:`~btbctl.engine.gateway.events.EventBus`; none of them knows the gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from aiohttp import web
from pydantic import BaseModel, ValidationError

from btbctl.engine.constants import WARM_REPLICAS_ALIAS, BtbConstants
from btbctl.engine.control.schema import (
    PROMPT_KEYS,
    AgentRegistrationAnswer,
    AgentsAnswer,
    ErrorAnswer,
    ErrorDetail,
    FlushAnswer,
    PrewarmRequest,
)
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.events import EventBus
from btbctl.engine.gateway.prompt import parse_json_object
from btbctl.engine.gateway.replicator import PrewarmOutcome, ReplicateError, ReplicateOutcome
from btbctl.engine.gateway.reports import PrefixLookupError, Reports
from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES
from btbctl.engine.logfmt import RateLimiter, log_event
from btbctl.engine.policies import POLICIES, live_policy_error
from btbctl.engine.replication.registration import REGISTER_PATH, SIGNATURE_HEADER, AnnouncementError

log = logging.getLogger(__name__)

#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE_S = 15.0
#: Largest body a control write accepts, bytes.
MAX_CONTROL_BODY = 64 * 1024
#: Largest body of ``POST /control/prewarm`` (a prompt: the data plane's own limit), bytes. Only requests with the
#: bearer token get their body read.
MAX_PREWARM_BODY = MAX_REQUEST_BODY_BYTES


def _err(status: int, message: str, headers: dict | None = None, **fields) -> web.Response:
    """An error answer: :class:`~btbctl.engine.control.schema.ErrorAnswer` with ``message`` and ``fields``."""
    return web.json_response(
        ErrorAnswer(error=ErrorDetail(message=message, **fields)).model_dump(mode="json"),
        status=status,
        headers=headers,
    )


def _ok(answer: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(answer.model_dump(mode="json"), status=status)


class Steering(Protocol):
    """What the control API changes, and who may (the gateway provides it)."""

    @property
    def constants(self) -> BtbConstants: ...

    def set_constants(self, updates: dict) -> BtbConstants:
        """Apply a validated partial update of the four constants."""

    def set_policy(self, name: str) -> None:
        """Switch to the routing policy ``name`` (a registered one)."""

    async def replicate(self, chain: tuple, n: int) -> ReplicateOutcome:
        """Copy ``chain`` to ``n`` more workers now (raises :class:`ReplicateError`)."""

    async def prewarm(self, route: str, obj: dict, n: int) -> PrewarmOutcome:
        """Have one worker compute a prompt (``obj``, a data-plane body for ``route``), then copy it to ``n`` more
        workers (raises :class:`ReplicateError`)."""

    async def flush(self) -> dict[str, str]:
        """Empty every worker's cache and the gateway's records of them; ``{worker name: "flushed" or why not}``."""

    def check_token(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the control API's bearer token."""

    def register_agent(self, body: bytes, signature: str | None) -> dict:
        """Take a node agent's signed announcement (:mod:`btbctl.engine.replication.registration`); the answer.
        Raises :class:`~btbctl.engine.replication.registration.AnnouncementError`."""

    def registered_agents(self) -> dict:
        """``{"agents": [{"name", "control_url", "peer_addr", "workers": [names], "static", "expires_in_s"}]}``: the
        node agents the l3 executor knows now (empty list in other modes)."""

    def save_tuned(self) -> str | None:
        """Record the constants and policy held now (the run directory's ``tuned.json``); the path, or None when
        nothing is recorded. Raises OSError when the record cannot be written."""


class ControlApi:
    """Handlers of the control API.

    Args:
        reports: builds the answers.
        steering: applies the writes and checks the token.
        bus: the event bus behind ``GET /control/events``.
        open_reads: reads need no token (the listener is on loopback).
        retry_after_s: ``Retry-After`` of the 503 answer when the event streams are at their cap.
    """

    def __init__(
        self, reports: Reports, steering: Steering, bus: EventBus, *, open_reads: bool, retry_after_s: int = 1
    ) -> None:
        self.retry_after_s = retry_after_s
        self.reports = reports
        self.steering = steering
        self.bus = bus
        self.open_reads = open_reads
        self.limiter = RateLimiter()

    # -- plumbing -----------------------------------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        write = request.method not in ("GET", "HEAD", "OPTIONS")
        if request.path == REGISTER_PATH and request.method == "POST":
            return await handler(request)  # signed by the agent's node key instead (checked by the handler)
        if (write or not self.open_reads) and not self.steering.check_token(request.headers.get("Authorization")):
            token = "wrong" if request.headers.get("Authorization") else "no"
            ok, held = self.limiter.allow(f"denied:{token}")
            if ok:  # counted by the token check (btb_rejected_requests{reason="auth"}); logged once per interval
                log_event(
                    log,
                    "control_denied",
                    logging.WARNING,
                    peer=request.remote,
                    method=request.method,
                    path=request.path,
                    token=token,
                    repeats_held=held or None,
                )
            return _err(
                401,
                "missing or wrong bearer token (Authorization: Bearer <token>)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _err(e.status, e.text if e.status == 413 else f"{e.reason}: {request.method} {request.path}")

    @staticmethod
    async def _body(request: web.Request, limit: int = MAX_CONTROL_BODY) -> bytes | web.Response:
        """The request's body, or a 413 answer when it is over ``limit`` bytes (declared or read)."""
        cl = request.content_length
        if cl is not None and cl > limit:
            return _err(413, f"a body of {cl} bytes exceeds the limit of {limit} bytes")
        body = await request.read()
        if len(body) > limit:
            return _err(413, f"a body of {len(body)} bytes exceeds the limit of {limit} bytes")
        return body

    async def _json_body(self, request: web.Request, limit: int = MAX_CONTROL_BODY) -> dict | web.Response:
        body = await self._body(request, limit)
        if isinstance(body, web.Response):
            return body
        try:
            return parse_json_object(body) if body else {}
        except ValueError as e:  # the message is for the client
            return _err(400, str(e))

    @staticmethod
    def _num_query(
        request: web.Request, name: str, default: float, lo: float, hi: float, integer: bool = False
    ) -> float | web.Response:
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

    # -- reads --------------------------------------------------------------------------------------------------

    async def fleet(self, request: web.Request) -> web.Response:
        return _ok(self.reports.fleet())

    async def prefixes(self, request: web.Request) -> web.Response:
        top = self._num_query(request, "top", 10, 1, 1000, integer=True)
        if isinstance(top, web.Response):
            return top
        return _ok(self.reports.prefixes(int(top)))

    async def transfers(self, request: web.Request) -> web.Response:
        limit = self._num_query(request, "limit", 100, 1, 10000, integer=True)
        if isinstance(limit, web.Response):
            return limit
        return _ok(self.reports.transfers(int(limit)))

    async def ttft(self, request: web.Request) -> web.Response:
        window = self._num_query(request, "window_s", 60.0, 0.001, 86400.0)
        if isinstance(window, web.Response):
            return window
        step = self._num_query(request, "step_s", 1.0, 0.001, 86400.0)
        if isinstance(step, web.Response):
            return step
        if window / step > 10000:
            return _err(400, "window_s / step_s must be at most 10000 buckets", key="step_s")
        return _ok(self.reports.ttft(window, step))

    async def get_constants(self, request: web.Request) -> web.Response:
        return _ok(self.reports.constants())

    async def replications(self, request: web.Request) -> web.Response:
        try:
            key, chain = self.reports.resolve_prefix(request.match_info["prefix"])
        except PrefixLookupError as e:
            return _err(e.status, str(e), **e.fields)
        return _ok(self.reports.replication(key, chain))

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
        if "policy" in obj and (not isinstance(policy, str) or policy not in POLICIES):
            return _err(400, f"policy: {live_policy_error(policy)}", key="policy", valid=list(POLICIES))
        updates = {k: v for k, v in obj.items() if k != "policy"}
        steering = self.steering
        try:
            steering.constants.with_updates(**updates)  # validate everything before applying anything
        except ConfigError as e:
            return _err(400, str(e), key=e.key, valid=BtbConstants.describe(e.key))
        old = steering.constants.as_dict()
        old_policy = self.reports.src.policy_name
        new = steering.set_constants(updates).as_dict() if updates else old
        if policy is not None:
            steering.set_policy(policy)
        try:
            saved = steering.save_tuned()
        except OSError as e:
            # a change that would be lost on the next `up` is not confirmed: set back what was held
            steering.set_constants(old)
            steering.set_policy(old_policy)
            why = f"cannot record the change in {e.filename or 'the tuned file'}: {e.strerror or e}"
            log_event(log, "control_write_undone", peer=request.remote, reason=why)
            return _err(507, f"{why}; the change was undone: the gateway holds its old settings")
        for k in new:
            if new[k] != old[k] or k in updates:
                log_event(
                    log, "control_write", peer=request.remote, token="yes", key=k, old=old[k], new=new[k], saved=saved
                )
        if policy is not None:
            log_event(
                log,
                "control_write",
                peer=request.remote,
                token="yes",
                key="policy",
                old=old_policy,
                new=policy,
                saved=saved,
            )
        return _ok(self.reports.constants())

    async def replicate(self, request: web.Request) -> web.Response:
        obj = await self._json_body(request)
        if isinstance(obj, web.Response):
            return obj
        if "prefix" not in obj:
            return _err(400, "prefix: required", key="prefix")
        n = obj.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return _err(400, f"n: must be an integer >= 1, got {n!r}", key="n")
        try:
            _, chain = self.reports.resolve_prefix(obj["prefix"])
        except PrefixLookupError as e:
            return _err(e.status, str(e), **e.fields)
        log_event(log, "control_replicate", peer=request.remote, token="yes", prefix=str(obj["prefix"]), n=n)
        try:
            outcome = await self.steering.replicate(chain, n)
        except ReplicateError as e:
            log_event(log, "control_replicate_refused", peer=request.remote, status=e.status, reason=str(e))
            return _err(e.status, str(e))
        # 200 and no targets: every eligible worker holds it already (nothing to do is not an error)
        return _ok(self.reports.replicate(outcome), status=202 if outcome.started else 200)

    async def prewarm(self, request: web.Request) -> web.Response:
        obj = await self._json_body(request, MAX_PREWARM_BODY)
        if isinstance(obj, web.Response):
            return obj
        try:
            body = PrewarmRequest.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            loc = [str(p) for p in err.get("loc", ())]
            key = loc[0] if loc else "prompt"
            where = ".".join(loc)
            msg = err.get("msg", "invalid").removeprefix("Value error, ")
            return _err(400, f"{where}: {msg}" if where else msg, key=key, valid=PREWARM_VALID)
        route, data = prewarm_request(body)
        log_event(
            log, "control_prewarm", peer=request.remote, token="yes", prompt=next(k for k in data if k in PROMPT_KEYS)
        )
        try:
            done = await self.steering.prewarm(route, data, body.n)
        except ReplicateError as e:
            log_event(log, "control_prewarm_refused", peer=request.remote, status=e.status, reason=str(e))
            return _err(e.status, str(e))
        return _ok(self.reports.prewarm(done), status=202 if done.copies.started else 200)

    async def flush(self, request: web.Request) -> web.Response:
        obj = await self._json_body(request)
        if isinstance(obj, web.Response):
            return obj
        results = await self.steering.flush()
        flushed = sum(v == "flushed" for v in results.values())
        log_event(log, "control_flush", peer=request.remote, token="yes", flushed=flushed, workers=len(results))
        return _ok(FlushAnswer(workers=results, flushed=flushed))

    # -- events -------------------------------------------------------------------------------------------------

    async def agents(self, request: web.Request) -> web.Response:
        """``GET /control/agents``: the node agents known now (registered or from the settings)."""
        return _ok(AgentsAnswer(**self.steering.registered_agents()))

    async def register_agent(self, request: web.Request) -> web.Response:
        """``POST /control/agents``: a node agent announces itself (signed, not the bearer token)."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            answer = self.steering.register_agent(body, request.headers.get(SIGNATURE_HEADER))
        except AnnouncementError as e:
            if e.status in (401, 403):
                ok, held = self.limiter.allow(f"agent_denied:{e.status}")
                if ok:
                    log_event(
                        log,
                        "agent_registration_denied",
                        logging.WARNING,
                        peer=request.remote,
                        status=e.status,
                        error=str(e),
                        repeats_held=held or None,
                    )
            return _err(e.status, str(e))
        return _ok(AgentRegistrationAnswer(**answer))

    async def events(self, request: web.Request) -> web.StreamResponse:
        bus = self.bus
        if bus.subscribers >= bus.max_subscribers:
            return _err(
                503,
                f"{bus.subscribers} event streams are open, the limit; retry later",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        await resp.prepare(request)
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


#: The prompt fields of ``POST /control/prewarm`` (exactly one is given) and what its body accepts.
PREWARM_VALID = [*PROMPT_KEYS, "n"]


def prewarm_request(body: PrewarmRequest) -> tuple[str, dict]:
    """The data-plane request that computes a prewarm's prompt and asks for one new token: ``(route, body)``; a
    chat goes to the chat route, so its template matches the batch's own chat requests."""
    one = {"max_new_tokens": 1, "temperature": 0}
    if body.messages is not None:
        return "chat", {"messages": body.messages, "max_tokens": 1, "temperature": 0}
    if body.input_ids is not None:
        return "generate", {"input_ids": body.input_ids, "sampling_params": one}
    return "generate", {"text": body.text, "sampling_params": one}


def build_control_app(
    reports: Reports,
    steering: Steering,
    bus: EventBus,
    *,
    open_reads: bool,
    retry_after_s: int = 1,
    middlewares: Sequence[Any] = (),
) -> web.Application:
    """The control-API :class:`aiohttp.web.Application` (see :class:`ControlApi` for the arguments; ``middlewares``
    run first)."""
    api = ControlApi(reports, steering, bus, open_reads=open_reads, retry_after_s=retry_after_s)
    app = web.Application(
        client_max_size=max(MAX_CONTROL_BODY, MAX_PREWARM_BODY), middlewares=[*middlewares, api.middleware]
    )
    r = app.router
    r.add_get("/control/fleet", api.fleet)
    r.add_get("/control/prefixes", api.prefixes)
    r.add_get("/control/transfers", api.transfers)
    r.add_get("/control/ttft", api.ttft)
    r.add_get("/control/constants", api.get_constants)
    r.add_put("/control/constants", api.put_constants)
    r.add_post("/control/replicate", api.replicate)
    r.add_post("/control/prewarm", api.prewarm)
    r.add_post("/control/flush", api.flush)
    r.add_get("/control/replications/{prefix}", api.replications)
    r.add_get("/control/events", api.events)
    r.add_get(REGISTER_PATH, api.agents)
    r.add_post(REGISTER_PATH, api.register_agent)
    return app


def build_register_app(
    reports: Reports, steering: Steering, bus: EventBus, *, middlewares: Sequence[Any] = ()
) -> web.Application:
    """The registration-only :class:`aiohttp.web.Application` (``GatewayConfig.register_hosts``): ``POST
    /control/agents`` (signed by the agent's node key) and nothing else; any other request is refused as on the
    control API without a token (401), or 404 with one."""
    api = ControlApi(reports, steering, bus, open_reads=False)
    app = web.Application(client_max_size=MAX_CONTROL_BODY, middlewares=[*middlewares, api.middleware])
    app.router.add_post(REGISTER_PATH, api.register_agent)
    return app
