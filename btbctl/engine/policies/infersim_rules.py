"""Routing rules of the reference simulator, used for ``cache_aware`` and ``btb`` in the ``infersim`` fidelity.

The reference simulator (Infer-Sim, github.com/jwlaboratory/inference-sim, ``router.py``) and the BTB harness
(github.com/jwlaboratory/bite-the-bullet, ``2-bite-the-bullet``, policy ``early_rdma``) route differently from the
SGLang router this package models elsewhere (:mod:`btbctl.engine.policies.cache_aware`): they match the replicas'
**actual** caches rather than a router-side tree, use other thresholds, and break every tie at random. To check the
published table (REFERENCE.md s1, s2), ``make_policy(name, ..., fidelity="infersim")`` returns these variants under
the same names; ``least_load`` (:class:`InferSimLeastLoad`) is the registry's rule with the reference's random
draws (see below); the other registry policies run unchanged.

``cache_aware`` (:class:`InferSimCacheAware`), per request:

1. ``load(r)`` = running + queued requests on replica ``r``.
2. If ``max load > balance_abs_threshold`` **and** ``max load > balance_rel_threshold x min load``: the
   least-loaded replica (ties random). Defaults 64 and 1.5 (Infer-Sim ``IMBALANCE_ABS`` / ``IMBALANCE_REL``,
   set to the SGLang router's ``--balance-abs/rel-threshold`` defaults). Note the absolute test is on the maximum
   load, not on ``max - min`` as in the router.
3. Otherwise the replica with the longest leading run of the prompt's blocks in its cache (HBM or host RAM:
   ``view.cached_blocks``), then the lowest load, then at random. No match-ratio threshold: with no match
   anywhere this is least-load.

``btb`` (:class:`InferSimBtb`), per request, with the four constants X = ``threshold``, Y = ``prefix_blocks``,
Z = ``window_s``, M = ``replicas`` (:class:`~btbctl.engine.constants.BtbConstants`, published 2 / 256 / 1.0 / 4):

1. The key is the prompt's first Y block hashes (prompts with fewer blocks skip to step 4). Its arrival times are
   kept; those older than ``now - Z`` are dropped (an arrival exactly Z seconds ago still counts). The prefix is
   **active** on this arrival when at least X arrivals, this one included, remain. There is no other state: a
   prefix is active or not arrival by arrival.
2. While active, top up copies: *holders* are replicas with all Y blocks in HBM (``view.hbm_blocks`` when the
   view has it, else ``view.cached_blocks``). With no holder nothing is copied. Otherwise, with ``planned`` the
   replicas a copy of the prefix is already heading to (``view.copy_in_flight``), ``need = M - holders -
   planned``; the ``need`` least-loaded replicas that are neither (ties: lowest index, a stable sort) get a copy
   from the least-loaded holder (``view.replicate``). In the infersim model a copy costs bytes / NIC bandwidth on
   the target's clock only and does not wait for the source (REFERENCE.md s1).
3. While active and some replica holds the prefix (after step 2's bookkeeping; copies count once they have
   arrived): the least-loaded holder, ties random.
4. Otherwise :class:`InferSimCacheAware` (sharing the random source).

No rollback on misprediction: copies age out by the replicas' LRU.

``least_load`` (:class:`InferSimLeastLoad`): the least-loaded replica, ties random: the registry's rule
(:mod:`btbctl.engine.policies.least_load`), but drawing as below even without a tie. The draw pattern alone moves
this policy's mean and p95 TTFT on a Bursted window by several percent, so matching it is needed to compare with
the reference's output.

Random draws: every tie-break draws ``rng.choice`` over the tied replicas in index order, even when only one is
left, exactly once per routed request, as the reference does with its (reseeded) global random source. With the same
seed, a run therefore follows the reference's random stream.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request

#: Infer-Sim ``IMBALANCE_ABS``: requests in flight on the busiest replica above which balance may override
#: affinity (its config.py, matching the SGLang router's ``--balance-abs-threshold`` default).
INFERSIM_BALANCE_ABS = 64
#: Infer-Sim ``IMBALANCE_REL``: balance overrides affinity when ``max load > REL x min load`` (its config.py,
#: matching the SGLang router's ``--balance-rel-threshold`` default).
INFERSIM_BALANCE_REL = 1.5


def _pick_least(view: FleetView, candidates: Sequence[int], rng: random.Random) -> int:
    """The least-loaded candidate; ties (and a single candidate) go through one ``rng.choice``."""
    loads = list(map(view.load, candidates))
    best = min(loads)
    return rng.choice([r for r, x in zip(candidates, loads, strict=True) if x == best])


def _routes(n_replicas: int) -> tuple[Route, ...]:
    """One copy-less :class:`Route` per replica (immutable, so shared by every request routed there)."""
    return tuple(Route(r) for r in range(n_replicas))


class InferSimCacheAware(Policy[FleetView]):
    """Infer-Sim's cache-aware rule (see the module docstring).

    Args:
        n_replicas: fleet size.
        rng: seeded random source for ties.
        constants: unused.
        balance_abs_threshold: requests (default 64, >= 0).
        balance_rel_threshold: ratio (default 1.5, >= 1).

    Raises:
        ConfigError: a threshold out of range.
    """

    name = "cache_aware"
    summary = (
        "Infer-Sim: longest match in the replicas' caches, then load, then random; least-load if max > 64 "
        "and > 1.5x min"
    )

    def __init__(
        self,
        n_replicas: int,
        rng: random.Random,
        constants: BtbConstants | None = None,
        *,
        balance_abs_threshold: int = INFERSIM_BALANCE_ABS,
        balance_rel_threshold: float = INFERSIM_BALANCE_REL,
    ) -> None:
        super().__init__(n_replicas, rng, constants)
        if balance_abs_threshold < 0:
            raise ConfigError("balance_abs_threshold", f"must be >= 0, got {balance_abs_threshold!r}")
        if not balance_rel_threshold >= 1.0:
            raise ConfigError("balance_rel_threshold", f"must be >= 1, got {balance_rel_threshold!r}")
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.routes = _routes(n_replicas)
        self._imbalanced = 0
        self._affinity = 0
        self._cold = 0

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        return self.routes[self.choose(req, view, now_s)]

    def choose(self, req: Request, view: FleetView, now_s: float) -> int:
        """The rule's replica for ``req``."""
        n = self.n_replicas
        loads = list(map(view.load, range(n)))
        hi = max(loads)
        if hi > self.balance_abs_threshold and hi > self.balance_rel_threshold * min(loads):
            self._imbalanced += 1
            lo = min(loads)
            return self.rng.choice([r for r in range(n) if loads[r] == lo])
        chain = req.block_hashes
        keys = [(-view.cached_blocks(r, chain), loads[r]) for r in range(n)]
        best = min(keys)
        if best[0] < 0:
            self._affinity += 1
        else:
            self._cold += 1
        return self.rng.choice([r for r in range(n) if keys[r] == best])

    def stats(self) -> dict[str, int]:
        """``imbalanced`` (least-load routes forced by the thresholds), ``affinity`` (routes to a replica holding
        some leading blocks), ``cold`` (no replica held any)."""
        return {"imbalanced": self._imbalanced, "affinity": self._affinity, "cold": self._cold}


