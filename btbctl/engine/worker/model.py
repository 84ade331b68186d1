"""The emulated worker's "GPU": one :class:`~btbctl.engine.sim.replica.ReplicaModel` driven in (scaled) real time.

Model time runs at ``time_scale`` model seconds per wall second: ``model_now = (clock() - t0) x time_scale``, with
an injected monotonic ``clock``. A driver task sleeps until the end of the model's step in progress (converted back
to wall time) and is woken by every submission, so each request's first token and finish happen at the wall time
the model says. In zero-delay mode (``--zero-delay`` or ``time_scale`` 0) model time is decoupled from the wall
clock: a submission runs the model forward until that request finishes, at once; cache bookkeeping is the same.

A streamed request whose HTTP client went away is aborted (as SGLang does): it leaves the decode batch at once, or
stops at its first token if it had not reached it; a non-streamed one runs to completion.

Copies. *Outgoing*: :meth:`ModelDriver.wait_blocks` lets a sender wait until the model has committed the leading
blocks of a chain it is still computing (blocks commit at the end of each prefill chunk); waiters are checked after
every step of the model. *Incoming*: :meth:`ModelDriver.begin_copy` registers a chain whose blocks are arriving as
pending in the model (room reserved, the blocks already resident pinned), so a request needing them waits for them
instead of recomputing; :meth:`ModelDriver.end_copy` commits them (all verified) or drops the reservation (the copy
failed: waiting requests then compute the blocks themselves).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from btbctl.engine.aiotasks import cancel_and_wait
from btbctl.engine.sim.replica import IncomingCopy, ReplicaModel, ReplicaRequest, ReplicaState
from btbctl.engine.trace.model import Request
from btbctl.engine.worker.config import WorkerConfig


class TooLarge(ValueError):
    """A request whose prompt plus output can never fit in this worker's KV cache (HTTP 400)."""


class BlocksLost(RuntimeError):
    """Blocks a sender waits for are neither resident nor being computed here any more (evicted, or never
    planned), or did not arrive within the wait's timeout."""


class NoRoom(RuntimeError):
    """An incoming copy does not fit in the KV cache (even after evicting every unpinned block)."""


@dataclass
class LiveRequest:
    """One request in flight. Wall times are ``clock()`` seconds; model times are model seconds.

    ``first`` resolves when the first token is out (with ``cached_tokens``), ``done`` when the request finished
    (with True).
    """

    rid: str
    sim_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival_wall: float
    first: asyncio.Future
    done: asyncio.Future
    cached_tokens: int = 0
    first_wall: float = math.nan
    finish_wall: float = math.nan
    ttft_model_s: float = math.nan
    e2e_model_s: float = math.nan
    itl_wall_s: float = 0.0
    """Estimated wall seconds between output tokens (decode step time at the first token / time_scale)."""
    tiers: object | None = None
    """With HiCache: how its prefix was served (:class:`~btbctl.engine.worker.hicache.Admission`)."""


