"""The clairvoyant reference policy: bursts found as the detector's ground truth, copies warmed just in time from a
replica that already holds the prefix (network time from the cost model), the simulator-only guard."""

from __future__ import annotations

import random

import pydantic
import pytest

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway import GatewayConfig
from btbctl.engine.policies import POLICIES, REFERENCE_POLICIES, SIM_POLICIES, live_policy_error
from btbctl.engine.policies.clairvoyant import find_bursts
from btbctl.engine.sim import simulate
from btbctl.engine.sim.foresight import ForesightSimulator
from btbctl.engine.trace.model import Request, Trace

BT = 256
Y = 4
CONSTANTS = BtbConstants(prefix_blocks=Y, threshold=2, window_s=1.0, warm_replicas=4)
#: 8,192-token suffixes: 20 of them within 1 s are more than one replica can prefill (the rate target wants 4)
SUFFIX_BLOCKS = 32
CLUSTER = ClusterConfig(model="qwen3-8b", gpu="h100", gpus_per_replica=1, replicas=4)


def _req(rid: str, t: float, prefix: tuple, kind: str = "background") -> Request:
    chain = (*prefix, *(f"{rid}-s{i}" for i in range(SUFFIX_BLOCKS)))
    return Request(rid, t, len(chain) * BT, 1, chain, kind=kind)


def _trace() -> Trace:
    """One request computes prefix P at t=0; a burst of 20 requests on P starts at t=10 (within 0.4 s); a lone
    request on another prefix Q at t=5 and a pair on Q more than Z apart (not a burst)."""
    p = tuple(f"P{i}" for i in range(Y))
    q = tuple(f"Q{i}" for i in range(Y))
    reqs = [_req("early", 0.0, p), _req("q1", 5.0, q), _req("q2", 6.5, q)]
    reqs += [_req(f"b{i}", 10.0 + 0.02 * i, p, kind="x") for i in range(20)]
    return Trace(reqs, BT, "generated")


def test_bursts_are_the_detectors_ground_truth():
    tr = _trace()
    bursts = find_bursts(tr.requests, CONSTANTS)
    assert len(bursts) == 1  # "early" is more than Z before the burst; q1/q2 are 1.5 s apart
    b = bursts[0]
    assert (b.start_s, b.size, b.first_id) == (10.0, 20, "b0")
    assert b.prefix == tuple(f"P{i}" for i in range(Y))  # the longest chain all of them share
    assert find_bursts(tr.requests, CONSTANTS.with_updates(threshold=21)) == []


def test_warms_before_the_bursts_first_request_at_the_models_copy_time():
    tr = _trace()
    pol = SIM_POLICIES["clairvoyant"](CLUSTER.replicas, random.Random(1), CONSTANTS)
    sim = ForesightSimulator(tr, pol, CLUSTER, CONSTANTS)
    sim.run()
    copies = sim.finished_copies()
    assert copies, "no copy was made"
    pre = [c for c in copies if c.started_s < 10.0]
    assert len(pre) == 3  # the three replicas that lack P, warmed before the first burst request
    assert pol.stats()["prewarm_copies"] == 3
    assert sim.wakes == 1
    cost = CLUSTER.replica_cost()
    one = cost.transfer_time_s(cost.kv_bytes(Y * BT))
    for c in pre:
        assert c.total_bytes == cost.kv_bytes(Y * BT)
        # the three copies share the source's NIC: each takes three single-copy times, ending as the burst begins
        assert c.done_s - c.started_s == pytest.approx(3 * one, rel=1e-6)
        assert c.done_s == pytest.approx(10.0, abs=1e-9)
    holder = next(r for r in sim.records if r.request_id == "early").replica
    assert {c.source for c in pre} == {holder}
    burst = [r for r in sim.records if r.request_id.startswith("b")]
    assert all(r.cached_tokens >= Y * BT for r in burst)  # every burst request found P resident
    assert len({r.replica for r in burst}) > 1  # and the burst was spread over the warmed replicas


def test_runs_in_the_simulator_by_name_and_not_in_infersim():
    tr = _trace()
    res = simulate(tr, "clairvoyant", CLUSTER, CONSTANTS, seed=3)
    assert res.policy == "clairvoyant" and len(res.records) == len(tr)
    with pytest.raises(ConfigError, match="realistic fidelity only") as ei:
        simulate(tr, "clairvoyant", CLUSTER, CONSTANTS, fidelity="infersim")
    assert ei.value.key == "policy"


def test_not_a_live_policy():
    assert "clairvoyant" in REFERENCE_POLICIES and "clairvoyant" not in POLICIES
    why = live_policy_error("clairvoyant")
    assert why is not None and "simulator-only" in why and "cannot route live" in why
    assert live_policy_error("btb_plus") is None
    with pytest.raises(pydantic.ValidationError, match="cannot route live"):
        GatewayConfig(workers=["http://127.0.0.1:1"], policy="clairvoyant")


def test_route_without_foresight_says_so():
    from btbctl.engine.sim.simulator import Simulator

    pol = SIM_POLICIES["clairvoyant"](CLUSTER.replicas, random.Random(1), CONSTANTS)
    with pytest.raises(RuntimeError, match="foresee"):
        Simulator(_trace(), pol, CLUSTER, CONSTANTS).run()
