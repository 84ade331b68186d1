"""``btb_plus``: BTB with copies that trail the source, a break-even check, a replica count from the arrival rate,
deepest-prefix matching and expected-TTFT routing.

It keeps BTB's idea (Birmiwal & Bhat, "Biting the Bullet", 2026-07-22; REFERENCE.md s1): when a long prefix turns
hot, put its KV cache on more replicas before the bulk of the burst arrives. It changes five things, each for a
weakness REFERENCE.md s1 lists or a point the published rule leaves open. Per request, with the four constants
(``X = threshold``, ``Y = prefix_blocks``, ``Z = window_s``, ``M = replicas``):

1. **Deepest hot prefix** (instead of exactly Y blocks). The prompt's chain is observed at depths
   ``Y, 2Y, 4Y, ...`` (Y times powers of two, up to the chain's length), each depth with its own
   :class:`~btbctl.engine.detector.BurstDetector` (X arrivals within Z seconds fire; "active" as defined there).
   The request's hot prefix is the deepest active depth. Prompts shorter than Y blocks never trigger, so Y stays
   the minimum. With Y = 64 on the Bursted workload (256 shared blocks) the copies carry all 256 shared blocks.
2. **How many replicas** (instead of always M). ``lambda`` = arrivals of the prefix in the window / Z
   (requests/s); ``s`` = prefill time of this request's non-shared suffix at the prefix's context
   (``cost.prefill_time_s(input - prefix tokens, prefix tokens)``), so one replica serves ``1 / s`` such requests
   per second. The rate target is ``k = ceil(lambda x s)`` replicas (the offered load, in replicas), clamped to
   ``[1, min(M, n_replicas)]``. Beyond it, one more copy is made on an arrival when the copy would give that very
   request an earlier first token than every replica that holds, computes or is receiving the prefix (their
   queues have grown longer than the time to warm one more); the total stays capped at ``min(M, n_replicas)``.
   Replicas that hold, compute, are receiving, or have a request queued that will compute the prefix all count.
3. **Copies only from a real source, trailing it.** The source holds all blocks of the prefix (least busy NIC
   first, then least queued work); without a holder, it is the replica that will have computed it soonest (it is
   computing it, or a request queued there will). Only blocks the source has computed are sent: the fleet streams
   blocks as the source commits them. A replica still receiving the prefix is never a source. No source, no copy.
4. **Break-even before copying.** For a target ``t`` lacking ``b`` blocks of the prefix:
   ``transfer = bytes(b blocks) / (nic_bytes_per_s / (1 + copies already on the source's or the target's NIC))``
   must be shorter than ``recompute = queued prefill on t + cost.prefill_time_s(b blocks' tokens, context of the
   blocks t has)``; a copy with steps after its last byte (``view.copy_after_s``: an ``l3`` copy's write-through
   and proof) must also land (the later of ``transfer`` and the source's remaining prefill, plus those steps)
   before ``recompute`` is done; and ``t`` needs KV headroom (free + evictable tokens) for the ``b`` blocks.
   Targets are tried in order of the first token they could give this request. When no copy pays, nothing is
   copied: a burst request may still go to an idle replica and recompute the prefix there (speculative prefill)
   when that is its best choice under rule 5, and that replica then counts as computing the prefix.
5. **Routing by expected TTFT** (every request, hot or not). For each replica ``r``: the request reuses the
   leading blocks resident there, on their way, or to be computed by a request already queued there
   (``view.planned_blocks``) and computes the rest, ``own = cost.prefill_time_s(rest, reused)``. It starts after
   the queued prefill ahead (``view.queued_prefill_s``) plus, when the KV cache there is full, the decoding needed
   to free room for it and the requests waiting ahead (``view.admission_wait_s``), except that requests waiting
   there for a hot prefix not there yet (``view.waiting_groups``; arriving by copy, ``view.copy_status``, or
   computed there) run only once it lands: a request that does not need it runs before them if it can start
   first, and one that needs it starts no earlier than it lands. A copy lands after its remaining bytes at its
   current rate or, while it waits for the source's compute, after the later of the source's remaining prefill
   of the prefix and the bytes at a fair NIC share; a prefix computed there lands after the rest of its prefill.
   Expected TTFT = start + own. The request goes to the replica with the lowest cost, where cost = expected TTFT
   + the delay it imposes on requests already waiting there for a hot prefix (those whose prefix lands while it
   runs wait for it: requests x overlap seconds; a prefix computed there counts as landing one prefill chunk
   early, because the step computing its last block admits other work first) + ``own`` x the requests expected to
   wait behind this one's prefill there: the larger of the requests there still waiting for their first token
   (``view.prefill_load`` minus those waiting for a hot prefix; by Little's law, in a steady state as many arrive
   during one time to first token) and the arrivals expected during its expected TTFT at the fleet's recent
   arrival rate per replica (arrivals in the trailing :data:`RATE_WINDOW_S` seconds / :data:`RATE_WINDOW_S` /
   replicas). The second term keeps a long cold prompt out of a burst's warm queue when it can wait elsewhere; the
   third makes the rule prefer cache hits in proportion to how loaded the fleet is (under overload every second of
   prefill delays everyone queued after it). Requests that already have their first token (decoding) do not count:
   a prefill slows their later tokens, not their first, and counting them made the rule shun a replica with long
   decodes in flight although it could start the prefill at once (on 2 replicas with 430-token answers that
   alone cost +16% p95 TTFT against round robin). The rate is counted over a bounded window, never since the
   first request: at a gateway's cold start "since the first" is microseconds, and a burst then read as tens of
   thousands of requests per second, which made every request chase the replicas that would reuse the most.
   Ties go to the lower load, then at random (the policy's seeded rng). Requests without a hot prefix are routed by
   the same rule; on traffic without bursts (no copies) it is a shortest-expected-delay router that weighs cache
   hits.

6. **Pacing a spread burst** (the gateway's; the simulator sends at once). A request of a hot prefix that at least
   two replicas hold, receive or will compute goes out with ``Route.pace`` = ``ceil(PACE_HORIZON_S / own)``
   (at least 1; ``own``: its prefill there, rule 5): the gateway sends it once fewer of its requests wait for a
   first token there, and holds it until then. A replica forms a prefill batch of every request waiting there
   and the first tokens of a batch all come at its end, so a burst's queue sent at once (20 requests behind a
   copy's proof, each 26 ms of prefill at a 16k-token context) gets its first tokens 0.5 s later; paced, the
   queue drains in batches of about :data:`PACE_HORIZON_S` each, and the first ones answer within it. A prefix
   on one replica alone is never paced: there the queue is the bottleneck, and small batches would lower the
   replica's throughput (each step pays its own weight reads).

Copies only where they can be made. A replica that cannot take part in a copy (``view.accepts_copies`` False: a
gateway's worker without the BTB routes, such as a stock SGLang server, or an unhealthy one) is neither a target nor
a source, and neither is, for ``Z`` seconds, a target the executor just refused
(:class:`~btbctl.engine.policies.base.CopyRefusals`, fed by :meth:`BtbPlus.on_copy_result`). Rule 5 then weighs the
holders' queues against recomputing elsewhere, so a burst is never forced onto a holder that cannot keep up.

No constant of this module is tuned to a workload: the rule uses only the four BTB constants, the cost model, the
fleet view and the rate window (:data:`RATE_WINDOW_S`, a horizon, not a fitted value). No rollback: copies age out
by LRU, as in BTB. ``set_constants`` retunes live.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Collection, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar, overload

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan, CopyStatus
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.detector import BurstDetector, Detection
from btbctl.engine.policies.base import CopyRefusals, CostView, Policy, Route, RouteIndex, route_index
from btbctl.engine.trace.model import Request

#: Seconds of arrivals behind the recent arrival rate of rule 5 (a product choice: long against one request's time to
#: first token, seconds, and short against a shift in traffic, minutes; the horizon of a one-minute load average).
RATE_WINDOW_S = 60.0
#: Slots the rate window is counted in (its resolution is ``RATE_WINDOW_S / RATE_SLOTS`` seconds).
RATE_SLOTS = 60
#: Seconds of prefill a replica is sent ahead of a spread burst's first tokens (rule 6; a product choice: long
#: against the gateway's round trip to send the next request, milliseconds, so the replica is not left idle between
#: batches, and short against the TTFT a batch end adds to its first request). On 4 emulated H100 x 4 workers with
#: a 200-request, 16k-token-prefix burst: 4 requests a batch (0.1 s) gave a mean TTFT of 0.447 s, 2 gave 0.477 s,
#: 8 gave 0.471 s, 1 gave 0.627 s, unpaced 0.508 s (one run each).
PACE_HORIZON_S = 0.1
#: Prompt shapes whose prefill time :meth:`BtbPlus.prefill_s` remembers (cleared when full).
PREFILL_MEMO = 4096

#: Groups of a replica's waiting requests that wait for a hot prefix not there yet:
#: (seconds until it is there, requests, seconds of their prefill, prefix key, seconds of grace).
_Groups = list[tuple[float, int, float, Hashable, float]]
_K = TypeVar("_K")
_V = TypeVar("_V")


#: An empty map of planned blocks read (see :func:`_planned`); never written.
_NOT_READ: dict[int, int] = {}


def _lowest(values: Iterable[float]) -> float:
    """The least of ``values``, inf when empty (a loop: ``min(default=)`` is a generic call in the compiled build)."""
    low = math.inf
    for v in values:
        if v < low:
            low = v
    return low


def _planned(view: CostView, known: dict[int, int], replica: int, prefix: Sequence[Hashable]) -> int:
    """``view.planned_blocks(replica, prefix)``, from ``known`` (read while pricing) when there."""
    got = known.get(replica)
    return view.planned_blocks(replica, prefix) if got is None else got


class _LazyGroups:
    """``groups[replica]`` is ``BtbPlus.blocked_groups(view, replica, now_s)``, computed on first use (one request's
    route). A plain class rather than a dict with ``__missing__``: the compiled build calls it natively."""

    __slots__ = ("_policy", "_view", "_now_s", "_known")

    def __init__(self, policy: BtbPlus, view: CostView, now_s: float) -> None:
        self._policy, self._view, self._now_s = policy, view, now_s
        self._known: dict[int, _Groups] = {}

    def __getitem__(self, replica: int) -> _Groups:
        g = self._known.get(replica)
        if g is None:
            waiting = self._view.waiting_groups(replica)  # none (the common case): no call to blocked_groups
            g = self._policy.blocked_groups(self._view, replica, self._now_s, waiting) if waiting else []
            self._known[replica] = g
        return g


class _Without(Sequence[int]):
    """``order`` (ascending) without the members ``skip`` (ascending, a few), indexed without copying ``order``:
    O(len(skip) x log len(order)) per item."""

    def __init__(self, order: Sequence[int], skip: Sequence[int]) -> None:
        self._order = order
        self._at = [bisect_left(order, r) for r in skip]  # ascending positions in order

    def __len__(self) -> int:
        return len(self._order) - len(self._at)

    @overload
    def __getitem__(self, k: int) -> int: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[int]: ...
    def __getitem__(self, k: int | slice) -> int | Sequence[int]:
        if isinstance(k, slice):
            return list(self)[k]
        if not 0 <= k < len(self):
            raise IndexError(k)
        for p in self._at:
            if p <= k:
                k += 1
            else:
                break
        return self._order[k]

    def __iter__(self) -> Iterator[int]:
        at = set(self._at)
        return iter([r for i, r in enumerate(self._order) if i not in at])


class ArrivalRate:
    """Arrivals in the trailing ``window_s`` seconds of the time passed in, counted in ``slots`` equal slots: O(1) per
    arrival, memory bounded by ``slots``. :meth:`per_s` divides by the whole window, also before a window has passed
    since the first arrival (the time before it counts as quiet): a cold start or an idle gap never reads as a
    high rate.

    Args:
        window_s: seconds (> 0).
        slots: resolution (>= 1).
    """

    __slots__ = ("window_s", "slots", "_width", "_counts", "_total")

    def __init__(self, window_s: float = RATE_WINDOW_S, slots: int = RATE_SLOTS) -> None:
        if not window_s > 0 or slots < 1:
            raise ValueError(f"window_s must be > 0 and slots >= 1, got {window_s!r}, {slots!r}")
        self.window_s = float(window_s)
        self.slots = slots
        self._width = self.window_s / slots
        self._counts: deque[list[int]] = deque()  # [slot index, arrivals], oldest first
        self._total = 0

    def _expire(self, slot: int) -> None:
        counts = self._counts
        while counts and counts[0][0] <= slot - self.slots:
            self._total -= counts.popleft()[1]

    def add(self, now_s: float) -> None:
        """One arrival at ``now_s`` (times never go back; an earlier one counts in the latest slot)."""
        slot = math.floor(now_s / self._width)
        self._expire(slot)
        counts = self._counts
        if counts and counts[-1][0] >= slot:
            counts[-1][1] += 1
        else:
            counts.append([slot, 1])
        self._total += 1

    def per_s(self, now_s: float) -> float:
        """Arrivals per second over the trailing window at ``now_s``."""
        self._expire(math.floor(now_s / self._width))
        return self._total / self.window_s


class BtbPlus(Policy[CostView]):
    """BTB with trailing copies, break-even, rate-sized replica count, deepest-prefix match and expected-TTFT
    routing (see the module docstring).

    Args:
        n_replicas: fleet size.
        rng: seeded random source (ties between equally good replicas).
        constants: the four constants (default: the published ones); Y is the minimum depth, M the cap.
        max_tracked: bound on tracked prefixes per depth and on the policy's own memos (default 65,536, as the
            detector's).

    It reads a :class:`~btbctl.engine.policies.base.CostView` (the simulators' views and the gateway's offer one).
    """

    name = "btb_plus"
    needs_cost_view = True
    #: Whether :meth:`route` may skip replicas through the view's route index (off in a subclass whose costs
    #: differ per replica beyond rule 5's).
    use_route_index = True
    #: Whether :meth:`_warm` skips pricing copy targets when none can beat the covered replicas (exact: the same
    #: plans; off only to check that).
    prune_backlog_pricing = True
    summary = (
        "BTB+: deepest hot prefix, copies sized by arrival rate and checked against recompute, expected-TTFT routing"
    )

    def __init__(
        self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None, *, max_tracked: int = 65536
    ) -> None:
        super().__init__(n_replicas, rng, constants)
        self.max_tracked = max_tracked
        self._levels: dict[int, BurstDetector] = {}
        self._shared: BurstDetector | None = None  # depth Y's detector, when it is its caller's (share_detector)
        self._hot_since: OrderedDict[tuple[int, Hashable], float] = OrderedDict()
        # prefix key (its last block) -> the prefix chain, for hot prefixes (to price copies of them)
        self._prefixes: OrderedDict[Hashable, tuple[Hashable, ...]] = OrderedDict()
        # (replica, prefix key) -> when the replica should have computed a prefix this policy sent there
        self._ready_at: OrderedDict[tuple[int, Hashable], float] = OrderedDict()
        self.arrivals = ArrivalRate()
        self.refusals = CopyRefusals()
        # (new tokens, context tokens) -> prefill seconds under ``_prefill_cost`` (:meth:`prefill_s`)
        self._prefill_cost: ReplicaCost | None = None
        self._prefill_memo: dict[tuple[int, int], float] = {}
        # (Y, chain blocks) -> the depths observed (:meth:`depths`)
        self._depths_memo: dict[tuple[int, int], list[int]] = {}
        # (replica, pace) -> the Route of a decision without copies (frozen: one object serves every such decision)
        self._routes: dict[tuple[int, int], Route] = {}
        self._stats = {
            "fires": 0,
            "copies_requested": 0,
            "copies_refused": 0,
            "rate_copies": 0,
            "backlog_copies": 0,
            "copy_not_paying": 0,
            "copy_no_room": 0,
            "no_source": 0,
            "hot_routes": 0,
            "speculative_routes": 0,
            "deepest_above_min": 0,
            "harm_avoiding_routes": 0,
            "paced_routes": 0,
        }

    # -- constants --------------------------------------------------------------------------------------------

    def set_constants(self, constants: BtbConstants) -> None:
        """Retune live from the next request. A new Y drops every depth's state (keys change meaning); a new X or
        Z keeps it (see :meth:`BurstDetector.set_constants`); M applies at once."""
        old_y = self.constants.prefix_blocks
        super().set_constants(constants)
        if constants.prefix_blocks != old_y:
            self._levels.clear()
            self._hot_since.clear()
            if self._shared is not None:  # depth Y stays the shared detector (its owner retunes it too)
                self._shared.set_constants(constants)
                self._levels[constants.prefix_blocks] = self._shared
            return
        for depth, det in self._levels.items():
            det.set_constants(constants.with_updates(prefix_blocks=depth))

    def share_detector(self, detector: BurstDetector) -> bool:
        """Observe depth Y through ``detector`` from now on (see :meth:`Policy.share_detector`); the deeper depths
        keep detectors of their own."""
        self._shared = detector
        self._levels[self.constants.prefix_blocks] = detector
        return True

    def _level(self, depth: int) -> BurstDetector:
        det = self._levels.get(depth)
        if det is None:
            det = BurstDetector(self.constants.with_updates(prefix_blocks=depth), max_tracked=self.max_tracked)
            self._levels[depth] = det
        return det

    def prefill_s(self, cost: ReplicaCost, new_tokens: int, context_tokens: int) -> float:
        """``cost.prefill_time_s(new_tokens, context_tokens)``, seconds, remembered while the view's cost model is
        the same object (a request's route asks for the same few prompt shapes on every replica)."""
        memo = self._prefill_memo
        if cost is not self._prefill_cost:
            self._prefill_cost = cost
            memo.clear()
        key = (new_tokens, context_tokens)
        v = memo.get(key)
        if v is None:
            if len(memo) >= PREFILL_MEMO:
                memo.clear()
            v = memo[key] = cost.prefill_time_s(new_tokens, context_tokens)
        return v

    def _remember(self, memo: OrderedDict[_K, _V], key: _K, value: _V) -> None:
        memo[key] = value
        memo.move_to_end(key)
        while len(memo) > self.max_tracked:
            memo.popitem(last=False)

    # -- rule 1: the deepest hot prefix -----------------------------------------------------------------------

    def depths(self, n_blocks: int) -> list[int]:
        """Depths observed for a chain of ``n_blocks`` blocks: ``Y, 2Y, 4Y, ...`` up to ``n_blocks`` (remembered per
        ``(Y, n_blocks)``; the list is shared: read it, never change it)."""
        y = self.constants.prefix_blocks
        memo = self._depths_memo
        out = memo.get((y, n_blocks))
        if out is None:
            out = []
            d = y
            while d <= n_blocks:
                out.append(d)
                d *= 2
            if len(memo) >= PREFILL_MEMO:
                memo.clear()
            memo[(y, n_blocks)] = out
        return out

    def detect(self, chain: Sequence[Hashable], now_s: float, arrivals: int = 1) -> tuple[Detection, float] | None:
        """Record an arrival (counted ``arrivals`` times: a declared burst) at every depth; return the deepest
        active prefix's detection and the time it turned hot (seconds), or None when no depth is active."""
        best = None
        for depth in self.depths(len(chain)):
            det = self._level(depth).observe(chain, now_s, arrivals)
            if det is None:
                continue
            key = (depth, det.key)
            if det.fired or key not in self._hot_since:
                if det.fired:
                    self._stats["fires"] += 1
                self._remember(self._hot_since, key, now_s)
                self._remember(self._prefixes, det.key, det.prefix)
            best = (det, self._hot_since[key])
        if best is not None and len(best[0].prefix) > self.constants.prefix_blocks:
            self._stats["deepest_above_min"] += 1
        return best

    # -- rule 2: replicas wanted from the arrival rate --------------------------------------------------------

    def rate_target(self, arrivals_in_window: int, suffix_s: float) -> int:
        """``ceil(lambda x s)`` replicas clamped to ``[1, min(M, n_replicas)]``, with ``lambda`` =
        ``arrivals_in_window / window_s`` (requests/s) and ``suffix_s`` = seconds one replica spends on one
        request's non-shared suffix."""
        cap = max(1, min(self.constants.warm_replicas, self.n_replicas))
        lam = arrivals_in_window / self.constants.window_s
        want = math.ceil(lam * suffix_s - 1e-12) if suffix_s > 0 else 1
        return max(1, min(cap, want))

    # -- rule 5: when copies land, expected TTFT --------------------------------------------------------------

    def source_ready_s(self, view: CostView, source: int, key: Hashable, now_s: float) -> float:
        """Seconds until ``source`` holds the prefix whose last block is ``key``: 0 when it does; the prefill of the
        blocks it lacks while it computes them; when a request queued there will compute them, the time this policy
        expected when it sent that request (if still ahead), else the source's queued prefill plus that prefill."""
        chain = self._prefixes.get(key)
        rest = 0.0
        if chain is not None:
            n = len(chain)
            have = view.cached_blocks(source, chain)
            if have >= n:
                return 0.0
            bt = view.block_tokens
            rest = self.prefill_s(view.cost, (n - have) * bt, have * bt)
            if view.pending_blocks(source, chain) >= n:
                return rest
        at = self._ready_at.get((source, key))
        if at is not None and at > now_s:
            return at - now_s
        return view.queued_prefill_s(source) + rest

    def copy_lands_s(self, view: CostView, status: CopyStatus, key: Hashable, now_s: float) -> float:
        """Seconds until the copy described by ``status`` (of the prefix whose last block is ``key``) has landed and
        the target can use it: remaining bytes at its rate; while it trails the source's compute, the later of
        :meth:`source_ready_s` and the remaining bytes at the path's measured rate (else a fair share of the
        source's NIC); plus the copy's ``after_s`` (an ``l3`` copy's proof)."""
        left = max(0.0, status.total_bytes - status.sent_bytes)
        if status.available_bytes >= status.total_bytes and status.rate_bytes_per_s > 0:
            return left / status.rate_bytes_per_s + status.after_s
        share = (
            status.rate_bytes_per_s
            or status.path_bytes_per_s
            or view.cost.nic_bytes_per_s / max(1, view.nic_copies(status.source))
        )
        return max(left / share, self.source_ready_s(view, status.source, key, now_s)) + status.after_s

    def blocked_groups(
        self, view: CostView, replica: int, now_s: float, waiting: list[tuple[Hashable, int, float]] | None = None
    ) -> _Groups:
        """The requests waiting on ``replica`` for a hot prefix that is not there yet, by prefix: ``(seconds until
        it is there, requests, seconds of their prefill, key, grace)``, soonest first. The prefix arrives by
        copy (:meth:`copy_lands_s`, grace 0) or is computed there (:meth:`source_ready_s`; grace = one prefill chunk
        at the prefix's context: the step that computes its last block leaves room in the batch for a request
        admitted before the group can run). Requests waiting for other blocks are left out: they count as queued
        ahead of a new request. ``waiting``: ``view.waiting_groups(replica)`` when already read."""
        if waiting is None:
            waiting = view.waiting_groups(replica)
        if not waiting:
            return []
        out = []
        for key, n, work_s in waiting:
            chain = self._prefixes.get(key)
            if chain is None:
                continue
            st = view.copy_status(replica, (key,))  # copies are keyed by their chain's last block
            if st is not None:
                out.append((self.copy_lands_s(view, st, key, now_s), n, work_s, key, 0.0))
            else:
                ctx = len(chain) * view.block_tokens
                grace = self.prefill_s(view.cost, view.chunk_tokens, ctx)
                out.append((self.source_ready_s(view, replica, key, now_s), n, work_s, key, grace))
        out.sort(key=lambda g: g[0])
        return out

    def _copies_land_s(
        self,
        view: CostView,
        replica: int,
        chain: Sequence[Hashable],
        there: int,
        depths: Sequence[int],
        now_s: float,
    ) -> float:
        """Seconds until the copies towards ``replica`` of the leading ``depths`` of ``chain`` (up to ``there``
        blocks, those planned there) have landed (:meth:`copy_lands_s`); 0 when ``replica`` holds them already or
        none is on its way."""
        ready = 0.0
        if there > view.cached_blocks(replica, chain):
            n = len(chain)
            for d in depths:
                if d <= there:
                    st = view.copy_status(replica, chain if d == n else chain[:d])
                    if st is not None:
                        ready = max(ready, self.copy_lands_s(view, st, chain[d - 1], now_s))
        return ready

    def estimate(
        self,
        view: CostView,
        replica: int,
        req: Request,
        now_s: float,
        depths: Sequence[int] = (),
        groups: _Groups | None = None,
        ready_s: float | None = None,
        copied_blocks: int = 0,
        planned: int | None = None,
    ) -> tuple[float, float, float]:
        """``(expected TTFT, delay imposed on requests waiting for a hot prefix, start)`` of ``req`` on
        ``replica``, seconds (rule 5). ``depths``: prefix lengths at which a copy towards ``replica`` may bring the
        request's blocks; ``groups``: :meth:`blocked_groups` (computed when None); ``ready_s`` and
        ``copied_blocks``: for a copy about to start, when it would land and how many leading blocks it brings;
        ``planned``: ``view.planned_blocks(replica, chain)`` when already read."""
        chain = req.block_hashes
        bt = view.block_tokens
        inp = req.input_tokens
        if groups is None:
            groups = self.blocked_groups(view, replica, now_s)
        if planned is None:
            planned = view.planned_blocks(replica, chain) if chain else 0
        there = max(planned, copied_blocks)
        ready = 0.0 if ready_s is None else ready_s
        if ready_s is None and there and depths:
            ready = self._copies_land_s(view, replica, chain, there, depths, now_s)
        mine: set[Hashable] = set()
        if ready_s is None and there and groups:
            for lands, _, _, key, _ in groups:  # prefixes this request itself waits for (copied or computed here)
                n = len(self._prefixes[key])
                if n <= there and chain[n - 1] == key:
                    mine.add(key)
                    ready = max(ready, lands)
        have = min(there * bt, inp - 1)
        own = self.prefill_s(view.cost, inp - have, have)
        wait = view.queued_prefill_s(replica) + view.admission_wait_s(replica, inp - have + req.output_tokens)
        if not groups:
            start = max(max(0.0, wait), ready)
            return start + own, 0.0, start
        start = max(0.0, wait - sum(g[2] for g in groups))
        start = max(start, ready)
        harm = 0.0
        for lands, n, work_s, key, grace in groups:
            if key in mine or lands + grace <= start:
                start += work_s  # queued before this request and runnable by the time it could start
            elif lands < start + own:
                harm += n * (start + own - lands)
        return start + own, harm, start

    def expected_ttft_s(
        self, view: CostView, replica: int, req: Request, now_s: float, depths: Sequence[int] = ()
    ) -> float:
        """Expected seconds to the first token of ``req`` on ``replica`` (rule 5)."""
        return self.estimate(view, replica, req, now_s, depths)[0]

    def _estimates(
        self,
        view: CostView,
        req: Request,
        now_s: float,
        depths: Sequence[int],
        groups: _LazyGroups,
        replicas: Iterable[int],
        out: dict[int, tuple[float, float, float]],
        own0: float,
        reuses: bool = True,
        planned_out: dict[int, int] | None = None,
    ) -> None:
        """:meth:`estimate` of ``req`` on each of ``replicas`` into ``out``, the same floats, with the common case
        inlined: on a replica where the request reuses nothing (no block of its chain planned there) and nobody
        waits for a hot prefix, the estimate is the queue plus the cold prefill, which is the same on all such
        replicas (``own0``: the cold prefill, :meth:`_cold_prefill_s`). ``reuses`` False: none of ``replicas`` plans a
        block of the chain (outside the route index's holders), so that is not asked. ``planned_out``: receives the
        ``view.planned_blocks`` of the chain read on each replica (not on one where requests wait for a prefix)."""
        chain = req.block_hashes
        inp = req.input_tokens
        out_tokens = req.output_tokens
        kv_tokens = inp + out_tokens
        have0 = min(0, inp - 1)  # estimate's ``have`` with nothing there
        planned, queued, admission = view.planned_blocks, view.queued_prefill_s, view.admission_wait_s
        bt = view.block_tokens
        cost = view.cost
        for r in replicas:
            g = groups[r]
            if g:
                out[r] = self.estimate(view, r, req, now_s, depths, g)
                continue
            there = planned(r, chain) if reuses and chain else 0
            if planned_out is not None and reuses and chain:
                planned_out[r] = there
            if there:
                # estimate() with nobody waiting for a hot prefix here, inlined (the same operations)
                ready = self._copies_land_s(view, r, chain, there, depths, now_s) if depths else 0.0
                have = min(there * bt, inp - 1)
                own = self.prefill_s(cost, inp - have, have)
                wait = queued(r) + admission(r, inp - have + out_tokens)
                start = max(max(0.0, wait), ready)
                out[r] = (start + own, 0.0, start)
            else:
                wait = queued(r) + admission(r, kv_tokens - have0)
                out[r] = (wait + own0, 0.0, wait)

    def _cold_prefill_s(self, view: CostView, req: Request) -> float:
        """:meth:`estimate`'s ``own`` on a replica holding nothing of ``req``'s chain, seconds."""
        inp = req.input_tokens
        have0 = min(0, inp - 1)
        return self.prefill_s(view.cost, inp - have0, have0)

    def _best(
        self, view: CostView, replicas: Sequence[int], cost: Sequence[float], quiet: Sequence[int], quiet_cost: float
    ) -> int:
        """The lowest cost; ties go to the lower load, then at random (one draw from the tied replicas in ascending
        order). ``quiet``: more replicas, all at cost ``quiet_cost`` and load 0 (disjoint from ``replicas``).

        Plain loops, no ``min(default=)`` or ``zip(strict=)``: builtins called with keywords are generic calls that
        cost more than the loop in the compiled build (README "Compiled core")."""
        best = _lowest(cost)
        if quiet and quiet_cost < best:
            best = quiet_cost
        top = best * (1 + 1e-9) + 1e-12
        tied = [replicas[i] for i in range(len(cost)) if cost[i] <= top]
        load = view.load
        if quiet and quiet_cost <= top:
            idle = [r for r in tied if load(r) == 0]  # load 0 is the lowest
            if idle:
                idle.extend(quiet)
                idle.sort()
            tied = idle or list(quiet)
        elif len(tied) > 1:
            low = load(tied[0])
            lowest = [tied[0]]
            for k in range(1, len(tied)):
                r = tied[k]
                x = load(r)
                if x < low:
                    low = x
                    lowest = [r]
                elif x == low:
                    lowest.append(r)
            tied = lowest
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    # -- routing ------------------------------------------------------------------------------------------------

    def route(self, req: Request, view: CostView, now_s: float) -> Route:
        """Rule 5 over every replica, rules 2-4 for a hot prefix.

        With a view's :class:`~btbctl.engine.policies.base.RouteIndex` the replicas are not priced one by one where
        the answer is known: an idle replica that may hold nothing of the request's chain (not among the index's
        holders) and is not a copy target ("quiet") starts at once and computes the whole prompt, so all quiet
        replicas cost the same, and that cost is the floor of every replica that reuses nothing (they can only
        start later and have more requests behind). So when one is quiet, only the holders and the copy targets
        are priced one by one, against the quiet cost; a skipped busy replica can at best tie with a quiet one and
        loses the tie on load. Without a quiet replica every replica is priced. The choice (and the random draw)
        is the same as without the index."""
        chain = req.block_hashes
        n = self.n_replicas
        depths = self.depths(len(chain))
        hot = self.detect(chain, now_s, req.arrivals) if chain else None
        index = route_index(view) if self.use_route_index else None
        groups = _LazyGroups(self, view, now_s)
        ests: dict[int, tuple[float, float, float]] = {}
        holders: Collection[int] = range(n) if index is None else (index.holders(chain[0]) if chain else ())
        own0 = self._cold_prefill_s(view, req)
        planned_of: dict[int, int] = {}  # planned blocks of the chain read while pricing
        if holders:
            self._estimates(view, req, now_s, depths, groups, holders, ests, own0, planned_out=planned_of)
        plan = None
        if hot is not None:
            det, since = hot
            plan = self._warm(req, det, since, view, now_s, ests, groups, depths, index, holders)
        self.arrivals.add(now_s)
        per_replica = self.arrivals.per_s(now_s) / n  # requests/s per replica, recent
        quiet: Sequence[int] = ()
        rest: list[int] = []  # replicas outside the index's holders, not priced yet (no quiet replica)
        by_index = sorted(ests)  # the priced replicas, ascending
        if index is not None:
            idle = index.idle
            priced = [r for r in by_index if r in idle]
            if len(index.idle_order) > len(priced):
                quiet = _Without(index.idle_order, priced) if priced else index.idle_order
            else:
                rest = [r for r in range(n) if r not in ests]
        quiet_cost = own0 + 0.0 + own0 * max(0, per_replica * own0)  # the cost below with est own0, start 0
        move = self._move_costs(view, req, holders) if hot is None and holders else None
        if move is not None:
            quiet_cost += move[1]
        replicas: Sequence[int] = by_index if len(ests) < n else range(n)
        cost = self._costs(view, replicas, ests, groups, per_replica, move)
        if rest:
            # A replica of ``rest`` reuses nothing: its estimate is at least ``own0`` (it starts at 0 or later) and
            # every other term of its cost is >= 0, so its cost is at least ``own0`` + the move cost. When that is
            # above the tie window of the best priced cost (``_best``'s), none of them can be chosen or tie: they
            # are left unpriced (the same choice and the same random draw).
            floor = own0 + (move[1] if move is not None else 0.0)
            if not floor > _lowest(cost) * (1 + 1e-9) + 1e-12:
                self._estimates(view, req, now_s, depths, groups, rest, ests, own0, reuses=False)
                by = dict(zip(replicas, cost, strict=True))
                by.update(zip(rest, self._costs(view, rest, ests, groups, per_replica, move), strict=True))
                replicas = range(n)
                cost = [by[r] for r in replicas]
                rest = []
        choice = self._best(view, replicas, cost, quiet, quiet_cost)
        if rest and ests[choice][0] > own0 * (1 + 1e-9) + 1e-12:
            # the unpriced estimates (>= own0) may be below the chosen one's: priced for the count below
            self._estimates(view, req, now_s, depths, groups, rest, ests, own0, reuses=False)
        low_est = _lowest([e[0] for e in ests.values()])
        if quiet and own0 < low_est:
            low_est = own0
        mine = ests.get(choice, (own0, 0.0, 0.0))  # not priced: a quiet replica
        if mine[0] > low_est * (1 + 1e-9) + 1e-12:
            self._stats["harm_avoiding_routes"] += 1
        copied = len(plan.prefix) if plan is not None and choice in plan.targets[: plan.want] else 0
        if depths:
            self._note_planned(view, choice, req, now_s, depths, mine[2], copied, planned_of.get(choice))
        pace = 0
        if hot is not None:
            prefix = hot[0].prefix
            # the planned blocks of the prefix read while pricing, when the prefix is the whole chain (the same query).
            # The prefix is this chain's leading blocks and its last block's hash identifies it (chained hashes, the
            # detector's key), so equal lengths suffice: comparing the tuples element by element took about 8 us for
            # 256 blocks of a request's own chain (new strings, so no identity shortcut)
            known = planned_of if len(prefix) == len(chain) else _NOT_READ
            self._stats["hot_routes"] += 1
            if (
                not copied
                and _planned(view, known, choice, prefix) < len(prefix)
                and any(view.cached_blocks(r, prefix) >= len(prefix) for r in holders if r != choice)
            ):
                self._stats["speculative_routes"] += 1
            pace = self._pace(view, prefix, holders, mine[0] - mine[2], known)
        if plan is not None:
            return Route(choice, (plan,), pace)
        out = self._routes.get((choice, pace))
        if out is None:
            if len(self._routes) >= PREFILL_MEMO:
                self._routes.clear()
            out = self._routes[(choice, pace)] = Route(choice, (), pace)
        return out

    def _pace(
        self, view: CostView, prefix: Sequence[Hashable], near: Iterable[int], own_s: float, known: dict[int, int]
    ) -> int:
        """Rule 6: the ``Route.pace`` of a request of the hot ``prefix`` whose own prefill takes ``own_s`` seconds on
        its replica; 0 unless at least two of ``near`` (the replicas that may hold any of it) hold, receive or will
        compute all of it (the view's planned blocks of the prefix; ``known``: those already read, by replica)."""
        if own_s <= 0:
            return 0
        y = len(prefix)
        spread = 0
        for r in near:
            if _planned(view, known, r, prefix) >= y:
                spread += 1
                if spread == 2:
                    self._stats["paced_routes"] += 1
                    return max(1, math.ceil(PACE_HORIZON_S / own_s))
        return 0

    @staticmethod
    def _costs(
        view: CostView,
        replicas: Iterable[int],
        ests: dict[int, tuple[float, float, float]],
        groups: _LazyGroups,
        per_replica: float,
        move: tuple[int, float] | None,
    ) -> list[float]:
        """Rule 5's cost of each of ``replicas`` (priced in ``ests``): expected TTFT + harm + its own prefill x the
        requests expected behind it (+ the move cost away from the chain's home), seconds."""
        cost = []
        load = view.prefill_load
        home, move_s = move if move is not None else (-1, 0.0)
        for r in replicas:
            est, harm, start = ests[r]
            gr = groups[r]
            blocked = sum(g[1] for g in gr) if gr else 0
            behind = max(load(r) - blocked, per_replica * est)
            cost.append(est + harm + (est - start) * behind + (move_s if move is not None and r != home else 0.0))
        return cost

    @staticmethod
    def _move_costs(view: CostView, req: Request, holders: Iterable[int]) -> tuple[int, float] | None:
        """What moving ``req`` away from the one replica that holds its chain deepest costs the fleet beyond the
        request's own time: ``(that home, seconds on every other replica)``, or None when no replica holds more of
        it than every other. The blocks only the home holds (a conversation's history beyond the prompt it shares
        with others) are re-computed by a move, which the request's own TTFT counts; the turns that follow carry
        them again and find them only where this one ran, and the GPU time is spent twice, so they count once
        more: their prefill time at the context of the blocks other replicas share. Blocks a second replica holds
        too cost only the request's own time (a prefix held by one replica alone, a conversation's or a system
        prompt not spread yet, counts as the home's own until it is)."""
        chain = req.block_hashes
        deep = shared = 0
        home = -1
        for r in holders:
            d = view.planned_blocks(r, chain)
            if d > deep:
                deep, shared, home = d, deep, r
            elif d > shared:
                shared = d
        if deep == shared:
            return None
        bt = view.block_tokens
        top = min(deep * bt, req.input_tokens - 1)
        have = min(shared * bt, top)
        return (home, view.cost.prefill_time_s(top - have, have)) if top > have else None

    def on_copy_result(self, plan: CopyPlan, target: int, started: bool, now_s: float) -> None:
        self.refusals.note(target, started, now_s)
        self._stats["copies_requested" if started else "copies_refused"] += 1

    def _note_planned(
        self,
        view: CostView,
        replica: int,
        req: Request,
        now_s: float,
        depths: Sequence[int],
        start_s: float,
        copied_blocks: int = 0,
        planned: int | None = None,
    ) -> None:
        """``req`` goes to ``replica``: remember when each depth's prefix it will compute there should be done
        (its start + its prefill up to that depth; queues are FCFS, so later arrivals do not delay it).
        ``copied_blocks``: leading blocks a copy planned with this route brings there (not computed by it);
        ``planned``: ``view.planned_blocks(replica, chain)`` when already read."""
        chain = req.block_hashes
        if planned is None:
            planned = view.planned_blocks(replica, chain)
        there = max(planned, copied_blocks)
        if there >= depths[-1]:
            return
        bt = view.block_tokens
        have = there * bt
        for d in depths:
            if d > there:
                at = now_s + start_s + self.prefill_s(view.cost, d * bt - have, have)
                self._remember(self._ready_at, (replica, chain[d - 1]), at)

    # -- rules 2-4: warming ---------------------------------------------------------------------------------------

    def _warm(
        self,
        req: Request,
        det: Detection,
        since: float,
        view: CostView,
        now_s: float,
        ests: dict[int, tuple[float, float, float]],
        groups: _LazyGroups,
        depths: Sequence[int],
        index: RouteIndex | None = None,
        near: Collection[int] | None = None,
    ) -> CopyPlan | None:
        """The plan topping up copies of ``det.prefix`` (rules 2-4), or None. Targets it picks are priced as if
        their copies start (``ests`` updated with the copy's landing time); the targets it did not pick follow as
        fallbacks the executor tries when it refuses a picked one. ``index``: the view's route index (replicas
        outside its holders of the prefix's root hold, receive and plan none of it; its idle ones queue nothing),
        None to look at every replica; ``near``: its holders of the prefix's root when already read."""
        prefix = det.prefix
        y = len(prefix)
        key = prefix[-1]
        hold_s = self.constants.window_s
        holders: list[int] = []
        computing: list[int] = []
        covered: list[int] = []
        free: list[int] = []
        cap = max(1, min(self.constants.warm_replicas, self.n_replicas))
        if index is None:
            near = range(self.n_replicas)
        elif near is None:
            near = index.holders(prefix[0])
        idle: Collection[int] = () if index is None else index.idle
        accepts = view.accepts_copies
        refused = self.refusals.refused if self.refusals else None
        has_copy = view.has_copy
        # The replicas that may hold, receive or plan the prefix first (ascending): when they cover it, the rest of
        # the fleet is not looked at; the others can only be free targets.
        least = y  # the fewest blocks a free target lacks (one outside ``near`` holds none of the prefix)
        for r in near if index is None else sorted(near):
            have = view.cached_blocks(r, prefix)
            if have >= y:
                holders.append(r)
                covered.append(r)
            elif has_copy(r, prefix):
                covered.append(r)
            elif view.planned_blocks(r, prefix) >= y:
                computing.append(r)  # computing it, or a request queued there will
                covered.append(r)
            elif accepts(r) and not (refused and refused(r, now_s, hold_s)):
                free.append(r)
                least = min(least, y - have)
                continue
            else:
                continue
            if len(covered) >= cap:
                return None  # covered already (the steady state of a burst): the rest of the fleet is not looked at
        cost = view.cost
        bt = view.block_tokens
        inp = req.input_tokens
        ptoks = min(y * bt, inp - 1)
        suffix_s = self.prefill_s(cost, inp - ptoks, ptoks)
        want = self.rate_target(det.arrivals_in_window, suffix_s)
        found = self._source(view, holders, computing, key, now_s)
        kv = cost.model.kv_bytes_per_token
        nic_bps = cost.nic_bytes_per_s
        if (
            found is not None
            and len(covered) >= want
            and self.prune_backlog_pricing
            and all(r in ests for r in covered)
        ):
            # Only a copy beyond the rate target is possible (the loop's backlog case below, nothing picked yet), for
            # an earlier first token than every covered replica's. No copy lands before its bytes at the source's
            # NIC share (at most ``nic_bps / (1 + its copies)``) nor before the source has the prefix, and
            # ``after`` is >= 0: when even that bound (a hair lower, against rounding) plus ``suffix_s`` does not
            # beat the covered replicas, no target can, and the loop's pruning would give the same None. Checked
            # before the rest of the fleet is looked at and the targets' break-even and headroom checks, which cost
            # more than the rest of a decision in a burst's steady state.
            bound = max(least * bt * kv * (1 + view.nic_copies(found[0])) / nic_bps * (1 - 1e-9), found[1])
            if not bound + suffix_s < _lowest([ests[r][0] for r in covered]):
                return None
        if index is not None:
            near = near if isinstance(near, (set, frozenset, range)) else set(near)  # membership, per replica below
            free.extend(
                r
                for r in range(self.n_replicas)
                if r not in near and accepts(r) and not (refused and refused(r, now_s, hold_s))
            )
            free.sort()
        if not free:
            return None
        if found is None:
            self._stats["no_source"] += 1
            return None
        source, src_left = found
        src_nic = view.nic_copies(source)
        picked: list[int] = []
        options: list[tuple[float, int, int, tuple[float, float, float]]] = []
        prefills: dict[int, float] = {}  # blocks a target holds -> seconds to compute the rest of the prefix there
        cached, nic_copies, headroom = view.cached_blocks, view.nic_copies, view.kv_headroom_tokens
        queued, copy_after = view.queued_prefill_s, view.copy_after_s
        while free and len(covered) < cap:
            options = []
            by_rate = len(covered) < want
            ready: list[tuple[float, int]] = []  # (when the copy would land, target) of the targets it pays for
            for t in free:
                t_have = cached(t, prefix) if t in near else 0
                send = y - t_have
                share = nic_bps / (1 + max(src_nic, nic_copies(t)))
                transfer = send * bt * kv / share
                prefill_s = prefills.get(t_have)
                if prefill_s is None:
                    prefill_s = prefills[t_have] = self.prefill_s(cost, send * bt, t_have * bt)
                recompute = (0.0 if t in idle else queued(t)) + prefill_s
                # A copy whose blocks land in the target's cache as they arrive (after 0) trails the source and
                # lands when it finishes, no later than a recompute started now; one with steps after its bytes
                # (l3: write-through, proof) must also land before that recompute would be done.
                after = copy_after(t, send)
                lands = max(transfer, src_left) + after
                if not (transfer < recompute and (after <= 0 or lands < recompute)):
                    self._stats["copy_not_paying"] += 1
                    continue
                if headroom(t) < send * bt:
                    self._stats["copy_no_room"] += 1
                    continue
                ready.append((lands, t))
            if not ready:
                break
            if not by_rate and not picked and self.prune_backlog_pricing:
                # A copy beyond the rate target is made only for an earlier first token than every covered
                # replica's. A target's estimate starts no sooner than its copy lands and then computes the
                # suffix (``suffix_s``: the request's chain extends the prefix, so ``y`` blocks are there), so
                # when no landing time plus ``suffix_s`` beats the covered replicas, no target can: skip pricing
                # them (with nothing picked, the options are not needed as fallbacks either).
                best_covered = _lowest([ests[r][0] for r in covered])
                if not _lowest([lands for lands, _ in ready]) + suffix_s < best_covered:
                    break
            for lands, t in ready:
                est = self.estimate(view, t, req, now_s, depths, groups[t], lands, y)
                options.append((est[0], view.load(t), t, est))
            options.sort()
            ttft, _, target, est = options.pop(0)
            if not by_rate and not ttft < _lowest([ests[r][0] for r in covered]):
                options.insert(0, (ttft, 0, target, est))
                break
            free.remove(target)
            picked.append(target)
            self._stats["rate_copies" if by_rate else "backlog_copies"] += 1
            covered.append(target)
            src_nic += 1
            ests[target] = est
            if not by_rate:
                break  # one copy beyond the rate target per arrival; the next arrival re-evaluates
        if not picked:
            return None
        fallbacks = tuple(o[2] for o in options if o[2] not in picked)
        return CopyPlan(prefix, source, tuple(picked) + fallbacks, len(picked), since)

    def _source(
        self, view: CostView, holders: Sequence[int], computing: Sequence[int], key: Hashable, now_s: float
    ) -> tuple[int, float] | None:
        """Rule 3's source of a copy of the prefix whose last block is ``key``: ``(replica, seconds until it holds
        the prefix)``: of ``holders`` that can send, the least busy NIC, then the least queued prefill (0 s);
        else of ``computing`` that can send, the one done soonest (:meth:`source_ready_s`); None without one."""
        accepts = view.accepts_copies
        # (copies on its NIC, queued prefill s, replica) of the best holder: a loop, as min(key=) is a generic call
        # in the compiled build
        best: tuple[int, float, int] | None = None
        for r in holders:
            if accepts(r):
                k = (view.nic_copies(r), view.queued_prefill_s(r), r)
                if best is None or k < best:
                    best = k
        if best is not None:
            return best[2], 0.0
        feeders = [r for r in computing if accepts(r)]
        if feeders:
            src_left, source = min((self.source_ready_s(view, r, key, now_s), r) for r in feeders)
            return source, src_left
        return None

    def stats(self) -> dict[str, int]:
        """Integer counters: ``fires`` (activations over all depths), ``copies_requested`` (copies the executor
        started), ``copies_refused`` (attempts it refused), ``rate_copies`` / ``backlog_copies`` (copies planned for the
        arrival-rate target / for an earlier first token), ``copy_not_paying`` / ``copy_no_room`` (targets skipped by
        the break-even or headroom check; targets are not checked when no copy beyond the rate target could beat the
        covered replicas), ``no_source``, ``hot_routes`` (requests with an active prefix),
        ``speculative_routes`` (of those, sent to recompute the prefix while another replica held it),
        ``harm_avoiding_routes`` (requests sent elsewhere than their lowest expected TTFT to spare requests waiting for
        a copy), ``paced_routes`` (hot requests given a pace, rule 6: a gateway holds
        them for their turn, the simulator does not), ``deepest_above_min`` (hot matches deeper
        than Y), ``tracked_prefixes`` (all depths)."""
        out = dict(self._stats)
        out["tracked_prefixes"] = sum(len(d) for d in self._levels.values())
        return out
