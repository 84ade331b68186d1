"""``power_of_two``: sample two distinct random replicas, send to the less loaded one.

Rule: draw two distinct replicas uniformly at random (the policy's seeded rng); the one with the lower
``view.load(r)`` wins; on equal load the first drawn wins (it is random already). With one replica, it is chosen.
No thresholds. Source: the SGLang router's ``power_of_two`` policy as REFERENCE.md s4 states it (smg-project/smg),
after Mitzenmacher's "power of two choices". smg 1.13 compares its expected-wait estimate by default (a
``--power-of-two-load-metric`` option selects request counts); here the load is the in-flight count, as for every
load-based policy of this package.
"""

from __future__ import annotations

from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request


class PowerOfTwo(Policy[FleetView]):
    """Two random replicas, lower load wins (see the module docstring)."""

    name = "power_of_two"
    summary = "two random replicas, the less loaded wins"

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        n = self.n_replicas
        if n == 1:
            return Route(0)
        a, b = self.rng.sample(range(n), 2)
        return Route(b if view.load(b) < view.load(a) else a)
