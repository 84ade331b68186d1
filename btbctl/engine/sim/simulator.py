"""Discrete-event simulator of a GPU fleet serving a trace under one routing policy (``realistic`` fidelity).

Model (deterministic for a seed; events ordered by ``(time, priority, sequence)``):

* **Replica** = one model instance, TP over ``gpus_per_replica`` GPUs (capacities from
  :class:`~btbctl.engine.costmodel.ReplicaCost`). KV budget = ``mem_fraction`` x HBM - weights, in tokens.
* **Prefix cache**: block-level, LRU over unpinned blocks (:class:`~btbctl.engine.sim.cache.PrefixCache`).
* **Scheduler** (SGLang-like, prefill first): each iteration forms a prefill batch of at most
  ``chunked_prefill_tokens`` new tokens: first the request being chunked, then waiting requests in FCFS order
  while a request slot (``max_running``) and KV space exist (head-of-line blocking on memory, as SGLang).
  A request whose next uncached block is being computed on this replica (by an earlier request's prefill) or is
  arriving by copy *waits* for it instead of recomputing it, without holding up the requests behind it.
  Blocks become cached (usable by later requests and copyable) at the end of the chunk that computes them.
  When no prefill batch can be formed, all running requests take decode steps together.
  Step times: prefill = FLOPs (linear + attention term) at ``mfu`` of peak, floored by one weight read; decode =
  weights + all running KV read at ``hbm_efficiency`` of HBM bandwidth; plus a fixed per-step overhead.
  Decode runs are simulated in closed form up to the next completion and cut at a step boundary when new work
  arrives.
* **TTFT** = end of the prefill step that computes the prompt's last token - arrival.
* **Copies** (BTB replication): over full-duplex NICs with max-min fair sharing
  (:mod:`btbctl.engine.sim.network`); a copy sends only blocks the source has computed and the target uses the
  blocks only when the whole copy has arrived. Space for the copy is reserved at the target when it starts.

The simulator never reads the wall clock; the policy sees the fleet only through :class:`SimFleetView`.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass
from typing import Callable, Hashable, Sequence

from btbctl.engine.config import FIDELITIES, ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.errors import ConfigError
from btbctl.engine.copies import CopyPlan, CopyStatus, carry_out
from btbctl.engine.sim.cache import PrefixCache
from btbctl.engine.sim.network import Copy, Network
from btbctl.engine.stats import summarize
from btbctl.engine.trace.model import Request, Trace

# event kinds, in tie-break priority order (lower runs first at equal times)
_EV_COPY = 0
_EV_STEP = 1


@dataclass(slots=True)
class RequestRecord:
    """Outcome of one simulated request. Times in seconds from trace start; token counts in tokens."""

    request_id: str
    kind: str
    arrival_s: float
    replica: int
    ttft_s: float
    queue_wait_s: float
    cached_tokens: int
    prefill_tokens: int
    finish_s: float
    input_tokens: int = 0
    #: prompt tokens this request computed while the same blocks were resident or being computed on another
    #: replica (redundant prefix work a copy could have saved)
    recomputed_prefix_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class _Req:
    """Mutable state of a request inside the simulator."""

    __slots__ = ("req", "chain", "rep", "admitted_s", "computed", "next_block", "cached_tokens", "ttft_s",
                 "private", "recomputed", "finish_g", "join_s", "seq", "est_flops", "queued_from", "dep_key",
                 "kv_need", "aborted")

    def __init__(self, req: Request, seq: int) -> None:
        self.req = req
        self.chain = req.block_hashes
        self.rep = -1
        self.admitted_s = math.nan
        self.computed = 0  # prompt tokens computed or reused
        self.next_block = 0  # first block index not yet committed to the cache by this request
        self.cached_tokens = 0
        self.ttft_s = math.nan
        self.private = 0
        self.recomputed = 0
        self.finish_g = 0
        self.join_s = 0
        self.seq = seq
        self.aborted = False  # live use: the client went away (see Simulator.abort)
        self.est_flops = 0.0  # estimated prefill FLOPs still to do (queued-work estimate for policies)
        self.queued_from = -1  # while waiting: chain[queued_from:] is registered in its replica's queued_blocks
        self.dep_key = None  # while waiting: the not-yet-resident block its est_flops is registered under
        self.kv_need = 0  # while waiting: KV tokens it will take when admitted (estimate)


class _Replica:
    __slots__ = ("idx", "cache", "waiting", "prefilling", "decoding", "n_decoding", "dec_s", "dec_g", "pending",
                 "busy", "step_kind", "step_start", "step_end", "step_m", "step_payload", "version", "copies_in",
                 "queued_flops", "queued_blocks", "dep_flops", "dep_count", "copied", "copy_lens", "waiting_kv",
                 "dec_finish_sum")

    def __init__(self, idx: int, cache: PrefixCache) -> None:
        self.idx = idx
        self.cache = cache
        self.waiting: list[_Req] = []
        self.prefilling: list[_Req] = []
        self.decoding: list[tuple[int, int, _Req]] = []  # heap (finish_g, seq, req)
        self.n_decoding = 0
        self.dec_s = 0  # sum over decoding seqs of (context at join - G at join); KV tokens = dec_s + n * dec_g
        self.dec_g = 0  # decode steps taken so far on this replica
        self.pending: dict[Hashable, object] = {}  # block hash -> owner (_Req computing it, or Copy bringing it)
        self.busy = False
        self.step_kind = ""
        self.step_start = 0.0
        self.step_end = 0.0
        self.step_m = 0
        self.step_payload: list = []  # prefill: (request, new tokens, their FLOPs)
        self.version = 0
        self.copies_in: dict[Hashable, Copy] = {}
        self.queued_flops = 0.0  # sum of est_flops over waiting + prefilling requests
        self.queued_blocks: dict[Hashable, int] = {}  # block -> waiting requests here that would compute it
        self.dep_flops: dict[Hashable, float] = {}  # block not yet resident -> est_flops of waiting requests needing it
        self.dep_count: dict[Hashable, int] = {}  # block not yet resident -> waiting requests needing it
        self.waiting_kv = 0  # sum of kv_need over waiting requests
        self.dec_finish_sum = 0  # sum of finish_g over decoding requests
        self.copied: dict[Hashable, Copy] = {}  # block hash -> the completed copy that brought it here
        self.copy_lens: set[int] = set()  # chain lengths of copies completed here

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.n_decoding


@dataclass
class SimResult:
    """Per-request records plus counters of one policy's run."""

    policy: str
    records: list[RequestRecord]
    replications: int
    replicated_bytes: float
    copies_started: int
    copies_refused: int
    policy_stats: dict
    fidelity: str = "realistic"
    percentile_method: str = "linear"
    #: Completed copies that no request reused afterwards (None: the fidelity profile does not track it).
    wasted_replications: int | None = None
    #: Per completed copy, seconds from the moment the policy saw the need for it (``hot_since_s`` of
    #: its :class:`~btbctl.engine.copies.CopyPlan`, default the copy's start) to the arrival of its last byte (None: not tracked).
    time_to_warm_s: list[float] | None = None

    def summary(self, replication_details: bool = False) -> dict:
        """The stable summary used by ``dry-run --format json`` (see the README for the schema).

        With ``replication_details`` four keys follow the stable ones: ``copies_started`` and ``copies_refused``
        (copy requests the fleet accepted or refused), ``wasted_replications`` (completed copies never reused; None
        when not tracked) and ``time_to_warm_s`` (mean/p50/p95/p99/max seconds over completed copies, NaN when
        there were none; None when not tracked)."""
        recs = self.records
        by_kind: dict[str, list[float]] = {}
        for r in recs:
            by_kind.setdefault(r.kind, []).append(r.ttft_s)
        total_in = sum(r.input_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        out = {
            "policy": self.policy,
            "requests": len(recs),
            "ttft_s": summarize((r.ttft_s for r in recs), self.percentile_method),
            "by_kind": {
                k: {"requests": len(v), "ttft_s": summarize(v, self.percentile_method)}
                for k, v in sorted(by_kind.items())
            },
            "prefix_hit_ratio": (cached / total_in) if total_in else math.nan,  # NaN -> null in JSON reports
            "replications": self.replications,
            "replicated_bytes": self.replicated_bytes,
            "recomputed_prefix_tokens": sum(r.recomputed_prefix_tokens for r in recs),
        }
        if replication_details:
            out["copies_started"] = self.copies_started
            out["copies_refused"] = self.copies_refused
            out["wasted_replications"] = self.wasted_replications
            out["time_to_warm_s"] = (None if self.time_to_warm_s is None
                                     else summarize(self.time_to_warm_s, self.percentile_method))
        return out


class SimFleetView:
    """The :class:`~btbctl.engine.policies.base.FleetView` the simulator hands to policies."""

    def __init__(self, sim: "Simulator") -> None:
        self._sim = sim

    @property
    def n_replicas(self) -> int:
        return len(self._sim.replicas)

    def load(self, replica: int) -> int:
        return self._sim.replicas[replica].load

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return self._sim.replicas[replica].cache.match(chain)

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        rep = self._sim.replicas[replica]
        n = rep.cache.match(chain)
        pending = rep.pending
        while n < len(chain) and chain[n] in pending:
            n += 1
        return n

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return bool(chain) and chain[-1] in self._sim.replicas[replica].copies_in

    def queued_prefill_s(self, replica: int) -> float:
        """Seconds of prefill compute queued on ``replica`` ahead of a new request: for every waiting or
        prefilling request, the FLOPs (attention term included, at its context) of the prompt tokens it still has
        to compute (before admission: those not resident, computing or arriving there when it was routed), at the
        replica's achieved FLOP/s; minus the elapsed part of a prefill step in progress, plus the rest of one
        decode step in progress (decode runs yield to new prefill work at the next step). O(1)."""
        sim = self._sim
        rep = sim.replicas[replica]
        s = rep.queued_flops / (sim.cost.flops * sim.cost.mfu) if rep.queued_flops > 0 else 0.0
        if rep.busy:
            if rep.step_kind == "prefill":
                s = max(0.0, s - (sim.now - rep.step_start))
            else:
                s += max(0.0, min(rep.step_end - sim.now, sim._decode_time(rep, 1)))
        return s

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        """The in-flight copy of ``chain`` (keyed by its last block) towards ``replica``, or None."""
        c = self._sim.replicas[replica].copies_in.get(chain[-1]) if chain else None
        if c is None:
            return None
        return CopyStatus(source=c.src, total_bytes=c.total_bytes, sent_bytes=c.sent_bytes,
                          available_bytes=min(c.avail_bytes, c.total_bytes), rate_bytes_per_s=c.rate)

    def nic_copies(self, replica: int) -> int:
        """Copies in flight that send from or receive at ``replica`` (they share its NIC)."""
        return sum(1 for c in self._sim.net.active if c.src == replica or c.dst == replica)

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` that ``replica`` holds, is computing or receiving, or that a request waiting
        there will compute before a new request would (>= :meth:`pending_blocks` up to evictions). O(log n)."""
        return self._sim.planned_blocks(self._sim.replicas[replica], chain)

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        """Requests waiting on ``replica`` for a block that is not resident there yet (being computed or copied),
        grouped by that block: ``(block hash, requests, seconds of their queued prefill)``, in first-registered
        order. Their work is part of :meth:`queued_prefill_s` but cannot start before the block is there."""
        sim = self._sim
        rep = sim.replicas[replica]
        if not rep.dep_count:
            return []
        rate = sim.cost.flops * sim.cost.mfu
        parent = rep.cache.parent
        return [(h, n, max(0.0, rep.dep_flops[h]) / rate) for h, n in rep.dep_count.items() if h not in parent]

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        """Seconds of decoding ``replica`` must do before its KV cache has room for the requests waiting there plus
        a new one needing ``kv_tokens`` tokens (prompt tokens it computes + output), 0 when they fit now
        (free + evictable). Decoding requests release their KV when they finish: on average
        ``held tokens / (mean remaining decode steps x current step time)`` tokens per second. Prefill runs first on
        a replica, so this adds to :meth:`queued_prefill_s`. O(1)."""
        sim = self._sim
        rep = sim.replicas[replica]
        cache = rep.cache
        short = rep.waiting_kv + kv_tokens - (max(0, cache.free_tokens) + cache.evictable_tokens)
        n = rep.n_decoding
        if short <= 0 or n == 0:
            return 0.0
        held = rep.dec_s + n * rep.dec_g
        left_steps = (rep.dec_finish_sum - n * rep.dec_g) / n
        if held <= 0 or left_steps <= 0:
            return 0.0
        return short / held * left_steps * sim._decode_time(rep, 1)

    def kv_headroom_tokens(self, replica: int) -> int:
        """KV-cache tokens ``replica`` could give a new copy now: free plus evictable (unpinned) tokens."""
        cache = self._sim.replicas[replica].cache
        return max(0, cache.free_tokens) + cache.evictable_tokens

    @property
    def cost(self) -> ReplicaCost:
        return self._sim.cost

    @property
    def block_tokens(self) -> int:
        return self._sim.block_tokens

    @property
    def chunk_tokens(self) -> int:
        """Most new prompt tokens one prefill step computes on a replica (chunked prefill)."""
        return self._sim.chunk_tokens


class Simulator:
    """One policy over one trace on one fleet.

    Args:
        trace: the requests.
        policy: a :class:`~btbctl.engine.policies.base.Policy` instance (fresh; it keeps routing state).
        cluster: fleet configuration.
        constants: BTB constants (handed to the policy by the caller; kept here for reports).
        progress: called with the number of requests finished since the previous call.
    """

    def __init__(self, trace: Trace, policy, cluster: ClusterConfig, constants: BtbConstants,
                 progress: Callable[[int], None] | None = None) -> None:
        self.trace = trace
        self.policy = policy
        self.cluster = cluster
        self.constants = constants
        self.cost = cluster.replica_cost()
        self.block_tokens = trace.block_tokens
        self.chunk_tokens = cluster.chunk_tokens()
        self.max_running = cluster.max_running
        self.bytes_per_block = self.block_tokens * self.cost.model.kv_bytes_per_token
        self.fleet_blocks: dict[Hashable, int] = {}  # block -> replicas holding it (for recompute accounting)
        self.fleet_computing: dict[Hashable, int] = {}  # block -> prefills computing it right now, fleet-wide
        self.replicas = [
            _Replica(i, PrefixCache(self.cost.kv_budget_tokens, self.block_tokens, self._on_insert, self._on_evict))
            for i in range(cluster.replicas)
        ]
        self.net = Network(cluster.replicas, self.cost.nic_bytes_per_s)
        self.view = SimFleetView(self)
        self.heap: list = []
        self._seq = 0
        self._cid = 0
        self.now = 0.0
        self.records: list[RequestRecord] = []
        self.progress = progress
        self._since_progress = 0
        #: live hooks: ``on_first_token(req, replica, ttft_s, cached_tokens)`` and ``on_finish(record)``
        self.on_first_token: Callable[[Request, int, float, int], None] | None = None
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self._submitted: dict[str, _Req] = {}  # live use: unfinished requests given to submit(), by id
        self.replications = 0
        self.replicated_bytes = 0.0
        self.copies_started = 0
        self.copies_refused = 0
        self.completed_copies: list[Copy] = []
        # decode step-time coefficients: t = max(a + b*K, c*n) + overhead
        bw = self.cost.hbm_bytes_per_s * self.cost.hbm_efficiency
        self._dec_a = self.cost.model.active_params * self.cost.model.dtype_bytes / bw
        self._dec_b = self.cost.model.kv_bytes_per_token / bw
        self._dec_c = 2.0 * self.cost.model.active_params / (self.cost.flops * self.cost.mfu)
        self._dec_oh = self.cost.step_overhead_s

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _on_insert(self, h: Hashable) -> None:
        self.fleet_blocks[h] = self.fleet_blocks.get(h, 0) + 1

    def _on_evict(self, h: Hashable) -> None:
        c = self.fleet_blocks.get(h, 0) - 1
        if c > 0:
            self.fleet_blocks[h] = c
        else:
            self.fleet_blocks.pop(h, None)

    def _push(self, t: float, kind: int, payload) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, kind, self._seq, payload))

    # -- main loop --------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        """Replay the whole trace to completion and return the result."""
        reqs = self.trace.requests
        i, n = 0, len(reqs)
        heap = self.heap
        while i < n or heap:
            if i < n and (not heap or reqs[i].arrival_s <= heap[0][0]):
                r = reqs[i]
                i += 1
                self.now = max(self.now, r.arrival_s)
                self._arrive(_Req(r, i))
                continue
            self._pop_event()
        if self.progress and self._since_progress:
            self.progress(self._since_progress)
        unfinished = n - len(self.records)
        if unfinished:
            raise RuntimeError(f"simulation ended with {unfinished} unfinished requests")  # a bug, not user input
        self.records.sort(key=lambda rec: (rec.arrival_s, rec.request_id))
        return self.result()

    def result(self) -> SimResult:
        """Records and counters so far."""
        return SimResult(
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            records=self.records,
            replications=self.replications,
            replicated_bytes=self.replicated_bytes,
            copies_started=self.copies_started,
            copies_refused=self.copies_refused,
            policy_stats=self.policy.stats(),
            wasted_replications=sum(1 for c in self.completed_copies if not c.meta["used"]),
            time_to_warm_s=[c.done_s - c.meta["hot_since_s"] for c in self.completed_copies],
        )

    def _pop_event(self) -> None:
        t, kind, _, payload = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        if kind == _EV_STEP:
            rep, version = payload
            if version == rep.version:
                self._end_step(rep)
        else:
            copy, version = payload
            if version == copy.version:
                self._copy_event(copy)

    # -- incremental (live) use: the emulated worker drives the same model in (scaled) real time ---------------
    def submit(self, req: Request, replica: int | None = None) -> None:
        """A request arrives at the current time ``self.now`` (its ``arrival_s`` is overwritten). Routed by the
        policy unless ``replica`` is given."""
        self._seq += 1
        req.arrival_s = self.now
        rq = _Req(req, self._seq)
        self._submitted[req.request_id] = rq
        if replica is None:
            self._arrive(rq)
            return
        rq.rep = replica
        rep = self.replicas[replica]
        self._estimate_work(rep, rq)
        rep.waiting.append(rq)
        self._kick(rep)

    def abort(self, request_id: str) -> bool:
        """Live use: the client of a request given to :meth:`submit` went away (SGLang aborts such requests).
        A decoding request finishes now and frees its KV; one still waiting or prefilling finishes at its first
        token instead of decoding (its prefix blocks stay useful to others). Returns False when the request is
        unknown or already finished."""
        rq = self._submitted.get(request_id)
        if rq is None:
            return False
        rq.aborted = True
        if math.isnan(rq.ttft_s):
            return True  # ends at its first token (_end_prefill)
        rep = self.replicas[rq.rep]
        dec = rep.decoding
        for i, item in enumerate(dec):
            if item[2] is rq:
                dec[i] = dec[-1]
                dec.pop()
                heapq.heapify(dec)
                break
        else:
            return False
        rep.n_decoding -= 1
        rep.dec_finish_sum -= rq.finish_g
        rep.dec_s -= rq.req.input_tokens + 1 - rq.join_s
        self._finish(rep, rq)
        self._kick(rep)  # re-plan the decode run of the remaining sequences
        return True

    def next_event_s(self) -> float | None:
        """Time of the next pending event (None when idle)."""
        return self.heap[0][0] if self.heap else None

    def advance_to(self, t: float) -> None:
        """Process every event due at or before ``t``; afterwards ``now == max(now, t)``."""
        while self.heap and self.heap[0][0] <= t:
            self._pop_event()
        self.now = max(self.now, t)

    def insert_prefix(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Make ``chain`` resident on ``replica`` (blocks that arrived from outside the model, e.g. a verified
        copy in the live worker). Returns the number of blocks inserted; 0 when they do not fit."""
        rep = self.replicas[replica]
        chain = tuple(chain)
        have = rep.cache.match(chain)
        add = len(chain) - have
        if add <= 0:
            return 0
        rep.cache.pin(chain, have)
        if not rep.cache.make_room(add * self.block_tokens):
            rep.cache.unpin(chain, have)
            return 0
        rep.cache.reserve_blocks(add)
        for k in range(have, len(chain)):
            rep.cache.commit_block(chain[k], chain[k - 1] if k else None, pinned=True)
        rep.cache.unpin(chain, len(chain))
        self._kick(rep)
        return add

    def replica_state(self, replica: int) -> dict:
        """Counters of one replica for live views: ``running``, ``waiting``, ``used_tokens``,
        ``capacity_tokens``, ``cached_blocks``."""
        rep = self.replicas[replica]
        return {
            "running": len(rep.prefilling) + rep.n_decoding,
            "waiting": len(rep.waiting),
            "used_tokens": rep.cache.used_tokens,
            "capacity_tokens": rep.cache.capacity_tokens,
            "cached_blocks": len(rep.cache),
        }

    def _arrive(self, rq: _Req) -> None:
        route = self.policy.route(rq.req, self.view, self.now)
        r = route.replica
        if not 0 <= r < len(self.replicas):
            raise RuntimeError(f"policy {self.policy.name} returned replica {r}")
        for plan in route.copies:
            self.execute(plan)
        rq.rep = r
        rep = self.replicas[r]
        self._estimate_work(rep, rq)
        rep.waiting.append(rq)
        self._kick(rep)

    def _estimate_work(self, rep: _Replica, rq: _Req) -> None:
        """Queued-work estimate of a new request: the prompt tokens beyond what ``rep`` holds, is computing or
        receiving, or a request queued ahead there will compute (it waits for those instead), at their context.
        Registers the rest of its chain as planned on ``rep`` until it is admitted."""
        chain = rq.chain
        have_blocks = self.planned_blocks(rep, chain)
        queued = rep.queued_blocks
        for k in range(have_blocks, len(chain)):
            h = chain[k]
            queued[h] = queued.get(h, 0) + 1
        rq.queued_from = have_blocks
        have = min(have_blocks * self.block_tokens, rq.req.input_tokens - 1)
        rq.est_flops = self.cost.prefill_flops(rq.req.input_tokens - have, have)
        rep.queued_flops += rq.est_flops
        rq.kv_need = rq.req.input_tokens - have + rq.req.output_tokens
        rep.waiting_kv += rq.kv_need
        if have_blocks and chain[have_blocks - 1] not in rep.cache.parent:
            key = chain[have_blocks - 1]
            rq.dep_key = key
            rep.dep_flops[key] = rep.dep_flops.get(key, 0.0) + rq.est_flops
            rep.dep_count[key] = rep.dep_count.get(key, 0) + 1

    @staticmethod
    def planned_blocks(rep: _Replica, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident on ``rep``, being computed or copied there, or in the chain of a
        request waiting there (binary search: that union is prefix-closed along a chain, up to evictions of
        unpinned blocks, which makes this an estimate)."""
        n = len(chain)
        parent, pending, queued = rep.cache.parent, rep.pending, rep.queued_blocks
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

    def _kick(self, rep: _Replica) -> None:
        """New work may be admissible on ``rep``: start a step if idle, or cut a decode run at the next step."""
        if not rep.busy:
            self._start_step(rep)
        elif rep.step_kind == "decode" and rep.step_m > 1:
            elapsed = self.now - rep.step_start
            m = self._decode_steps_covering(rep, elapsed)
            if m < rep.step_m:
                rep.step_m = m
                rep.step_end = rep.step_start + self._decode_time(rep, m)
                rep.version += 1
                self._push(rep.step_end, _EV_STEP, (rep, rep.version))

    # -- scheduling -------------------------------------------------------------------------------------------
    def _start_step(self, rep: _Replica) -> None:
        batch = self._form_prefill(rep)
        if batch:
            flops = 0.0
            for _, _, f in batch:
                flops += f
            dt = self.cost.prefill_flops_time_s(flops)
            rep.busy, rep.step_kind, rep.step_payload = True, "prefill", batch
            rep.step_start, rep.step_end = self.now, self.now + dt
            rep.version += 1
            self._push(rep.step_end, _EV_STEP, (rep, rep.version))
            return
        if rep.n_decoding:
            m = rep.decoding[0][0] - rep.dec_g  # steps until the next completion
            rep.busy, rep.step_kind, rep.step_m = True, "decode", max(1, m)
            rep.step_start = self.now
            rep.step_end = self.now + self._decode_time(rep, rep.step_m)
            rep.version += 1
            self._push(rep.step_end, _EV_STEP, (rep, rep.version))
            return
        rep.busy = False
        rep.step_kind = ""

    def _form_prefill(self, rep: _Replica) -> list[tuple[_Req, int, float]]:
        """The next prefill batch: ``(request, new tokens, their FLOPs)`` per request."""
        budget = self.chunk_tokens
        prefill_flops = self.cost.prefill_flops
        batch: list[tuple[_Req, int, float]] = []
        for rq in rep.prefilling:
            if budget <= 0:
                break
            new = min(budget, rq.req.input_tokens - rq.computed)
            if new > 0:
                batch.append((rq, new, prefill_flops(new, rq.computed)))
                budget -= new
        if budget <= 0:
            return batch
        waiting = rep.waiting
        keep: list[_Req] = []
        admitted_any = False
        stop = False
        for idx, rq in enumerate(waiting):
            if stop or budget <= 0 or len(rep.prefilling) + rep.n_decoding >= self.max_running:
                keep.extend(waiting[idx:])
                break
            verdict = self._try_admit(rep, rq)
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
            rep.waiting = keep
        return batch

    def _try_admit(self, rep: _Replica, rq: _Req) -> str:
        """Admit ``rq`` on ``rep`` if its next block is not being computed/copied here and KV space exists."""
        chain = rq.chain
        cache = rep.cache
        bt = self.block_tokens
        matched = cache.match(chain)
        if matched < len(chain) and chain[matched] in rep.pending:
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
        rq.admitted_s = self.now
        rep.waiting_kv -= rq.kv_need
        rq.kv_need = 0
        if rq.queued_from >= 0:
            queued = rep.queued_blocks
            for k in range(rq.queued_from, n_blocks):
                h = chain[k]
                c = queued[h] - 1
                if c:
                    queued[h] = c
                else:
                    del queued[h]
            rq.queued_from = -1
        if rq.dep_key is not None:
            key = rq.dep_key
            left = rep.dep_count[key] - 1
            if left:
                rep.dep_count[key] = left
                rep.dep_flops[key] -= rq.est_flops
            else:
                del rep.dep_count[key]
                del rep.dep_flops[key]
            rq.dep_key = None
        est = self.cost.prefill_flops(inp - cached_tokens, cached_tokens)
        rep.queued_flops += est - rq.est_flops
        rq.est_flops = est
        if matched and rep.copied:
            self._note_copy_use(rep, chain, matched)
        fleet, computing = self.fleet_blocks, self.fleet_computing
        recomputed = 0
        for k in range(matched, n_blocks):
            h = chain[k]
            rep.pending[h] = rq
            c = computing.get(h, 0)
            if c or h in fleet:  # resident or being computed on another replica: redundant work
                recomputed += max(0, min(bt, inp - k * bt))
            computing[h] = c + 1
        rq.recomputed = recomputed
        rep.prefilling.append(rq)
        return "ok"

    def _end_step(self, rep: _Replica) -> None:
        if rep.step_kind == "prefill":
            self._end_prefill(rep)
        else:
            self._end_decode(rep)
        rep.busy = False
        self._start_step(rep)

    def _end_prefill(self, rep: _Replica) -> None:
        bt = self.block_tokens
        cache = rep.cache
        done: list[_Req] = []
        committed = False
        copied = rep.copied
        for rq, new, f in rep.step_payload:
            rq.est_flops -= f
            rep.queued_flops -= f
            rq.computed += new
            chain = rq.chain
            inp = rq.req.input_tokens
            upto = len(chain) if rq.computed >= inp else min(len(chain), rq.computed // bt)
            for k in range(rq.next_block, upto):
                h = chain[k]
                if rep.pending.get(h) is rq:
                    del rep.pending[h]
                c = self.fleet_computing.get(h, 0) - 1
                if c > 0:
                    self.fleet_computing[h] = c
                else:
                    self.fleet_computing.pop(h, None)
                cache.commit_block(h, chain[k - 1] if k else None, pinned=True)
                if copied:
                    copied.pop(h, None)
                committed = True
            rq.next_block = max(rq.next_block, upto)
            if rq.computed >= inp:
                done.append(rq)
                rep.queued_flops -= rq.est_flops
                rq.est_flops = 0.0
        rep.step_payload = []
        if not rep.waiting and len(done) == len(rep.prefilling):
            rep.queued_flops = 0.0  # nothing queued any more: drop float residue
        if done:
            keep = [rq for rq in rep.prefilling if rq.computed < rq.req.input_tokens]
            rep.prefilling = keep
        for rq in done:
            rq.ttft_s = self.now - rq.req.arrival_s
            if self.on_first_token is not None:
                self.on_first_token(rq.req, rep.idx, rq.ttft_s, rq.cached_tokens)
            out = rq.req.output_tokens
            if out <= 1 or rq.aborted:
                self._finish(rep, rq)
            else:
                rq.join_s = rep.dec_g
                rq.finish_g = rep.dec_g + out - 1
                heapq.heappush(rep.decoding, (rq.finish_g, rq.seq, rq))
                rep.n_decoding += 1
                rep.dec_finish_sum += rq.finish_g
                rep.dec_s += rq.req.input_tokens + 1 - rep.dec_g
        if committed and self.net.active:
            self._source_progress(rep.idx)

    def _end_decode(self, rep: _Replica) -> None:
        m = rep.step_m
        rep.dec_g += m
        dec = rep.decoding
        while dec and dec[0][0] <= rep.dec_g:
            _, _, rq = heapq.heappop(dec)
            rep.n_decoding -= 1
            rep.dec_finish_sum -= rq.finish_g
            rep.dec_s -= rq.req.input_tokens + 1 - rq.join_s
            self._finish(rep, rq)

    def _finish(self, rep: _Replica, rq: _Req) -> None:
        if self._submitted:
            self._submitted.pop(rq.req.request_id, None)
        cache = rep.cache
        cache.unpin(rq.chain, len(rq.chain))
        cache.private_tokens -= rq.private
        self.policy.on_finish(rq.req, rep.idx, self.now)
        req = rq.req
        record = RequestRecord(
            request_id=req.request_id, kind=req.kind, arrival_s=req.arrival_s, replica=rep.idx,
            ttft_s=rq.ttft_s, queue_wait_s=rq.admitted_s - req.arrival_s, cached_tokens=rq.cached_tokens,
            prefill_tokens=req.input_tokens - rq.cached_tokens, finish_s=self.now, input_tokens=req.input_tokens,
            recomputed_prefix_tokens=rq.recomputed,
        )
        self.records.append(record)
        if self.on_finish is not None:
            self.on_finish(record)
        if self.progress:
            self._since_progress += 1
            if self._since_progress >= 256:
                self.progress(self._since_progress)
                self._since_progress = 0

    # -- decode closed form -----------------------------------------------------------------------------------
    def _decode_time(self, rep: _Replica, m: int) -> float:
        """Seconds for ``m`` decode steps of the current batch (KV grows by n tokens per step)."""
        n = rep.n_decoding
        k0 = rep.dec_s + n * rep.dec_g
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

    def _decode_steps_covering(self, rep: _Replica, elapsed: float) -> int:
        """Smallest step count m >= 1 whose cumulative time reaches ``elapsed`` (the step in progress)."""
        lo, hi = 1, rep.step_m
        while lo < hi:
            mid = (lo + hi) // 2
            if self._decode_time(rep, mid) >= elapsed - 1e-12:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- copies ---------------------------------------------------------------------------------------------------
    def execute(self, plan: CopyPlan) -> list[int]:
        """Carry out a policy's copy plan now (:func:`~btbctl.engine.copies.carry_out` over :meth:`start_copy`),
        reporting every attempt to the policy; returns the targets whose copies started."""
        now = self.now
        policy = self.policy
        return carry_out(plan, lambda t: self.start_copy(plan.prefix, plan.source, t, now, plan.hot_since_s),
                         lambda t, ok: policy.on_copy_result(plan, t, ok, now))

    def start_copy(self, chain: tuple, source: int, target: int, now_s: float,
                   hot_since_s: float | None = None) -> bool:
        """Start copying ``chain``'s KV from ``source`` to ``target``; False when refused (same replica, a bad index,
        a copy of it to the target in flight or the target already holding or computing it, no room there, or a
        source that will not have the blocks).
        ``hot_since_s``: when the policy saw the need for it (time-to-warm reports); default ``now_s``.
        The source must hold the blocks, or be computing or receiving them, or have a request queued that will
        compute them (:meth:`planned_blocks`); bytes move only as the source commits blocks."""
        n = len(self.replicas)
        if not (0 <= source < n and 0 <= target < n) or source == target or not chain:
            self.copies_refused += 1
            return False
        src, dst = self.replicas[source], self.replicas[target]
        view = self.view
        if chain[-1] in dst.copies_in or view.pending_blocks(target, chain) == len(chain):
            self.copies_refused += 1
            return False
        if self.planned_blocks(src, chain) < len(chain):
            # the source neither holds, computes, receives nor has a request queued that will compute the prefix
            self.copies_refused += 1
            return False
        offset = dst.cache.match(chain)
        send = len(chain) - offset
        dst.cache.pin(chain, offset)
        if not dst.cache.make_room(send * self.block_tokens):
            dst.cache.unpin(chain, offset)
            self.copies_refused += 1
            return False
        dst.cache.reserve_blocks(send)
        self._cid += 1
        c = Copy(cid=self._cid, src=source, dst=target, chain=chain, offset=offset,
                 bytes_per_block=self.bytes_per_block, started_s=now_s, total_bytes=send * self.bytes_per_block,
                 t_last=now_s)
        c.meta["hot_since_s"] = now_s if hot_since_s is None else min(hot_since_s, now_s)
        c.meta["used"] = 0
        for k in range(offset, len(chain)):
            dst.pending[chain[k]] = c
        dst.copies_in[chain[-1]] = c
        have = src.cache.match(chain)
        src.cache.pin(chain, have)
        c.src_pinned = have
        c.avail_bytes = max(0, have - offset) * self.bytes_per_block
        self.net.advance(now_s)
        self.net.active.append(c)
        self.copies_started += 1
        self._reschedule_copies()
        return True

    @staticmethod
    def _note_copy_use(rep: _Replica, chain: Sequence[Hashable], matched: int) -> None:
        """A request admitted on ``rep`` reuses ``matched`` leading blocks: count a use of every completed copy
        that brought one of them (found at the deepest matched block and at the end of each copied chain)."""
        copied = rep.copied
        used = {id(c): c for c in (copied.get(chain[n - 1]) for n in rep.copy_lens if n < matched) if c is not None}
        c = copied.get(chain[matched - 1])
        if c is not None:
            used[id(c)] = c
        for c in used.values():
            c.meta["used"] += 1

    def _source_progress(self, source: int) -> None:
        """The source committed blocks: copies trailing its prefill may send more."""
        src = self.replicas[source]
        changed = False
        for c in self.net.active:
            if c.src != source or c.src_pinned >= len(c.chain):
                continue
            have = src.cache.match(c.chain)
            if have > c.src_pinned:
                if not changed:
                    self.net.advance(self.now)
                    changed = True
                src.cache.pin(c.chain[c.src_pinned:have], have - c.src_pinned)
                c.src_pinned = have
                c.avail_bytes = max(0, have - c.offset) * c.bytes_per_block
        if changed:
            self._reschedule_copies()

    def _reschedule_copies(self) -> None:
        self.net.reallocate()
        for c in self.net.active:
            c.version += 1
            eta = c.eta_s()
            if eta is not None:
                self._push(self.now + eta, _EV_COPY, (c, c.version))

    def _copy_event(self, c: Copy) -> None:
        self.net.advance(self.now)
        for done in [x for x in self.net.active if x.finished]:  # copies sharing a bottleneck end together
            self._complete_copy(done)
        self._reschedule_copies()

    def _complete_copy(self, c: Copy) -> None:
        self.net.active.remove(c)
        c.done_s = self.now
        src, dst = self.replicas[c.src], self.replicas[c.dst]
        src.cache.unpin(c.chain, c.src_pinned)
        chain = c.chain
        for k in range(c.offset, len(chain)):
            h = chain[k]
            if dst.pending.get(h) is c:
                del dst.pending[h]
            dst.cache.commit_block(h, chain[k - 1] if k else None, pinned=True)
            dst.copied[h] = c
        dst.copy_lens.add(len(chain))
        dst.cache.unpin(chain, len(chain))  # deepest first, so LRU evicts leaves before their ancestors
        dst.copies_in.pop(chain[-1], None)
        self.completed_copies.append(c)
        self.replications += 1
        self.replicated_bytes += c.total_bytes
        self._kick(dst)
        self._kick(src)  # unpinned source blocks may make room for a request waiting on memory
        if self.net.active:
            self._source_progress(c.dst)  # copies chained behind this one may send more


def check_fits(trace: Trace, kv_budget_tokens: int) -> None:
    """Raise :class:`ConfigError` if some request's prompt + output cannot fit in one replica's KV budget."""
    bt = trace.block_tokens
    worst = None
    for r in trace.requests:
        need = max(len(r.block_hashes) * bt, r.input_tokens) + r.output_tokens
        if need > kv_budget_tokens and (worst is None or need > worst[0]):
            worst = (need, r.request_id)
    if worst is not None:
        raise ConfigError(
            "gpus_per_replica",
            f"request {worst[1]} needs {worst[0]} tokens of KV cache but a replica holds {kv_budget_tokens}; "
            "use more GPUs per replica, a larger GPU or a higher mem_fraction",
        )


def simulate(trace: Trace, policy: str, cluster: ClusterConfig, constants: BtbConstants, *, seed: int = 42,
             fidelity: str = "realistic", progress: Callable[[int], None] | None = None) -> SimResult:
    """Simulate ``trace`` on ``cluster`` routed by the policy named ``policy``.

    Args:
        trace: requests (sorted by arrival).
        policy: registry name (``btbctl.engine.policies.POLICIES``).
        cluster: the fleet.
        constants: BTB's four constants (used by BTB-style policies).
        seed: seeds the policy's random source; same inputs and seed give identical results.
        fidelity: ``realistic`` (this module's model) or ``infersim`` (the reference simulator's simplifications,
            :func:`btbctl.engine.sim.infersim.simulate_infersim`).
        progress: called with increments of finished requests.

    Raises:
        ConfigError: unknown policy or fidelity, unknown presets, a model that does not fit.
    """
    from btbctl.engine.policies import make_policy

    if fidelity == "infersim":
        from btbctl.engine.sim.infersim import simulate_infersim

        return simulate_infersim(trace, policy, cluster, constants, seed=seed, progress=progress)
    if fidelity != "realistic":
        raise ConfigError("fidelity", f"unknown or unavailable fidelity {fidelity!r}; valid: {', '.join(FIDELITIES)}")
    cost = cluster.replica_cost()  # validate before building anything
    check_fits(trace, cost.kv_budget_tokens)
    pol = make_policy(policy, cluster.replicas, random.Random(seed), constants, block_tokens=trace.block_tokens)
    return Simulator(trace, pol, cluster, constants, progress=progress).run()
