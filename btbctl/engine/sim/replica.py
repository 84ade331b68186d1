"""One model instance of the ``realistic`` fleet model: prefix cache, scheduler, step timing and the queue
estimates the policies read.

The simulator composes N :class:`ReplicaModel` s, the emulated worker drives one in (scaled) real time and the
dashboard's simulation reuses the simulator. Time is always passed in (``now_s``, model seconds); the model never
reads a clock. It does not call back into whoever drives it: it reports what happens to a :class:`ReplicaEvents`
sink (a step that ends at a given time, first tokens, finished requests, blocks computed, cache insertions and
evictions), and the driver calls :meth:`ReplicaModel.end_step` when that time comes.

The model (scheduler, step times, queue estimates, incoming copies) is specified in ``docs/simulator.md``.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.sim.cache import PrefixCache
from btbctl.engine.trace.model import Request


class ReplicaRequest:
    """Mutable state of one request inside a :class:`ReplicaModel` (tokens in tokens, times in model seconds).

    Args:
        req: the request; ``req.arrival_s`` is its arrival (TTFT counts from it).
        seq: tie-break among requests finishing at the same decode step (lower finishes first); give requests
            increasing numbers in arrival order.

    Attributes read by drivers: ``replica`` (index of the replica it was enqueued on, -1 before), ``admitted_s``
    (NaN before admission), ``cached_tokens`` (prompt tokens reused, at most prompt - 1), ``ttft_s`` (NaN before the
    first token), ``recomputed`` (set by the driver's :meth:`ReplicaEvents.admitted`; 0 otherwise),
    ``aborted``.
    """

    __slots__ = (
        "req",
        "chain",
        "replica",
        "admitted_s",
        "computed",
        "next_block",
        "cached_tokens",
        "ttft_s",
        "private",
        "recomputed",
        "finish_g",
        "join_g",
        "seq",
        "est_flops",
        "queued_from",
        "dep_key",
        "kv_need",
        "aborted",
    )

    def __init__(self, req: Request, seq: int) -> None:
        self.req = req
        self.chain = req.block_hashes
        self.replica = -1
        self.admitted_s = math.nan
        self.computed = 0  # prompt tokens computed or reused
        self.next_block = 0  # first block index not yet committed to the cache by this request
        self.cached_tokens = 0
        self.ttft_s = math.nan
        self.private = 0  # KV tokens reserved for it alone (prompt tail without a hash + output)
        self.recomputed = 0
        self.finish_g = 0  # decode step index at which it finishes
        self.join_g = 0  # decode step index at which it joined the decode batch
        self.seq = seq
        self.aborted = False  # the client went away (see ReplicaModel.abort)
        self.est_flops = 0.0  # estimated prefill FLOPs still to do (queued-work estimate for policies)
        # while waiting (after the enqueue that found it not admissible): chain[queued_from:] is registered in its
        # replica's queued_blocks
        self.queued_from = -1
        # while waiting: the not-yet-resident block its est_flops is registered under
        self.dep_key: Hashable | None = None
        self.kv_need = 0  # while waiting: KV tokens it will take when admitted (estimate)


class ReplicaEvents(Protocol):
    """What a :class:`ReplicaModel` reports to its driver. Every call happens inside a call the driver made
    (:meth:`~ReplicaModel.enqueue`, :meth:`~ReplicaModel.kick`, :meth:`~ReplicaModel.end_step`, ...); the model
    never calls back into the driver otherwise."""

    def step_scheduled(self, replica: ReplicaModel, end_s: float, version: int) -> None:
        """The step the replica just started (or cut short) ends at ``end_s``: call ``replica.end_step(end_s)``
        then, if ``replica.version == version`` still (a later schedule voids this one)."""

    def admitted(self, replica: ReplicaModel, rq: ReplicaRequest, matched_blocks: int) -> None:
        """``rq`` was admitted: it reuses the resident ``chain[:matched_blocks]`` and computes the rest of its
        chain, which is now pending on the replica. The driver may set ``rq.recomputed``."""

    def computed(self, replica: ReplicaModel, rq: ReplicaRequest, start: int, stop: int) -> None:
        """``rq``'s prefill committed ``chain[start:stop]`` to the replica's cache (now resident)."""

    def first_token(self, replica: ReplicaModel, rq: ReplicaRequest) -> None:
        """``rq`` produced its first token (``rq.ttft_s`` and ``rq.cached_tokens`` are set)."""

    def finished(self, replica: ReplicaModel, rq: ReplicaRequest, now_s: float) -> None:
        """``rq`` finished at ``now_s`` and released its KV cache."""

    def blocks_committed(self, replica: ReplicaModel) -> None:
        """A prefill step committed blocks (after its :meth:`first_token` and :meth:`finished` reports): copies
        trailing this replica's prefill may send more."""

    def block_inserted(self, block_hash: Hashable) -> None:
        """A block became resident in the replica's cache (computed or copied)."""

    def block_evicted(self, block_hash: Hashable) -> None:
        """A block left the replica's cache."""

    # Optional, looked up by name: ``blocks_inserted(hashes)`` and ``blocks_evicted(hashes)`` report a run of
    # distinct blocks in one call, in order (as that many block_inserted / block_evicted calls would); a driver that
    # defines them gets one call per prefill run committed and per eviction pass instead of one per block.


@dataclass(eq=False, slots=True)
class IncomingCopy:
    """Room a :class:`ReplicaModel` holds for a copy arriving at it (see :meth:`ReplicaModel.begin_incoming`).

    Attributes:
        chain: the copy's block hashes (root first).
        have: leading blocks resident when it began (pinned until it ends).
        reserved: blocks reserved for it (``len(chain) - have``).
        open: False once :meth:`ReplicaModel.end_incoming` ran.
    """

    chain: tuple[Hashable, ...]
    have: int
    reserved: int
    open: bool = True


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """Counters of one replica for dashboards and the worker's load reports.

    Attributes:
        running: requests admitted (prefilling or decoding).
        waiting: requests queued, not admitted yet.
        used_tokens: KV-cache tokens in use as SGLang's ``num_used_tokens`` counts them: capacity minus free minus
            evictable (pinned resident blocks + reserved blocks + private reservations; cached blocks no request
            uses are evictable, so they do not count).
        capacity_tokens: KV-cache budget, tokens.
        cached_blocks: resident blocks.
        busy: a step (prefill or decode) is in progress.
        evictable_tokens: tokens of resident blocks no request or copy uses (SGLang's ``kv_evictable_tokens``:
            cached, reusable, freed when room is needed).
    """

    running: int
    waiting: int
    used_tokens: int
    capacity_tokens: int
    cached_blocks: int
    busy: bool
    evictable_tokens: int = 0


class ReplicaModel:
    """One model instance: KV prefix cache, SGLang-like scheduler with chunked prefill, step timing.

    Args:
        idx: the replica's index in its fleet (reported back in events and records).
        cost: the cost model of one replica (FLOP/s, HBM, KV budget, step overhead).
        block_tokens: tokens per block of the chains it serves.
        chunk_tokens: most new prompt tokens one prefill step computes.
        max_running: most requests admitted at once.
        events: where it reports what happens (:class:`ReplicaEvents`).

    The cache (:attr:`cache`, a :class:`~btbctl.engine.sim.cache.PrefixCache`) may be read; change it only through
    this class.
    """

    __slots__ = (
        "idx",
        "cost",
        "block_tokens",
        "chunk_tokens",
        "max_running",
        "events",
        "cache",
        "version",
        "_waiting",
        "_prefilling",
        "_decoding",
        "_n_decoding",
        "_dec_s",
        "_dec_g",
        "_pending",
        "_busy",
        "_step_kind",
        "_step_start",
        "_step_end",
        "_step_m",
        "_step_payload",
        "_queued_flops",
        "_queued_blocks",
        "_dep_flops",
        "_dep_count",
        "_waiting_kv",
        "_dec_finish_sum",
        "_dec_a",
        "_dec_b",
        "_dec_c",
        "_dec_oh",
        "fleet",
    )

    def __init__(
        self,
        idx: int,
        cost: ReplicaCost,
        *,
        block_tokens: int,
        chunk_tokens: int,
        max_running: int,
        events: ReplicaEvents,
        kv_tokens: int | None = None,
    ) -> None:
        self.idx = idx
        self.cost = cost
        self.block_tokens = block_tokens
        self.chunk_tokens = chunk_tokens
        self.max_running = max_running
        self.events = events
        self.cache = PrefixCache(
            cost.kv_budget_tokens if kv_tokens is None else kv_tokens,
            block_tokens,
            events.block_inserted,
            events.block_evicted,
            getattr(events, "blocks_inserted", None),
            getattr(events, "blocks_evicted", None),
        )
        self._waiting: list[ReplicaRequest] = []
        self._prefilling: list[ReplicaRequest] = []
        self._decoding: list[tuple[int, int, ReplicaRequest]] = []  # heap (finish_g, seq, request)
        self._n_decoding = 0
        self._dec_s = 0  # sum over decoding seqs of (context at join - G at join); KV tokens = dec_s + n * dec_g
        self._dec_g = 0  # decode steps taken so far on this replica
        self._pending: dict[Hashable, object] = {}  # block hash -> owner (request computing it, or IncomingCopy)
        self._busy = False
        self._step_kind = ""
        self._step_start = 0.0
        self._step_end = 0.0
        self._step_m = 0
        self._step_payload: list[tuple[ReplicaRequest, int, float]] = []  # prefill: (request, new tokens, their FLOPs)
        self.version = 0  # bumped at every step (re)schedule; see ReplicaEvents.step_scheduled
        self._queued_flops = 0.0  # sum of est_flops over waiting + prefilling requests
        self._queued_blocks: dict[Hashable, int] = {}  # block -> waiting requests here that would compute it
        # block not yet resident -> est_flops of waiting requests needing it
        self._dep_flops: dict[Hashable, float] = {}
        self._dep_count: dict[Hashable, int] = {}  # block not yet resident -> waiting requests needing it
        self._waiting_kv = 0  # sum of kv_need over waiting requests
        self._dec_finish_sum = 0  # sum of finish_g over decoding requests
        #: the driver's :class:`FleetIndex`, kept up to date by this replica (None: no index)
        self.fleet: FleetIndex | None = None
        # decode step-time coefficients: t = max(a + b*K, c*n) + overhead
        bw = cost.hbm_bytes_per_s * cost.hbm_efficiency
        self._dec_a = cost.model.active_params * cost.model.dtype_bytes / bw
        self._dec_b = cost.model.kv_bytes_per_token / bw
        self._dec_c = 2.0 * cost.model.active_params / (cost.flops * cost.mfu)
        self._dec_oh = cost.step_overhead_s

    # -- reads ------------------------------------------------------------------------------------------------
    @property
    def load(self) -> int:
        """Requests waiting, prefilling or decoding here."""
        return len(self._waiting) + len(self._prefilling) + self._n_decoding

    @property
    def prefill_load(self) -> int:
        """Requests waiting or prefilling here (no first token yet)."""
        return len(self._waiting) + len(self._prefilling)

    def cached_blocks(self, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident here."""
        return self.cache.match(chain)

    def is_resident(self, block_hash: Hashable) -> bool:
        return block_hash in self.cache

    def pending_blocks(self, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident here, or being computed or copied here."""
        n = self.cache.match(chain)
        pending = self._pending
        while n < len(chain) and chain[n] in pending:
            n += 1
        return n

    def planned_blocks(self, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident here, being computed or copied here, or in the chain of a request
        waiting here (binary search: that union is prefix-closed along a chain, up to evictions of unpinned blocks,
        which makes this an estimate). O(log n)."""
        n = len(chain)
        parent, pending, queued = self.cache.parent, self._pending, self._queued_blocks
        if n == 0:
            return 0
        h = chain[n - 1]
        if h in parent or h in pending or h in queued:
            return n
        h = chain[0]
        if not (h in parent or h in pending or h in queued):
            return 0
        lo, hi = 1, n - 1  # chain[lo - 1] is planned, chain[hi] is not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = chain[mid - 1]
            if h in parent or h in pending or h in queued:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def queued_prefill_s(self, now_s: float) -> float:
        """Seconds of prefill compute queued here ahead of a new request arriving at ``now_s``: for every waiting or
        prefilling request, the FLOPs (attention term included, at its context) of the prompt tokens it still has
        to compute (before admission: those not resident, computing or arriving here when it was enqueued), at the
        achieved FLOP/s; minus the elapsed part of a prefill step in progress, plus the rest of one decode step in
        progress (decode runs yield to new prefill work at the next step). O(1)."""
        cost = self.cost
        s = self._queued_flops / (cost.flops * cost.mfu) if self._queued_flops > 0 else 0.0
        if self._busy:
            if self._step_kind == "prefill":
                s = max(0.0, s - (now_s - self._step_start))
            else:
                s += max(0.0, min(self._step_end - now_s, self.decode_time_s(1)))
        return s

    def waiting_groups(self) -> list[tuple[Hashable, int, float]]:
        """Requests waiting here for a block that is not resident yet (being computed or copied), grouped by that
        block: ``(block hash, requests, seconds of their queued prefill)``, in first-registered order."""
        if not self._dep_count:
            return []
        cost = self.cost
        rate = cost.flops * cost.mfu
        parent = self.cache.parent
        dep_flops = self._dep_flops
        return [(h, n, max(0.0, dep_flops[h]) / rate) for h, n in self._dep_count.items() if h not in parent]

    def admission_wait_s(self, kv_tokens: int) -> float:
        """Seconds of decoding before the KV cache has room for the requests waiting here plus a new one needing
        ``kv_tokens`` tokens (prompt tokens it computes + output), 0 when they fit now (free + evictable).
        Decoding requests release their KV when they finish: on average ``held tokens / (mean remaining decode
        steps x current step time)`` tokens per second. O(1)."""
        cache = self.cache
        short = self._waiting_kv + kv_tokens - (max(0, cache.free_tokens) + cache.evictable_tokens)
        n = self._n_decoding
        if short <= 0 or n == 0:
            return 0.0
        held = self._dec_s + n * self._dec_g
        left_steps = (self._dec_finish_sum - n * self._dec_g) / n
        if held <= 0 or left_steps <= 0:
            return 0.0
        return short / held * left_steps * self.decode_time_s(1)

    def kv_headroom_tokens(self) -> int:
        """KV-cache tokens a new copy could get now: free plus evictable (unpinned) tokens."""
        cache = self.cache
        return max(0, cache.free_tokens) + cache.evictable_tokens

    def state(self) -> ReplicaState:
        """The counters of :class:`ReplicaState`."""
        cache = self.cache
        return ReplicaState(
            running=len(self._prefilling) + self._n_decoding,
            waiting=len(self._waiting),
            used_tokens=cache.used_tokens - cache.evictable_tokens,
            capacity_tokens=cache.capacity_tokens,
            cached_blocks=len(cache),
            busy=self._busy,
            evictable_tokens=cache.evictable_tokens,
        )

    def resident_chains(self, limit: int) -> list[tuple[Hashable, int]]:
        """The deepest block of each resident chain and the chain's length in blocks, at most ``limit`` of them:
        chains in use (a pinned leaf: a running request or a copy) first, then most recently used first."""
        cache = self.cache
        parent, children, refs = cache.parent, cache.children, cache.refs
        leaves = [h for h in parent if not children.get(h)]
        pos = {h: i for i, h in enumerate(cache.lru)}
        leaves.sort(key=lambda h: (0, 0) if h in refs else (1, -pos.get(h, -1)))
        depth: dict[Hashable, int] = {}
        out = []
        for h in leaves[: max(0, limit)]:
            path = []
            x = h
            while x is not None and x not in depth:
                path.append(x)
                x = parent.get(x)
            d = depth.get(x, 0) if x is not None else 0
            for y in reversed(path):
                d += 1
                depth[y] = d
            out.append((h, depth[h]))
        return out

    # -- requests ---------------------------------------------------------------------------------------------
    def enqueue(self, rq: ReplicaRequest, now_s: float) -> None:
        """``rq`` arrives here at ``now_s``: it joins the waiting queue (FCFS) and a step starts if the replica is
        idle."""
        rq.replica = self.idx
        planned = self._estimate_work(rq)
        self._waiting.append(rq)
        fleet = self.fleet
        if fleet is not None:
            fleet.mark(self.idx, False)
            chain = rq.req.block_hashes
            if chain:
                fleet.entered(chain[0], self.idx)
        self.kick(now_s)
        if rq.admitted_s != rq.admitted_s:  # NaN: still waiting
            # register its chain as planned here only now: nothing reads the queued blocks during kick, and most
            # requests are admitted by it
            queued = self._queued_blocks
            for h in rq.chain[planned:]:
                queued[h] = queued.get(h, 0) + 1
            rq.queued_from = planned

    def abort(self, rq: ReplicaRequest, now_s: float) -> bool:
        """The client of ``rq`` went away at ``now_s`` (SGLang aborts such requests). A decoding request finishes now
        and frees its KV; one still waiting or prefilling finishes at its first token instead of decoding (its
        prefix blocks stay useful to others). Returns False when ``rq`` already finished."""
        rq.aborted = True
        if math.isnan(rq.ttft_s):
            return True  # ends at its first token (_end_prefill)
        dec = self._decoding
        for i, item in enumerate(dec):
            if item[2] is rq:
                dec[i] = dec[-1]
                dec.pop()
                heapq.heapify(dec)
                break
        else:
            return False
        self._n_decoding -= 1
        self._dec_finish_sum -= rq.finish_g
        self._dec_s -= rq.req.input_tokens + 1 - rq.join_g
        self._finish(rq, now_s)
        self.kick(now_s)  # re-plan the decode run of the remaining sequences
        self._sync_idle()
        return True

    def kick(self, now_s: float) -> None:
        """New work may be admissible (a request arrived, blocks or room became available): start a step if idle,
        or cut a decode run in progress at the next step boundary after ``now_s``."""
        if not self._busy:
            self._start_step(now_s)
        elif self._step_kind == "decode" and self._step_m > 1:
            elapsed = now_s - self._step_start
            m = self._decode_steps_covering(elapsed)
            if m < self._step_m:
                self._step_m = m
                self._step_end = self._step_start + self.decode_time_s(m)
                self.version += 1
                self.events.step_scheduled(self, self._step_end, self.version)

    def end_step(self, now_s: float) -> None:
        """The step in progress ends at ``now_s`` (the time :meth:`ReplicaEvents.step_scheduled` gave for the
        current :attr:`version`): apply it and start the next one."""
        if self._step_kind == "prefill":
            self._end_prefill(now_s)
        else:
            self._end_decode(now_s)
        self._busy = False
        self._start_step(now_s)
        self._sync_idle()

    def _sync_idle(self) -> None:
        fleet = self.fleet
        if fleet is not None:
            fleet.mark(self.idx, not (self._waiting or self._prefilling or self._n_decoding or self._busy))

    def plans_root(self, root: Hashable, request_roots: Collection[Hashable]) -> bool:
        """Whether a chain starting with block ``root`` may have blocks resident, pending or queued here
        (``request_roots``: the first blocks of the chains of the requests waiting or prefilling here)."""
        planned = root in self.cache.parent or root in self._pending or root in self._queued_blocks
        return planned or root in request_roots

    def request_roots(self) -> set[Hashable]:
        """First blocks of the chains of the requests waiting or prefilling here."""
        out = set()
        for rq in self._waiting:
            if rq.req.block_hashes:
                out.add(rq.req.block_hashes[0])
        for rq in self._prefilling:
            if rq.req.block_hashes:
                out.add(rq.req.block_hashes[0])
        return out

    # -- cache from outside: inserted prefixes, incoming and outgoing copies ---------------------------------
    def insert_prefix(self, chain: Sequence[Hashable], now_s: float) -> int:
        """Make ``chain`` resident (blocks that arrived from outside the model, e.g. a verified copy in the worker).
        Returns the number of blocks inserted; 0 when they do not fit."""
        cache = self.cache
        chain = tuple(chain)
        have = cache.match(chain)
        add = len(chain) - have
        if add <= 0:
            return 0
        if self.fleet is not None:
            self.fleet.entered(chain[0], self.idx)
        cache.pin(chain, have)
        if not cache.make_room(add * self.block_tokens):
            cache.unpin(chain, have)
            return 0
        cache.reserve_blocks(add)
        cache.commit_run(chain, have, len(chain))
        cache.unpin(chain, len(chain))
        self.kick(now_s)
        return add

    def begin_incoming(self, chain: tuple[Hashable, ...], *, claim_pending: bool = True) -> IncomingCopy | None:
        """A copy of ``chain`` starts arriving: pin its resident leading blocks, reserve room for the others
        (evicting LRU blocks as needed) and mark those as pending, so that a request needing them waits for the
        copy instead of computing them. None (nothing changed) when they do not fit.

        ``claim_pending``: a block already pending here (a prefill computing it) is marked as the copy's too (the
        simulator's rule); False leaves it to the prefill, so that a failed copy cannot strand a request waiting for
        it (the worker's rule). Call :meth:`end_incoming` exactly once afterwards, then :meth:`kick`."""
        cache = self.cache
        have = cache.match(chain)
        add = len(chain) - have
        if chain and self.fleet is not None:
            self.fleet.entered(chain[0], self.idx)
        cache.pin(chain, have)
        if add and not cache.make_room(add * self.block_tokens):
            cache.unpin(chain, have)
            return None
        cache.reserve_blocks(add)
        inc = IncomingCopy(chain, have, add)
        pending = self._pending
        for k in range(have, len(chain)):
            h = chain[k]
            if claim_pending or h not in pending:
                pending[h] = inc
        return inc

    def end_incoming(self, inc: IncomingCopy, ok: bool) -> bool:
        """End an incoming copy: with ``ok`` every block arrived (and verified) and becomes resident; otherwise the
        reservation is dropped and requests waiting for the blocks compute them. Call :meth:`kick` afterwards.
        Returns whether the whole chain is resident now. Idempotent (False after the first call)."""
        if not inc.open:
            return False
        inc.open = False
        pending, cache, chain = self._pending, self.cache, inc.chain
        if ok:
            for h in chain[inc.have :]:
                if pending.get(h) is inc:
                    del pending[h]
            cache.commit_run(chain, inc.have, len(chain))
            cache.unpin(chain, len(chain))  # deepest first, so LRU evicts leaves before their ancestors
            return True
        for k in range(inc.have, len(chain)):
            h = chain[k]
            if pending.get(h) is inc:
                del pending[h]
        cache.release_reservation(inc.reserved)
        cache.unpin(chain, inc.have)
        return cache.match(chain) == len(chain)

    def pin(self, chain: Sequence[Hashable], start: int, stop: int) -> None:
        """Pin the resident blocks ``chain[start:stop]`` (an outgoing copy sends them) so they cannot be evicted:
        the copy's hold on ``chain[:start]`` (none when ``start`` is 0) extends to ``chain[:stop]``."""
        if stop > start:
            self.cache.pin(chain, stop)
            self.cache.unpin(chain, start)  # the longer hold keeps chain[:start] pinned: no block changes state

    def unpin(self, chain: Sequence[Hashable], n: int) -> None:
        """Undo :meth:`pin` of the first ``n`` blocks of ``chain``. Call :meth:`kick` afterwards if requests may be
        waiting for memory."""
        if n > 0:
            self.cache.unpin(chain, n)

    def flush(self) -> int:
        """Drop every unpinned block (SGLang ``/flush_cache``); returns blocks dropped."""
        return self.cache.flush()

    # -- decode closed form -----------------------------------------------------------------------------------
    def decode_time_s(self, m: int) -> float:
        """Seconds for ``m`` decode steps of the current batch (KV grows by n tokens per step)."""
        n = self._n_decoding
        k0 = self._dec_s + n * self._dec_g
        a = self._dec_a + self._dec_b * k0
        slope = self._dec_b * n
        c = self._dec_c * n
        # steps j = 0..m-1 cost max(a + slope*j, c)
        if slope > 0:
            j0 = min(m, max(0, math.ceil((c - a) / slope)))
        else:
            j0 = m if c > a else 0
        total = j0 * c + (m - j0) * a + slope * ((m - 1) * m / 2 - (j0 - 1) * j0 / 2)
        return total + m * self._dec_oh

    def _decode_steps_covering(self, elapsed: float) -> int:
        """Smallest step count m >= 1 whose cumulative time reaches ``elapsed`` (the step in progress)."""
        lo, hi = 1, self._step_m
        while lo < hi:
            mid = (lo + hi) // 2
            if self.decode_time_s(mid) >= elapsed - 1e-12:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- scheduling -------------------------------------------------------------------------------------------
    def _estimate_work(self, rq: ReplicaRequest) -> int:
        """Queued-work estimate of a new request: the prompt tokens beyond what this replica holds, is computing or
        receiving, or a request queued ahead here will compute (it waits for those instead), at their context.
        Returns those leading blocks (planned here); :meth:`enqueue` registers the rest of the chain as planned
        here if the request waits."""
        chain = rq.chain
        have_blocks = self.planned_blocks(chain)
        have = min(have_blocks * self.block_tokens, rq.req.input_tokens - 1)
        rq.est_flops = self.cost.prefill_flops(rq.req.input_tokens - have, have)
        self._queued_flops += rq.est_flops
        rq.kv_need = rq.req.input_tokens - have + rq.req.output_tokens
        self._waiting_kv += rq.kv_need
        if have_blocks and chain[have_blocks - 1] not in self.cache.parent:
            key = chain[have_blocks - 1]
            rq.dep_key = key
            self._dep_flops[key] = self._dep_flops.get(key, 0.0) + rq.est_flops
            self._dep_count[key] = self._dep_count.get(key, 0) + 1
        return have_blocks

    def _start_step(self, now_s: float) -> None:
        batch = self._form_prefill(now_s)
        if batch:
            flops = 0.0
            for _, _, f in batch:
                flops += f
            dt = self.cost.prefill_flops_time_s(flops)
            self._busy, self._step_kind, self._step_payload = True, "prefill", batch
            self._step_start, self._step_end = now_s, now_s + dt
            self.version += 1
            self.events.step_scheduled(self, self._step_end, self.version)
            return
        if self._n_decoding:
            m = self._decoding[0][0] - self._dec_g  # steps until the next completion
            self._busy, self._step_kind, self._step_m = True, "decode", max(1, m)
            self._step_start = now_s
            self._step_end = now_s + self.decode_time_s(self._step_m)
            self.version += 1
            self.events.step_scheduled(self, self._step_end, self.version)
            return
        self._busy = False
        self._step_kind = ""

    def _form_prefill(self, now_s: float) -> list[tuple[ReplicaRequest, int, float]]:
        """The next prefill batch: ``(request, new tokens, their FLOPs)`` per request."""
        budget = self.chunk_tokens
        prefill_flops = self.cost.prefill_flops
        batch: list[tuple[ReplicaRequest, int, float]] = []
        for rq in self._prefilling:
            if budget <= 0:
                break
            new = min(budget, rq.req.input_tokens - rq.computed)
            if new > 0:
                batch.append((rq, new, prefill_flops(new, rq.computed)))
                budget -= new
        if budget <= 0:
            return batch
        waiting = self._waiting
        keep: list[ReplicaRequest] = []
        admitted_any = False
        stop = False
        for idx, rq in enumerate(waiting):
            if stop or budget <= 0 or len(self._prefilling) + self._n_decoding >= self.max_running:
                keep.extend(waiting[idx:])
                break
            verdict = self._try_admit(rq, now_s)
            if verdict == "blocked":
                keep.append(rq)
                continue
            if verdict == "nomem":
                keep.extend(waiting[idx:])
                stop = True
                break
            admitted_any = True
            new = min(budget, rq.req.input_tokens - rq.computed)
            batch.append((rq, new, prefill_flops(new, rq.computed)))
            budget -= new
        if admitted_any or stop:
            self._waiting = keep
        return batch

    def _try_admit(self, rq: ReplicaRequest, now_s: float) -> str:
        """Admit ``rq`` if its next block is not being computed/copied here and KV space exists."""
        chain = rq.chain
        cache = self.cache
        bt = self.block_tokens
        matched = cache.match(chain)
        if matched < len(chain) and chain[matched] in self._pending:
            return "blocked"
        inp = rq.req.input_tokens
        n_blocks = len(chain)
        new_blocks = n_blocks - matched
        tail = max(0, inp - n_blocks * bt)  # prompt tokens without a block hash (private)
        private = tail + rq.req.output_tokens
        need = new_blocks * bt + private
        # pin what we reuse before evicting, so it cannot be evicted under us
        cache.pin(chain, matched)
        if not cache.make_room(need):
            cache.unpin(chain, matched)
            return "nomem"  # space frees up when running requests or copies finish (sizes are checked up front)
        cache.reserve_blocks(new_blocks)
        cache.private_tokens += private
        rq.private = private
        cached_tokens = min(matched * bt, inp - 1)
        rq.cached_tokens = cached_tokens
        rq.computed = cached_tokens
        rq.next_block = matched
        rq.admitted_s = now_s
        self._waiting_kv -= rq.kv_need
        rq.kv_need = 0
        if rq.queued_from >= 0:
            queued = self._queued_blocks
            for h in chain[rq.queued_from :]:
                c = queued[h] - 1
                if c:
                    queued[h] = c
                else:
                    del queued[h]
            rq.queued_from = -1
        if rq.dep_key is not None:
            key = rq.dep_key
            left = self._dep_count[key] - 1
            if left:
                self._dep_count[key] = left
                self._dep_flops[key] -= rq.est_flops
            else:
                del self._dep_count[key]
                del self._dep_flops[key]
            rq.dep_key = None
        est = self.cost.prefill_flops(inp - cached_tokens, cached_tokens)
        self._queued_flops += est - rq.est_flops
        rq.est_flops = est
        pending = self._pending
        for h in chain[matched:]:
            pending[h] = rq
        self.events.admitted(self, rq, matched)
        self._prefilling.append(rq)
        return "ok"

    def _end_prefill(self, now_s: float) -> None:
        bt = self.block_tokens
        cache = self.cache
        pending = self._pending
        events = self.events
        done: list[ReplicaRequest] = []
        committed = False
        for rq, new, f in self._step_payload:
            rq.est_flops -= f
            self._queued_flops -= f
            rq.computed += new
            chain = rq.chain
            inp = rq.req.input_tokens
            upto = len(chain) if rq.computed >= inp else min(len(chain), rq.computed // bt)
            start = rq.next_block
            if upto > start:
                for h in chain[start:upto]:
                    if pending.get(h) is rq:
                        del pending[h]
                cache.commit_run(chain, start, upto)
                events.computed(self, rq, start, upto)
                rq.next_block = upto
                committed = True
            if rq.computed >= inp:
                done.append(rq)
                self._queued_flops -= rq.est_flops
                rq.est_flops = 0.0
        self._step_payload = []
        if not self._waiting and len(done) == len(self._prefilling):
            self._queued_flops = 0.0  # nothing queued any more: drop float residue
        if done:
            self._prefilling = [rq for rq in self._prefilling if rq.computed < rq.req.input_tokens]
        for rq in done:
            rq.ttft_s = now_s - rq.req.arrival_s
            events.first_token(self, rq)
            out = rq.req.output_tokens
            if out <= 1 or rq.aborted:
                self._finish(rq, now_s)
            else:
                rq.join_g = self._dec_g
                rq.finish_g = self._dec_g + out - 1
                heapq.heappush(self._decoding, (rq.finish_g, rq.seq, rq))
                self._n_decoding += 1
                self._dec_finish_sum += rq.finish_g
                self._dec_s += rq.req.input_tokens + 1 - self._dec_g
        if committed:
            events.blocks_committed(self)

    def _end_decode(self, now_s: float) -> None:
        self._dec_g += self._step_m
        dec = self._decoding
        while dec and dec[0][0] <= self._dec_g:
            _, _, rq = heapq.heappop(dec)
            self._n_decoding -= 1
            self._dec_finish_sum -= rq.finish_g
            self._dec_s -= rq.req.input_tokens + 1 - rq.join_g
            self._finish(rq, now_s)

    def _finish(self, rq: ReplicaRequest, now_s: float) -> None:
        cache = self.cache
        cache.unpin(rq.chain, len(rq.chain))
        cache.private_tokens -= rq.private
        self.events.finished(self, rq, now_s)


class FleetIndex:
    """Fleet-wide lookups kept by the replicas (:attr:`ReplicaModel.fleet`), so that a policy can skip the replicas
    a request can reuse nothing on instead of pricing every replica per request.

    * :attr:`idle`: exactly the replicas with no request (waiting, prefilling or decoding) and no step running
      (:attr:`idle_order`: the same, ascending).
    * :meth:`holders`: for a chain's first block, a superset of the replicas where a block of a chain starting
      with it is resident, being computed or copied, or queued (every block enters a replica with a chain that
      starts at its root: a request, a copy or an inserted prefix). Entries a replica no longer plans are dropped
      when the index has doubled since the last sweep (amortised O(1) per entry).

    Args:
        replicas: the fleet, attached here (each replica's :attr:`~ReplicaModel.fleet` is set).
    """

    #: Entries below which no sweep runs.
    SWEEP_MIN = 4096

    def __init__(self, replicas: Sequence[ReplicaModel]) -> None:
        self.replicas = replicas
        self.idle: set[int] = set()
        #: :attr:`idle` in ascending order
        self.idle_order: list[int] = []
        self.roots: dict[Hashable, set[int]] = {}
        self._sweep_at = self.SWEEP_MIN
        for rep in replicas:
            rep.fleet = self
            rep._sync_idle()

    def mark(self, replica: int, idle: bool) -> None:
        """``replica`` is idle now, or not."""
        if idle:
            if replica not in self.idle:
                self.idle.add(replica)
                insort(self.idle_order, replica)
        elif replica in self.idle:
            self.idle.remove(replica)
            del self.idle_order[bisect_left(self.idle_order, replica)]

    def entered(self, root: Hashable, replica: int) -> None:
        """A chain starting with block ``root`` enters ``replica``."""
        reps = self.roots.get(root)
        if reps is not None:
            reps.add(replica)
            return
        if len(self.roots) >= self._sweep_at:
            self.sweep()  # before the new entry: the chain is not there yet
        self.roots[root] = {replica}

    def holders(self, root: Hashable) -> Collection[int]:
        """Replicas that may plan a block of a chain starting with ``root`` (a superset)."""
        return self.roots.get(root, ())

    def sweep(self) -> None:
        """Drop the entries of replicas that plan no block of the root's chains any more."""
        live = [rep.request_roots() for rep in self.replicas]
        reps_of = self.replicas
        for root in list(self.roots):
            reps = self.roots[root]
            for r in [r for r in reps if not reps_of[r].plans_root(root, live[r])]:
                reps.discard(r)
            if not reps:
                del self.roots[root]
        self._sweep_at = max(self.SWEEP_MIN, 2 * len(self.roots))


__all__ = ["FleetIndex", "IncomingCopy", "ReplicaEvents", "ReplicaModel", "ReplicaRequest", "ReplicaState"]
