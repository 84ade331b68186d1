"""``clairvoyant``: a reference policy that knows every burst in advance, for a floor online rules can approach.

It is ``btb_plus`` (:mod:`btbctl.engine.policies.btb_plus`: the same expected-TTFT routing, the same copy sources,
break-even and headroom checks) with its online detector replaced by foreknowledge of the trace. It runs only in
the simulator (``realistic`` fidelity): before the first request the simulator hands it the whole trace
(:meth:`Clairvoyant.foresee`), which no live router can have, so the gateway and ``btbctl up`` refuse it.

**Bursts, as the detector's ground truth.** Requests of at least Y blocks (``Y = prefix_blocks``) are grouped by
their Y-block prefix; a group's arrivals split into episodes wherever two consecutive arrivals are more than
``Z = window_s`` apart (the detector's "active" ends there). An episode is a burst when some Z-second window of it
holds at least ``X = threshold`` arrivals (the detector would fire on it). Its prefix is the longest chain all its
requests share (at least Y blocks); its start, end and size are its first and last arrival and its request count.
No request label (``kind``) is read.

What the foreknowledge buys, within the same copy and compute model (copies take network time on the source's and
the target's NICs and move only blocks the source has computed; every token is prefilled by some replica):

1. **Detection at the first arrival.** Every request of a burst is hot from the burst's first arrival on (the
   online detector waits for X arrivals), and the replica count comes from the burst's true rate
   (size / max(duration, Z)) instead of the arrivals seen in the trailing window; ``btb_plus``'s break-even and
   backlog rules then apply unchanged, capped at ``min(M, n_replicas)``.
2. **Copies just in time.** When a replica already holds the burst's prefix before the burst starts (an earlier
   request computed it), copies to the replicas the rate target wants start at ``start - lead``, where ``lead`` is
   the time the source's NIC needs to send one copy to each of them back to back
   (``cost.transfer_time_s(prefix bytes)`` per target), so they land as the burst begins. The simulator wakes the
   policy at that time (:meth:`Clairvoyant.wakeups`, :meth:`Clairvoyant.wake`). A prefix nobody holds yet cannot be
   copied before someone computes it; its copies trail the replica computing it, as ``btb_plus``'s do.
3. **Keeping a replica free for the burst.** Routing adds, for each replica, the delay that sending the request
   there would impose on the next burst that starts before the request's prefill ends there: the burst's first
   request needs one replica free to compute the prefix (``w x`` the extra seconds until the earliest replica is
   free after ``start``), and its suffixes need the fleet once the prefix has been computed (``w x`` the seconds of
   that replica's time taken from the window ``[start + prefix prefill, + w x suffix prefill / n_replicas]``,
   ``/ (2 x n_replicas)``: a replica lost for ``d`` seconds delays the waiting requests by about
   ``d / n_replicas``, half of them on average). ``w`` = the burst's requests that arrive before its prefix can be
   computed (``size x min(1, (prefix ready - start) / duration)``: a burst spread over a minute has most of its
   requests arrive after the prefix is there). A cold request may then wait on a busy replica rather than take the
   one the burst will need.

It is not a proven lower bound (routing is still a heuristic and the simulator's outcome depends on every choice),
but it removes what an online rule cannot know; the evidence report shows every policy's gap to it.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan
from btbctl.engine.detector import Detection
from btbctl.engine.policies.base import CostView, Route
from btbctl.engine.policies.btb_plus import BtbPlus
from btbctl.engine.trace.model import Request

#: What the gateway, ``btbctl up`` and the control API say when asked to route live with a reference policy.
NOT_LIVE = (
    "is a simulator-only reference policy (it reads the whole trace before the first request) and cannot route live;"
    " use it with dry-run, sweep or report"
)


@dataclass(frozen=True, slots=True)
class Burst:
    """One burst as the trace's ground truth has it.

    Attributes:
        key: the last block of ``prefix`` (identifies it, as a detector key does).
        prefix: the longest chain every request of the burst shares (at least Y blocks).
        start_s, end_s: first and last arrival, seconds.
        size: requests in the burst.
        first_id: ``request_id`` of its first request.
        suffix_tokens: mean prompt tokens of its requests beyond ``prefix``.
    """

    key: Hashable
    prefix: tuple[Hashable, ...]
    start_s: float
    end_s: float
    size: int
    first_id: str
    suffix_tokens: float


def find_bursts(requests: Sequence[Request], constants: BtbConstants) -> list[Burst]:
    """The bursts of ``requests`` (sorted by arrival), in start order (see the module docstring)."""
    y, x, z = constants.prefix_blocks, constants.threshold, constants.window_s
    groups: dict[Hashable, list[Request]] = {}
    for r in requests:
        if len(r.block_hashes) >= y:
            groups.setdefault(r.block_hashes[y - 1], []).append(r)
    out: list[Burst] = []
    for reqs in groups.values():
        episodes: list[list[Request]] = []
        for r in reqs:
            if episodes and r.arrival_s - episodes[-1][-1].arrival_s <= z:
                episodes[-1].append(r)
            else:
                episodes.append([r])
        for episode in episodes:
            if len(episode) >= x and _max_in_window([q.arrival_s for q in episode], z) >= x:
                out.append(_burst(episode, y))
    out.sort(key=lambda b: (b.start_s, b.first_id))
    return out


def _max_in_window(times: Sequence[float], window_s: float) -> int:
    """Most arrivals inside one window of ``window_s`` seconds (``(t - window_s, t]``) of sorted ``times``."""
    best = lo = 0
    for hi, t in enumerate(times):
        while times[lo] <= t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def _burst(episode: list[Request], y: int) -> Burst:
    chains = [r.block_hashes for r in episode]
    depth = min(len(c) for c in chains)
    first = chains[0]
    n = y
    while n < depth and all(c[n] == first[n] for c in chains):
        n += 1
    prefix = tuple(first[:n])
    return Burst(
        key=prefix[-1],
        prefix=prefix,
        start_s=episode[0].arrival_s,
        end_s=episode[-1].arrival_s,
        size=len(episode),
        first_id=episode[0].request_id,
        suffix_tokens=0.0,
    )


class Clairvoyant(BtbPlus):
    """``btb_plus`` with foreknowledge of the trace's bursts (see the module docstring). Call :meth:`foresee` with
    the trace before the first request; the simulator does, and calls :meth:`wake` at each of :meth:`wakeups`.

    Args:
        n_replicas, rng, constants, max_tracked: as :class:`~btbctl.engine.policies.btb_plus.BtbPlus`.
    """

    name = "clairvoyant"
    use_route_index = False  # rule 3 adds a per-replica reservation cost to every replica
    summary = "reference (simulator only): btb_plus that knows every burst's start, size and prefix in advance"
    #: The policy needs the whole trace before the first request: simulator only.
    needs_foresight = True

    def __init__(
        self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None, *, max_tracked: int = 65536
    ) -> None:
        super().__init__(n_replicas, rng, constants, max_tracked=max_tracked)
        self.bursts: list[Burst] = []
        self._starts: list[float] = []
        self._of: dict[str, Burst] = {}  # request id -> its burst
        self._burst: Burst | None = None  # burst of the request being routed
        self._req: Request | None = None
        self._now = 0.0
        self._foreseen = False
        self._burst_since: dict[int, float] = {}  # id(burst) -> its first arrival (time-to-warm reports)
        #: whether routing keeps a replica free for upcoming bursts (rule 3); off gives rules 1-2 alone
        self.reserve = True
        self._stats.update({"bursts_foreseen": 0, "prewarm_copies": 0, "reserving_routes": 0})

    # -- foresight ------------------------------------------------------------------------------------------------

    def foresee(self, requests: Sequence[Request], block_tokens: int) -> None:
        """Read the whole trace: find its bursts (:func:`find_bursts`) and remember which request belongs to which."""
        self.bursts = find_bursts(requests, self.constants)
        self._starts = [b.start_s for b in self.bursts]
        by_key: dict[Hashable, list[Burst]] = {}
        for b in self.bursts:
            by_key.setdefault(b.prefix[self.constants.prefix_blocks - 1], []).append(b)
        y = self.constants.prefix_blocks
        members: dict[int, list[Request]] = {}
        for r in requests:
            if len(r.block_hashes) < y:
                continue
            for b in by_key.get(r.block_hashes[y - 1], ()):
                if b.start_s <= r.arrival_s <= b.end_s:
                    self._of[r.request_id] = b
                    members.setdefault(id(b), []).append(r)
                    break
        for i, b in enumerate(self.bursts):
            reqs = members.get(id(b), [])
            suffix = sum(r.input_tokens for r in reqs) / max(1, len(reqs)) - len(b.prefix) * block_tokens
            self.bursts[i] = b = Burst(b.key, b.prefix, b.start_s, b.end_s, b.size, b.first_id, max(1.0, suffix))
            for r in reqs:
                self._of[r.request_id] = b
        self._stats["bursts_foreseen"] = len(self.bursts)
        self._foreseen = True

    def wakeups(self, view: CostView) -> list[tuple[float, Burst]]:
        """When to wake up to warm each burst's replicas just in time: ``(start - lead, burst)`` for every burst
        (``lead``: one prefix copy per extra replica the cap allows, back to back on the source's NIC)."""
        cost = view.cost
        extra = max(0, min(self.constants.warm_replicas, self.n_replicas) - 1)
        out = []
        for b in self.bursts:
            lead = extra * cost.transfer_time_s(cost.kv_bytes(len(b.prefix) * view.block_tokens))
            out.append((max(0.0, b.start_s - lead), b))
        return out

    def wake(self, burst: Burst, view: CostView, now_s: float) -> CopyPlan | None:
        """At ``start - lead``: when a replica already holds ``burst``'s whole prefix, the plan copying it to the
        replicas the burst's rate wants (least queued prefill first, those with room for it); None otherwise."""
        prefix = burst.prefix
        y = len(prefix)
        self._remember(self._prefixes, burst.key, prefix)
        holders = [r for r in range(self.n_replicas) if view.cached_blocks(r, prefix) >= y]
        if not holders:
            return None
        bt = view.block_tokens
        ptoks = y * bt
        suffix_s = view.cost.prefill_time_s(int(burst.suffix_tokens), ptoks)
        want = self._rate_for(burst, suffix_s)
        covered = [
            r
            for r in range(self.n_replicas)
            if r in holders or view.copy_status(r, prefix) is not None or view.planned_blocks(r, prefix) >= y
        ]
        free = [
            r
            for r in range(self.n_replicas)
            if r not in covered and view.kv_headroom_tokens(r) >= (y - view.cached_blocks(r, prefix)) * bt
        ]
        need = min(want - len(covered), len(free))
        if need <= 0:
            return None
        source = min(holders, key=lambda r: (view.nic_copies(r), view.queued_prefill_s(r), r))
        order = tuple(sorted(free, key=lambda r: (view.queued_prefill_s(r), view.load(r), r)))
        self._stats["prewarm_copies"] += need
        return CopyPlan(prefix, source, order, need, now_s)

    # -- btb_plus's hooks, with foreknowledge ---------------------------------------------------------------------

    def route(self, req: Request, view: CostView, now_s: float) -> Route:
        if not self._foreseen:
            raise RuntimeError("clairvoyant needs the trace in advance (foresee) before the first request")
        self._burst = self._of.get(req.request_id)
        self._req, self._now = req, now_s
        try:
            return super().route(req, view, now_s)
        finally:
            self._burst = self._req = None

    def detect(self, chain: Sequence[Hashable], now_s: float, arrivals: int = 1) -> tuple[Detection, float] | None:
        """The burst of the request being routed, hot from its first arrival (no online detector)."""
        b = self._burst
        if b is None:
            return None
        since = self._burst_since.get(id(b))
        fired = since is None
        if since is None:
            self._stats["fires"] += 1
            since = self._burst_since[id(b)] = now_s
            self._remember(self._prefixes, b.key, b.prefix)
        return Detection(b.key, b.prefix, b.size, fired, now_s), since

    def rate_target(self, arrivals_in_window: int, suffix_s: float) -> int:
        """From the burst's true rate (size / max(duration, Z)) when a burst is being routed, else ``btb_plus``'s."""
        if self._burst is None:
            return super().rate_target(arrivals_in_window, suffix_s)
        return self._rate_for(self._burst, suffix_s)

    def _rate_for(self, burst: Burst, suffix_s: float) -> int:
        cap = max(1, min(self.constants.warm_replicas, self.n_replicas))
        lam = burst.size / max(burst.end_s - burst.start_s, self.constants.window_s)
        want = math.ceil(lam * suffix_s - 1e-12) if suffix_s > 0 else 1
        return max(1, min(cap, want))

    def _best(
        self, view: CostView, replicas: Sequence[int], cost: Sequence[float], quiet: Sequence[int], quiet_cost: float
    ) -> int:
        # every replica is priced here (use_route_index False): replicas is range(n) and quiet is empty
        req = self._req
        if req is not None and self.bursts and self.reserve:
            extra = self.reservation_cost(view, req, self._now)
            if any(extra):
                self._stats["reserving_routes"] += 1
                cost = [c + e for c, e in zip(cost, extra, strict=True)]
        return super()._best(view, replicas, cost, quiet, quiet_cost)

    # -- rule 3: keep a replica free for the next burst -----------------------------------------------------------

    def reservation_cost(self, view: CostView, req: Request, now_s: float) -> list[float]:
        """Per replica, the delay (request-seconds) sending ``req`` there imposes on bursts that start later but
        before its prefill would end there (see the module docstring, rule 3)."""
        n = self.n_replicas
        busy = [now_s + view.queued_prefill_s(r) for r in range(n)]
        ends = [now_s + self.estimate(view, r, req, now_s)[0] for r in range(n)]
        horizon = max(ends)
        mine = self._burst
        out = [0.0] * n
        i = bisect.bisect_right(self._starts, now_s)
        bt = view.block_tokens
        cost = view.cost
        while i < len(self.bursts) and self.bursts[i].start_s < horizon:
            b = self.bursts[i]
            i += 1
            if b is mine:
                continue
            start = b.start_s
            base = max(0.0, min(busy) - start)
            ptoks = len(b.prefix) * bt
            landed = start + base + cost.prefill_time_s(ptoks)
            # requests of the burst that arrive before its prefix is computed: they wait for it
            waiting = b.size * min(1.0, (landed - start) / max(b.end_s - b.start_s, 1e-9))
            window = waiting * cost.prefill_time_s(int(b.suffix_tokens), ptoks) / n
            for r in range(n):
                after = [ends[q] if q == r else busy[q] for q in range(n)]
                delay = max(0.0, min(after) - start) - base
                lost = max(0.0, min(ends[r], landed + window) - max(busy[r], landed))
                out[r] += waiting * (delay + lost / (2 * n))
        return out

    def stats(self) -> dict[str, int]:
        """``btb_plus``'s counters plus ``bursts_foreseen``, ``prewarm_copies`` (copies planned before a burst's
        first arrival) and ``reserving_routes`` (routes whose costs included keeping a replica free for a burst)."""
        return super().stats()


__all__ = ["NOT_LIVE", "Burst", "Clairvoyant", "find_bursts"]
