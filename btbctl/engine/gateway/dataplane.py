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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from aiohttp.payload import BytesPayload
from prometheus_client import CONTENT_TYPE_LATEST
from yarl import URL

from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import api_error_body
from btbctl.engine.gateway.guard import RateLimiter, is_local_exhaustion, overloaded
from btbctl.engine.gateway.metrics import GatewayMetrics, worker_label
from btbctl.engine.gateway.prompt import (
    PromptError,
    PromptTooLong,
    chain_from_packed,
    output_tokens_of,
    parse_json_object,
    prompt_of,
)
from btbctl.engine.gateway.state import FleetState
from btbctl.engine.gateway.tokens import L3Prompts
from btbctl.engine.hashing import BYTES_PER_TOKEN
from btbctl.engine.limits import MAX_PROMPT_TOKENS, MAX_REQUEST_BODY_BYTES
from btbctl.engine.logfmt import log_event
from btbctl.engine.policies.base import Policy
from btbctl.engine.trace.model import Request
from btbctl.engine.wording import plural

log = logging.getLogger(__name__)

_FORWARD_HEADERS = {"Content-Type": "application/json"}
#: Response header naming the worker (base URL) that answered; ``btbctl bench`` counts answers per worker by it.
WORKER_HEADER = "X-BTB-Worker"
#: The prompt routes: the name the prompt parser knows each by, and its path (the same on the workers).
DATA_ROUTES = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}
#: Request header of a batch client declaring its burst: how many requests of this prompt it is about to send
#: (an integer >= 1). The detector counts the request as that many arrivals, within the client's bound
#: (``declared_requests_max``); the header is not forwarded to the worker.
EXPECTED_REQUESTS_HEADER = "X-BTB-Expected-Requests"
#: Largest value the header may carry (what is granted is bounded far lower, per client).
MAX_EXPECTED_REQUESTS = 1_000_000_000
#: Bytes of stream preamble (chunks without a ``data:`` line, e.g. SSE comments) held back before the first data
#: chunk; past this the stream is passed on anyway.
_PREAMBLE_LIMIT = 65536
#: Longest a request routed to the target of a copy not pushed yet waits for the push, seconds (a push is a
#: ``/btb/match`` and a ``/btb/push`` call, milliseconds on loopback or a LAN; a product choice).
COPY_ACCEPT_WAIT_S = 0.5
#: End-of-answer event of an SSE stream (SGLang and OpenAI), and how many trailing bytes are kept to spot it.
_DONE_MARK = b"data: [DONE]"
_DONE_TAIL = 64
#: Exceptions that mean "the worker failed us" on the upstream side.
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
#: The gateway's metrics on the data app (the error middleware counts the requests aiohttp refused).
METRICS_KEY = web.AppKey("btb_metrics", GatewayMetrics)


def json_error(status: int, message: str, kind: str | None = None, **extra) -> web.Response:
    """An error answer in the shape the emulated worker uses too (:func:`~btbctl.engine.errors.api_error_body`)."""
    body = api_error_body(status, message, kind, **extra)
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Turn aiohttp's HTTP errors (404 unknown route, 405, 413 body too large) and unexpected exceptions into
    JSON errors; the process never dies on a request."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found" if e.status == 404 else "invalid_request_error"
        metrics = request.app.get(METRICS_KEY)
        if metrics is not None:
            metrics.reject(e.status)
        msg = e.text if e.status == 413 else f"{e.reason}: {request.method} {request.path}"
        return json_error(e.status, msg, kind)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_error(500, "internal gateway error", "internal_error")


