"""The simulator's route index (``SimFleetView.route_index``): ``btb_plus`` routes the same with it as without it
(every replica priced), and the index keeps its contract while a simulation runs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.sim.replica import FleetIndex
from btbctl.engine.sim.simulator import SimFleetView, simulate_realistic
from btbctl.engine.trace.generate import BurstedParams, generate_bursted


def _trace(seed: int, replicas: int):
    params = BurstedParams(
        bursts=3,
        burst_size=20 * replicas,
        spread_s=4.0,
        prefix_tokens=32 * 256,
        decoys=15,
        first_burst_s=2.0,
        burst_period_s=9.0,
        jitter_s=1.0,
        decoy_start_s=0.5,
        decoy_end_s=30.0,
        background_rps=0.6 * replicas,
        background_end_s=30.0,
        output_tokens=8,
    )
    return generate_bursted(params, seed=seed)


def _rows(result) -> list[tuple]:
    return [(r.request_id, r.replica, r.ttft_s, r.cached_tokens, r.finish_s) for r in result.records]


@pytest.mark.parametrize("seed,replicas", [(1, 8), (2, 16), (3, 5)])
def test_btb_plus_routes_the_same_with_and_without_the_index(monkeypatch, seed, replicas):
    trace = _trace(seed, replicas)
    cluster = ClusterConfig(model="qwen3-8b", gpu="h100", gpus_per_replica=1, replicas=replicas)
    constants = BtbConstants(prefix_blocks=8, threshold=3, window_s=5.0, warm_replicas=4)
    indexed = simulate_realistic(trace, "btb_plus", cluster, constants, seed=seed)
    calls = []
    real = SimFleetView.route_index

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(SimFleetView, "route_index", counting)
    again = simulate_realistic(trace, "btb_plus", cluster, constants, seed=seed)
    assert calls  # the index is consulted
    monkeypatch.setattr(SimFleetView, "route_index", lambda self: None)
    full = simulate_realistic(trace, "btb_plus", cluster, constants, seed=seed)
    assert _rows(indexed) == _rows(again)
    assert _rows(indexed) == _rows(full)
    assert indexed.policy_stats == full.policy_stats
    assert indexed.replications == full.replications > 0


def test_the_index_keeps_its_contract_during_a_run(monkeypatch):
    """After every routed request: ``idle`` is exactly the replicas with load 0 and no step running, and
    ``holders`` covers every replica where a block of the request's chain is planned."""
    trace = _trace(4, 6)
    cluster = ClusterConfig(model="qwen3-8b", gpu="h100", gpus_per_replica=1, replicas=6)
    constants = BtbConstants(prefix_blocks=8, threshold=3, window_s=5.0, warm_replicas=3)
    monkeypatch.setattr(FleetIndex, "SWEEP_MIN", 8)  # sweep often
    checked = []
    real = SimFleetView.route_index

    def checking(self):
        index = real(self)
        n = self.n_replicas
        assert set(index.idle) == {r for r in range(n) if self.load(r) == 0 and not self._reps[r]._busy}
        for r in index.idle:  # RouteIndex.idle's promise
            assert self.queued_prefill_s(r) == 0.0 and self.admission_wait_s(r, 10**6) == 0.0
            assert self.waiting_groups(r) == [] and self.prefill_load(r) == 0
        for root, reps in index.roots.items():
            assert reps <= set(range(n)) and reps, root
        checked.append(len(index.roots))
        return index

    monkeypatch.setattr(SimFleetView, "route_index", checking)
    from btbctl.engine.policies.btb_plus import BtbPlus

    real_route = BtbPlus.route

    def route(self, req, view, now_s):
        chain = req.block_hashes
        if chain:
            held = set(view.route_index().holders(chain[0]))
            planned = {r for r in range(view.n_replicas) if view.planned_blocks(r, chain)}
            assert planned <= held, (req.request_id, planned, held)
        return real_route(self, req, view, now_s)

    monkeypatch.setattr(BtbPlus, "route", route)
    simulate_realistic(trace, "btb_plus", cluster, constants, seed=4)
    assert len(checked) > 100
    assert max(checked) < len(trace.requests)  # the sweep keeps the index bounded, not one entry per request


@given(st.sets(st.integers(0, 300)), st.data())
def test_without_indexes_like_the_filtered_list(members, data):
    from btbctl.engine.policies.btb_plus import _Without

    order = sorted(members)
    skip = sorted(data.draw(st.sets(st.sampled_from(order))) if order else set())
    want = [r for r in order if r not in skip]
    got = _Without(order, skip)
    assert len(got) == len(want) and list(got) == want
    assert [got[k] for k in range(len(want))] == want
    with pytest.raises(IndexError):
        got[len(want)]
