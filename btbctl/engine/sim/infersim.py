"""The ``infersim`` fidelity profile: the reference simulator's simplifications, so the published table can be checked.

Source: Infer-Sim (github.com/jwlaboratory/inference-sim), the simulator behind the published BTB results
(REFERENCE.md s1, s2), re-implemented independently. Rule, in short: replicas add up their GPUs' FLOP/s, HBM and
NICs; prefill is not chunked and has no attention term; decode advances every running sequence together; admission
is FCFS with ``input + output`` tokens reserved up front; per-replica HBM LRU of block hashes spilling to host RAM; a
copy is charged to the target's clock only and never waits for its source; TTFT = queueing + reuse + prefill;
percentiles are ``sorted[int(q n)]``. The full specification (every simplification, with Infer-Sim's defaults) is in
``docs/simulator.md`` ("The infersim profile"). The module never reads the wall clock.
"""

from __future__ import annotations

import gc
import math
import random
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from itertools import compress, count, islice, repeat

from btbctl.engine.chains import count_blocks
from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyStatus, carry_out
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies import make_policy
from btbctl.engine.sim.results import RequestRecord, SimResult
from btbctl.engine.trace.model import Request, Trace

#: Fidelity name of this profile (``simulate(..., fidelity=FIDELITY)``).
FIDELITY = "infersim"
#: Copies whose ready time is within this many seconds after "now" count as arrived (absorbs float rounding of
#: ``start + duration``; the reference harness uses the same slack).
READY_SLACK_S = 1e-12


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block, if it is on.

    A run allocates tens of thousands of long-lived objects (cache runs, records), so the collector would sweep
    the young generations dozens of times and the caller's whole heap (the trace's block chains) at least once,
    finding nothing to free; that is about a sixth of a run's time. Only the caller that turned it off turns it back
    on, so nested or concurrent runs leave it as they found it."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


class _OutBlock:
    """Stands for one cache block of a request's generated tokens: unique, so nobody else ever matches it."""

    __slots__ = ()


class _Seq:
    """A request inside the infersim model (queued, then running)."""

    __slots__ = (
        "req",
        "blocks",
        "prefix_tokens",
        "need",
        "left",
        "context",
        "start_s",
        "reuse_s",
        "prefill_s",
        "hit_tokens",
        "recomputed",
        "window",
        "est_s",
    )

    def __init__(self, req: Request, block_tokens: int, window: int) -> None:
        self.req = req
        self.blocks = req.block_hashes
        inp = req.input_tokens
        self.prefix_tokens = min(len(self.blocks) * block_tokens, inp)
        self.need = inp + req.output_tokens  # KV tokens reserved at admission
        self.left = req.output_tokens  # decode steps still to run
        self.context = inp  # KV tokens this sequence holds while decoding
        self.start_s = math.nan
        self.reuse_s = 0.0
        self.prefill_s = 0.0
        self.hit_tokens = 0
        self.recomputed = 0
        self.window = window
        self.est_s = 0.0  # prefill seconds estimated when it was queued (for queued_prefill_s)


