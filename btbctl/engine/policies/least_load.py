"""``least_load``: the replica with the fewest requests in flight, ignoring cache.

Rule: the replica with the lowest ``view.load(r)`` (requests the router has in flight to it: running + waiting);
ties go to a uniformly random one of the tied replicas (the policy's seeded rng), as in the reference simulator
(REFERENCE.md s2: "Ties broken at random"). No thresholds.
Source: least-load routing as evaluated by Birmiwal & Bhat (REFERENCE.md s1) and the SGLang router's shortest-queue
fallback (REFERENCE.md s4).
"""

from __future__ import annotations

from btbctl.engine.policies.base import FleetView, Policy, Route, least_loaded
from btbctl.engine.trace.model import Request


class LeastLoad(Policy[FleetView]):
    """Fewest requests in flight, random ties (see the module docstring)."""

    name = "least_load"
    summary = "fewest requests in flight (ties random); ignores cache"

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        return Route(least_loaded(view, range(self.n_replicas), self.rng))