class Router(Protocol):
    """What the data plane asks of the gateway: the fleet state (workers, copies, chains, TTFT), the metrics, the
    shared upstream session, the page size and constants in force, the policy (its name and ``on_finish``), the
    routing decision, and two notifications."""

    @property
    def state(self) -> FleetState: ...

    @property
    def metrics(self) -> GatewayMetrics: ...

    @property
    def session(self) -> aiohttp.ClientSession: ...

    @property
    def page_size(self) -> int: ...

    @property
    def constants(self) -> BtbConstants: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def l3_prompts(self) -> L3Prompts | None:
        """Replication mode ``l3``: the prompts' token ids and SGLang page keys; None in the other modes."""

    def choose(self, req: Request, excluded: Sequence[int]) -> tuple[int, int] | None:
        """The worker for ``req`` outside ``excluded`` and its pace (``Route.pace``: 0, send at once), or None when
        none is available."""

    def worker_failed(self, idx: int, reason: str, kind: str = "error") -> None:
        """A forwarded request failed on worker ``idx``: ``kind`` ``refused`` (connection error, broken answer),
        ``error`` (5xx) or ``slow`` (no first byte or data in time)."""

    def next_request_id(self) -> str:
        """A fresh request id."""

    def mark_changed(self, kind: str) -> None:
        """Something behind the control API's ``kind`` events changed (``prefixes``, ``ttft``)."""

    def declare(self, client: str, extra: int) -> int:
        """Extra detector arrivals granted to ``client`` (its address) that declared ``extra`` more requests
        (within its bound per window)."""


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
    """Request handlers in front of the workers, routed by a :class:`Router`.

    Args:
        gw: the router (the gateway).
        limits: body, prompt, in-flight and upstream time limits.
    """

    def __init__(self, gw: Router, limits: DataLimits | None = None) -> None:
        self.gw = gw
        self.limits = lim = limits or DataLimits()
        self.max_body = lim.max_body_bytes
        self.max_retries = lim.max_retries
        self._urls: dict[tuple[str, str], URL] = {}
        #: requests admitted and not answered yet
        self.inflight = 0
        #: requests on a second or later attempt now (the retry budget's count)
        self.retrying = 0
        #: per worker index: futures of attempts without a first byte yet, resolved when the worker goes down
        self._waiting: dict[int, set[asyncio.Future]] = {}
        #: per worker index: (pace, future) of the requests held at the gateway for their turn, in arrival order;
        #: a future's result is None (its turn) or why the worker went down
        self._paced: dict[int, deque[tuple[int, asyncio.Future]]] = {}
        self._pool: ThreadPoolExecutor | None = None
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

    def _prefill_ended(self, idx: int, w, rid: object, left: bool) -> None:
        """Request ``rid`` got its first byte from worker ``idx`` or its attempt there ended without one (``left``:
        it had left the gateway): the held requests there may go."""
        w.end_prefill(rid, left)
        self._next_turns(idx)

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

    def close(self) -> None:
        """Stop the prompt-hashing thread pool (after the listener stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _warn(self, event: str, **fields: Any) -> None:
        """A structured warning, at most one per event and interval (repeats are counted in the next line)."""
        ok, held = self.limiter.allow(event)
        if ok:
            log_event(log, event, logging.WARNING, repeats_held=held or None, **fields)

    def _url(self, base: str, path: str) -> URL:
        """The parsed upstream URL (cached: parsing a URL per request costs more than routing it)."""
        key = (base, path)
        u = self._urls.get(key)
        if u is None:
            u = self._urls[key] = URL(base + path)
        return u

    # -- routes -------------------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "generate", DATA_ROUTES["generate"])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completions", DATA_ROUTES["completions"])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", DATA_ROUTES["chat"])

    async def health(self, request: web.Request) -> web.Response:
        """200 ``ok`` while a worker is healthy; 200 ``degraded`` while none is but some still answer requests
        (the gateway routes to them, :meth:`FleetState.fallback`; a load balancer must keep sending); else 503."""
        state = self.gw.state
        ws = state.workers
        n = sum(1 for w in ws if w.healthy)
        answering = n or len(state.fallback(()))
        status = "ok" if n else ("degraded" if answering else "unavailable")
        return web.json_response(
            {"status": status, "healthy": n, "answering": answering, "total": len(ws)},
            status=200 if answering else 503,
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.gw.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        gw = self.gw
        up = [w for w in gw.state.workers if w.healthy] or gw.state.fallback(())
        for w in sorted(up, key=lambda w: w.inflight):
            try:
                async with gw.session.get(f"{w.url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    body = await resp.read()
                    if resp.status < 500:
                        return web.Response(
                            status=resp.status,
                            body=body,
                            headers={"Content-Type": resp.headers.get("Content-Type", "application/json")},
                        )
            except _UPSTREAM_ERRORS:
                continue
        gw.metrics.reject(503)
        return json_error(503, "no healthy worker", "unavailable")

    # -- the request path ---------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request, route: str, path: str) -> web.StreamResponse:
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

    async def _admitted(self, request: web.Request, route: str, path: str) -> web.StreamResponse:
        gw = self.gw
        lim = self.limits
        t0 = gw.state.clock()
        cl = request.content_length
        if cl is not None and cl > self.max_body:
            gw.metrics.reject(413)
            return json_error(413, f"request body of {cl} bytes exceeds the limit of {self.max_body} bytes")
        try:
            body = await _read_within(request.content, request.read, lim.body_timeout_s)
        except asyncio.TimeoutError:
            return json_error(408, f"the request body did not arrive within {lim.body_timeout_s:g} s")
        try:
            obj, chain, n_tokens = await self.prompt_chain(route, body)
        except _PromptTooLong as e:
            return json_error(413, str(e))
        except PromptError as e:
            gw.metrics.reject(400)
            return json_error(400, str(e))
        arrivals = 1
        declared = request.headers.get(EXPECTED_REQUESTS_HEADER)
        if declared is not None:
            expected = _expected_requests(declared)
            if expected is None:
                gw.metrics.reject(400)
                return json_error(
                    400,
                    f"{EXPECTED_REQUESTS_HEADER}: must be an integer in [1, {MAX_EXPECTED_REQUESTS}], "
                    f"got {declared[:40]!r}",
                )
            if expected > 1 and len(chain) >= gw.constants.prefix_blocks:  # shorter prompts are never tracked
                arrivals += gw.declare(request.remote or "unknown", expected - 1)
        req = Request(
            request_id=gw.next_request_id(),
            arrival_s=t0,
            input_tokens=max(1, n_tokens),
            output_tokens=output_tokens_of(route, obj),
            block_hashes=chain,
            arrivals=arrivals,
        )
        stream = obj.get("stream") is True
        return await self._forward(request, path, body, req, stream, t0)

    async def prompt_chain(self, route: str, body: bytes) -> tuple[dict, tuple, int]:
        """A request body's parsed object, its prompt's chain of block hashes (in mode ``l3``: SGLang's page keys
        of its token ids) and its length in tokens, as the data plane routes it (big bodies are parsed off the
        event loop).

        Raises:
            PromptError: malformed body or prompt (400); :class:`~btbctl.engine.gateway.prompt.PromptTooLong` over
                ``max_prompt_tokens`` (413).
        """
        lim = self.limits
        l3 = self.gw.l3_prompts
        page_size = self.gw.page_size
        if len(body) > lim.offload_bytes:  # a big prompt: parse and hash it off the event loop
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="btb-prompt")
            loop = asyncio.get_running_loop()
            obj, chain, n_tokens = await loop.run_in_executor(
                self._pool, self._prepare, route, body, page_size, l3 is None
            )
        else:
            obj, chain, n_tokens = self._prepare(route, body, page_size, l3 is None)
        if l3 is not None:  # SGLang fleets: the chain is SGLang's page keys of the token ids
            big = len(body) > lim.offload_bytes
            chain, n_tokens = await l3.chain(
                route,
                obj,
                page_size,
                max_tokens=lim.max_prompt_tokens,
                max_blocks=lim.max_chain_blocks,
                offload=self._offload if big else None,
            )
        return obj, chain, n_tokens

    async def _offload(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in the prompt-hashing thread pool (a big prompt's ids and page keys)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="btb-prompt")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _prepare(self, route: str, body: bytes, page_size: int, hash_it: bool) -> tuple[dict, tuple, int]:
        """The parsed body, the prompt's chain (empty unless ``hash_it``) and its length in tokens; the length is
        checked against ``max_prompt_tokens`` before hashing. Runs in a thread for big bodies.

        Raises:
            PromptError: malformed body or prompt (400).
            _PromptTooLong: over ``max_prompt_tokens`` (413).
        """
        obj = parse_json_object(body)
        if not hash_it:
            return obj, (), 0
        data, n_tokens = prompt_of(route, obj)
        if n_tokens > self.limits.max_prompt_tokens:
            raise _PromptTooLong(
                f"prompt of {n_tokens} tokens exceeds the limit of {self.limits.max_prompt_tokens} tokens"
            )
        keep = self.limits.max_chain_blocks * page_size * BYTES_PER_TOKEN  # the leading blocks only
        return obj, chain_from_packed(data[:keep] if len(data) > keep else data, page_size), n_tokens

    def _learn(self, chain: tuple) -> None:
        """A worker answered ``chain``'s request successfully: the chain index may know it now (never before, so
        refused or failed requests cannot evict good prefixes from it)."""
        gw = self.gw
        gw.state.chains.add(chain)
        if len(chain) >= gw.constants.prefix_blocks:
            gw.mark_changed("prefixes")

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
        if not task.cancelled() and task.exception() is None:
            res = task.result()
            if isinstance(res, aiohttp.ClientResponse):
                res.close()
        if reason is not None:
            raise _Abandoned(reason)
        raise asyncio.TimeoutError(f"no first byte within {self.limits.first_byte_timeout_s:g} s")

    async def _forward(
        self, request: web.Request, path: str, body: bytes, req: Request, stream: bool, t0: float
    ) -> web.StreamResponse:
        retry = _RetrySlot(self)
        try:
            return await self._attempts(request, path, body, req, stream, t0, retry)
        finally:
            retry.release()

    def retry_allowance(self) -> int:
        """Retries that may be in flight now: ``retry_budget_percent`` of the requests in flight, at least
        ``retry_budget_min``."""
        lim = self.limits
        return max(lim.retry_budget_min, int(self.inflight * lim.retry_budget_percent / 100))

    async def _attempts(
        self, request: web.Request, path: str, body: bytes, req: Request, stream: bool, t0: float, retry: _RetrySlot
    ) -> web.StreamResponse:
        gw = self.gw
        state = gw.state
        metrics = gw.metrics
        policy_name = gw.policy.name
        chain = req.block_hashes
        rid = req.request_id
        excluded: list[int] = []
        attempts: list[str] = []
        lim = self.limits
        loop = asyncio.get_running_loop()
        learned = False
        kv_tokens = req.input_tokens + req.output_tokens  # what the request takes of a worker's KV at its end
        # whether the request's first token is seen before its whole answer (else a pace slot would last its decode)
        pace_ok = stream or req.output_tokens <= 1
        reached = False  # an attempt of it left the gateway: a request only held here is routed again for free
        for attempt in range(self.max_retries + 1):
            if attempt and reached and not retry.take():
                metrics.retries_denied.inc()
                self._warn("retry_denied", request=rid, retrying=self.retrying, inflight=self.inflight)
                metrics.request("none", policy_name, "503")
                metrics.reject(503, "retry_budget")
                return overloaded(
                    lim.retry_after_s,
                    f"no retry left in the fleet's retry budget after {plural(len(attempts), 'attempt')}: "
                    + "; ".join(attempts)[:500],
                )
            pick = gw.choose(req, excluded)
            if pick is None:
                break
            idx, pace = pick
            if not pace_ok:
                pace = 0
            w = state.workers[idx]
            if attempt:
                metrics.retries.inc()
                log_event(log, "request_retry", request=rid, attempt=attempt, worker=w.name, after=attempts[-1][:200])
            w.inflight += 1
            w.start_prefill(rid, chain, req.input_tokens)
            gauge = metrics.inflight_gauge(worker_label(w))
            gauge.inc()
            prefilled = False
            counted_kv = kv_epoch = 0  # KV tokens this attempt counts at the worker (once it leaves the gateway)
            solo: list[tuple[int, float]] = []  # (cached tokens, sent at) of a calibration sample (see below)
            sent: list[float] = []  # when the request left for the worker (after any wait at a copy's gate)

            # w and idx bound as defaults: the callback belongs to this attempt's worker
            def first_byte(now: float | None = None, w=w, idx=idx, solo=solo, sent=sent) -> None:
                nonlocal prefilled, learned
                prefilled = True
                if chain and not learned:
                    learned = True
                    self._learn(chain)
                if now is None:
                    now = state.clock()
                w.last_progress_s = now
                self._prefill_ended(idx, w, rid, bool(sent))
                if chain:
                    w.hold_routed(chain)
                ttft = now - t0
                if solo:  # a request alone on its worker: what its prefill really took
                    state.observe_prefill(req.input_tokens, solo[0][0], now - solo[0][1])
                state.record_ttft(idx, now, ttft, now - sent[0] if sent else None)
                metrics.observe_ttft(worker_label(w), ttft, policy_name)
                gw.mark_changed("ttft")

            deadline = loop.time() + lim.first_byte_timeout_s
            try:
                if chain and state.transfers.active:
                    await _await_copy_accepted(state, idx, chain)
                # Held at the gateway before it leaves: l3, until the copies to this worker are proved (a failed
                # one: the worker computes the prefix itself, as without it); a paced route, until its turn. Only the
                # worker going down moves it elsewhere.
                held = False
                down = None
                if chain and state.transfers.active and state.transfers.gate(idx, chain) is not None:
                    held = True
                    down = await self._held(self._through_gates(idx, chain, w, deadline), w, excluded, "its copy")
                if down is None and pace:
                    held = True
                    turn = self._turn(idx, w, pace, loop.time() + lim.first_byte_timeout_s)
                    down = await self._held(turn, w, excluded, "its turn")
                if down is not None:
                    attempts.append(f"{w.url}: {down}")
                    excluded.append(idx)
                    continue
                if held:
                    if request.transport is None or request.transport.is_closing():  # the client left meanwhile
                        metrics.request(worker_label(w), policy_name, "client_gone")
                        return web.Response(status=499)
                    deadline = loop.time() + lim.first_byte_timeout_s
                sent.append(state.clock())
                w.leave()
                reached = True
                counted_kv = w.kv_tokens_of(kv_tokens)
                kv_epoch = w.send_kv(counted_kv)
                if state.calibrating and w.inflight == 1 and (stream or req.output_tokens <= 1):
                    solo.append((w.held_blocks(chain) * gw.page_size if chain else 0, sent[0]))
                try:
                    resp = await self._until_first_byte(
                        gw.session.post(
                            self._url(w.url, path),
                            # a ready payload: aiohttp skips looking its type up in its payload registry
                            data=BytesPayload(body, content_type="application/json"),
                            headers=_FORWARD_HEADERS,
                        ),
                        idx,
                        deadline,
                    )
                except _Abandoned as e:
                    attempts.append(f"{w.url}: marked unhealthy before its first byte ({e})")
                    excluded.append(idx)
                    continue
                except _UPSTREAM_ERRORS as e:
                    if is_local_exhaustion(e):  # our descriptors, not the worker's fault
                        metrics.reject(503, "descriptors")
                        self._warn("upstream_connect_refused", reason="descriptors", worker=w.url, error=_describe(e))
                        return overloaded(lim.retry_after_s, "the gateway is out of descriptors; retry shortly")
                    reason = _describe(e)
                    attempts.append(f"{w.url}: {reason}")
                    gw.worker_failed(idx, reason, _kind(e))
                    excluded.append(idx)
                    continue
                t_head = state.clock()
                try:
                    status = resp.status
                    if status >= 500:
                        try:
                            detail = (await asyncio.wait_for(resp.read(), lim.idle_timeout_s))[:200].decode(
                                "utf-8", "replace"
                            )
                        except _UPSTREAM_ERRORS:
                            detail = ""
                        reason = f"HTTP {status}" + (f": {detail}" if detail else "")
                        attempts.append(f"{w.url}: {reason}")
                        gw.worker_failed(idx, reason)
                        excluded.append(idx)
                        continue
                    ctype = resp.headers.get("Content-Type", "application/json")
                    if not (stream and status == 200 and ctype.startswith("text/event-stream")):
                        try:
                            payload = await _read_within(resp.content, resp.read, lim.idle_timeout_s)
                        except _UPSTREAM_ERRORS as e:
                            reason = f"answer broke off: {_describe(e)}"
                            attempts.append(f"{w.url}: {reason}")
                            gw.worker_failed(idx, reason, _kind(e))
                            excluded.append(idx)
                            continue
                        if status < 300:
                            first_byte(t_head)
                        w.last_progress_s = state.clock()  # it answered: alive, whatever its /health says
                        # a 4xx is the client's: passed through as is, the worker stays healthy
                        w.served += 1
                        metrics.request(worker_label(w), policy_name, str(status))
                        metrics.observe_duration(worker_label(w), state.clock() - t0)
                        return web.Response(
                            status=status, body=payload, headers={"Content-Type": ctype, WORKER_HEADER: w.url}
                        )
                    return await self._stream(
                        request, resp, w, idx, policy_name, ctype, first_byte, attempts, excluded, t0, deadline
                    )
                finally:
                    resp.release()
            except _RetryStream:
                continue
            finally:
                w.inflight -= 1
                if counted_kv:
                    w.finish_kv(counted_kv, kv_epoch)
                gauge.dec()
                if not prefilled:
                    self._prefill_ended(idx, w, rid, bool(sent))
                gw.policy.on_finish(req, idx, state.clock())
        if not attempts:
            metrics.request("none", policy_name, "503")
            metrics.reject(503)
            return json_error(503, "no healthy worker", "unavailable")
        metrics.request("none", policy_name, "502")
        return json_error(
            502,
            f"no worker could serve the request after {plural(len(attempts), 'attempt')}",
            "upstream_error",
            attempts=attempts,
        )

    async def _stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        w,
        idx: int,
        policy_name: str,
        ctype: str,
        first_byte,
        attempts: list[str],
        excluded: list[int],
        t0: float,
        deadline: float,
    ) -> web.StreamResponse:
        gw = self.gw
        clock = gw.state.clock
        idle = self.limits.idle_timeout_s
        content = resp.content
        held: list[bytes] = []
        size = 0
        # Before the first data chunk nothing has reached the client: a failure here is retried elsewhere.
        try:
            while True:
                chunk = await self._until_first_byte(content.readany(), idx, deadline)
                if not chunk:
                    raise aiohttp.ClientPayloadError("stream ended before any data")
                held.append(chunk)
                size += len(chunk)
                if b"data:" in chunk or size >= _PREAMBLE_LIMIT:
                    break
        except _Abandoned as e:
            attempts.append(f"{w.url}: marked unhealthy before its first byte ({e})")
            excluded.append(idx)
            raise _RetryStream() from None
        except _UPSTREAM_ERRORS as e:
            reason = f"stream broke before its first byte: {_describe(e)}"
            attempts.append(f"{w.url}: {reason}")
            gw.worker_failed(idx, reason, _kind(e))
            excluded.append(idx)
            raise _RetryStream() from None
        first_byte()
        out = web.StreamResponse(
            status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache", WORKER_HEADER: w.url}
        )
        status = "200"
        try:
            await out.prepare(request)
            await out.write(b"".join(held))
        except (ConnectionResetError, RuntimeError):  # the client went away
            resp.close()
            gw.metrics.request(worker_label(w), policy_name, "client_gone")
            return out
        # From here on the answer is committed to this worker: never retried.
        tail = b"".join(held)[-_DONE_TAIL:]
        while True:
            try:
                chunk = await asyncio.wait_for(content.readany(), idle)
            except _UPSTREAM_ERRORS as e:
                why = f"no data for {idle:g} s (idle timeout)" if isinstance(e, asyncio.TimeoutError) else _describe(e)
                reason = f"stream broke after its first byte: {why}"
                gw.worker_failed(idx, reason, _kind(e))
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
        if status == "200":
            w.served += 1
        else:
            resp.close()  # stop the worker's side of an abandoned or broken stream
        gw.metrics.request(worker_label(w), policy_name, status)
        gw.metrics.observe_duration(worker_label(w), gw.state.clock() - t0)
        return out


def _expected_requests(raw: str) -> int | None:
    """The value of :data:`EXPECTED_REQUESTS_HEADER`, or None when it is not an integer in
    ``[1, MAX_EXPECTED_REQUESTS]``."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 10:  # ASCII: str.isdigit() also takes '²' and '３'
        return None
    n = int(text)
    return n if 1 <= n <= MAX_EXPECTED_REQUESTS else None


