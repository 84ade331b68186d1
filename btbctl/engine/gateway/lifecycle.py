"""A request's life at the gateway, between the HTTP server (the data plane) and the rules.

The data plane moves bytes: it reads a body, holds a request at the gateway when told to, forwards it and streams
the answer back. Everything a request means to the fleet happens here, in the order of the extension points that
the Gateway API Inference Extension and llm-d's scheduler name:

1. :meth:`RequestLifecycle.admit` (produce the request's data): parse the body, tokenize (``l3``: SGLang's page
   keys), hash the prompt into its chain of blocks, grant a declared burst; a :class:`Request` or a
   :class:`Refusal`.
2. :meth:`~RequestLifecycle.pick`: the burst detector sees the arrival (unless the policy observes through it), the
   fleet's other gateways hear of it, the policy's :class:`~btbctl.engine.policies.base.Route` names the worker
   and its pace, and the route's copy orders go to the executor of the replication mode (pre-request). An
   unavailable pick falls back to the least-loaded available worker.
3. :meth:`~RequestLifecycle.start` / :meth:`~RequestLifecycle.sent`: an :class:`Attempt` on that worker counts
   in its load, its prefill and its KV use from the moment it is routed / it left the gateway.
4. :meth:`~RequestLifecycle.first_byte`: the prefill ended; the worker holds the prompt's blocks, TTFT is
   recorded, the chain index learns the prompt.
5. :meth:`~RequestLifecycle.answered` (the answer went out) or :meth:`~RequestLifecycle.worker_failed` (the data
   plane retries elsewhere while nothing reached the client; the retry is the data plane's explicit decision) and,
   for every attempt, :meth:`~RequestLifecycle.end`.
6. Workers removed and added: :meth:`~RequestLifecycle.worker_down` (a failed health check or forwarded request:
   out of the routing; the data plane's attempts waiting there hear of it through ``on_worker_down``),
   :meth:`~RequestLifecycle.worker_up` and :meth:`~RequestLifecycle.worker_degraded` (the health prober's).

The lifecycle owns the request path's pieces: the fleet state, the detector, the policy (swapped with
:meth:`~RequestLifecycle.install_policy`) and the copy executor; the data plane knows only this object
(:class:`~btbctl.engine.gateway.dataplane.Lifecycle`, its protocol) and never imports a rule, the detector or an
executor (an import contract keeps it so).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from btbctl.engine.constants import BtbConstants
from btbctl.engine.detector import BurstDetector, DeclaredBursts, tracked_key
from btbctl.engine.gateway.fleetshare import FleetShare
from btbctl.engine.gateway.metrics import GatewayMetrics, worker_label
from btbctl.engine.gateway.prompt import (
    PromptError,
    PromptTooLong,
    chain_from_packed,
    output_tokens_of,
    parse_json_object,
    prompt_of,
)
from btbctl.engine.gateway.replicator import CopyExecutor
from btbctl.engine.gateway.state import FleetState, WorkerState
from btbctl.engine.gateway.tokens import L3Prompts
from btbctl.engine.hashing import BYTES_PER_TOKEN
from btbctl.engine.logfmt import log_event
from btbctl.engine.policies.base import ExcludingView, Policy
from btbctl.engine.trace.model import Request

#: the gateway's operations log (the lines of a request's path keep the logger they always had)
log = logging.getLogger("btbctl.engine.gateway.server")

#: Request header of a batch client declaring its burst: how many requests of this prompt it is about to send
#: (an integer >= 1). The detector counts the request as that many arrivals, within the client's bound
#: (``declared_requests_max``); the header is not forwarded to the worker.
EXPECTED_REQUESTS_HEADER = "X-BTB-Expected-Requests"
#: Largest value the header may carry (what is granted is bounded far lower, per client).
MAX_EXPECTED_REQUESTS = 1_000_000_000


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted: the HTTP status and a one-line message; ``counted``: whether it counts in
    ``btb_rejected_requests`` (a malformed request does; a too long one is the client's limit)."""

    status: int
    message: str
    counted: bool = True


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt may be: ``max_prompt_tokens`` tokens, of which the leading ``max_chain_blocks`` blocks are
    hashed; bodies over ``offload_bytes`` are parsed and hashed in a thread, off the event loop."""

    max_prompt_tokens: int
    max_chain_blocks: int
    offload_bytes: int


@dataclass(eq=False)
class Attempt:
    """One try of a request on one worker, from :meth:`RequestLifecycle.start` to :meth:`RequestLifecycle.end`.

    Attributes:
        req: the request; ``idx`` / ``worker``: where it is tried; ``pace``: the route's pace (0: none); ``early``:
            its first token is seen before its whole answer (see :meth:`RequestLifecycle.start`);
            ``policy_name``: the policy that routed it (its metrics' label).
        sent_s: when it left the gateway (after any hold), clock seconds; None while held.
        prefilled: its first byte came.
        solo_tokens: a calibration sample: the cached tokens when it was sent alone to its worker (else None).
        counted_kv / kv_epoch: the KV tokens it counts at the worker once sent, and the worker's epoch then.
    """

    req: Request
    idx: int
    worker: WorkerState
    pace: int
    early: bool
    gauge: Any
    policy_name: str
    sent_s: float | None = None
    prefilled: bool = False
    solo_tokens: int | None = None
    counted_kv: int = 0
    kv_epoch: int = 0


@dataclass
class RequestLifecycle:
    """The request path of one gateway (see the module's docstring). ``clock`` gives seconds since the gateway
    started; ``mark`` tells the control API's event bus what changed (``prefixes``, ``ttft``); ``page_size`` the
    tokens per block (fixed once a worker told it); ``on_fallback``: routing falls back to answering but unhealthy
    workers (True) or no longer (False)."""

    state: FleetState
    detector: BurstDetector
    executor: CopyExecutor
    metrics: GatewayMetrics
    constants: BtbConstants
    rng: random.Random
    declared: DeclaredBursts
    limits: PromptLimits
    clock: Callable[[], float]
    mark: Callable[[str], None]
    page_size: Callable[[], int]
    on_fallback: Callable[[bool], None]
    policy: Policy
    l3_prompts: L3Prompts | None = None
    fleet: FleetShare | None = None
    reroute_on_unhealthy: bool = True
    #: ``(worker index, reason)``: the data plane's attempts waiting there give up on a worker that went down
    #: silent (set by whoever wires the data plane to this lifecycle)
    on_worker_down: Callable[[int, str], None] | None = None
    _feeds_detector: bool = field(default=False, init=False)
    _request_seq: int = field(default=0, init=False)
    _pool: ThreadPoolExecutor | None = field(default=None, init=False)

    # -- the policy -----------------------------------------------------------------------------------------------

    def install_policy(self, new: Policy, old: Policy | None, tree_max_blocks: int, tree_max_bytes: int) -> None:
        """Route with ``new`` from the next request. One detector serves the gateway's life (heat survives swaps),
        fed once per request: by the policy when it declares it observes through it
        (:meth:`~btbctl.engine.policies.base.Policy.share_detector`), else here; a cache-aware prefix tree moves
        from ``old`` to ``new`` when both carry one, under one bound for all workers."""
        new.configure(block_tokens=self.page_size())
        self._feeds_detector = not new.share_detector(self.detector)
        if old is not None:
            src, dst = old.tree_holder(), new.tree_holder()
            if src is not None and dst is not None:
                dst.tree = src.tree  # keep the cache-aware affinity learned so far
        holder = new.tree_holder()
        if holder is not None:
            holder.tree.set_bounds(max_blocks=tree_max_blocks, max_bytes=tree_max_bytes)
        self.policy = new

    # -- 1. admit -------------------------------------------------------------------------------------------------

    async def admit(
        self, route: str, body: bytes, declared: str | None, client: str, arrival_s: float
    ) -> tuple[Request, bool] | Refusal:
        """The request of ``body`` on data route ``route`` (``generate``, ``completions``, ``chat``), arrived at
        ``arrival_s`` (clock seconds), with the ``X-BTB-Expected-Requests`` header ``declared`` (None: absent) from
        ``client`` (an address), and whether it asks for a stream; or why it is refused (400 malformed, 413 too
        long)."""
        try:
            obj, chain, n_tokens = await self.prompt_chain(route, body)
        except PromptTooLong as e:
            return Refusal(413, str(e), counted=False)
        except PromptError as e:
            return Refusal(400, str(e))
        arrivals = 1
        if declared is not None:
            expected = expected_requests(declared)
            if expected is None:
                return Refusal(
                    400,
                    f"{EXPECTED_REQUESTS_HEADER}: must be an integer in [1, {MAX_EXPECTED_REQUESTS}], "
                    f"got {declared[:40]!r}",
                )
            if expected > 1 and len(chain) >= self.constants.prefix_blocks:  # shorter prompts are never tracked
                arrivals += self.declare(client, expected - 1)
        self._request_seq += 1
        req = Request(
            request_id=str(self._request_seq),
            arrival_s=arrival_s,
            input_tokens=max(1, n_tokens),
            output_tokens=output_tokens_of(route, obj),
            block_hashes=chain,
            arrivals=arrivals,
        )
        return req, obj.get("stream") is True

    async def prompt_chain(self, route: str, body: bytes) -> tuple[dict, tuple, int]:
        """A request body's parsed object, its prompt's chain of block hashes (in mode ``l3``: SGLang's page keys
        of its token ids) and its length in tokens (big bodies are parsed off the event loop).

        Raises:
            PromptError: malformed body or prompt (400); :class:`~btbctl.engine.gateway.prompt.PromptTooLong` over
                ``max_prompt_tokens`` (413).
        """
        lim = self.limits
        l3 = self.l3_prompts
        page_size = self.page_size()
        big = len(body) > lim.offload_bytes
        if big:  # a big prompt: parse and hash it off the event loop
            obj, chain, n_tokens = await self._offload(lambda: self._prepare(route, body, page_size, l3 is None))
        else:
            obj, chain, n_tokens = self._prepare(route, body, page_size, l3 is None)
        if l3 is not None:  # SGLang fleets: the chain is SGLang's page keys of the token ids
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
        """Run ``fn`` in the prompt-hashing thread pool (a big prompt's parse, ids and page keys)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="btb-prompt")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _prepare(self, route: str, body: bytes, page_size: int, hash_it: bool) -> tuple[dict, tuple, int]:
        """The parsed body, the prompt's chain (empty unless ``hash_it``) and its length in tokens; the length is
        checked against ``max_prompt_tokens`` before hashing. Runs in a thread for big bodies.

        Raises:
            PromptError: malformed body or prompt (400).
            PromptTooLong: over ``max_prompt_tokens`` (413).
        """
        obj = parse_json_object(body)
        if not hash_it:
            return obj, (), 0
        data, n_tokens = prompt_of(route, obj)
        lim = self.limits
        if n_tokens > lim.max_prompt_tokens:
            raise PromptTooLong(f"prompt of {n_tokens} tokens exceeds the limit of {lim.max_prompt_tokens} tokens")
        keep = lim.max_chain_blocks * page_size * BYTES_PER_TOKEN  # the leading blocks only
        return obj, chain_from_packed(data[:keep] if len(data) > keep else data, page_size), n_tokens

    def declare(self, client: str, extra: int) -> int:
        """Extra detector arrivals granted to ``client`` (an address) that declared ``extra`` more requests of its
        prompt: at most what is left of ``declared_requests_max`` in the trailing ``window_s``. What is asked
        beyond is dropped, with one ``declared_burst_capped`` line per client and window."""
        window_s = self.constants.window_s
        granted, first_refusal = self.declared.grant(client, extra, self.clock(), window_s)
        if first_refusal:
            log_event(
                log,
                "declared_burst_capped",
                logging.WARNING,
                client=client,
                asked=extra,
                granted=granted,
                cap=self.declared.max_extra,
                window_s=window_s,
            )
        return granted

    # -- 2. pick (and pre-request: the route's copy orders) ---------------------------------------------------------

    def pick(self, req: Request, excluded: Sequence[int]) -> tuple[int, int] | None:
        """The worker for ``req`` and its pace (``Route.pace``): the policy's choice, unless that worker is
        unavailable (unhealthy or in ``excluded``), in which case the least-loaded available one (ties at random)
        with pace 0. None when no worker is available. The route's copy plans go to the executor (never to or from
        an excluded worker). Feeds the detector when the policy does not (once per request: not again on a retry; a
        BTB-style policy observes the arrival again when asked again, a rare double count after a failure)."""
        state = self.state
        now = self.clock()
        if not excluded:
            if self._feeds_detector:
                self.detector.observe(req.block_hashes, now, req.arrivals)
            if self.fleet is not None:
                key = tracked_key(req.block_hashes, self.constants.prefix_blocks)
                if key is not None:
                    self.fleet.note_arrival(key, req.arrivals)
        view = ExcludingView(state, excluded) if excluded else state
        policy = self.policy
        route = policy.route(req, view, now)
        for plan in route.copies:
            self.executor.execute(plan, policy, excluded)
        idx = route.replica
        ws = state.workers
        if 0 <= idx < len(ws) and ws[idx].healthy and idx not in excluded:
            self.on_fallback(False)
            return idx, route.pace
        open_ = [w for w in ws if w.healthy and w.index not in excluded]
        if open_:
            self.on_fallback(False)
        else:  # none is healthy: the ones still answering rather than refusing the request
            open_ = state.fallback(excluded)
            if not open_:
                return None
            self.on_fallback(True)
        low = min(w.inflight for w in open_)
        return self.rng.choice([w.index for w in open_ if w.inflight == low]), 0

    # -- 3. an attempt on a worker ----------------------------------------------------------------------------------

    def start(self, req: Request, idx: int, pace: int, early: bool) -> Attempt:
        """An attempt of ``req`` on worker ``idx`` with the route's ``pace`` begins: it counts in the worker's load
        and prefill queue now. ``early``: the gateway sees its first token before its whole answer (streamed, or one
        output token); only then is it paced (else a pace slot would last its decode)."""
        w = self.state.workers[idx]
        w.inflight += 1
        w.start_prefill(req.request_id, req.block_hashes, req.input_tokens)
        gauge = self.metrics.inflight_gauge(worker_label(w))
        gauge.inc()
        return Attempt(req, idx, w, pace if early else 0, early, gauge, self.policy.name)

    def sent(self, a: Attempt) -> None:
        """Attempt ``a`` leaves the gateway for its worker now: its KV use counts there from now on; alone on its
        worker (and ``a.early``), it is a calibration sample of the prefill rate."""
        state = self.state
        w = a.worker
        req = a.req
        a.sent_s = state.clock()
        w.leave()
        a.counted_kv = w.kv_tokens_of(req.input_tokens + req.output_tokens)
        a.kv_epoch = w.send_kv(a.counted_kv)
        if state.calibrating and w.inflight == 1 and a.early:
            chain = req.block_hashes
            a.solo_tokens = w.held_blocks(chain) * self.page_size() if chain else 0

    # -- 4. first byte --------------------------------------------------------------------------------------------

    def first_byte(self, a: Attempt, now: float | None = None) -> None:
        """The first byte of attempt ``a``'s answer came (at ``now``, clock seconds; default: now; once per
        request: nothing is retried after it): its prefill ended, its worker holds the prompt's blocks, the chain
        index learns the prompt (only an answered request teaches it, so refused or failed ones cannot evict good
        prefixes), TTFT is recorded."""
        a.prefilled = True
        state = self.state
        req = a.req
        chain = req.block_hashes
        w = a.worker
        if chain:
            state.chains.add(chain)
            if len(chain) >= self.constants.prefix_blocks:
                self.mark("prefixes")
        if now is None:
            now = state.clock()
        w.last_progress_s = now
        w.end_prefill(req.request_id, a.sent_s is not None)
        if chain:
            w.hold_routed(chain)
        ttft = now - req.arrival_s
        if a.solo_tokens is not None and a.sent_s is not None:  # alone on its worker: what its prefill really took
            state.observe_prefill(req.input_tokens, a.solo_tokens, now - a.sent_s)
        state.record_ttft(a.idx, now, ttft, now - a.sent_s if a.sent_s is not None else None)
        self.metrics.observe_ttft(worker_label(w), ttft, a.policy_name)
        self.mark("ttft")

    # -- 5. outcomes ----------------------------------------------------------------------------------------------

    def answered(self, a: Attempt, status: str) -> None:
        """Attempt ``a``'s answer went to the client with ``status`` (an HTTP status, or ``stream_error`` /
        ``client_gone`` for a stream that broke off after its first byte); an answer with an HTTP status counts as
        served by its worker (a 4xx is the client's problem)."""
        w = a.worker
        if status.isdigit():
            w.served += 1
        label = worker_label(w)
        self.metrics.request(label, a.policy_name, status)
        self.metrics.observe_duration(label, self.state.clock() - a.req.arrival_s)

    def unanswered(self, a: Attempt | None, status: str) -> None:
        """A request ended without an answer from a worker: ``status`` (``client_gone``, ``502``, ``503``) counted
        against attempt ``a``'s worker (None: no worker was reached)."""
        if a is None:
            self.metrics.request("none", self.policy.name, status)
        else:
            self.metrics.request(worker_label(a.worker), a.policy_name, status)

    def end(self, a: Attempt) -> None:
        """Attempt ``a`` is over (answered, failed or abandoned): it leaves its worker's load; without a first byte
        its prefill place is given up."""
        w = a.worker
        w.inflight -= 1
        if a.counted_kv:
            w.finish_kv(a.counted_kv, a.kv_epoch)
        a.gauge.dec()
        if not a.prefilled:
            w.end_prefill(a.req.request_id, a.sent_s is not None)
        self.policy.on_finish(a.req, a.idx, self.state.clock())

    # -- 6. workers removed from and added back to the routing -----------------------------------------------------

    def worker_failed(self, idx: int, reason: str, kind: str = "error") -> None:
        """A forwarded request failed on worker ``idx`` (``kind``: ``refused``, a connection error or a broken
        answer; ``error``, a 5xx; ``slow``, no first byte in time): it is marked unhealthy now."""
        w = self.state.workers[idx]
        w.failed += 1
        w.failure_kind = kind
        self.worker_down(w, reason)

    def worker_down(self, w: WorkerState, reason: str) -> None:
        """``w`` failed (its health check, or a forwarded request): out of the routing, its holdings forgotten. Its
        requests still waiting for a first byte are sent elsewhere only when it shows no sign of life either (a
        frozen or dead process): a worker that is answering keeps them, and each one that fails fails over on its
        own."""
        w.health_error = reason
        w.degraded = None
        if w.healthy:
            w.healthy = False
            w.forget()
            self.metrics.healthy.labels(worker_label(w)).set(0)
            alive = self.state.alive(w)
            log_event(
                log,
                "worker_down",
                logging.WARNING,
                worker=w.name,
                url=w.url,
                reason=reason.splitlines()[0],
                answering=alive or None,
            )
            if self.on_worker_down is not None and self.reroute_on_unhealthy and not alive:
                self.on_worker_down(w.index, reason)
        self.mark("fleet")

    def worker_up(self, w: WorkerState, degraded: str | None = None) -> None:
        """``w`` passed its check after being down, unidentified or degraded (or, with ``degraded``, shows signs
        of life while down: it comes back degraded). A worker coming back may have restarted: its holdings and
        times are forgotten."""
        if w.healthy and w.degraded is not None and degraded is None:  # /health passes again: it was up all along
            w.degraded = None
            log_event(log, "worker_recovered", worker=w.name, url=w.url)
            self.mark("fleet")
            return
        w.forget()  # a worker coming back may have restarted with an empty cache
        w.ttft_ewma_s = None  # ... and its old times say nothing of it now (the healthy ones' stand in)
        w.server_info = None  # ... or with other flags: the scraper reads its /server_info again
        if not w.healthy:
            log_event(log, "worker_up", worker=w.name, url=w.url, degraded=degraded)
        w.healthy = True
        w.health_error = None
        w.degraded = degraded
        self.metrics.healthy.labels(worker_label(w)).set(1)

    def worker_degraded(self, w: WorkerState, reason: str) -> None:
        """``w``'s ``/health`` timed out but it shows signs of life: busy, not dead. It stays (or comes back) in
        the routing, with ``degraded`` saying why; one line when it becomes degraded."""
        was = w.degraded
        if not w.healthy:
            self.worker_up(w, degraded=reason)
        elif was is None:
            log_event(log, "worker_degraded", logging.WARNING, worker=w.name, url=w.url, reason=reason)
        w.degraded = reason
        self.mark("fleet")

    def close(self) -> None:
        """Stop the prompt-hashing thread pool (after the listener stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def expected_requests(raw: str) -> int | None:
    """The value of :data:`EXPECTED_REQUESTS_HEADER`, or None when it is not an integer in
    ``[1, MAX_EXPECTED_REQUESTS]``."""
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 10:  # ASCII: str.isdigit() also takes '²' and '３'
        return None
    n = int(text)
    return n if 1 <= n <= MAX_EXPECTED_REQUESTS else None
