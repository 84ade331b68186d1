"""Discrete-event simulator of a GPU fleet serving a trace under one routing policy (``realistic`` fidelity).

The fleet is N :class:`~btbctl.engine.sim.replica.ReplicaModel` s (prefix cache, scheduler, step timing) plus what
belongs to the fleet: the event heap keyed by ``(time, priority, sequence)`` (deterministic for a seed), the network
and the copies over it (:mod:`btbctl.engine.sim.network`), recompute accounting, copy-use tracking, executing the
policy's copy plans, and :class:`SimFleetView`, the only way the policy sees the fleet. It never reads the wall
clock. The model is specified in ``docs/simulator.md``.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from btbctl.engine.chains import count_blocks, uncount_blocks
from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan, CopyState, CopyStatus, carry_out
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.policies import make_policy
from btbctl.engine.sim.network import Copy, Network
from btbctl.engine.sim.replica import FleetIndex, ReplicaModel, ReplicaRequest, ReplicaState
from btbctl.engine.sim.results import RequestRecord, SimResult, check_fits
from btbctl.engine.trace.model import Request, Trace

# event kinds, in tie-break priority order (lower runs first at equal times)
_EV_COPY = 0
_EV_STEP = 1


@dataclass(frozen=True, slots=True)
class CopyInfo:
    """One copy as the simulator's read API reports it (bytes in bytes, times in simulated seconds).

    Attributes:
        copy_id: the simulator's number for it (1, 2, ... in start order).
        source, target: replica indices.
        prefix: the copied chain (root first).
        sent_bytes: bytes delivered, extrapolated to the time asked about at the current rate (never more than
            the source has computed).
        total_bytes: bytes the copy moves (the blocks the target lacked when it started).
        rate_bytes_per_s: current rate; 0 while stalled on the source's compute, and once done.
        eta_s: seconds to the last byte at the current rate; None when stalled or done.
        state: :class:`~btbctl.engine.copies.CopyState` (``running``, ``stalled``, ``done``; copies never fail
            here).
        started_s: when it started.
        done_s: when its last byte arrived (None while in flight).
    """

    copy_id: int
    source: int
    target: int
    prefix: tuple
    sent_bytes: float
    total_bytes: float
    rate_bytes_per_s: float
    eta_s: float | None
    state: CopyState
    started_s: float
    done_s: float | None


class SimFleetView:
    """The :class:`~btbctl.engine.policies.base.FleetView` (and ``CostView``) the simulator hands to policies."""

    def __init__(self, sim: Simulator) -> None:
        self._sim = sim
        self._reps = sim.replicas  # the same list (policies call the view once per replica per request)

    @property
    def n_replicas(self) -> int:
        return len(self._reps)

    def load(self, replica: int) -> int:
        return self._reps[replica].load

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return self._reps[replica].cache.match(chain)

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return self._reps[replica].pending_blocks(chain)

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return bool(chain) and chain[-1] in self._sim._copies_in[replica]

    def route_index(self) -> FleetIndex:
        """The replicas' :class:`~btbctl.engine.sim.replica.FleetIndex` (a
        :class:`~btbctl.engine.policies.base.RouteIndex`)."""
        return self._sim.index

    def accepts_copies(self, replica: int) -> bool:
        """Always True: every simulated replica can send and receive copies (a copy may still be refused, see
        :meth:`Simulator.start_copy`)."""
        return True

    def prefill_load(self, replica: int) -> int:
        """Requests waiting or prefilling on ``replica`` (no first token yet). O(1)."""
        return self._sim.replicas[replica].prefill_load

    def queued_prefill_s(self, replica: int) -> float:
        """See :meth:`~btbctl.engine.sim.replica.ReplicaModel.queued_prefill_s` (at the simulator's time). O(1)."""
        sim = self._sim
        return sim.replicas[replica].queued_prefill_s(sim.now)

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return self.copy_status(replica, chain) is not None

    def copy_after_s(self, replica: int, blocks: int) -> float:
        """0: a copy's blocks land in the target's KV cache as they arrive (the push model)."""
        return 0.0

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        """The in-flight copy of ``chain`` (keyed by its last block) towards ``replica``, or None."""
        c = self._sim._copies_in[replica].get(chain[-1]) if chain else None
        if c is None:
            return None
        return CopyStatus(
            source=c.src,
            total_bytes=c.total_bytes,
            sent_bytes=c.sent_bytes,
            available_bytes=min(c.avail_bytes, c.total_bytes),
            rate_bytes_per_s=c.rate,
        )

    def nic_copies(self, replica: int) -> int:
        """Copies in flight that send from or receive at ``replica`` (they share its NIC)."""
        return sum(1 for c in self._sim._net.active if c.src == replica or c.dst == replica)

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` that ``replica`` holds, is computing or receiving, or that a request waiting
        there will compute before a new request would (>= :meth:`pending_blocks` up to evictions). O(log n)."""
        return self._reps[replica].planned_blocks(chain)

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        """See :meth:`~btbctl.engine.sim.replica.ReplicaModel.waiting_groups`."""
        return self._sim.replicas[replica].waiting_groups()

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        """See :meth:`~btbctl.engine.sim.replica.ReplicaModel.admission_wait_s`. O(1)."""
        return self._reps[replica].admission_wait_s(kv_tokens)

    def kv_headroom_tokens(self, replica: int) -> int:
        """KV-cache tokens ``replica`` could give a new copy now: free plus evictable (unpinned) tokens."""
        return self._sim.replicas[replica].kv_headroom_tokens()

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


class _FleetEvents:
    """How the simulator hears from its replicas (:class:`~btbctl.engine.sim.replica.ReplicaEvents`): step ends go
    on the event heap; admissions and computed blocks feed the fleet-wide recompute accounting and copy-use
    tracking; first tokens and finishes become records and hooks."""

    __slots__ = ("sim", "fleet", "computing")

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.fleet = sim._fleet_blocks
        self.computing = sim._fleet_computing

    def step_scheduled(self, replica: ReplicaModel, end_s: float, version: int) -> None:
        self.sim._push(end_s, _EV_STEP, (replica, version))

    def admitted(self, replica: ReplicaModel, rq: ReplicaRequest, matched_blocks: int) -> None:
        sim = self.sim
        chain = rq.chain
        if matched_blocks:
            copied = sim._copied[replica.idx]
            if copied:
                sim._note_copy_use(copied, sim._copy_lens[replica.idx], chain, matched_blocks)
        fleet, computing = self.fleet, self.computing
        bt = replica.block_tokens
        inp = rq.req.input_tokens
        if inp >= len(chain) * bt:  # every block full: bt tokens per block resident or computing elsewhere
            hits = 0
            for h in chain[matched_blocks:]:
                c = computing.get(h, 0)
                if c or h in fleet:
                    hits += 1
                computing[h] = c + 1
            rq.recomputed = hits * bt
            return
        recomputed = 0
        for k, h in enumerate(chain[matched_blocks:], matched_blocks):
            c = computing.get(h, 0)
            if c or h in fleet:  # resident or being computed on another replica: redundant work
                recomputed += max(0, min(bt, inp - k * bt))
            computing[h] = c + 1
        rq.recomputed = recomputed

    def computed(self, replica: ReplicaModel, rq: ReplicaRequest, start: int, stop: int) -> None:
        hs = rq.chain[start:stop]
        uncount_blocks(self.computing, hs)
        copied = self.sim._copied[replica.idx]
        if copied:
            for h in hs:
                copied.pop(h, None)  # computed here now: no longer the copy's

    def first_token(self, replica: ReplicaModel, rq: ReplicaRequest) -> None:
        hook = self.sim.on_first_token
        if hook is not None:
            hook(rq.req, replica.idx, rq.ttft_s, rq.cached_tokens)

    def finished(self, replica: ReplicaModel, rq: ReplicaRequest, now_s: float) -> None:
        self.sim._finished(replica, rq, now_s)

    def blocks_committed(self, replica: ReplicaModel) -> None:
        sim = self.sim
        if sim._net.active:
            sim._source_progress(replica.idx)

    def block_inserted(self, h: Hashable) -> None:
        count_blocks(self.fleet, (h,))

    def block_evicted(self, h: Hashable) -> None:
        uncount_blocks(self.fleet, (h,))

    def blocks_inserted(self, hs: Sequence[Hashable]) -> None:
        """:meth:`block_inserted` for each of ``hs`` (one call per run of blocks)."""
        count_blocks(self.fleet, hs)

    def blocks_evicted(self, hs: Sequence[Hashable]) -> None:
        """:meth:`block_evicted` for each of ``hs`` (one call per run of blocks)."""
        uncount_blocks(self.fleet, hs)


class Simulator:
    """One policy over one trace on one fleet.

    Args:
        trace: the requests.
        policy: a :class:`~btbctl.engine.policies.base.Policy` instance (fresh; it keeps routing state).
        cluster: fleet configuration.
        constants: BTB constants (handed to the policy by the caller; kept here for reports).
        progress: called with the number of requests finished since the previous call.

    Batch use: :meth:`run`. Incremental use (the dashboard's simulation, tests): :meth:`submit`, :meth:`abort`,
    :meth:`advance_to`, :meth:`next_event_s`, :meth:`insert_prefix`, :meth:`start_copy`, the read API
    (:meth:`replica_state`, :meth:`holders`, :meth:`copies_in_flight`, :meth:`finished_copies`,
    :meth:`copy_info`, :attr:`detector`, :attr:`policy_name`) and the hooks :attr:`on_first_token` and
    :attr:`on_finish`. :attr:`now` is the simulated time, seconds.
    """

    def __init__(
        self,
        trace: Trace,
        policy,
        cluster: ClusterConfig,
        constants: BtbConstants,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.trace = trace
        self.policy = policy
        self.cluster = cluster
        self.constants = constants
        self.cost = cluster.replica_cost()
        self.block_tokens = trace.block_tokens
        self.chunk_tokens = cluster.chunk_tokens()
        self.max_running = cluster.max_running
        self.bytes_per_block = self.block_tokens * self.cost.model.kv_bytes_per_token
        self._fleet_blocks: dict[Hashable, int] = {}  # block -> replicas holding it (for recompute accounting)
        self._fleet_computing: dict[Hashable, int] = {}  # block -> prefills computing it right now, fleet-wide
        events = _FleetEvents(self)
        n = cluster.replicas
        self.replicas = [
            ReplicaModel(
                i,
                self.cost,
                block_tokens=self.block_tokens,
                chunk_tokens=self.chunk_tokens,
                max_running=self.max_running,
                events=events,
            )
            for i in range(n)
        ]
        self.index = FleetIndex(self.replicas)
        self._net = Network(n, self.cost.nic_bytes_per_s)
        self._copies_in: list[dict[Hashable, Copy]] = [{} for _ in range(n)]  # per target: last block -> copy
        # copy-use tracking, per target: block hash -> the completed copy that brought it; chain lengths copied
        self._copied: list[dict[Hashable, Copy]] = [{} for _ in range(n)]
        self._copy_lens: list[set[int]] = [set() for _ in range(n)]
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
        self._submitted: dict[str, ReplicaRequest] = {}  # incremental use: unfinished submitted requests, by id
        self.replications = 0
        self.replicated_bytes = 0.0
        self.copies_started = 0
        self.copies_refused = 0
        self._completed: list[Copy] = []

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
                self._arrive(ReplicaRequest(r, i))
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
            policy=self.policy_name,
            records=self.records,
            replications=self.replications,
            replicated_bytes=self.replicated_bytes,
            copies_started=self.copies_started,
            copies_refused=self.copies_refused,
            policy_stats=self.policy.stats(),
            wasted_replications=sum(1 for c in self._completed if not c.meta["used"]),
            time_to_warm_s=[c.done_s - c.meta["hot_since_s"] for c in self._completed],
        )

    def _pop_event(self) -> None:
        t, kind, _, payload = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        if kind == _EV_STEP:
            rep, version = payload
            if version == rep.version:
                rep.end_step(self.now)
        else:
            copy, version = payload
            if version == copy.version:
                self._copy_event(copy)

    def _arrive(self, rq: ReplicaRequest) -> None:
        route = self.policy.route(rq.req, self.view, self.now)
        r = route.replica
        if not 0 <= r < len(self.replicas):
            raise RuntimeError(f"policy {self.policy.name} returned replica {r}")
        for plan in route.copies:
            self.execute(plan)
        self.replicas[r].enqueue(rq, self.now)

    def _finished(self, rep: ReplicaModel, rq: ReplicaRequest, now_s: float) -> None:
        req = rq.req
        if self._submitted:
            self._submitted.pop(req.request_id, None)
        self.policy.on_finish(req, rep.idx, now_s)
        record = RequestRecord(
            request_id=req.request_id,
            kind=req.kind,
            arrival_s=req.arrival_s,
            replica=rep.idx,
            ttft_s=rq.ttft_s,
            queue_wait_s=rq.admitted_s - req.arrival_s,
            cached_tokens=rq.cached_tokens,
            prefill_tokens=req.input_tokens - rq.cached_tokens,
            finish_s=now_s,
            input_tokens=req.input_tokens,
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

    # -- incremental use ----------------------------------------------------------------------------------------
    def submit(self, req: Request, replica: int | None = None) -> None:
        """A request arrives at the current time ``self.now`` (its ``arrival_s`` is overwritten). Routed by the
        policy unless ``replica`` is given."""
        self._seq += 1
        req.arrival_s = self.now
        rq = ReplicaRequest(req, self._seq)
        self._submitted[req.request_id] = rq
        if replica is None:
            self._arrive(rq)
            return
        self.replicas[replica].enqueue(rq, self.now)

    def abort(self, request_id: str) -> bool:
        """The client of a request given to :meth:`submit` went away (SGLang aborts such requests): see
        :meth:`~btbctl.engine.sim.replica.ReplicaModel.abort`. Returns False when the request is unknown or already
        finished."""
        rq = self._submitted.get(request_id)
        if rq is None:
            return False
        return self.replicas[rq.replica].abort(rq, self.now)

    def next_event_s(self) -> float | None:
        """Time of the next pending event (None when idle)."""
        return self.heap[0][0] if self.heap else None

    def advance_to(self, t: float) -> None:
        """Process every event due at or before ``t``; afterwards ``now == max(now, t)``."""
        while self.heap and self.heap[0][0] <= t:
            self._pop_event()
        self.now = max(self.now, t)

    def insert_prefix(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Make ``chain`` resident on ``replica`` (blocks that arrived from outside the model). Returns the number
        of blocks inserted; 0 when they do not fit."""
        return self.replicas[replica].insert_prefix(chain, self.now)

    # -- read API (dashboards) ----------------------------------------------------------------------------------
    @property
    def n_replicas(self) -> int:
        return len(self.replicas)

    @property
    def policy_name(self) -> str:
        return getattr(self.policy, "name", type(self.policy).__name__)

    @property
    def detector(self):
        """The policy's :class:`~btbctl.engine.detector.BurstDetector`, or None for a policy without one."""
        return getattr(self.policy, "detector", None)

    def replica_state(self, replica: int) -> ReplicaState:
        """Counters of one replica (:class:`~btbctl.engine.sim.replica.ReplicaState`)."""
        return self.replicas[replica].state()

    def holders(self, chain: Sequence[Hashable]) -> list[int]:
        """Replicas on which the whole of ``chain`` is resident, in index order."""
        n = len(chain)
        return [r.idx for r in self.replicas if r.cache.match(chain) >= n]

    def copies_in_flight(self) -> list[CopyInfo]:
        """Copies in flight, in start order, with their progress at :attr:`now`."""
        return [self._copy_info(c) for c in self._net.active]

    def finished_copies(self, last: int | None = None) -> list[CopyInfo]:
        """Completed copies in completion order (the ``last`` ones when given)."""
        done = self._completed if last is None else self._completed[-last:] if last > 0 else []
        return [self._copy_info(c) for c in done]

    def copy_info(self, target: int, chain: Sequence[Hashable]) -> CopyInfo | None:
        """The copy of ``chain`` (keyed by its last block) in flight towards ``target``, or None."""
        c = self._copies_in[target].get(chain[-1]) if chain else None
        return None if c is None else self._copy_info(c)

    def _copy_info(self, c: Copy) -> CopyInfo:
        if c.done_s is not None:
            return CopyInfo(
                c.cid,
                c.src,
                c.dst,
                c.chain,
                c.total_bytes,
                c.total_bytes,
                0.0,
                None,
                CopyState.DONE,
                c.started_s,
                c.done_s,
            )
        sent = min(c.total_bytes, c.avail_bytes, c.sent_bytes + c.rate * max(0.0, self.now - c.t_last))
        sent = max(sent, c.sent_bytes)
        eta = (c.total_bytes - sent) / c.rate if c.rate > 0 else None
        state = CopyState.STALLED if c.rate <= 0 else CopyState.RUNNING
        return CopyInfo(c.cid, c.src, c.dst, c.chain, sent, c.total_bytes, c.rate, eta, state, c.started_s, None)

    # -- control (dashboards) -----------------------------------------------------------------------------------
    def set_policy(self, policy) -> None:
        """Route with ``policy`` (a fresh :class:`~btbctl.engine.policies.base.Policy`) from now on."""
        self.policy = policy

    def set_constants(self, constants: BtbConstants) -> None:
        """Hand BTB's constants to the policy from now on."""
        self.policy.set_constants(constants)
        self.constants = constants

    # -- copies ---------------------------------------------------------------------------------------------------
    def execute(self, plan: CopyPlan) -> list[int]:
        """Carry out a policy's copy plan now (:func:`~btbctl.engine.copies.carry_out` over :meth:`start_copy`),
        reporting every attempt to the policy; returns the targets whose copies started."""
        now = self.now
        policy = self.policy
        return carry_out(
            plan,
            lambda t: self.start_copy(plan.prefix, plan.source, t, now, plan.hot_since_s),
            lambda t, ok: policy.on_copy_result(plan, t, ok, now),
        )

    def start_copy(
        self, chain: tuple, source: int, target: int, now_s: float, hot_since_s: float | None = None
    ) -> bool:
        """Start copying ``chain``'s KV from ``source`` to ``target``; False when refused (same replica, a bad index,
        a copy of it to the target in flight or the target already holding or computing it, no room there, or a
        source that will not have the blocks).
        ``hot_since_s``: when the policy saw the need for it (time-to-warm reports); default ``now_s``.
        The source must hold the blocks, or be computing or receiving them, or have a request queued that will
        compute them (``planned_blocks``); bytes move only as the source commits blocks."""
        n = len(self.replicas)
        if not (0 <= source < n and 0 <= target < n) or source == target or not chain:
            self.copies_refused += 1
            return False
        src, dst = self.replicas[source], self.replicas[target]
        if chain[-1] in self._copies_in[target] or dst.pending_blocks(chain) == len(chain):
            self.copies_refused += 1
            return False
        if src.planned_blocks(chain) < len(chain):
            # the source neither holds, computes, receives nor has a request queued that will compute the prefix
            self.copies_refused += 1
            return False
        inc = dst.begin_incoming(chain)
        if inc is None:
            self.copies_refused += 1
            return False
        offset = inc.have
        send = len(chain) - offset
        self._cid += 1
        c = Copy(
            cid=self._cid,
            src=source,
            dst=target,
            chain=chain,
            offset=offset,
            bytes_per_block=self.bytes_per_block,
            started_s=now_s,
            total_bytes=send * self.bytes_per_block,
            t_last=now_s,
        )
        c.meta["hot_since_s"] = now_s if hot_since_s is None else min(hot_since_s, now_s)
        c.meta["used"] = 0
        c.meta["incoming"] = inc
        self._copies_in[target][chain[-1]] = c
        have = src.cache.match(chain)
        src.pin(chain, 0, have)
        c.src_pinned = have
        c.avail_bytes = max(0, have - offset) * self.bytes_per_block
        self._net.advance(now_s)
        self._net.active.append(c)
        self.copies_started += 1
        self._reschedule_copies()
        return True

    @staticmethod
    def _note_copy_use(copied: dict, copy_lens: set, chain: Sequence[Hashable], matched: int) -> None:
        """A request admitted on a replica reuses ``matched`` leading blocks: count a use of every completed copy
        that brought one of them (found at the deepest matched block and at the end of each copied chain)."""
        used = {id(c): c for c in (copied.get(chain[n - 1]) for n in copy_lens if n < matched) if c is not None}
        c = copied.get(chain[matched - 1])
        if c is not None:
            used[id(c)] = c
        for c in used.values():
            c.meta["used"] += 1

    def _source_progress(self, source: int) -> None:
        """The source committed blocks: copies trailing its prefill may send more."""
        src = self.replicas[source]
        changed = False
        for c in self._net.active:
            if c.src != source or c.src_pinned >= len(c.chain):
                continue
            have = src.cache.match(c.chain)
            if have > c.src_pinned:
                if not changed:
                    self._net.advance(self.now)
                    changed = True
                src.pin(c.chain, c.src_pinned, have)
                c.src_pinned = have
                c.avail_bytes = max(0, have - c.offset) * c.bytes_per_block
        if changed:
            self._reschedule_copies()

    def _reschedule_copies(self) -> None:
        self._net.reallocate()
        for c in self._net.active:
            c.version += 1
            eta = c.eta_s()
            if eta is not None:
                self._push(self.now + eta, _EV_COPY, (c, c.version))

    def _copy_event(self, c: Copy) -> None:
        self._net.advance(self.now)
        for done in [x for x in self._net.active if x.finished]:  # copies sharing a bottleneck end together
            self._complete_copy(done)
        self._reschedule_copies()

    def _complete_copy(self, c: Copy) -> None:
        self._net.active.remove(c)
        c.done_s = self.now
        src, dst = self.replicas[c.src], self.replicas[c.dst]
        chain = c.chain
        src.unpin(chain, c.src_pinned)
        dst.end_incoming(c.meta["incoming"], True)
        copied = self._copied[c.dst]
        for k in range(c.offset, len(chain)):
            copied[chain[k]] = c
        self._copy_lens[c.dst].add(len(chain))
        self._copies_in[c.dst].pop(chain[-1], None)
        self._completed.append(c)
        self.replications += 1
        self.replicated_bytes += c.total_bytes
        dst.kick(self.now)
        src.kick(self.now)  # unpinned source blocks may make room for a request waiting on memory
        if self._net.active:
            self._source_progress(c.dst)  # copies chained behind this one may send more


def simulate_realistic(
    trace: Trace,
    policy: str,
    cluster: ClusterConfig,
    constants: BtbConstants,
    *,
    seed: int = 42,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``trace`` on ``cluster`` routed by the policy named ``policy`` with this module's model.

    Args:
        trace: requests (sorted by arrival).
        policy: registry name (``btbctl.engine.policies.POLICIES``).
        cluster: the fleet.
        constants: BTB's four constants (used by BTB-style policies).
        seed: seeds the policy's random source; same inputs and seed give identical results.
        progress: called with increments of finished requests.

    Raises:
        ConfigError: unknown policy, unknown presets, a model or a request that does not fit.
    """
    cost = cluster.replica_cost()  # validate before building anything
    check_fits(trace, cost.kv_budget_tokens)
    pol = make_policy(policy, cluster.replicas, random.Random(seed), constants, block_tokens=trace.block_tokens)
    return Simulator(trace, pol, cluster, constants, progress=progress).run()


__all__ = ["CopyInfo", "SimFleetView", "Simulator", "simulate_realistic"]
