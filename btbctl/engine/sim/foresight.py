"""The ``realistic`` simulator for reference policies that read the whole trace in advance (``clairvoyant``).

:class:`ForesightSimulator` is :class:`~btbctl.engine.sim.simulator.Simulator` plus wake-up events: before the
first request it hands the policy the trace (``policy.foresee``) and puts each of ``policy.wakeups(view)`` on the
event heap; at each it asks the policy (``policy.wake``) for a copy plan and carries it out like a route's copies
(same network, same refusals, reported back through ``on_copy_result``). Nothing else changes: the replica model,
the network and the view are the realistic simulator's, so the reference policy gets no cheaper copies or compute.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies import REFERENCE_POLICIES, make_policy
from btbctl.engine.sim.results import SimResult, check_fits
from btbctl.engine.sim.simulator import Simulator
from btbctl.engine.trace.model import Trace

#: Event kind of a wake-up: after copies (0) and steps (1) at equal times.
_EV_WAKE = 2


class ForesightSimulator(Simulator):
    """A :class:`~btbctl.engine.sim.simulator.Simulator` whose policy sees the trace first and is woken at the
    times it asks for (see the module docstring). Same arguments as ``Simulator``; the policy must have
    ``foresee``, ``wakeups`` and ``wake`` (:class:`~btbctl.engine.policies.clairvoyant.Clairvoyant`)."""

    def __init__(self, trace: Trace, policy, cluster: ClusterConfig, constants: BtbConstants, **kw) -> None:
        super().__init__(trace, policy, cluster, constants, **kw)
        self.wakes = 0
        policy.foresee(trace.requests, trace.block_tokens)
        for t, payload in policy.wakeups(self.view):
            self._push(t, _EV_WAKE, payload)

    def _pop_event(self) -> None:
        if self.heap[0][1] != _EV_WAKE:
            super()._pop_event()
            return
        t, _, _, payload = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        self.wakes += 1
        plan = self.policy.wake(payload, self.view, self.now)
        if plan is not None:
            self.execute(plan)


def simulate_foresight(
    trace: Trace,
    policy: str,
    cluster: ClusterConfig,
    constants: BtbConstants,
    *,
    seed: int = 42,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``trace`` under the reference policy ``policy`` (a key of
    :data:`~btbctl.engine.policies.REFERENCE_POLICIES`) with the realistic model. Same arguments and errors as
    :func:`~btbctl.engine.sim.simulator.simulate_realistic`."""
    if policy not in REFERENCE_POLICIES:
        raise ConfigError("policy", f"{policy!r} is not a reference policy; valid: {', '.join(REFERENCE_POLICIES)}")
    cost = cluster.replica_cost()
    check_fits(trace, cost.kv_budget_tokens)
    pol = make_policy(policy, cluster.replicas, random.Random(seed), constants, block_tokens=trace.block_tokens)
    return ForesightSimulator(trace, pol, cluster, constants, progress=progress).run()


__all__ = ["ForesightSimulator", "simulate_foresight"]
