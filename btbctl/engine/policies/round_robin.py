"""``round_robin``: replicas in turn, ignoring load and cache.

Rule: the k-th request (0-based) goes to replica ``k mod n_replicas``. No thresholds.
Source: the SGLang router's ``round_robin`` policy (smg-project/smg; REFERENCE.md s4).
"""

from __future__ import annotations

import random

from btbctl.engine.constants import BtbConstants
from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request


class RoundRobin(Policy[FleetView]):
    """Replicas in turn (see the module docstring)."""

    name = "round_robin"
    summary = "replicas in turn; ignores load and cache"

    def __init__(self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None) -> None:
        super().__init__(n_replicas, rng, constants)
        self._next = 0

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        r = self._next
        self._next = (r + 1) % self.n_replicas
        return Route(r)
