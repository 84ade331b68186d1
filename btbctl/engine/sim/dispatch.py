"""One entry point over the fidelity profiles: :func:`simulate` runs the ``realistic`` model
(:mod:`btbctl.engine.sim.simulator`) or the ``infersim`` one (:mod:`btbctl.engine.sim.infersim`); neither of those
imports the other."""

from __future__ import annotations

from collections.abc import Callable

from btbctl.engine.config import FIDELITIES, ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies import REFERENCE_POLICIES
from btbctl.engine.sim.foresight import simulate_foresight
from btbctl.engine.sim.infersim import FIDELITY as INFERSIM
from btbctl.engine.sim.infersim import simulate_infersim
from btbctl.engine.sim.results import SimResult
from btbctl.engine.sim.simulator import simulate_realistic
from btbctl.engine.trace.model import Trace


def simulate(
    trace: Trace,
    policy: str,
    cluster: ClusterConfig,
    constants: BtbConstants,
    *,
    seed: int = 42,
    fidelity: str = "realistic",
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``trace`` on ``cluster`` routed by the policy named ``policy``.

    Args:
        trace: requests (sorted by arrival).
        policy: registry name (``btbctl.engine.policies.POLICIES``).
        cluster: the fleet.
        constants: BTB's four constants (used by BTB-style policies).
        seed: seeds the policy's random source; same inputs and seed give identical results.
        fidelity: ``realistic`` (:func:`~btbctl.engine.sim.simulator.simulate_realistic`; for a reference policy
            that reads the trace in advance, :func:`~btbctl.engine.sim.foresight.simulate_foresight`) or
            ``infersim`` (the reference simulator's simplifications,
            :func:`~btbctl.engine.sim.infersim.simulate_infersim`; no reference policy).
        progress: called with increments of finished requests.

    Raises:
        ConfigError: unknown policy or fidelity, a reference policy with ``infersim``, unknown presets, a model
            that does not fit.
    """
    if policy in REFERENCE_POLICIES:
        if fidelity != "realistic":
            raise ConfigError("policy", f"{policy} runs in the realistic fidelity only, not {fidelity!r}")
        return simulate_foresight(trace, policy, cluster, constants, seed=seed, progress=progress)
    if fidelity == INFERSIM:
        return simulate_infersim(trace, policy, cluster, constants, seed=seed, progress=progress)
    if fidelity != "realistic":
        raise ConfigError("fidelity", f"unknown or unavailable fidelity {fidelity!r}; valid: {', '.join(FIDELITIES)}")
    return simulate_realistic(trace, policy, cluster, constants, seed=seed, progress=progress)


__all__ = ["simulate"]