async def _read_within(content: aiohttp.StreamReader, read: Callable[[], Awaitable[bytes]], timeout_s: float) -> bytes:
    """``await read()`` (a whole body), at most ``timeout_s``; without the timeout's task and timer when the body
    is already all buffered (``content`` at its end: usually so for small bodies, which arrive with their head)."""
    if content.is_eof():
        return await read()
    return await asyncio.wait_for(read(), timeout_s)


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


class _RetryStream(Exception):
    """Internal: a stream failed before its first byte reached the client."""


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


_PromptTooLong = PromptTooLong


def _kind(e: BaseException) -> str:
    """How an upstream failure looks (``worker_failed``'s ``kind``): ``slow`` for a timeout, else ``refused``."""
    return "slow" if isinstance(e, asyncio.TimeoutError) else "refused"


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def build_data_app(dp: DataPlane, middlewares: Sequence[Any] = ()) -> web.Application:
    """The data-plane :class:`aiohttp.web.Application` of ``dp`` (``middlewares`` run before the error
    middleware)."""
    app = web.Application(client_max_size=dp.max_body, middlewares=[*middlewares, error_middleware])
    app[METRICS_KEY] = dp.gw.metrics
    app.router.add_post(DATA_ROUTES["generate"], dp.generate)
    app.router.add_post(DATA_ROUTES["completions"], dp.completions)
    app.router.add_post(DATA_ROUTES["chat"], dp.chat)
    app.router.add_get("/v1/models", dp.models)
    app.router.add_get("/health", dp.health)
    app.router.add_get("/metrics", dp.metrics)
    return app