class InferSimCost:
    """Infer-Sim's timing equations for one replica.

    Args:
        cluster: the fleet; uses ``model``, ``gpu``, ``gpus_per_replica``, ``nic_gbps``, ``mfu``,
            ``hbm_efficiency`` and ``max_running``. ``mem_fraction`` and ``chunked_prefill_tokens`` are ignored
            (Infer-Sim has neither: all HBM is usable and prefill is not chunked).
        block_tokens: tokens per cache block (the trace's block size).

    Attributes (units in the names): ``flops``, ``hbm_bytes_per_s``, ``pcie_bytes_per_s``, ``nic_bytes_per_s``
    (replica aggregates), ``kv_bytes_per_token``, ``block_bytes``, ``active_bytes`` (weights read per decode
    step), ``kv_budget_tokens``, ``budget_blocks``, ``max_running``.

    Raises:
        ConfigError: unknown presets; weights that leave no room for one block of KV (key ``gpus_per_replica``).
    """

    def __init__(self, cluster: ClusterConfig, block_tokens: int) -> None:
        cost: ReplicaCost = cluster.replica_cost(attention_term=False, mem_fraction=1.0, step_overhead_s=0.0)
        m, gpu, g = cost.model, cost.gpu, cost.gpus_per_replica
        self.cost = cost
        self.block_tokens = block_tokens
        self.active_params = m.active_params
        self.mfu = cost.mfu
        self.mbu = cost.hbm_efficiency
        self.flops = cost.flops
        self.hbm_bytes_per_s = cost.hbm_bytes_per_s
        self.pcie_bytes_per_s = cost.pcie_bytes_per_s
        self.nic_bytes_per_s = cost.nic_bytes_per_s
        # Infer-Sim has one dtype knob for weights and KV; every preset keeps them equal, and ``precision`` /
        # ``kv_dtype`` (the cost model's effective preset) set them apart
        self.kv_bytes_per_token = m.kv_bytes_per_token
        self.block_bytes = self.kv_bytes_per_token * block_tokens
        self.active_bytes = m.active_params * m.dtype_bytes
        free = cost.kv_budget_bytes  # all of HBM less the weights (mem_fraction 1.0)
        self.kv_budget_tokens = int(free / self.kv_bytes_per_token)
        self.budget_blocks = int(free / self.block_bytes)
        self.max_running = cluster.max_running
        if self.budget_blocks < 1:
            raise ConfigError(
                "gpus_per_replica",
                f"{m.name} weights ({m.total_params * m.dtype_bytes / 1e9:.0f} GB) leave less than one "
                f"{block_tokens}-token block of KV cache on {g} x {gpu.name} ({gpu.hbm_bytes * g / 1e9:.0f} GB) "
                "in the infersim profile; use more GPUs per replica or a larger GPU",
            )

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens: ``2 x active_params x tokens / (FLOP/s x mfu)``."""
        return 2 * self.active_params * tokens / (self.flops * self.mfu)

    def reload_s(self, blocks: int) -> float:
        """Seconds to bring ``blocks`` blocks back from host RAM over PCIe."""
        return blocks * self.block_bytes / self.pcie_bytes_per_s

    def copy_s(self, blocks: int) -> float:
        """Seconds a copy of ``blocks`` blocks occupies its target (bytes / the target's NIC bandwidth)."""
        return blocks * self.block_bytes / self.nic_bytes_per_s

    def decode_s(self, steps: int, running: int, kv_tokens: int) -> float:
        """Seconds for ``steps`` decode steps of ``running`` sequences holding ``kv_tokens`` KV tokens at the first
        step; every sequence grows by one token per step."""
        kv = self.kv_bytes_per_token * (steps * kv_tokens + running * steps * (steps - 1) / 2)
        return (self.active_bytes * steps + kv) / (self.hbm_bytes_per_s * self.mbu)


Piece = tuple[tuple, int, int]


class _Chains:
    """Splits block chains into pieces ``(src, lo, hi)`` with ``chain[lo:hi] == src[lo:hi]``, shared by all replicas.

    ``src`` is the first chain seen along a radix-tree path: every chain that runs through the same prefix gets the
    same ``(src, lo, hi)`` for it, so a replica's cache runs (:class:`_KvCache`) line up with the pieces and a shared
    prefix costs one step per piece, not one per block. Sources are kept (their ids key the tree); a chain's pieces
    are memoized by identity.
    """

    #: memoized chains kept before the memo starts over
    MEMO_SIZE = 4096

    def __init__(self) -> None:
        self._roots: dict[Hashable, tuple] = {}  # first block -> the first chain seen starting with it
        self._kids: dict[tuple[int, int, Hashable], tuple] = {}  # (id(src), i, block) -> source going on from i
        self._points: dict[int, list[int]] = {}  # id(src) -> positions where a kid leaves it (sorted)
        self._distinct: dict[int, bool] = {}  # id(src) -> whether its blocks are pairwise distinct
        self._sets: dict[int, frozenset] = {}  # id(src) -> its blocks (made when a kid's tail is checked)
        self._memo: dict[int, tuple[Sequence[Hashable], tuple[Piece, ...], bool]] = {}

    def pieces(self, chain: Sequence[Hashable]) -> tuple[tuple[Piece, ...], bool]:
        """``chain``'s pieces, in order, and whether its blocks are known pairwise distinct (False: maybe not)."""
        m = self._memo.get(id(chain))
        if m is not None and m[0] is chain:
            return m[1], m[2]
        c = chain if type(chain) is tuple else tuple(chain)
        ps = self._split(c)
        distinct = self._distinct[id(ps[-1][0])] if ps else True
        if len(self._memo) >= self.MEMO_SIZE:
            self._memo.clear()
        self._memo[id(chain)] = (chain, ps, distinct)
        return ps, distinct

    def _split(self, c: tuple) -> tuple[Piece, ...]:
        n = len(c)
        if not n:
            return ()
        src = self._roots.get(c[0])
        if src is None:
            self._roots[c[0]] = c
            self._distinct[id(c)] = len(set(c)) == n
            return ((c, 0, n),)
        out = []
        i = 0
        while True:
            m = self._common(c, src, i)
            if m > i:
                out.append((src, i, m))
            if m == n:
                return tuple(out)
            key = (id(src), m, c[m])
            nxt = self._kids.get(key)
            if nxt is None:  # c leaves every known source at m: it becomes the source from m on
                self._kids[key] = c
                pts = self._points.setdefault(id(src), [])
                if m not in pts:
                    insort(pts, m)
                tail = c[m:]
                self._distinct[id(c)] = (
                    self._distinct[id(src)] and len(set(tail)) == len(tail) and self._set(src).isdisjoint(tail)
                )
                out.append((c, m, n))
                return tuple(out)
            src, i = nxt, m

    def _set(self, src: tuple) -> frozenset:
        s = self._sets.get(id(src))
        if s is None:
            s = self._sets[id(src)] = frozenset(src)
        return s

    def _common(self, c: tuple, src: tuple, i: int) -> int:
        """Length of the common prefix of ``c`` and ``src``, given that their first ``i`` blocks agree."""
        n = min(len(c), len(src))
        pts = self._points.get(id(src), ())
        k = bisect_right(pts, i)
        for p in pts[k : k + 8]:  # where other chains left src: the likely place for c to leave it too
            if p >= n:
                break
            if c[p] != src[p]:
                if c[i:p] == src[i:p]:
                    return p
                break
        if c[i:n] == src[i:n]:
            return n
        lo, hi = i, n  # c[:lo] == src[:lo]; c[lo:hi] != src[lo:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if c[lo:mid] == src[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo


class _Run:
    """Blocks ``src[lo:hi]``: in HBM, adjacent in LRU order (oldest first, linked by ``prev``/``next``); or in host
    RAM (unlinked, order irrelevant)."""

    __slots__ = ("src", "lo", "hi", "prev", "next")

    def __init__(self, src: tuple, lo: int, hi: int) -> None:
        self.src = src
        self.lo = lo
        self.hi = hi
        self.prev: _Run = self
        self.next: _Run = self


class _KvCache:
    """One replica's HBM LRU of blocks spilling to a host-RAM set, kept as runs of chain sources (see
    :class:`_Chains`).

    Same states as a block-by-block ``OrderedDict`` LRU plus a host set (Infer-Sim's ``Node.insert`` / ``match``).
    Invariants: every HBM block is in exactly one linked run and ``where`` maps it to that run, runs hold pairwise
    distinct blocks, the list order (``head.next`` oldest) followed by each run's ``src[lo:hi]`` is the LRU order,
    ``size`` counts the HBM blocks; every host block is in exactly one host run and ``hwhere`` maps it there.
    """

    #: longest newest run that takes in an insert's ``extra`` blocks (see :meth:`_append_extra`)
    PACK_BLOCKS = 4

    def __init__(self, budget_blocks: int, chains: _Chains, fleet: dict[Hashable, int]) -> None:
        self.budget = budget_blocks
        self.chains = chains
        self.fleet = fleet  # block -> replicas holding it in HBM or host RAM (shared by the fleet)
        self.head = _Run((), 0, 0)  # sentinel of the circular list: head.next oldest, head.prev newest
        self.where: dict[Hashable, _Run] = {}
        self.hwhere: dict[Hashable, _Run] = {}
        self.size = 0
        self._hlast: _Run | None = None  # the host run the next eviction may extend
        self.version = 0  # bumped by every insert: a match of the same chain at the same version is the same
        self._last: tuple[object, int, tuple[int, int]] = (None, -1, (0, 0))  # (chain, version, match)

    def blocks(self) -> Iterator[Hashable]:
        """HBM blocks, least recently used first."""
        r = self.head.next
        while r is not self.head:
            yield from r.src[r.lo : r.hi]
            r = r.next

    # -- queries ----------------------------------------------------------------------------------------------
    def match(self, chain: Sequence[Hashable]) -> tuple[int, int]:
        """The leading run of ``chain`` found in HBM or host RAM, as ``(blocks in HBM, blocks in host RAM)``."""
        last = self._last
        if last[0] is chain and last[1] == self.version:  # asked again before anything changed
            return last[2]
        res = self._match(chain)
        self._last = (chain, self.version, res)
        return res

    def _match(self, chain: Sequence[Hashable], host: bool = True) -> tuple[int, int]:
        """:meth:`match` without the memo; ``host`` False: stop at the first block not in HBM (host blocks 0)."""
        where, hwhere = self.where, self.hwhere
        a = b = 0
        for src, i, e in self.chains.pieces(chain)[0]:
            while i < e:
                r = where.get(src[i])
                in_hbm = r is not None
                if not in_hbm:
                    r = hwhere.get(src[i]) if host else None
                    if r is None:
                        return a, b
                # the rest of the piece this run holds in order, else the one block
                k = (r.hi if r.hi < e else e) - i if r.src is src and r.lo <= i < r.hi else 1
                if in_hbm:
                    a += k
                else:
                    b += k
                i += k
        return a, b

    def hbm_run(self, chain: Sequence[Hashable]) -> int:
        """Length of the leading run of ``chain`` resident in HBM."""
        return self._match(chain, host=False)[0]

    # -- updates ----------------------------------------------------------------------------------------------
    def insert(self, chain: Sequence[Hashable], extra: tuple = ()) -> None:
        """Touch ``chain`` then ``extra`` (blocks nobody else holds) in order, as most recently used, taking blocks
        back from host RAM; then spill the least recently used blocks over the budget to host RAM."""
        self.version += 1
        pieces, distinct = self.chains.pieces(chain)
        where, hwhere, head = self.where, self.hwhere, self.head
        for src, i, e in pieces:
            while i < e:
                blk = src[i]
                r = where.get(blk)
                if r is not None:  # in HBM: move the part of its run that continues the piece to the MRU end
                    if r.src is src and r.lo <= i < r.hi:
                        j = r.hi if r.hi < e else e
                        if r.lo < i or j < r.hi:
                            r = self._cut(r, i, j)
                    else:  # the block sits elsewhere in its run (a chain repeating a block, or not interned alike)
                        at = r.src.index(blk, r.lo, r.hi)
                        r = self._cut(r, at, at + 1)
                        j = i + 1
                    last = head.prev
                    if r is not last:  # unlink, then link as the newest
                        r.prev.next = r.next
                        r.next.prev = r.prev
                        r.prev, r.next = last, head
                        last.next = r
                        head.prev = r
                    i = j
                    continue
                h = hwhere.get(blk)
                if h is not None:  # in host RAM: take the part of its host run that continues the piece back
                    if h.src is src and h.lo <= i < h.hi:
                        j = min(h.hi, e)
                        self._take_host(h, i, j)
                        self._append(src, i, j)
                    else:
                        self._take_host(h, h.src.index(blk, h.lo, h.hi), -1)
                        self._append(src, i, i + 1)
                        j = i + 1
                    i = j
                    continue
                # new here: the stretch of blocks in neither (one block at a time if the chain may repeat one)
                j = i + 1
                if distinct and j < e:
                    j = min(
                        next(compress(count(i), map(where.__contains__, islice(src, i, e))), e),
                        next(compress(count(i), map(hwhere.__contains__, islice(src, i, e))), e),
                    )
                fleet = self.fleet
                if j - i == 1:
                    fleet[blk] = fleet.get(blk, 0) + 1
                else:  # pairwise distinct blocks: count them all at once
                    seg = src[i:j]
                    fleet.update(zip(seg, list(map((1).__add__, map(fleet.get, seg, repeat(0)))), strict=True))
                self._append(src, i, j)
                i = j
        if extra:
            self._append_extra(extra)
        if self.size > self.budget:
            self._evict(self.size - self.budget)

    def _append_extra(self, extra: tuple) -> None:
        """Add ``extra`` (blocks in no run and nowhere else) as the most recently used HBM blocks. A short newest
        run (typically a request's own last prompt block) takes them in, rebased onto a tuple of its own: one run to
        move and evict instead of two. Its blocks no longer line up with their chain's source, which costs a
        lookup per block in later walks; hence only short runs."""
        count_blocks(self.fleet, extra)
        last = self.head.prev
        if last is self.head or last.hi - last.lo > self.PACK_BLOCKS:
            self._append(extra, 0, len(extra))
            return
        last.src = last.src[last.lo : last.hi] + extra
        last.lo = 0
        last.hi = len(last.src)
        where = self.where
        for h in extra:
            where[h] = last
        self.size += len(extra)

    def _evict(self, over: int) -> None:
        """Spill the ``over`` least recently used HBM blocks to host RAM (a whole run moves over as it is)."""
        head, where, hwhere = self.head, self.where, self.hwhere
        self.size -= over
        while over:
            r = head.next
            lo, hi = r.lo, r.hi
            if hi - lo <= over and hi - lo <= self.PACK_BLOCKS:  # the usual case: a request's own last blocks
                for blk in r.src[lo:hi]:
                    del where[blk]
                    hwhere[blk] = r
                head.next = r.next
                r.next.prev = head
                over -= hi - lo
                continue
            end = min(hi, lo + over)
            out = r.src[lo:end]
            deque(map(where.__delitem__, out), maxlen=0)
            h = self._hlast
            if h is not None and h.src is r.src and h.hi == lo:
                h.hi = end
            elif end == hi:
                h = r
            else:
                h = _Run(r.src, lo, end)
            self._hlast = h
            hwhere.update(zip(out, repeat(h)))
            if end == hi:
                head.next = r.next
                r.next.prev = head
            else:
                r.lo = end
            over -= end - lo

    def _append(self, src: tuple, i: int, j: int) -> None:
        """Add ``src[i:j]`` (in no run) as the most recently used HBM blocks."""
        last = self.head.prev
        if last.src is src and last.hi == i:
            last.hi = j
            r = last
        else:
            r = _Run(src, i, j)
            self._link_last(r)
        if j - i == 1:
            self.where[src[i]] = r
        else:
            self.where.update(zip(src[i:j], repeat(r)))
        self.size += j - i

    def _cut(self, r: _Run, i: int, j: int) -> _Run:
        """The HBM run holding ``r.src[i:j]`` (``r.lo <= i < j <= r.hi``), splitting ``r`` where needed; the parts
        keep their places in LRU order."""
        if r.lo < i:
            r = self._split(r, i)[1]
        if j < r.hi:
            r = self._split(r, j)[0]
        return r

    def _split(self, r: _Run, at: int) -> tuple[_Run, _Run]:
        """Split HBM run ``r`` before ``at`` (``r.lo < at < r.hi``) into two adjacent linked runs ``(left, right)``;
        the smaller part gets the new object (its blocks are re-pointed)."""
        if at - r.lo < r.hi - at:
            left = _Run(r.src, r.lo, at)
            r.lo = at
            left.prev, left.next = r.prev, r
            r.prev.next = left
            r.prev = left
            self.where.update(zip(r.src[left.lo : at], repeat(left)))
            return left, r
        right = _Run(r.src, at, r.hi)
        r.hi = at
        right.prev, right.next = r, r.next
        r.next.prev = right
        r.next = right
        self.where.update(zip(r.src[at : right.hi], repeat(right)))
        return r, right

    def _take_host(self, h: _Run, i: int, j: int) -> None:
        """Remove ``h.src[i:j]`` (``j == -1``: one block) from host run ``h``."""
        if j < 0:
            j = i + 1
        src = h.src
        deque(map(self.hwhere.__delitem__, src[i:j]), maxlen=0)
        if i > h.lo and j < h.hi:  # a hole in the middle: the smaller side moves to a new run
            if i - h.lo < h.hi - j:
                side = _Run(src, h.lo, i)
                h.lo = j
            else:
                side = _Run(src, j, h.hi)
                h.hi = i
            self.hwhere.update(zip(src[side.lo : side.hi], repeat(side)))
        elif i > h.lo:
            h.hi = i
        else:
            h.lo = j  # may leave h empty: it holds nothing then

    def _link_last(self, r: _Run) -> None:
        head = self.head
        last = head.prev
        r.prev, r.next = last, head
        last.next = r
        head.prev = r


class InferSimReplica:
    """One replica of the infersim model: clock, queue, running batch, HBM LRU and host-RAM set.

    ``clock`` (seconds) is the replica's own time: the end of the work it has done so far. It can run ahead of the
    fleet's time (a long admission) and never falls behind the time it was last advanced to.
    """

    def __init__(self, idx: int, cost: InferSimCost, sim: InferSimulator, chains: _Chains | None = None) -> None:
        self.idx = idx
        self.cost = cost
        self.sim = sim
        self.clock = 0.0
        self.queue: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.reserved = 0  # KV tokens reserved by running sequences
        self.kv_tokens = 0  # sum of running sequences' contexts
        self.kv = _KvCache(cost.budget_blocks, chains if chains is not None else _Chains(), sim.fleet_blocks)
        self.queued_s = 0.0  # sum of est_s over the queue
        self.copied: dict[Hashable, _Copy] = {}  # last block of a copied chain -> the copy that brought it
        self.copy_lens: set[int] = set()  # chain lengths in ``copied``

    @property
    def load(self) -> int:
        """Running + queued requests."""
        return len(self.running) + len(self.queue)

    # -- cache ------------------------------------------------------------------------------------------------
    @property
    def hbm(self) -> list[Hashable]:
        """HBM blocks, least recently used first."""
        return list(self.kv.blocks())

    @property
    def host(self) -> set[Hashable]:
        """Blocks in host RAM."""
        return set(self.kv.hwhere)

    def match(self, chain: Sequence[Hashable]) -> tuple[int, int]:
        """The leading run of ``chain`` found in HBM or host RAM, as ``(blocks in HBM, blocks in host RAM)``."""
        return self.kv.match(chain)

    def hbm_run(self, chain: Sequence[Hashable]) -> int:
        """Length of the leading run of ``chain`` resident in HBM."""
        return self.kv.hbm_run(chain)

    def insert(self, blocks: Sequence[Hashable]) -> None:
        """Make ``blocks`` the most recently used HBM entries (in order), spilling LRU blocks to host RAM."""
        self.kv.insert(blocks)

    def prefill_estimate_s(self, s: _Seq) -> float:
        """Prefill seconds of ``s`` here given the cache as it is now (blocks in HBM or host RAM count as hits)."""
        a, b = self.kv.match(s.blocks)
        return self.cost.prefill_s(s.req.input_tokens - min((a + b) * self.cost.block_tokens, s.prefix_tokens))

    def enqueue(self, s: _Seq) -> None:
        """Put ``s`` at the back of the queue (estimating its prefill from the cache as it is now)."""
        s.est_s = self.prefill_estimate_s(s)
        self.queued_s += s.est_s
        self.queue.append(s)

    # -- scheduling -------------------------------------------------------------------------------------------
    def advance(self, until: float | None) -> None:
        """Do this replica's work up to time ``until`` (None: until its queue and batch are empty).

        Admissions run to completion even past ``until``; decode stops at the last whole step ending by
        ``until`` (at least one step).
        """
        cost = self.cost
        while True:
            if self.queue:
                self._admit()
            if until is not None and self.clock >= until:
                return
            running = self.running
            if not running:
                if until is not None:
                    self.clock = until
                return
            n = len(running)
            kv = self.kv_tokens
            steps = min([s.left for s in running])
            dt = cost.decode_s(steps, n, kv)
            if until is not None and dt > until - self.clock:
                lo, hi = 1, steps
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if cost.decode_s(mid, n, kv) <= until - self.clock:
                        lo = mid
                    else:
                        hi = mid - 1
                steps = lo
                dt = cost.decode_s(steps, n, kv)
            self.clock += dt
            done = False
            for s in running:
                s.left -= steps
                s.context += steps
                if s.left == 0:
                    done = True
            self.kv_tokens += n * steps
            if done:
                keep = []
                for s in running:
                    if s.left == 0:
                        self.reserved -= s.need
                        self.kv_tokens -= s.context
                        self.sim.finished(self, s)
                    else:
                        keep.append(s)
                self.running = keep

    def _admit(self) -> None:
        cost = self.cost
        queue = self.queue
        running = self.running
        kv = self.kv
        bt = cost.block_tokens
        while queue and len(running) < cost.max_running:
            s = queue[0]
            if self.reserved + s.need > cost.kv_budget_tokens:
                return  # FCFS: the head waits for running sequences to finish (sizes are checked up front)
            queue.popleft()
            self.queued_s = self.queued_s - s.est_s if queue else 0.0
            blocks = s.blocks
            n_hbm, n_host = kv.match(blocks)
            matched = n_hbm + n_host
            if self.copy_lens and matched:
                self._mark_copies_used(blocks, matched)
            hit = min(matched * bt, s.prefix_tokens)
            reuse = min(cost.reload_s(n_host), cost.prefill_s(hit)) if n_host else 0.0  # reload_s(0) == 0.0
            prefill = cost.prefill_s(s.req.input_tokens - hit)
            s.start_s = self.clock
            s.reuse_s = reuse
            s.prefill_s = prefill
            s.hit_tokens = hit
            if matched < len(blocks):
                s.recomputed = self.sim.recomputed_tokens(s, matched)
            running.append(s)
            self.reserved += s.need
            self.kv_tokens += s.context
            self.clock += reuse + prefill
            extra = -(-s.need // bt) - len(blocks)
            kv.insert(blocks, (_OutBlock(),) if extra == 1 else tuple(_OutBlock() for _ in range(extra)))

    def _mark_copies_used(self, blocks: Sequence[Hashable], matched: int) -> None:
        copied = self.copied
        for n in self.copy_lens:
            if n <= matched:
                c = copied.get(blocks[n - 1])
                if c is not None:
                    c.used = True


class _Copy:
    __slots__ = ("chain", "source", "target", "start_s", "ready_s", "used")

    def __init__(self, chain: tuple, source: int, target: int, start_s: float, ready_s: float) -> None:
        self.chain = chain
        self.source = source
        self.target = target
        self.start_s = start_s
        self.ready_s = ready_s
        self.used = False


class InferSimFleetView:
    """The :class:`~btbctl.engine.policies.base.FleetView` of the infersim model.

    ``cached_blocks`` is the leading run of a chain in a replica's HBM **or host RAM** (what an admission there
    would reuse without recomputing, and what Infer-Sim's cache-aware rule matches); ``hbm_blocks`` (an addition
    to the protocol) is the leading run in HBM only (what BTB counts as holding a prefix). ``pending_blocks`` adds a
    whole chain whose copy towards the replica is scheduled. Copies follow :meth:`InferSimulator.start_copy`.
    The cost-view reads this model has no notion of (queued requests' planned blocks, requests waiting for a
    block, decode admission, chunking) answer as if absent: ``planned_blocks`` = ``pending_blocks``, no waiting
    groups, no admission wait, prefill not chunked.
    """

    def __init__(self, sim: InferSimulator) -> None:
        self._sim = sim
        self._reps = sim.replicas  # fixed for the run

    @property
    def n_replicas(self) -> int:
        return len(self._sim.replicas)

    def load(self, replica: int) -> int:
        r = self._reps[replica]
        return len(r.running) + len(r.queue)

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        a, b = self._reps[replica].kv.match(chain)
        return a + b

    def hbm_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident in ``replica``'s HBM."""
        return self._reps[replica].kv.hbm_run(chain)

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        if self.copy_in_flight(replica, chain):
            return len(chain)
        return self.cached_blocks(replica, chain)

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether a copy of exactly ``chain`` towards ``replica`` is scheduled and not yet in its cache."""
        planned = self._sim.planned
        return bool(planned) and (replica, tuple(chain)) in planned

    def accepts_copies(self, replica: int) -> bool:
        """Always True: every replica of this model can send and receive copies."""
        return True

    def prefill_load(self, replica: int) -> int:
        """Requests queued on ``replica`` (not admitted yet; an admission computes the first token at once here)."""
        return len(self._sim.replicas[replica].queue)

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return self.copy_status(replica, chain) is not None

    def copy_after_s(self, replica: int, blocks: int) -> float:
        """0: a copy's blocks land in the target's KV cache as they arrive (the push model)."""
        return 0.0

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        """The scheduled copy of ``chain`` towards ``replica``, or None. In this model the copy moves at the target's
        NIC rate from its start (when the target is free) to its ready time, and never waits for the source: all its
        bytes count as available."""
        sim = self._sim
        c = sim.planned.get((replica, tuple(chain)))
        if c is None:
            return None
        total = len(c.chain) * sim.cost.block_bytes
        rate = sim.cost.nic_bytes_per_s
        sent = min(total, max(0.0, sim.now - c.start_s) * rate)
        sending = c.start_s <= sim.now < c.ready_s
        return CopyStatus(
            source=c.source,
            total_bytes=total,
            sent_bytes=sent,
            available_bytes=total,
            rate_bytes_per_s=rate if sending else 0.0,
        )

    def nic_copies(self, replica: int) -> int:
        """Scheduled copies towards ``replica`` not yet in its cache (sources are not charged in this model)."""
        return sum(1 for c in self._sim.copies if c.target == replica)

    def kv_headroom_tokens(self, replica: int) -> int:
        """Tokens of prefix cache a new copy may use on ``replica``: the whole HBM cache (every block is evictable to
        host RAM in this model, and cached blocks are separate from the running requests' reservations)."""
        cost = self._sim.cost
        return cost.budget_blocks * cost.block_tokens

    def queued_prefill_s(self, replica: int) -> float:
        """Prefill seconds of the requests queued on ``replica``, each counting the prompt tokens it would compute
        given the replica's cache when it was queued (no attention term in this model), plus the part of the
        replica's clock still ahead of now. O(1)."""
        sim = self._sim
        rep = sim.replicas[replica]
        return rep.queued_s + max(0.0, rep.clock - sim.now)

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return self.pending_blocks(replica, chain)

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        return []

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        return 0.0

    @property
    def chunk_tokens(self) -> int:
        return 0

    @property
    def cost(self) -> ReplicaCost:
        """The replica's :class:`~btbctl.engine.costmodel.ReplicaCost` (memory fraction 1.0, no attention term)."""
        return self._sim.cost.cost

    @property
    def block_tokens(self) -> int:
        return self._sim.cost.block_tokens


class InferSimulator:
    """One policy over one trace window on one fleet, in the infersim model.

    Args:
        requests: the window's requests, sorted by arrival.
        block_tokens: tokens per block of their hash chains.
        policy: a fresh :class:`~btbctl.engine.policies.base.Policy`.
        cluster: the fleet.
        window: index of the window (for unique output blocks and reports).
        on_finish: called with each finished request's record.
    """

    def __init__(
        self,
        requests: Sequence[Request],
        block_tokens: int,
        policy,
        cluster: ClusterConfig,
        window: int = 0,
        on_finish: Callable[[RequestRecord], None] | None = None,
    ) -> None:
        self.requests = requests
        self.policy = policy
        self.cost = InferSimCost(cluster, block_tokens)
        self.window = window
        self.fleet_blocks: dict[Hashable, int] = {}  # block -> replicas holding it in HBM or host RAM
        chains = _Chains()
        self.replicas = [InferSimReplica(i, self.cost, self, chains) for i in range(cluster.replicas)]
        self.view = InferSimFleetView(self)
        self.now = 0.0
        self.copies: list[_Copy] = []  # scheduled, not yet in the target's cache (creation order)
        self.all_copies: list[_Copy] = []
        self.planned: dict[tuple[int, tuple], _Copy] = {}
        self.time_to_warm_s: list[float] = []
        self.records: list[RequestRecord] = []
        self.on_finish = on_finish
        self.copies_started = 0
        self.copies_refused = 0
        self.copies_applied = 0
        self.copied_bytes = 0.0

    def run(self) -> list[RequestRecord]:
        """Replay the window to completion; returns the records (in completion order). The garbage collector is
        paused meanwhile (see :func:`_collector_paused`)."""
        with _collector_paused():
            return self._run()

    def _run(self) -> list[RequestRecord]:
        reps = self.replicas
        policy = self.policy
        view = self.view
        n = len(reps)
        bt = self.cost.block_tokens
        window = self.window
        for req in self.requests:
            t = req.arrival_s
            self.now = t
            for rep in reps:
                if rep.running or rep.queue:
                    rep.advance(t)
                elif rep.clock < t:  # what advance does for an idle replica
                    rep.clock = t
            if self.copies:
                self._apply_copies(t)
            route = policy.route(req, view, t)
            r = route.replica
            if not (isinstance(r, int) and 0 <= r < n):
                raise RuntimeError(f"policy {policy.name!r} returned replica {r!r} of {n}")  # a bug, not input
            for plan in route.copies:
                carry_out(
                    plan,
                    lambda tgt, p=plan, t=t: self.start_copy(p.prefix, p.source, tgt, t, p.hot_since_s),
                    lambda tgt, ok, p=plan, t=t: policy.on_copy_result(p, tgt, ok, t),
                )
            reps[r].enqueue(_Seq(req, bt, window))
        for rep in reps:
            rep.advance(None)
        return self.records

    # -- hooks from replicas ----------------------------------------------------------------------------------
    def recomputed_tokens(self, s: _Seq, matched: int) -> int:
        """Prompt tokens ``s`` computes past its local match although some replica holds the block."""
        held = self.fleet_blocks.__contains__
        bt = self.cost.block_tokens
        inp = s.req.input_tokens
        blocks = s.blocks
        # block k holds prompt tokens [k bt, (k + 1) bt) clipped to the prompt: the blocks before ``full`` are whole,
        # block ``full`` holds the remainder (maybe none), later ones hold none
        full = inp // bt
        out = bt * sum(map(held, islice(blocks, matched, full))) if matched < full else 0
        if matched <= full < len(blocks) and inp > full * bt and held(blocks[full]):
            out += inp - full * bt
        return out

    def finished(self, rep: InferSimReplica, s: _Seq) -> None:
        req = s.req
        ttft = s.start_s - req.arrival_s + s.reuse_s + s.prefill_s
        rec = RequestRecord(
            request_id=req.request_id,
            kind=req.kind,
            arrival_s=req.arrival_s,
            replica=rep.idx,
            ttft_s=ttft,
            queue_wait_s=s.start_s - req.arrival_s,
            cached_tokens=s.hit_tokens,
            prefill_tokens=req.input_tokens - s.hit_tokens,
            finish_s=rep.clock,
            input_tokens=req.input_tokens,
            recomputed_prefix_tokens=s.recomputed,
        )
        self.records.append(rec)
        self.policy.on_finish(req, rep.idx, rep.clock)
        if self.on_finish is not None:
            self.on_finish(rec)

    # -- copies -----------------------------------------------------------------------------------------------
    def start_copy(
        self, chain: tuple, source: int, target: int, now_s: float, hot_since_s: float | None = None
    ) -> bool:
        """Schedule a copy of ``chain`` to ``target``: charged to the target's clock only, not waiting for the source
        (see ``docs/simulator.md``). Refused (False) for a bad index, ``source == target``, an empty chain, a source
        that holds neither in HBM nor in host RAM the whole chain, or a copy of it already scheduled to the target.
        ``hot_since_s``: start of the time-to-warm measurement (default ``now_s``)."""
        n = len(self.replicas)
        if (
            not chain
            or not (0 <= source < n and 0 <= target < n)
            or source == target
            or (target, chain) in self.planned
            or self.view.cached_blocks(source, chain) < len(chain)
        ):
            self.copies_refused += 1
            return False
        dst = self.replicas[target]
        dt = self.cost.copy_s(len(chain))
        start = max(now_s, dst.clock)
        dst.clock = start + dt
        c = _Copy(chain, source, target, start, start + dt)
        self.copies.append(c)
        self.all_copies.append(c)
        self.planned[(target, chain)] = c
        self.time_to_warm_s.append(c.ready_s - (now_s if hot_since_s is None else hot_since_s))
        self.copies_started += 1
        self.copied_bytes += len(chain) * self.cost.block_bytes
        return True

    def _apply_copies(self, now_s: float) -> None:
        keep = []
        for c in self.copies:
            if c.ready_s <= now_s + READY_SLACK_S:
                dst = self.replicas[c.target]
                dst.insert(c.chain)
                dst.copied[c.chain[-1]] = c
                dst.copy_lens.add(len(c.chain))
                self.planned.pop((c.target, c.chain), None)
                self.copies_applied += 1
            else:
                keep.append(c)
        self.copies = keep


def trace_windows(trace: Trace, split_windows: bool | None = None) -> list[list[Request]]:
    """The trace's windows, each sorted by arrival (stable).

    Args:
        split_windows: True: one window per ``labels["trace_id"]`` (requests without one form a window of their
            own); False: the whole trace is one window; None (auto): split only when the trace was read from a
            ``btb-mixed-trace-v1`` file, every request has a ``trace_id`` label and there are at least two of them
            (a file as the reference dataset generator writes it). Generated traces and overlays are one window.

    Returns:
        Windows in order of first appearance in the trace.
    """
    reqs = trace.requests
    if split_windows is None:
        split_windows = trace.format == "btb-mixed-trace-v1" and all(
            r.labels is not None and r.labels.get("trace_id") is not None for r in reqs
        )
    if not split_windows:
        return [list(reqs)]
    groups: dict = {}
    for r in reqs:
        tid = r.labels.get("trace_id") if r.labels else None
        groups.setdefault(tid, []).append(r)
    return list(groups.values())


def check_fits_infersim(trace: Trace, cost: InferSimCost) -> None:
    """Raise :class:`ConfigError` (key ``gpus_per_replica``) if a request's ``input + output`` tokens exceed a
    replica's KV budget (it could never be admitted)."""
    worst = None
    for r in trace.requests:
        need = r.input_tokens + r.output_tokens
        if need > cost.kv_budget_tokens and (worst is None or need > worst[0]):
            worst = (need, r.request_id)
    if worst is not None:
        raise ConfigError(
            "gpus_per_replica",
            f"request {worst[1]} needs {worst[0]} tokens of KV cache but an infersim replica holds "
            f"{cost.kv_budget_tokens}; use more GPUs per replica or a larger GPU",
        )


def _merge_stats(total: dict, part: dict) -> None:
    for k, v in part.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(total.get(k, 0), (int, float)):
            total[k] = total.get(k, 0) + v
        else:
            total[k] = v


def simulate_infersim(
    trace: Trace,
    policy: str,
    cluster: ClusterConfig,
    constants: BtbConstants,
    *,
    seed: int = 42,
    progress: Callable[[int], None] | None = None,
    split_windows: bool | None = None,
) -> SimResult:
    """Simulate ``trace`` on ``cluster`` under the policy named ``policy`` with the infersim model.

    Args:
        trace: requests (sorted by arrival); one or more windows (see :func:`trace_windows`).
        policy: a registry name; ``cache_aware`` and ``btb`` take their Infer-Sim variants
            (:mod:`btbctl.engine.policies.infersim_rules`), the others run as in the registry.
        cluster: the fleet (see :class:`InferSimCost` for the fields used).
        constants: BTB's four constants.
        seed: each window's policy gets ``random.Random(seed)`` (the reference reseeds per window).
        progress: called with increments of finished requests (at least once per window).
        split_windows: see :func:`trace_windows`.

    Returns:
        A :class:`~btbctl.engine.sim.results.SimResult` with ``fidelity="infersim"`` and
        ``percentile_method="index"``; records sorted by ``(arrival_s, request_id)``. ``replications`` and
        ``copies_started`` count scheduled copies (every copy completes in this model), ``replicated_bytes`` their
        bytes, ``wasted_replications`` the copies no admission on their target reused (including copies still
        pending when the window ended), ``time_to_warm_s`` per copy the seconds from the policy's ``hot_since_s``
        (default: the request that asked for it) to its ready time; ``policy_stats`` sums the integer counters over
        windows.

    Raises:
        ConfigError: unknown policy or presets, a model that does not fit, a request larger than a replica's KV
            budget.
    """
    cost = InferSimCost(cluster, trace.block_tokens)
    check_fits_infersim(trace, cost)
    records: list[RequestRecord] = []
    stats: dict = {}
    started = refused = wasted = 0
    copied = 0.0
    warm: list[float] = []
    name = policy
    for w, reqs in enumerate(trace_windows(trace, split_windows)):
        pol = make_policy(
            policy, cluster.replicas, random.Random(seed), constants, block_tokens=trace.block_tokens, fidelity=FIDELITY
        )
        name = getattr(pol, "name", policy) or policy
        sim = InferSimulator(reqs, trace.block_tokens, pol, cluster, window=w)
        recs = sim.run()
        if len(recs) != len(reqs):
            raise RuntimeError(f"window {w}: {len(reqs) - len(recs)} requests unfinished")  # a bug, not input
        records.extend(recs)
        if progress is not None and recs:
            progress(len(recs))
        _merge_stats(stats, pol.stats())
        started += sim.copies_started
        refused += sim.copies_refused
        copied += sim.copied_bytes
        wasted += sum(1 for c in sim.all_copies if not c.used)
        warm.extend(sim.time_to_warm_s)
    records.sort(key=lambda r: (r.arrival_s, r.request_id))
    return SimResult(
        policy=name,
        records=records,
        replications=started,
        replicated_bytes=copied,
        copies_started=started,
        copies_refused=refused,
        policy_stats=stats,
        fidelity=FIDELITY,
        percentile_method="index",
        wasted_replications=wasted,
        time_to_warm_s=warm,
    )


__all__ = [
    "FIDELITY",
    "InferSimCost",
    "InferSimFleetView",
    "InferSimReplica",
    "InferSimulator",
    "check_fits_infersim",
    "simulate_infersim",
    "trace_windows",
]
