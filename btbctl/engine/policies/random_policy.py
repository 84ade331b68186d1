"""``random``: a uniformly random replica, ignoring load and cache.

Rule: ``rng.randrange(n_replicas)`` with the policy's own seeded random source. No thresholds.
Source: the SGLang router's ``random`` policy (smg-project/smg; REFERENCE.md s4).
"""

from __future__ import annotations

from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request


class RandomPolicy(Policy[FleetView]):
    """A uniformly random replica (see the module docstring)."""

    name = "random"
    summary = "uniformly random replica; ignores load and cache"

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        return Route(self.rng.randrange(self.n_replicas))
