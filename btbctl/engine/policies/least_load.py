"""``least_load``: the replica with the fewest requests in flight, ignoring cache.

Rule: the replica with the lowest ``view.load(r)`` (requests the router has in flight to it: running + waiting);
ties go to a uniformly random one of the tied replicas (the policy's seeded rng), as in the reference simulator
(REFERENCE.md s2: "Ties broken at random"). No thresholds.
Source: least-load routing as evaluated by Birmiwal & Bhat (REFERENCE.md s1) and the SGLang router's shortest-queue
fallback (REFERENCE.md s4).
"""

from __future__ import annotations

from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request


class LeastLoad(Policy[FleetView]):
    """Fewest requests in flight, random ties (see the module docstring)."""

    name = "least_load"
    summary = "fewest requests in flight (ties random); ignores cache"

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        # least_loaded's rule with one load read per replica
        loads = [view.load(r) for r in range(self.n_replicas)]
        best = min(loads)
        tied = [r for r, n in enumerate(loads) if n == best]
        return Route(tied[0] if len(tied) == 1 else self.rng.choice(tied))
