"""One entry point over the fidelity profiles: :func:`simulate` runs the ``realistic`` model
(:mod:`btbctl.engine.sim.simulator`) or the ``infersim`` one (:mod:`btbctl.engine.sim.infersim`); neither of those
imports the other."""

from __future__ import annotations

from collections.abc import Callable

from btbctl.engine.chains import chain_conflict, follows
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
            that does not fit, hash chains that are not prefix-chained (:func:`check_prefix_chained`).
    """
    check_prefix_chained(trace)
    if policy in REFERENCE_POLICIES:
        if fidelity != "realistic":
            raise ConfigError("policy", f"{policy} runs in the realistic fidelity only, not {fidelity!r}")
        return simulate_foresight(trace, policy, cluster, constants, seed=seed, progress=progress)
    if fidelity == INFERSIM:
        return simulate_infersim(trace, policy, cluster, constants, seed=seed, progress=progress)
    if fidelity != "realistic":
        raise ConfigError("fidelity", f"unknown or unavailable fidelity {fidelity!r}; valid: {', '.join(FIDELITIES)}")
    return simulate_realistic(trace, policy, cluster, constants, seed=seed, progress=progress)


def check_prefix_chained(trace: Trace) -> None:
    """Check that ``trace``'s hash chains are prefix-chained, unless it is known to be (``trace.prefix_chained``:
    read from a file or generated); both simulators' caches and the policies rely on it. O(blocks of the trace).

    Raises:
        ConfigError: the first block that follows another block than where it first appeared, by request.
    """
    if trace.prefix_chained:
        return
    parents: dict = {}
    for r in trace.requests:
        bad = chain_conflict(parents, r.block_hashes)
        if bad is None:
            continue
        i, prev, first_prev = bad
        h = r.block_hashes[i]
        where = next(q.request_id for q in trace.requests if h in q.block_hashes)
        raise ConfigError(
            "trace",
            f"request {r.request_id!r}: block_hashes[{i}] {h!r} {follows(prev)} here but {follows(first_prev)} in "
            f"request {where!r}; hash chains must be prefix-chained (each hash names the whole prefix through its "
            "block)",
        )


__all__ = ["check_prefix_chained", "simulate"]
