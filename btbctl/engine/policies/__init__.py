"""Routing policies: a registry by name and a factory.

Every policy implements :class:`~btbctl.engine.policies.base.Policy`; each module's docstring states its rule,
thresholds and sources. Importing this package loads only the pure-Python policy modules.
"""

from __future__ import annotations

import random
from typing import Any

from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies.base import FleetView, Policy, least_loaded
from btbctl.engine.policies.btb import Btb
from btbctl.engine.policies.btb_plus import BtbPlus
from btbctl.engine.policies.cache_aware import CacheAware
from btbctl.engine.policies.cache_aware_spill import CacheAwareSpill
from btbctl.engine.policies.clairvoyant import NOT_LIVE, Clairvoyant
from btbctl.engine.policies.infersim_rules import INFERSIM_POLICIES
from btbctl.engine.policies.least_load import LeastLoad
from btbctl.engine.policies.power_of_two import PowerOfTwo
from btbctl.engine.policies.random_policy import RandomPolicy
from btbctl.engine.policies.round_robin import RoundRobin

#: Policy classes by registry name (``Policy.name``): the ones that can route live (gateway, ``btbctl up``) as well
#: as in the simulators.
POLICIES: dict[str, type[Policy[Any]]] = {
    cls.name: cls
    for cls in (RoundRobin, RandomPolicy, LeastLoad, PowerOfTwo, CacheAware, CacheAwareSpill, Btb, BtbPlus)
}
#: Reference policies: simulator only (``realistic`` fidelity), never live. ``clairvoyant`` reads the whole trace
#: before the first request and gives the floor online rules are compared with.
REFERENCE_POLICIES: dict[str, type[Policy[Any]]] = {Clairvoyant.name: Clairvoyant}
#: Every policy the simulators can run (dry-run, sweep, report): :data:`POLICIES` then :data:`REFERENCE_POLICIES`.
SIM_POLICIES: dict[str, type[Policy[Any]]] = {**POLICIES, **REFERENCE_POLICIES}

#: The policies a dry-run compares when none are named, in report order.
DEFAULT_POLICIES = ("round_robin", "least_load", "cache_aware", "cache_aware_spill", "btb", "btb_plus")


def live_policy_error(name: object) -> str | None:
    """Why ``name`` cannot route live (gateway, ``btbctl up``, the control API), or None when it can: a reference
    policy says it is simulator-only; anything else unknown lists the valid names."""
    if isinstance(name, str) and name in POLICIES:
        return None
    if isinstance(name, str) and name in REFERENCE_POLICIES:
        return f"{name} {NOT_LIVE}; live policies: {', '.join(POLICIES)}"
    return f"unknown policy {name!r}; valid: {', '.join(POLICIES)}"


def make_policy(
    name: str,
    n_replicas: int,
    rng: random.Random,
    constants: BtbConstants | None = None,
    *,
    block_tokens: int | None = None,
    fidelity: str = "realistic",
) -> Policy[Any]:
    """A fresh policy by registry name.

    Args:
        name: a key of :data:`SIM_POLICIES` (a reference policy also needs the trace in advance: the simulators
            hand it over; see :mod:`btbctl.engine.sim.foresight`).
        n_replicas: fleet size (>= 1).
        rng: the policy's own seeded random source.
        constants: BTB's four constants (default: the published ones); only BTB-style policies use them.
        block_tokens: tokens per block of the workload's hash chains, passed to :meth:`Policy.configure`
            (policies that do not need it ignore it).
        fidelity: the simulator profile the policy will run in. With ``infersim``, ``cache_aware``, ``btb`` and
            ``least_load`` are the reference simulator's variants
            (:data:`~btbctl.engine.policies.infersim_rules.INFERSIM_POLICIES`); every other name, and every name in
            other profiles, is the registry's class.

    Raises:
        ConfigError: unknown ``name`` (the message lists the valid ones) or ``n_replicas`` < 1.
    """
    cls = SIM_POLICIES.get(name)
    if fidelity == "infersim" and name in INFERSIM_POLICIES:
        cls = INFERSIM_POLICIES[name]
    if cls is None:
        raise ConfigError("policy", f"unknown policy {name!r}; valid: {', '.join(SIM_POLICIES)}")
    if not isinstance(n_replicas, int) or n_replicas < 1:
        raise ConfigError("replicas", f"must be an integer >= 1, got {n_replicas!r}")
    policy = cls(n_replicas, rng, constants)
    if block_tokens is not None:
        policy.configure(block_tokens=block_tokens)
    return policy


__all__ = [
    "POLICIES",
    "REFERENCE_POLICIES",
    "SIM_POLICIES",
    "DEFAULT_POLICIES",
    "live_policy_error",
    "make_policy",
    "Policy",
    "FleetView",
    "least_loaded",
    "RoundRobin",
    "RandomPolicy",
    "LeastLoad",
    "PowerOfTwo",
    "CacheAware",
    "CacheAwareSpill",
    "Btb",
    "BtbPlus",
    "Clairvoyant",
]