class InferSimLeastLoad(Policy[FleetView]):
    """Fewest requests in flight, one random draw per request over the tied replicas (see the module docstring)."""

    name = "least_load"
    summary = "fewest requests in flight (ties random), drawing as Infer-Sim does"

    def __init__(self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None) -> None:
        super().__init__(n_replicas, rng, constants)
        self.routes = _routes(n_replicas)

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        return self.routes[_pick_least(view, range(self.n_replicas), self.rng)]


class _History:
    """One BTB prefix key: its arrival times within the window and whether it was active at the last one."""

    __slots__ = ("key", "times", "active")

    def __init__(self, key: tuple[Hashable, ...]) -> None:
        self.key = key
        self.times: deque[float] = deque()
        self.active = False


class InferSimBtb(Policy[FleetView]):
    """The published BTB rule as the reference harness runs it (see the module docstring).

    Args:
        n_replicas: fleet size.
        rng: seeded random source (ties among holders; shared with the cache-aware fallback).
        constants: the four constants (default: the published ones).

    Attributes:
        fallback: the inner :class:`InferSimCacheAware`.
    """

    name = "btb"
    summary = (
        "BTB as run in Infer-Sim: X arrivals of a Y-block prefix within Z s -> copy to M replicas, route to holders"
    )

    def __init__(self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None) -> None:
        super().__init__(n_replicas, rng, constants)
        self.fallback = InferSimCacheAware(n_replicas, rng, self.constants)
        # prefix key -> its history; the histories again, least recently seen first (keyed by identity: cheap to
        # reorder, where a 256-block key costs a hash per lookup)
        self._hist: dict[tuple[Hashable, ...], _History] = {}
        self._order: OrderedDict[_History, None] = OrderedDict()
        self._fires = 0
        self._copies = 0
        self._refused = 0
        self._holder_routes = 0
        self._fallback_routes = 0

    def _active(self, key: tuple[Hashable, ...], now_s: float) -> _History:
        """Record an arrival of ``key`` at ``now_s``; returns its history (``active`` set for this arrival)."""
        window = self.constants.window_s
        h = self._hist.get(key)
        if h is None:
            h = self._hist[key] = _History(key)
            self._order[h] = None
        else:
            self._order.move_to_end(h)
        times = h.times
        times.append(now_s)
        cut = now_s - window
        while times[0] < cut:
            times.popleft()
        # forget keys whose every arrival has left the window (their next arrival would drop them anyway)
        order = self._order
        while order:
            old = next(iter(order))
            if old is h or old.times[-1] >= cut:
                break
            order.popitem(last=False)
            del self._hist[old.key]
        active = len(times) >= self.constants.threshold
        if active and not h.active:
            self._fires += 1
        h.active = active
        return h

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        y = self.constants.prefix_blocks
        chain = req.block_hashes
        if len(chain) >= y:
            # the first arrival's key object stands for equal ones: the fleet view's per-chain work is memoized
            hist = self._active(tuple(chain[:y]), now_s)
            if hist.active:
                holders, plan = self._top_up(hist.key, view)
                copies = (plan,) if plan is not None else ()
                if holders:
                    self._holder_routes += 1
                    return Route(_pick_least(view, holders, self.rng), copies)
                self._fallback_routes += 1
                return Route(self.fallback.choose(req, view, now_s), copies)
        return self.fallback.routes[self.fallback.choose(req, view, now_s)]

    def on_copy_result(self, plan: CopyPlan, target: int, started: bool, now_s: float) -> None:
        if started:
            self._copies += 1
        else:
            self._refused += 1

    def _top_up(self, prefix: tuple[Hashable, ...], view: FleetView) -> tuple[list[int], CopyPlan | None]:
        """The replicas holding the prefix now, and the plan of copies towards M holders (every planned target is
        tried: Infer-Sim schedules them all)."""
        y = len(prefix)
        resident = getattr(view, "hbm_blocks", view.cached_blocks)
        n = self.n_replicas
        holders = [r for r in range(n) if resident(r, prefix) >= y]
        if not holders:
            return holders, None
        planned = [r for r in range(n) if view.copy_in_flight(r, prefix)]
        need = self.constants.warm_replicas - len(holders) - len(planned)
        if need <= 0:
            return holders, None
        taken = set(holders) | set(planned)
        targets = sorted((r for r in range(n) if r not in taken), key=view.load)
        if not targets:
            return holders, None
        loads = [view.load(r) for r in holders]
        source = holders[loads.index(min(loads))]
        tried = tuple(targets[:need])
        return holders, CopyPlan(prefix, source, tried, len(tried))

    def stats(self) -> dict[str, int]:
        """``fires`` (a prefix turning active), ``copies_requested`` (accepted copies), ``copies_refused``,
        ``holder_routes``, ``fallback_routes`` (active prefix, no holder yet), and the fallback's counters prefixed
        ``cache_aware_``."""
        out = {
            "fires": self._fires,
            "copies_requested": self._copies,
            "copies_refused": self._refused,
            "holder_routes": self._holder_routes,
            "fallback_routes": self._fallback_routes,
        }
        for k, v in self.fallback.stats().items():
            out[f"cache_aware_{k}"] = v
        return out


#: Policies that replace the registry's under the same name in the ``infersim`` fidelity.
INFERSIM_POLICIES: dict[str, type[Policy[FleetView]]] = {
    cls.name: cls for cls in (InferSimCacheAware, InferSimLeastLoad, InferSimBtb)
}

__all__ = [
    "INFERSIM_BALANCE_ABS",
    "INFERSIM_BALANCE_REL",
    "INFERSIM_POLICIES",
    "InferSimBtb",
    "InferSimCacheAware",
    "InferSimLeastLoad",
]
