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

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import filterfalse, islice, takewhile

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


class InferSimReplica:
    """One replica of the infersim model: clock, queue, running batch, HBM LRU and host-RAM set.

    ``clock`` (seconds) is the replica's own time: the end of the work it has done so far. It can run ahead of the
    fleet's time (a long admission) and never falls behind the time it was last advanced to.
    """

    def __init__(self, idx: int, cost: InferSimCost, sim: InferSimulator) -> None:
        self.idx = idx
        self.cost = cost
        self.sim = sim
        self.clock = 0.0
        self.queue: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.reserved = 0  # KV tokens reserved by running sequences
        self.kv_tokens = 0  # sum of running sequences' contexts
        self.hbm: OrderedDict[Hashable, None] = OrderedDict()  # least recently used first
        self.host: set[Hashable] = set()
        self.queued_s = 0.0  # sum of est_s over the queue
        self.copied: dict[Hashable, _Copy] = {}  # last block of a copied chain -> the copy that brought it
        self.copy_lens: set[int] = set()  # chain lengths in ``copied``

    @property
    def load(self) -> int:
        """Running + queued requests."""
        return len(self.running) + len(self.queue)

    # -- cache ------------------------------------------------------------------------------------------------
    def match(self, chain: Sequence[Hashable]) -> tuple[int, int]:
        """The leading run of ``chain`` found in HBM or host RAM, as ``(blocks in HBM, blocks in host RAM)``.
        The HBM-only leading run is taken at C level (``takewhile``, stops at the first miss); a plain loop goes on
        only where host RAM continues it."""
        hbm, host = self.hbm, self.host
        n_hbm = len(list(takewhile(hbm.__contains__, chain)))
        if n_hbm == len(chain) or chain[n_hbm] not in host:
            return n_hbm, 0
        n_host = 0
        for h in islice(chain, n_hbm, None):
            if h in hbm:
                n_hbm += 1
            elif h in host:
                n_host += 1
            else:
                break
        return n_hbm, n_host

    def hbm_run(self, chain: Sequence[Hashable]) -> int:
        """Length of the leading run of ``chain`` resident in HBM."""
        return len(list(takewhile(self.hbm.__contains__, chain)))

    def insert(self, blocks: Sequence[Hashable]) -> None:
        """Make ``blocks`` the most recently used HBM entries (in order), spilling LRU blocks to host RAM."""
        hbm, host = self.hbm, self.host
        fleet = self.sim.fleet_blocks
        new = list(filterfalse(hbm.__contains__, blocks))
        if len(set(new)) < len(new):  # a block repeated within the chain: one at a time
            for h in blocks:
                if h in hbm:
                    hbm.move_to_end(h)
                    continue
                if h in host:
                    host.discard(h)
                else:
                    fleet[h] = fleet.get(h, 0) + 1
                hbm[h] = None
        else:
            for h in new:
                if h in host:
                    host.discard(h)
                else:
                    fleet[h] = fleet.get(h, 0) + 1
                hbm[h] = None
            # every block to the MRU end in order: the same order a block-by-block pass leaves
            deque(map(hbm.move_to_end, blocks), maxlen=0)
        over = len(hbm) - self.cost.budget_blocks
        while over > 0:
            h, _ = hbm.popitem(last=False)
            host.add(h)
            over -= 1

    def prefill_estimate_s(self, s: _Seq) -> float:
        """Prefill seconds of ``s`` here given the cache as it is now (blocks in HBM or host RAM count as hits)."""
        a, b = self.match(s.blocks)
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
            steps = min(s.left for s in running)
            if until is not None and cost.decode_s(steps, n, kv) > until - self.clock:
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
        bt = cost.block_tokens
        while queue and len(self.running) < cost.max_running:
            s = queue[0]
            if self.reserved + s.need > cost.kv_budget_tokens:
                return  # FCFS: the head waits for running sequences to finish (sizes are checked up front)
            queue.popleft()
            self.queued_s = self.queued_s - s.est_s if queue else 0.0
            n_hbm, n_host = self.match(s.blocks)
            matched = n_hbm + n_host
            if self.copy_lens and matched:
                self._mark_copies_used(s.blocks, matched)
            hit = min(matched * bt, s.prefix_tokens)
            reuse = min(cost.reload_s(n_host), cost.prefill_s(hit))
            prefill = cost.prefill_s(s.req.input_tokens - hit)
            s.start_s = self.clock
            s.reuse_s = reuse
            s.prefill_s = prefill
            s.hit_tokens = hit
            s.recomputed = self.sim.recomputed_tokens(s, matched)
            self.running.append(s)
            self.reserved += s.need
            self.kv_tokens += s.context
            self.clock += reuse + prefill
            extra = -(-s.need // bt) - len(s.blocks)
            self.insert(s.blocks if extra <= 0 else tuple(s.blocks) + tuple(_OutBlock() for _ in range(extra)))

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

    @property
    def n_replicas(self) -> int:
        return len(self._sim.replicas)

    def load(self, replica: int) -> int:
        return self._sim.replicas[replica].load

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        a, b = self._sim.replicas[replica].match(chain)
        return a + b

    def hbm_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident in ``replica``'s HBM."""
        return self._sim.replicas[replica].hbm_run(chain)

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        if self.copy_in_flight(replica, chain):
            return len(chain)
        return self.cached_blocks(replica, chain)

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether a copy of exactly ``chain`` towards ``replica`` is scheduled and not yet in its cache."""
        return (replica, tuple(chain)) in self._sim.planned

    def accepts_copies(self, replica: int) -> bool:
        """Always True: every replica of this model can send and receive copies."""
        return True

    def prefill_load(self, replica: int) -> int:
        """Requests queued on ``replica`` (not admitted yet; an admission computes the first token at once here)."""
        return len(self._sim.replicas[replica].queue)

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
        self.replicas = [InferSimReplica(i, self.cost, self) for i in range(cluster.replicas)]
        self.view = InferSimFleetView(self)
        self.now = 0.0
        self.fleet_blocks: dict[Hashable, int] = {}  # block -> replicas holding it in HBM or host RAM
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
        """Replay the window to completion; returns the records (in completion order)."""
        reps = self.replicas
        policy = self.policy
        view = self.view
        n = len(reps)
        for req in self.requests:
            t = req.arrival_s
            self.now = t
            for rep in reps:
                rep.advance(t)
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
            reps[r].enqueue(_Seq(req, self.cost.block_tokens, self.window))
        for rep in reps:
            rep.advance(None)
        return self.records

    # -- hooks from replicas ----------------------------------------------------------------------------------
    def recomputed_tokens(self, s: _Seq, matched: int) -> int:
        """Prompt tokens ``s`` computes past its local match although some replica holds the block."""
        fleet = self.fleet_blocks
        bt = self.cost.block_tokens
        inp = s.req.input_tokens
        out = 0
        for k in range(matched, len(s.blocks)):
            if s.blocks[k] in fleet:
                out += max(0, min(bt, inp - k * bt))
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
