"""The data plane: OpenAI-compatible and SGLang-native routes in front of the workers.

Routes:

* ``POST /generate`` (SGLang native: ``text`` or ``input_ids``), ``POST /v1/completions`` (``prompt``),
  ``POST /v1/chat/completions`` (``messages``): routed by the policy and forwarded with the body unchanged;
  ``"stream": true`` answers are passed through chunk by chunk. In replication mode ``l3`` the prompt's chain is
  SGLang's page keys of its token ids (text and chats tokenized by a worker, :mod:`btbctl.engine.gateway.tokens`).
* ``GET /v1/models``: forwarded to a healthy worker. ``GET /health``: 200 ``{"status": "ok", "healthy",
  "total"}`` while at least one worker is healthy, else 503. ``GET /metrics``: Prometheus text
  (:mod:`btbctl.engine.gateway.metrics`).

Per request: the body is read (at most ``max_body_bytes``: 413 beyond), parsed (400 for malformed JSON, a
non-object body or a missing/ill-typed prompt field, naming the field), the prompt becomes a chain of block hashes
(:mod:`btbctl.engine.gateway.prompt`), the policy picks a worker (``now_s`` = seconds since the gateway started),
and the body is forwarded as received (no re-encoding). Answers carry ``X-BTB-Worker: <worker URL>``.
Errors are JSON ``{"error": {"message", "type", "param", "code"}}`` (the emulated worker's shape too); unknown
routes get 404 and wrong methods 405.

**TTFT** is measured at the gateway from the request's arrival to the first byte of the answer from the worker:
for a stream, the first chunk carrying an SSE ``data:`` line; for a non-streamed answer, the response head (a
non-streamed answer arrives whole, so its TTFT is its end-to-end latency; measure TTFT with ``stream`` or
``max_new_tokens`` 1).

**Pacing.** A route with a pace ``k`` (``Route.pace``: btb_plus's rule 6, a spread burst) is held at the gateway
until fewer than ``k`` of the gateway's requests sent to its worker wait for a first token, behind the ones held
there before it, and at most ``first_byte_timeout_s``; each first token (or an attempt ending without one) lets the
next ones go. Only a request whose first token the gateway sees before its whole answer is paced (streamed, or
one output token): a non-streamed answer's slot would last its whole decode. A held request whose client left is
never sent; one held for a worker marked unhealthy (and silent) is routed again, without spending the retry budget:
it never reached a worker.

**Retries, never duplicates.** A connection error, a 5xx, or a stream that breaks before its first ``data:``
chunk marks the worker unhealthy (the health checker revives it once ``/health`` passes again) and, as long as
nothing was sent to the client yet, the request is routed again by the policy with the failed workers excluded,
at most ``max_retries`` more times; when none is left the answer is 502 (503 when no worker was healthy at all).
When no worker is healthy the gateway still sends to the ones that answer (a sign of life within
``progress_window_s``, or a ``/health`` that only times out: one request at a time there), rather than refusing
everything. A worker marked unhealthy keeps its requests waiting for a first byte unless it shows no sign of life
either (a frozen process: they are retried elsewhere at once); each of them fails over on its own error.
Once the first byte went to the client the request is never retried: a broken stream ends with one SSE event
``data: {"error": {"message", "type": "upstream_error", "code": 502}}`` and the connection closes; a 4xx from a
worker is the client's problem and is passed through as is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST

from btbctl.engine.errors import api_error_body
from btbctl.engine.gateway.guard import RateLimiter, is_local_exhaustion, overload_parts
from btbctl.engine.gateway.httpserver import (
    Answer,
    HttpApp,
    HttpError,
    HttpRequest,
    HttpServer,
    Middleware,
    Response,
    StreamResponse,
    json_response,
)
from btbctl.engine.gateway.lifecycle import EXPECTED_REQUESTS_HEADER, Attempt, Refusal
from btbctl.engine.gateway.metrics import GatewayMetrics
from btbctl.engine.gateway.state import FleetState
from btbctl.engine.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from btbctl.engine.limits import MAX_PROMPT_TOKENS, MAX_REQUEST_BODY_BYTES
from btbctl.engine.logfmt import log_event
from btbctl.engine.trace.model import Request
from btbctl.engine.wording import plural

log = logging.getLogger(__name__)

#: Response header naming the worker (base URL) that answered; ``btbctl bench`` counts answers per worker by it.
WORKER_HEADER = "X-BTB-Worker"
#: The prompt routes: the name the prompt parser knows each by, and its path (the same on the workers).
DATA_ROUTES = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: Bytes of stream preamble (chunks without a ``data:`` line, e.g. SSE comments) held back before the first data
#: chunk; past this the stream is passed on anyway.
_PREAMBLE_LIMIT = 65536
#: Longest a request routed to the target of a copy not pushed yet waits for the push, seconds (a push is a
#: ``/btb/match`` and a ``/btb/push`` call, milliseconds on loopback or a LAN; a product choice).
COPY_ACCEPT_WAIT_S = 0.5
#: Bytes of a worker's 5xx answer kept as the attempt's reason (an entry of the 502's ``attempts``); only about
#: as much of its body is read, the rest is dropped with the connection.
_ERROR_DETAIL_BYTES = 200
#: End-of-answer event of an SSE stream (SGLang and OpenAI), and how many trailing bytes are kept to spot it.
_DONE_MARK = b"data: [DONE]"
_DONE_TAIL = 64
#: Exceptions that mean "the worker failed us" on the upstream side.
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def json_error(status: int, message: str, kind: str | None = None, **extra) -> Response:
    """An error answer in the shape the emulated worker uses too (:func:`~btbctl.engine.errors.api_error_body`)."""
    return json_response(api_error_body(status, message, kind, **extra), status)


def overloaded(retry_after_s: int, message: str) -> Response:
    """A 503 with ``Retry-After`` that closes the connection (:func:`~btbctl.engine.netguard.overload_parts`)."""
    body, headers = overload_parts(retry_after_s, message)
    return Response(503, body, headers)


def error_middleware(metrics: GatewayMetrics) -> Middleware:
    """A middleware turning the server's HTTP errors (404 unknown route, 405, 413 body too large; counted in
    ``metrics``) into JSON errors. An unexpected exception is the server's to answer (500, or the answer cut when it
    had started; :mod:`~btbctl.engine.gateway.httpserver`): the process never dies on a request."""

    async def middleware(request: HttpRequest, handler) -> Answer:
        try:
            return await handler(request)
        except HttpError as e:
            metrics.reject(e.status)
            return json_error(e.status, e.message, "not_found" if e.status == 404 else "invalid_request_error")

    return middleware


class Fleet(Protocol):
    """What the data plane reads of the gateway to move bytes: the workers (and the copies that gate them), the
    metrics it counts refusals and retries in, the connections to the workers (the pool forwards requests; the
    shared aiohttp session serves the rest)."""

    @property
    def state(self) -> FleetState: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def session(self) -> aiohttp.ClientSession: ...

    @property
    def upstream(self) -> UpstreamPool: ...


class Lifecycle(Protocol):
    """What the data plane reports a request's events to (:class:`~btbctl.engine.gateway.lifecycle.RequestLifecycle`,
    whose docstrings say what each means)."""

    async def admit(
        self, route: str, body: bytes, declared: str | None, client: str, arrival_s: float
    ) -> tuple[Request, bool] | Refusal:
        """The request of ``body`` (arrived at ``arrival_s``) and whether it asks for a stream, or why it is
        refused."""

    def pick(self, req: Request, excluded: Sequence[int]) -> tuple[int, int] | None:
        """The worker for ``req`` outside ``excluded`` and its pace (0: send at once), or None when none is
        available."""

    def start(self, req: Request, idx: int, pace: int, early: bool) -> Attempt:
        """An attempt of ``req`` on worker ``idx`` begins (``early``: its first token is seen before its answer)."""

    def sent(self, a: Attempt) -> None:
        """Attempt ``a`` leaves the gateway for its worker now."""

    def first_byte(self, a: Attempt, now: float | None = None) -> None:
        """The first byte of ``a``'s answer came."""

    def answered(self, a: Attempt, status: str) -> None:
        """``a``'s answer went to the client with ``status``."""

    def unanswered(self, a: Attempt | None, status: str) -> None:
        """The request ended without an answer (``a``: the attempt that was on, None: no worker was reached)."""

    def worker_failed(self, idx: int, reason: str, kind: str) -> None:
        """A forwarded request failed on worker ``idx``: ``kind`` ``refused`` (connection error, broken answer),
        ``error`` (5xx) or ``slow`` (no first byte or data in time)."""

    def end(self, a: Attempt) -> None:
        """Attempt ``a`` is over."""