class ModelDriver:
    """Drives the worker's replica model against an injected clock; its :class:`ReplicaEvents
    <btbctl.engine.sim.replica.ReplicaEvents>` sink.

    Args:
        cfg: worker settings (model, GPU, TP size, page size, chunking, ``time_scale``, zero-delay mode).
        clock: wall clock (monotonic seconds), injectable for tests.

    Raises:
        ConfigError: a model that does not fit its GPUs, unknown presets.
    """

    def __init__(self, cfg: WorkerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.cluster = cfg.cluster()
        self.cost = self.cluster.replica_cost()
        self.block_tokens = cfg.page_size
        self.capacity_tokens = cfg.max_total_tokens or self.cost.kv_budget_tokens
        self.zero = cfg.zero
        self.scale = cfg.time_scale
        self.clock = clock
        self.t0 = clock()
        self._ids = itertools.count(1)
        self._seqs = itertools.count(1)
        self._live: dict[str, LiveRequest] = {}
        self._requests: dict[str, ReplicaRequest] = {}  # sim_id -> the model's request, until it finishes
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        #: called with the hash of every block the model evicts
        self.on_evict: list[Callable[[Hashable], None]] = []
        #: called with the hash of every block the model makes resident (computed or copied)
        self.on_insert: list[Callable[[Hashable], None]] = []
        #: called with ``(chain, start, stop)`` whenever a prefill commits ``chain[start:stop]`` (write-through)
        self.on_computed: list[Callable[[tuple, int, int], None]] = []
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        #: senders waiting for blocks: (chain, blocks needed, future resolved with the resident count)
        self._block_waiters: list[tuple[tuple, int, asyncio.Future]] = []
        self._incoming: set[int] = set()  # ids of incoming copies still open
        self.now_s = 0.0  # model time reached, seconds
        self._step_end: float | None = None  # model time the replica's step in progress ends (None: idle)
        self.replica = ReplicaModel(
            0,
            self.cost,
            block_tokens=self.block_tokens,
            chunk_tokens=self.cluster.chunk_tokens(),
            max_running=self.cluster.max_running,
            events=self,
            kv_tokens=self.capacity_tokens,
        )

    # -- clock ------------------------------------------------------------------------------------------------
    def model_now(self) -> float:
        """Current model time, seconds."""
        if self.zero:
            return self.now_s
        return (self.clock() - self.t0) * self.scale

    def next_event_s(self) -> float | None:
        """Model time the step in progress ends (None when the model is idle)."""
        return self._step_end

    def advance_to(self, t: float) -> None:
        """End every step due at or before model time ``t``; afterwards ``now_s == max(now_s, t)``."""
        rep = self.replica
        while self._step_end is not None and self._step_end <= t:
            end = self._step_end
            self._step_end = None
            self.now_s = max(self.now_s, end)
            rep.end_step(self.now_s)  # schedules the next step, if any
        self.now_s = max(self.now_s, t)

    def sync(self) -> None:
        """Bring the model up to the current time (fires hooks of events that are due)."""
        if not self.zero:
            self.advance_to(self.model_now())
        if self._block_waiters:
            self._release_blocks()

    def _run_until_idle(self, done: Callable[[], bool]) -> bool:
        """Zero-delay mode: run the model step by step until ``done()``; False if it went idle first."""
        while not done():
            t = self._step_end
            if t is None:
                return False
            self.advance_to(t)
        return True

    def start(self) -> None:
        """Start the driver task (not needed in zero-delay mode). Call inside the running event loop."""
        if not self.zero and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    @property
    def alive(self) -> bool:
        """Whether the model is able to serve (driver running, or zero-delay mode)."""
        return self.zero or (self._task is not None and not self._task.done())

    async def _drive(self) -> None:
        while True:
            self._wake.clear()
            self.advance_to(self.model_now())
            if self._block_waiters:
                self._release_blocks()
            nxt = self._step_end
            timeout = None if nxt is None else max(0.0, (nxt - self.model_now()) / self.scale)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # -- what the replica model reports (ReplicaEvents) ---------------------------------------------------------
    def step_scheduled(self, replica: ReplicaModel, end_s: float, version: int) -> None:
        self._step_end = end_s  # one replica: the latest schedule is the only valid one

    def admitted(self, replica: ReplicaModel, rq: ReplicaRequest, matched_blocks: int) -> None:
        pass

    def computed(self, replica: ReplicaModel, rq: ReplicaRequest, start: int, stop: int) -> None:
        for cb in self.on_computed:
            cb(rq.chain, start, stop)

    def blocks_committed(self, replica: ReplicaModel) -> None:
        pass  # block waiters are checked after every advance

    def block_inserted(self, block_hash: Hashable) -> None:
        for cb in self.on_insert:
            cb(block_hash)

    def block_evicted(self, block_hash: Hashable) -> None:
        for cb in self.on_evict:
            cb(block_hash)

    def first_token(self, replica: ReplicaModel, rq: ReplicaRequest) -> None:
        lr = self._live.get(rq.req.request_id)
        if lr is None:
            return
        lr.first_wall = self.clock()
        lr.cached_tokens = rq.cached_tokens
        lr.ttft_model_s = rq.ttft_s
        self.cached_tokens_total += rq.cached_tokens
        if lr.max_new_tokens > 1 and not self.zero:
            # decode step of the sequences past their first token now (this one included), at their KV size
            decoding = [x for x in self._live.values() if not math.isnan(x.first_wall)]
            kv = sum(x.prompt_tokens + x.max_new_tokens // 2 for x in decoding)
            step = self.cost.decode_step_time_s(len(decoding), kv)
            lr.itl_wall_s = step / self.scale
        if not lr.first.done():
            lr.first.set_result(rq.cached_tokens)

    def finished(self, replica: ReplicaModel, rq: ReplicaRequest, now_s: float) -> None:
        rid = rq.req.request_id
        self._requests.pop(rid, None)
        lr = self._live.pop(rid, None)
        if lr is None:
            return
        lr.finish_wall = self.clock()
        lr.e2e_model_s = now_s - rq.req.arrival_s
        if not lr.done.done():
            lr.done.set_result(True)

    # -- requests ---------------------------------------------------------------------------------------------
    def check_fits(self, prompt_tokens: int, n_blocks: int, max_new_tokens: int) -> None:
        """Raise :class:`TooLarge` when the request can never fit in the KV cache."""
        need = max(n_blocks * self.block_tokens, prompt_tokens) + max(1, max_new_tokens)
        if need > self.capacity_tokens:
            raise TooLarge(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) need {need} "
                f"tokens of KV cache; this worker holds {self.capacity_tokens}"
            )

    def submit(self, chain: Sequence[str], prompt_tokens: int, max_new_tokens: int, rid: str) -> LiveRequest:
        """Start a request now. ``chain``: block hashes of the prompt's full pages; ``prompt_tokens`` >= 1.

        Raises:
            TooLarge: the request cannot fit.
        """
        self.check_fits(prompt_tokens, len(chain), max_new_tokens)
        loop = asyncio.get_running_loop()
        sim_id = f"r{next(self._ids)}"
        lr = LiveRequest(
            rid=rid,
            sim_id=sim_id,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            arrival_wall=self.clock(),
            first=loop.create_future(),
            done=loop.create_future(),
        )
        self._live[sim_id] = lr
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.sync()
        req = Request(
            request_id=sim_id,
            arrival_s=self.now_s,
            input_tokens=prompt_tokens,
            output_tokens=max(1, max_new_tokens),
            block_hashes=tuple(chain),
        )
        rq = ReplicaRequest(req, next(self._seqs))
        self._requests[sim_id] = rq
        self.replica.enqueue(rq, self.now_s)
        if self.zero:
            if not self._run_until_idle(lr.done.done) and not self._incoming:
                # it cannot wait for anything but a copy arriving here (end_copy runs it on): never spin
                self._live.pop(sim_id, None)
                self._requests.pop(sim_id, None)
                raise RuntimeError("model went idle with a request unfinished")
            if self._block_waiters:
                self._release_blocks()
        else:
            self._wake.set()
        return lr

    def abort(self, lr: LiveRequest) -> bool:
        """The client of ``lr`` went away: a decoding request leaves the batch now and frees its KV cache; one not
        yet at its first token stops there (SGLang aborts requests whose connection closed). Returns whether the
        model still had it."""
        if lr.done.done():
            return False
        self.sync()
        rq = self._requests.get(lr.sim_id)
        found = rq is not None and self.replica.abort(rq, self.now_s)
        self._wake.set()
        return found

    # -- cache ------------------------------------------------------------------------------------------------
    def cached_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident now."""
        self.sync()
        return self.replica.cached_blocks(chain)

    def pending_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident, being computed or arriving here."""
        self.sync()
        return self.replica.pending_blocks(chain)

    def planned_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident, being computed or arriving here, or that a request queued here
        will compute (what a copy from this worker may trail)."""
        self.sync()
        return self.replica.planned_blocks(chain)

    def resident(self, block_hash: str) -> bool:
        return self.replica.is_resident(block_hash)

    def insert(self, chain: Sequence[str]) -> bool:
        """Make ``chain`` resident (blocks that arrived by copy). True when the whole chain is resident after."""
        self.sync()
        self.replica.insert_prefix(chain, self.now_s)
        self._wake.set()
        return self.replica.cached_blocks(chain) == len(chain)

    def flush(self) -> int:
        """Drop every unpinned block (SGLang ``/flush_cache``); returns blocks dropped. Callers check idleness."""
        self.sync()
        return self.replica.flush()

    def busy(self) -> bool:
        """Whether requests run or wait (as of the last sync)."""
        st = self.replica.state()
        return bool(st.running or st.waiting)

    def state(self) -> ReplicaState:
        """The model's counters now (:class:`~btbctl.engine.sim.replica.ReplicaState`)."""
        self.sync()
        return self.replica.state()

    def cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over all requests that reached their first token."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def prefixes(self, limit: int) -> list[dict]:
        """Resident chains' deepest blocks: ``[{"hash", "blocks"}]``, those in use by a running request or a copy
        first, then most recently used first."""
        self.sync()
        return [{"hash": h, "blocks": n} for h, n in self.replica.resident_chains(limit)]

    # -- outgoing copies: waiting for the source's compute ----------------------------------------------------
    async def wait_blocks(self, chain: Sequence[str], need: int, timeout_s: float) -> int:
        """Wait until at least ``need`` leading blocks of ``chain`` are resident; returns how many are.

        Raises:
            BlocksLost: the blocks are neither resident nor planned here (evicted, or no request computes them),
                or ``timeout_s`` seconds passed first.
        """
        chain = tuple(chain)
        self.sync()
        rep = self.replica
        have = rep.cached_blocks(chain)
        if have >= need:
            return have
        if rep.planned_blocks(chain) < need:
            raise BlocksLost(f"block {have} ({chain[have]}) is neither resident nor being computed here")
        fut = asyncio.get_running_loop().create_future()
        entry = (chain, need, fut)
        self._block_waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise BlocksLost(f"block {rep.cached_blocks(chain)} was not computed within {timeout_s:g} s") from None
        finally:
            if entry in self._block_waiters:
                self._block_waiters.remove(entry)

    def _release_blocks(self) -> None:
        """Resolve the senders whose blocks are now resident, fail those whose blocks are lost."""
        rep = self.replica
        keep = []
        for entry in self._block_waiters:
            chain, need, fut = entry
            if fut.done():
                continue
            have = rep.cached_blocks(chain)
            if have >= need:
                fut.set_result(have)
            elif rep.planned_blocks(chain) < need:
                fut.set_exception(
                    BlocksLost(f"block {have} ({chain[have]}) was evicted or is no longer being computed here")
                )
            else:
                keep.append(entry)
        self._block_waiters = keep

    def pin(self, chain: Sequence[str], start: int, stop: int) -> None:
        """Pin blocks ``start..stop-1`` of ``chain`` (resident) so they cannot be evicted while being sent."""
        self.replica.pin(chain, start, stop)

    def unpin(self, chain: Sequence[str], n: int) -> None:
        """Undo :meth:`pin` of the first ``n`` blocks of ``chain``."""
        if n > 0:
            self.replica.unpin(chain, n)
            self._poke()

    # -- incoming copies ----------------------------------------------------------------------------------------
    def begin_copy(self, chain: Sequence[str]) -> IncomingCopy:
        """A copy of ``chain`` starts arriving: reserve room for the blocks not resident, pin the resident
        leading ones, and register the missing ones as pending (those a prefill here is not computing already), so
        that a request needing them waits for the copy.

        Raises:
            NoRoom: the missing blocks do not fit even after evicting every unpinned block.
        """
        self.sync()
        chain = tuple(chain)
        inc = self.replica.begin_incoming(chain, claim_pending=False)
        if inc is None:
            raise NoRoom(
                f"no room in the KV cache for {len(chain) - self.replica.cached_blocks(chain)} blocks "
                "(in use by running requests)"
            )
        self._incoming.add(id(inc))
        return inc

    def end_copy(self, inc: IncomingCopy, ok: bool) -> bool:
        """End an incoming copy: with ``ok`` every block arrived and verified and becomes resident; otherwise
        the reservation is dropped and requests waiting for the blocks compute them. Returns True when the whole
        chain is resident afterwards. Idempotent."""
        if not inc.open:
            return False
        self._incoming.discard(id(inc))
        self.sync()
        self.replica.end_incoming(inc, ok)
        self._poke()
        return self.replica.cached_blocks(inc.chain) == len(inc.chain)

    def _poke(self) -> None:
        """Blocks became resident or free: let the model admit waiting requests now, and wake the driver."""
        self.replica.kick(self.now_s)
        if self.zero:  # run the requests that waited for the blocks to completion, as submit does
            self._run_until_idle(lambda: not self._live)
        self._wake.set()
        if self._block_waiters:
            self._release_blocks()


__all__ = ["BlocksLost", "LiveRequest", "ModelDriver", "NoRoom", "TooLarge"]