@dataclass(frozen=True)
class Retry:
    """An attempt's explicit outcome when the request goes to another worker: why (``<worker URL>: <reason>``, one
    entry of the 502's ``attempts``)."""

    why: str


@dataclass(frozen=True)
class DataLimits:
    """The data plane's limits (the matching :class:`~btbctl.engine.gateway.config.GatewayConfig` fields say
    why each default is what it is)."""

    max_body_bytes: int = MAX_REQUEST_BODY_BYTES
    max_retries: int = 2
    retry_budget_percent: float = 20.0
    retry_budget_min: int = 10
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    offload_bytes: int = 256 * 1024
    max_inflight: int = 1 << 30
    retry_after_s: int = 1
    body_timeout_s: float = 60.0
    first_byte_timeout_s: float = 300.0
    idle_timeout_s: float = 60.0
    max_chain_blocks: int = 1 << 16

    @classmethod
    def from_config(cls, config: object, **over: int) -> DataLimits:
        """The limits from the same-named fields of a gateway config (``over``: values given instead)."""
        names = [f.name for f in fields(cls)]
        return cls(**{n: over[n] if n in over else getattr(config, n) for n in names})


class DataPlane:
    """Request handlers in front of the workers: they move the bytes and report each request's events to ``life``.

    Args:
        gw: the fleet the bytes go to (the gateway).
        life: the request lifecycle (admission, routing, accounting).
        limits: body, prompt, in-flight and upstream time limits.
    """

    def __init__(self, gw: Fleet, life: Lifecycle, limits: DataLimits | None = None) -> None:
        self.gw = gw
        self.life = life
        self.limits = lim = limits or DataLimits()
        self.max_body = lim.max_body_bytes
        self.max_retries = lim.max_retries
        #: requests admitted and not answered yet
        self.inflight = 0
        #: requests on a second or later attempt now (the retry budget's count)
        self.retrying = 0
        #: per worker index: futures of attempts without a first byte yet, resolved when the worker goes down
        self._waiting: dict[int, set[asyncio.Future]] = {}
        #: per worker index: (pace, future) of the requests held at the gateway for their turn, in arrival order;
        #: a future's result is None (its turn) or why the worker went down
        self._paced: dict[int, deque[tuple[int, asyncio.Future]]] = {}
        self.limiter = RateLimiter()

    async def _through_gates(self, idx: int, chain, w, deadline: float) -> str | None:
        """Wait until no copy of a leading part of ``chain`` towards worker ``idx`` is unresolved (each ``l3``
        copy's ``ready``; the deepest wins, as they are re-checked until none is left), at most until ``deadline``
        (loop time). Returns None to go on (proved, failed, or timed out: the worker then computes what it lacks),
        or the reason when the worker was marked unhealthy meanwhile."""
        loop = asyncio.get_running_loop()
        state = self.gw.state
        w.gated += 1
        waiter: asyncio.Future = loop.create_future()
        waiting = self._waiting.setdefault(idx, set())
        waiting.add(waiter)
        try:
            while (gate := state.transfers.gate(idx, chain)) is not None:
                left = deadline - loop.time()
                if left <= 0:
                    return None
                done, _ = await asyncio.wait({gate, waiter}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if waiter in done:
                    return str(waiter.result() or "unhealthy")
            return None
        finally:
            w.gated -= 1
            waiting.discard(waiter)

    async def _turn(self, idx: int, w, pace: int, deadline: float) -> str | None:
        """Hold a request routed to worker ``idx`` with ``pace`` (``Route.pace``) until fewer than ``pace`` of the
        gateway's requests sent there wait for their first token and every request held there before it has gone
        (arrival order), at most until ``deadline`` (loop time; then it goes anyway). Returns None to send it, or
        why the worker was marked unhealthy meanwhile."""
        queue = self._paced.setdefault(idx, deque())
        if not queue and w.sent_prefilling() < pace:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        item = (pace, fut)
        queue.append(item)
        w.paced += 1  # whoever resolves ``fut`` takes it off (it leaves the gateway's hold then)

        def overdue() -> None:
            if not fut.done():
                queue.remove(item)
                self._let_go(w, fut)

        timer = loop.call_at(deadline, overdue)
        try:
            res = await fut
        except asyncio.CancelledError:  # the client went away
            if fut.cancelled():  # while it was held: it gives up its place
                w.paced -= 1
                try:
                    queue.remove(item)
                except ValueError:
                    pass
            elif fut.result() is None:  # after it was let go, before it left
                w.released -= 1
            self._next_turns(idx)
            raise
        finally:
            timer.cancel()
        if res is None:
            w.released -= 1  # it leaves now (the caller counts it with ``leave`` before any await)
        return res

    @staticmethod
    def _let_go(w, fut: asyncio.Future) -> None:
        """Let a held request go: it counts as sent from now on (``released``) until it counts itself."""
        fut.set_result(None)
        w.paced -= 1
        w.released += 1

    async def _held(self, hold: Awaitable[str | None], w, excluded: Sequence[int], what: str) -> str | None:
        """Await ``hold`` (a wait at the gateway for worker ``w``: a copy's gate or the request's turn, answering None
        or why the worker went down); then None to send the request to ``w``, or why it goes elsewhere."""
        down = await hold
        if down is None:
            down = self._went_down(w, excluded)
        return None if down is None else f"marked unhealthy while the request waited for {what} ({down})"

    def _went_down(self, w, excluded: Sequence[int]) -> str | None:
        """Why a request held at the gateway for worker ``w`` (a copy's gate, its turn) should be routed again now
        that it may go: ``w`` was marked unhealthy meanwhile and another healthy worker outside ``excluded`` can
        take it (nothing of it reached ``w``); None to send it to ``w``."""
        if w.healthy:
            return None
        if not any(x.healthy and x.index != w.index and x.index not in excluded for x in self.gw.state.workers):
            return None  # none is healthy: the gateway sends to the ones still answering
        return w.health_error or "unhealthy"

    def _next_turns(self, idx: int) -> None:
        """Let the requests held for worker ``idx`` go, in order, while their pace allows (called when one of the
        gateway's requests there got its first token or ended without one)."""
        queue = self._paced.get(idx)
        if not queue:
            return
        w = self.gw.state.workers[idx]
        while queue and w.sent_prefilling() < queue[0][0]:
            _, fut = queue.popleft()
            if not fut.done():
                self._let_go(w, fut)

    def worker_down(self, idx: int, reason: str) -> None:
        """Worker ``idx`` was marked unhealthy: its attempts still waiting for a first byte, and the requests held
        for their turn there, give up on it now and retry elsewhere (nothing of them reached the client)."""
        for fut in self._waiting.pop(idx, ()):
            if not fut.done():
                fut.set_result(reason)
        held = self._paced.pop(idx, ())
        w = self.gw.state.workers[idx]
        for _, fut in held:
            if not fut.done():
                fut.set_result(reason)
                w.paced -= 1

    def _warn(self, event: str, **fields: Any) -> None:
        """A structured warning, at most one per event and interval (repeats are counted in the next line)."""
        ok, held = self.limiter.allow(event)
        if ok:
            log_event(log, event, logging.WARNING, repeats_held=held or None, **fields)

    # -- routes -------------------------------------------------------------------------------------------------

    async def generate(self, request: HttpRequest) -> Answer:
        return await self._handle(request, "generate", DATA_ROUTES["generate"])

    async def completions(self, request: HttpRequest) -> Answer:
        return await self._handle(request, "completions", DATA_ROUTES["completions"])

    async def chat(self, request: HttpRequest) -> Answer:
        return await self._handle(request, "chat", DATA_ROUTES["chat"])

    async def health(self, request: HttpRequest) -> Answer:
        """200 ``ok`` while a worker is healthy; 200 ``degraded`` while none is but some still answer requests
        (the gateway routes to them, :meth:`FleetState.fallback`; a load balancer must keep sending); else 503."""
        state = self.gw.state
        ws = state.workers
        n = sum(1 for w in ws if w.healthy)
        answering = n or len(state.fallback(()))
        status = "ok" if n else ("degraded" if answering else "unavailable")
        return json_response(
            {"status": status, "healthy": n, "answering": answering, "total": len(ws)}, 200 if answering else 503
        )

    async def metrics(self, request: HttpRequest) -> Answer:
        return Response(200, self.gw.metrics.render(), content_type=CONTENT_TYPE_LATEST)

    async def models(self, request: HttpRequest) -> Answer:
        gw = self.gw
        up = [w for w in gw.state.workers if w.healthy] or gw.state.fallback(())
        for w in sorted(up, key=lambda w: w.inflight):
            try:
                async with gw.session.get(f"{w.url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    body = await resp.read()
                    if resp.status < 500:
                        return Response(
                            resp.status, body, content_type=resp.headers.get("Content-Type", "application/json")
                        )
            except _UPSTREAM_ERRORS:
                continue
        gw.metrics.reject(503)
        return json_error(503, "no healthy worker", "unavailable")

    # -- the request path ---------------------------------------------------------------------------------------

    async def _handle(self, request: HttpRequest, route: str, path: str) -> Answer:
        lim = self.limits
        if self.inflight >= lim.max_inflight:
            self.gw.metrics.reject(503, "inflight")
            self._warn("request_refused", reason="inflight_cap", inflight=self.inflight, cap=lim.max_inflight)
            return overloaded(lim.retry_after_s, f"the gateway has {self.inflight} requests in flight, its limit")
        self.inflight += 1
        try:
            return await self._admitted(request, route, path)
        finally:
            self.inflight -= 1

    async def _admitted(self, request: HttpRequest, route: str, path: str) -> Answer:
        gw = self.gw
        lim = self.limits
        t0 = gw.state.clock()  # its arrival: TTFT counts from here
        cl = request.content_length
        if cl is not None and cl > self.max_body:
            gw.metrics.reject(413)
            return json_error(413, f"request body of {cl} bytes exceeds the limit of {self.max_body} bytes")
        try:
            # without the timeout's task and timer when the body is all buffered (usually so: it came with its head)
            read = request.read()
            body = await (read if request.at_eof() else asyncio.wait_for(read, lim.body_timeout_s))
        except asyncio.TimeoutError:
            return json_error(408, f"the request body did not arrive within {lim.body_timeout_s:g} s")
        admitted = await self.life.admit(
            route, body, request.headers.get(EXPECTED_REQUESTS_HEADER), request.remote or "unknown", t0
        )
        if isinstance(admitted, Refusal):
            if admitted.counted:
                gw.metrics.reject(admitted.status)
            return json_error(admitted.status, admitted.message)
        req, stream = admitted
        retry = _RetrySlot(self)
        try:
            return await self._attempts(request, path, body, req, stream, retry)
        finally:
            retry.release()

    async def _until_first_byte(self, aw: Awaitable[Any], idx: int, deadline: float) -> Any:
        """Await ``aw`` (the upstream request or a read before the first byte) until ``deadline`` (loop time) or
        until worker ``idx`` is marked unhealthy, whichever comes first.

        Raises:
            asyncio.TimeoutError: the deadline passed (the first-byte timeout).
            _Abandoned: the worker was marked unhealthy meanwhile.
        """
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(aw)
        # One waiter woken by whichever comes first: the attempt ends (None), the deadline (None) or worker_down
        # (the reason); lighter than asyncio.wait over the task and a second future, on every request.
        waiter: asyncio.Future = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        task.add_done_callback(wake)
        timer = loop.call_at(deadline, wake)
        waiting = self._waiting.setdefault(idx, set())
        waiting.add(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            task.cancel()
            task.add_done_callback(_close_answer)  # an answer head it has (or gets) is nobody's: closed
            raise
        finally:
            timer.cancel()
            waiting.discard(waiter)
            task.remove_done_callback(wake)
        if task.done():
            return task.result()
        reason = waiter.result()
        task.cancel()
        await asyncio.wait((task,))
        _close_answer(task)
        if reason is not None:
            raise _Abandoned(reason)
        raise asyncio.TimeoutError(f"no first byte within {self.limits.first_byte_timeout_s:g} s")

    def retry_allowance(self) -> int:
        """Retries that may be in flight now: ``retry_budget_percent`` of the requests in flight, at least
        ``retry_budget_min``."""
        lim = self.limits
        return max(lim.retry_budget_min, int(self.inflight * lim.retry_budget_percent / 100))

    async def _attempts(
        self, request: HttpRequest, path: str, body: bytes, req: Request, stream: bool, retry: _RetrySlot
    ) -> Answer:
        """Route ``req`` and try it on its worker; on a :class:`Retry` (nothing reached the client) route it again
        with that worker excluded, at most ``max_retries`` more times, within the fleet's retry budget once an
        attempt reached a worker; then 502 (503 when no worker was available at all)."""
        life = self.life
        metrics = self.gw.metrics
        excluded: list[int] = []
        attempts: list[str] = []
        lim = self.limits
        early = stream or req.output_tokens <= 1  # its first token is seen before its whole answer
        reached = False  # an attempt of it left the gateway: a request only held here is routed again for free
        for n in range(self.max_retries + 1):
            if n and reached and not retry.take():
                metrics.retries_denied.inc()
                self._warn("retry_denied", request=req.request_id, retrying=self.retrying, inflight=self.inflight)
                life.unanswered(None, "503")
                metrics.reject(503, "retry_budget")
                return overloaded(
                    lim.retry_after_s,
                    f"no retry left in the fleet's retry budget after {plural(len(attempts), 'attempt')}: "
                    + "; ".join(attempts)[:500],
                )
            pick = life.pick(req, excluded)
            if pick is None:
                break
            idx, pace = pick
            a = life.start(req, idx, pace, early)
            if n:
                metrics.retries.inc()
                log_event(
                    log,
                    "request_retry",
                    request=req.request_id,
                    attempt=n,
                    worker=a.worker.name,
                    after=attempts[-1][:200],
                )
            try:
                outcome = await self._attempt(request, path, body, a, stream, excluded)
            finally:
                life.end(a)
                if not a.prefilled:
                    self._next_turns(idx)
            reached = reached or a.sent_s is not None
            if not isinstance(outcome, Retry):
                return outcome
            attempts.append(outcome.why)
            excluded.append(idx)
        if not attempts:
            life.unanswered(None, "503")
            metrics.reject(503)
            return json_error(503, "no healthy worker", "unavailable")
        life.unanswered(None, "502")
        return json_error(
            502,
            f"no worker could serve the request after {plural(len(attempts), 'attempt')}",
            "upstream_error",
            attempts=attempts,
        )

    def _failed(self, a: Attempt, reason: str, kind: str | None = None) -> Retry:
        """Attempt ``a`` failed before anything reached the client: the request goes elsewhere; with ``kind``
        (see :meth:`Lifecycle.worker_failed`) its worker is marked unhealthy first."""
        if kind is not None:
            self.life.worker_failed(a.idx, reason, kind)
        return Retry(f"{a.worker.url}: {reason}")

    def _first_byte(self, a: Attempt, now: float | None = None) -> None:
        self.life.first_byte(a, now)
        self._next_turns(a.idx)  # its prefill ended: the requests held for their turn there may go

    async def _attempt(
        self, request: HttpRequest, path: str, body: bytes, a: Attempt, stream: bool, excluded: Sequence[int]
    ) -> Answer | Retry:
        """One attempt (``excluded``: the workers the request failed on before): held at the gateway while a copy
        to its worker is unresolved or its turn has not come, then forwarded; the answer (passed through, or
        streamed), or a :class:`Retry` when nothing reached the client."""
        gw = self.gw
        state = gw.state
        req = a.req
        chain = req.block_hashes
        idx, w = a.idx, a.worker
        lim = self.limits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + lim.first_byte_timeout_s
        if chain and state.transfers.active:
            await _await_copy_accepted(state, idx, chain)
        # Held at the gateway before it leaves: l3, until the copies to this worker are proved (a failed one: the
        # worker computes the prefix itself, as without it); a paced route, until its turn. Only the worker going
        # down moves it elsewhere.
        held = False
        down = None
        if chain and state.transfers.active and state.transfers.gate(idx, chain) is not None:
            held = True
            down = await self._held(self._through_gates(idx, chain, w, deadline), w, excluded, "its copy")
        if down is None and a.pace:
            held = True
            turn = self._turn(idx, w, a.pace, loop.time() + lim.first_byte_timeout_s)
            down = await self._held(turn, w, excluded, "its turn")
        if down is not None:
            return Retry(f"{w.url}: {down}")
        if held:
            if request.gone:  # the client left meanwhile
                self.life.unanswered(a, "client_gone")
                return Response(499)
            deadline = loop.time() + lim.first_byte_timeout_s
        self.life.sent(a)
        try:
            resp = await self._until_first_byte(gw.upstream.post(w.url, path, body), idx, deadline)
        except _Abandoned as e:
            return self._failed(a, f"marked unhealthy before its first byte ({e})")
        except _UPSTREAM_ERRORS as e:
            if is_local_exhaustion(e):  # our descriptors, not the worker's fault
                gw.metrics.reject(503, "descriptors")
                self._warn("upstream_connect_refused", reason="descriptors", worker=w.url, error=_describe(e))
                return overloaded(lim.retry_after_s, "the gateway is out of descriptors; retry shortly")
            return self._failed(a, _describe(e), _kind(e))
        t_head = state.clock()
        try:
            status = resp.status
            if status >= 500:
                try:
                    head = await _read_prefix(resp, _ERROR_DETAIL_BYTES, lim.idle_timeout_s)
                    detail = head[:_ERROR_DETAIL_BYTES].decode("utf-8", "replace")
                except _UPSTREAM_ERRORS:
                    detail = ""
                return self._failed(a, f"HTTP {status}" + (f": {detail}" if detail else ""), "error")
            ctype = resp.headers.get("content-type", "application/json")
            if stream and status == 200 and ctype.startswith("text/event-stream"):
                return await self._stream(request, resp, a, ctype, deadline)
            try:
                payload = await _read_within(resp, lim.idle_timeout_s)
            except _UPSTREAM_ERRORS as e:
                return self._failed(a, f"answer broke off: {_describe(e)}", _kind(e))
            if status < 300:
                self._first_byte(a, t_head)
            w.last_progress_s = state.clock()  # it answered: alive, whatever its /health says
            if request.gone:  # the client left meanwhile
                self.life.answered(a, "client_gone")
                return Response(499)
            # a 4xx is the client's: passed through as is, the worker stays healthy
            self.life.answered(a, str(status))
            return Response(status, payload, {"Content-Type": ctype, WORKER_HEADER: w.url})
        finally:
            resp.release()

    async def _stream(
        self, request: HttpRequest, resp: UpstreamResponse, a: Attempt, ctype: str, deadline: float
    ) -> Answer | Retry:
        """Pass a streamed answer through: its preamble up to the first ``data:`` chunk is held back (a failure
        before it is a :class:`Retry`); from the first chunk sent on, the answer is committed to this worker."""
        clock = self.gw.state.clock
        idle = self.limits.idle_timeout_s
        idx, w = a.idx, a.worker
        held: list[bytes] = []
        size = 0
        # Before the first data chunk nothing has reached the client: a failure here is retried elsewhere.
        try:
            while True:
                chunk = await self._until_first_byte(resp.readany(), idx, deadline)
                if not chunk:
                    raise UpstreamError("stream ended before any data")
                held.append(chunk)
                size += len(chunk)
                if b"data:" in chunk or size >= _PREAMBLE_LIMIT:
                    break
        except _Abandoned as e:
            return self._failed(a, f"marked unhealthy before its first byte ({e})")
        except _UPSTREAM_ERRORS as e:
            return self._failed(a, f"stream broke before its first byte: {_describe(e)}", _kind(e))
        self._first_byte(a)
        out = StreamResponse(200, {"Content-Type": ctype, "Cache-Control": "no-cache", WORKER_HEADER: w.url})
        status = "200"
        try:
            await out.prepare(request)
            await out.write(b"".join(held))
        except (ConnectionResetError, RuntimeError):  # the client went away
            resp.close()
            self.life.unanswered(a, "client_gone")
            return out
        # From here on the answer is committed to this worker: never retried.
        tail = b"".join(held)[-_DONE_TAIL:]
        while True:
            try:
                chunk = await asyncio.wait_for(resp.readany(), idle)
            except _UPSTREAM_ERRORS as e:
                why = f"no data for {idle:g} s (idle timeout)" if isinstance(e, asyncio.TimeoutError) else _describe(e)
                reason = f"stream broke after its first byte: {why}"
                self.life.worker_failed(idx, reason, _kind(e))
                if _DONE_MARK in tail:  # the client already has the whole answer: it counts as served
                    break
                status = "stream_error"
                err = {
                    "error": {
                        "message": f"worker {w.url} failed mid-answer ({reason}); the answer is "
                        "incomplete and was not retried",
                        "type": "upstream_error",
                        "code": 502,
                    }
                }
                try:
                    await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
                except (ConnectionResetError, RuntimeError):
                    pass
                break
            if not chunk:
                break
            w.last_progress_s = clock()  # streaming progress: alive, whatever its /health says
            tail = (tail + chunk)[-_DONE_TAIL:]
            try:
                await out.write(chunk)
            except (ConnectionResetError, RuntimeError):
                status = "client_gone"
                break
        try:
            await out.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass
        if status != "200":
            resp.close()  # stop the worker's side of an abandoned or broken stream
        self.life.answered(a, status)
        return out


def _close_answer(task: asyncio.Future) -> None:
    """Close the answer head ``task`` (an upstream request nobody waits for any more) ended with, if any: its
    connection is dropped instead of held against the pool's limit."""
    if not task.cancelled() and task.exception() is None:
        res = task.result()
        if isinstance(res, UpstreamResponse):
            res.close()


async def _read_prefix(resp: UpstreamResponse, size_bytes: int, timeout_s: float) -> bytes:
    """The start of ``resp``'s body: at least ``size_bytes`` unless it is shorter (more when more came at once),
    waiting at most ``timeout_s`` in all; the rest is left unread (releasing the answer then drops its connection).

    Raises:
        UpstreamError: the connection broke first.
        asyncio.TimeoutError: ``timeout_s`` passed.
    """

    async def prefix() -> bytes:
        out = b""
        while len(out) < size_bytes and (chunk := await resp.readany()):
            out += chunk
        return out

    return await asyncio.wait_for(prefix(), timeout_s)


async def _read_within(resp: UpstreamResponse, timeout_s: float) -> bytes:
    """``resp``'s whole body, waiting at most ``timeout_s``; without the timeout's task and timer when the body is
    already all buffered (usually so for small bodies, which arrive with their head)."""
    if resp.at_eof():
        return resp.body()
    return await asyncio.wait_for(resp.read(), timeout_s)


async def _await_copy_accepted(state, idx: int, chain) -> None:
    """A copy of a leading part of ``chain`` towards worker ``idx`` was planned but not pushed yet: wait (at most
    :data:`COPY_ACCEPT_WAIT_S`) until the target accepted it, so that the request reaches the worker after the
    worker counts the blocks as arriving and waits for them instead of recomputing them."""
    d = state.transfers.depth_to(idx, chain)
    t = state.transfers.active.get((idx, chain[d - 1])) if d else None
    if t is None or t.pushed is None or t.pushed.is_set() or t.ready is not None:  # l3 copies gate instead
        return
    try:
        await asyncio.wait_for(t.pushed.wait(), COPY_ACCEPT_WAIT_S)
    except asyncio.TimeoutError:
        pass


class _RetrySlot:
    """One request's share of the retry budget (:meth:`DataPlane.retry_allowance`): taken at its first retry,
    kept for its further ones, given back when it ends."""

    __slots__ = ("dp", "held")

    def __init__(self, dp: DataPlane) -> None:
        self.dp = dp
        self.held = False

    def take(self) -> bool:
        dp = self.dp
        if not self.held:
            if dp.retrying >= dp.retry_allowance():
                return False
            dp.retrying += 1
            self.held = True
        return True

    def release(self) -> None:
        if self.held:
            self.dp.retrying -= 1
            self.held = False


class _Abandoned(Exception):
    """Internal: the worker was marked unhealthy while an attempt waited for its first byte."""


def _kind(e: BaseException) -> str:
    """How an upstream failure looks (``worker_failed``'s ``kind``): ``slow`` for a timeout, else ``refused``."""
    return "slow" if isinstance(e, asyncio.TimeoutError) else "refused"


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_data_app(
    dp: DataPlane, middlewares: Sequence[Middleware] = (), on_answer: Callable[[HttpRequest, int], None] | None = None
) -> HttpServer:
    """The data-plane server of ``dp`` (``middlewares`` run before the error middleware; ``on_answer`` is called
    with each request and its answer's status); open it with :func:`~btbctl.engine.netguard.listen_http`."""
    get, post = "GET", "POST"
    routes = {
        (post, DATA_ROUTES["generate"]): dp.generate,
        (post, DATA_ROUTES["completions"]): dp.completions,
        (post, DATA_ROUTES["chat"]): dp.chat,
        (get, "/v1/models"): dp.models,
        (get, "/health"): dp.health,
        (get, "/metrics"): dp.metrics,
    }
    app = HttpApp(routes, [*middlewares, error_middleware(dp.gw.metrics)], on_answer)
    return HttpServer(app, max_body_bytes=dp.max_body, singletons=(EXPECTED_REQUESTS_HEADER,))
