"""``btb_plus``: each rule against a fake fleet view, plus one small end-to-end simulation."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyStatus
from btbctl.engine.costmodel import ReplicaCost, gpu_preset, model_preset
from btbctl.engine.policies import make_policy
from btbctl.engine.policies.btb_plus import BtbPlus
from btbctl.engine.sim import simulate
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.model import Request
from helpers import FakeFleet, route

BT = 256


def cost(nic_gbps: float = 400.0) -> ReplicaCost:
    """Llama-3.3-70B on 4 x H100 (the published setting) with ``nic_gbps`` per GPU."""
    return ReplicaCost(model_preset("llama-3.3-70b"), gpu_preset("h100"), 4, nic_gbps=nic_gbps)


_ids = iter(range(10**9))


def req(chain: Sequence[Hashable], t: float = 0.0, tokens: int | None = None) -> Request:
    chain = tuple(chain)
    return Request(f"q{next(_ids)}", t, tokens if tokens is not None else len(chain) * BT, 1, chain)


def burst_chain(prefix: tuple, i: int) -> tuple:
    return prefix + (f"own{i}",)


PREFIX = tuple(f"p{j}" for j in range(256))


def policy(n: int = 4, **k) -> BtbPlus:
    return BtbPlus(n, random.Random(0), BtbConstants(**k))


# -- rule 4: break-even ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nic_gbps,copies", [(400.0, True), (0.5, False)])
def test_break_even_copies_over_a_fast_fabric_and_not_over_a_slow_one(nic_gbps, copies):
    c = cost(nic_gbps)
    # 64k tokens of 70B KV: 21.5 GB. Recompute on an idle 4xH100 replica takes ~7.5 s; at 400 Gb/s per GPU the copy
    # takes ~0.1 s, at 0.5 Gb/s per GPU ~86 s.
    transfer = 256 * BT * c.model.kv_bytes_per_token / c.nic_bytes_per_s
    assert (transfer < c.prefill_time_s(256 * BT)) is copies
    view = FakeFleet(4, cost=c)
    view.cached[0].update(PREFIX)
    view.queued[0] = 30.0  # the holder is busy: a copy would give an earlier first token
    pol = policy(4)
    for i in range(40):  # 40 arrivals in the 1 s window: the rate target asks for more replicas
        route(pol, req(burst_chain(PREFIX, i), i * 0.01), view, i * 0.01)
    assert bool(view.copies) is copies
    stats = pol.stats()
    if copies:
        assert all(src == 0 and ch == PREFIX for ch, src, _, _, _ in view.copies)
        assert stats["copy_not_paying"] == 0
    else:
        assert stats["copy_not_paying"] > 0 and stats["copies_requested"] == 0


def test_a_targets_queue_counts_towards_its_recompute():
    """Over a fabric slower than an idle replica's own prefill of the prefix, a copy pays only towards a replica
    whose queue makes its recompute later still: the busy replica gets it, the idle ones recompute."""
    c = cost(2.0)
    transfer = 256 * BT * c.model.kv_bytes_per_token / c.nic_bytes_per_s
    bare = c.prefill_time_s(256 * BT)
    assert bare < transfer < bare + 30.0  # ~21 s against ~7.5 s idle, ~37.5 s behind a 30 s queue
    view = FakeFleet(4, cost=c)
    view.cached[0].update(PREFIX)
    view.queued[0] = 30.0
    view.queued[1] = 30.0
    pol = policy(4)
    for i in range(40):
        route(pol, req(burst_chain(PREFIX, i), i * 0.01), view, i * 0.01)
    assert view.copies and {tgt for _, _, tgt, _, _ in view.copies} == {1}
    assert pol.stats()["copy_not_paying"] > 0  # the idle replicas 2 and 3


def test_no_copy_without_headroom_on_the_target():
    view = FakeFleet(2)
    view.cached[0].update(PREFIX)
    view.queued[0] = 30.0
    view.headroom[1] = 100 * BT  # fewer than the prefix's 256 blocks
    pol = policy(2)
    for i in range(10):
        route(pol, req(burst_chain(PREFIX, i), i * 0.01), view, i * 0.01)
    assert view.copies == [] and pol.stats()["copy_no_room"] > 0


def test_copies_trail_a_source_still_computing_and_carry_the_fire_time():
    view = FakeFleet(3)
    view.pending[0].update(PREFIX)  # replica 0 is computing the prefix: no holder yet
    pol = policy(3)
    for i in range(30):
        route(pol, req(burst_chain(PREFIX, i), 5.0 + i * 0.002), view, 5.0 + i * 0.002)
    assert view.copies, "a copy may start from the replica computing the prefix"
    assert {src for _, src, _, _, _ in view.copies} == {0}
    fired = view.copies[0][4]
    assert fired == pytest.approx(5.002)  # the second arrival made the prefix hot (X = 2)
    assert all(hot == fired for *_, hot in view.copies)


def test_a_copy_with_steps_after_its_bytes_must_land_before_a_recompute_on_the_target():
    """An l3 copy (``copy_after_s`` > 0: write-through and proof after its last byte) from a source still computing
    the prefix lands after the source is done plus those steps, later than an idle target's own recompute started
    now: no copy, the target recomputes. From a source that holds the prefix it lands long before: copies."""

    def burst(view: FakeFleet, pol: BtbPlus) -> list[int]:
        return [route(pol, req(burst_chain(PREFIX, i), 5.0 + i * 0.002), view, 5.0 + i * 0.002) for i in range(4)]

    computing = FakeFleet(4)
    computing.pending[0].update(PREFIX)
    computing.queued[0] = 8.0  # its prefill of the prefix (7.5 s) and requests queued behind it
    computing.after_s = 0.05
    pol = policy(4)
    chosen = burst(computing, pol)
    assert computing.copies == [] and pol.stats()["copy_not_paying"] > 0
    assert set(chosen) - {0}, "the burst may recompute on an idle replica instead of queueing on the source"

    push = FakeFleet(4)  # the same with a push copy (after 0): it trails the source and lands with it
    push.pending[0].update(PREFIX)
    push.queued[0] = 8.0
    burst(push, policy(4))
    assert push.copies

    holding = FakeFleet(4)
    holding.cached[0].update(PREFIX)
    holding.queued[0] = 30.0
    holding.after_s = 0.05
    burst(holding, policy(4))
    assert holding.copies and {src for _, src, _, _, _ in holding.copies} == {0}


# -- rule 2: how many replicas ----------------------------------------------------------------------------------------


class _CountingFleet(FakeFleet):
    """Counts the replicas priced (:meth:`BtbPlus.estimate` asks each for its admission wait once; so does the
    routing of every replica it prices, the same in both runs compared)."""

    priced = 0

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        self.priced += 1
        return super().admission_wait_s(replica, kv_tokens)


def test_skipping_copy_pricing_that_cannot_win_changes_no_route_or_plan():
    """Beyond the rate target a copy is made only for an earlier first token than every covered replica's; when
    no target's landing time plus the suffix beats them, :meth:`BtbPlus._warm` skips pricing the targets. The
    routes, the copies and the counters are those of pricing every target, in scenarios where the skip happens
    and where backlog copies are made."""
    priced = {True: 0, False: 0}
    backlog = 0
    for seed in range(12):
        outcomes = []
        for prune in (True, False):
            rnd = random.Random(seed)
            n = 10
            view = _CountingFleet(n, [rnd.randrange(8) for _ in range(n)], cost(nic_gbps=rnd.choice((100.0, 400.0))))
            for h in rnd.sample(range(n), 2):
                view.cached[h].update(PREFIX)
            view.queued = [rnd.uniform(0.0, 3.0) for _ in range(n)]
            pol = policy(n, window_s=5.0, warm_replicas=6)
            pol.prune_backlog_pricing = prune
            picks = []
            for i in range(40):
                t = i * rnd.uniform(0.05, 0.6)
                picks.append(route(pol, req(burst_chain(PREFIX, i), t), view, t))
                for r in rnd.sample(range(n), 2):
                    view.queued[r] = rnd.uniform(0.0, 3.0)
            outcomes.append((picks, view.copies, pol.stats()))
            priced[prune] += view.priced
        assert outcomes[0] == outcomes[1], seed
        backlog += outcomes[0][2]["backlog_copies"]
    assert priced[True] < priced[False]  # the skip happened
    assert backlog > 0  # and copies beyond the rate target were still made


def test_rate_target_grows_with_the_arrival_rate_and_is_capped_by_m():
    pol = policy(8, replicas=3, window_s=2.0)
    s = 0.05  # seconds of suffix prefill per request: one replica serves 20 requests/s
    assert pol.rate_target(2, s) == 1  # 1 request/s
    assert pol.rate_target(40, s) == 1  # 20 requests/s: exactly one replica's rate
    assert pol.rate_target(41, s) == 2
    assert pol.rate_target(80, s) == 2
    assert pol.rate_target(81, s) == 3
    assert pol.rate_target(10_000, s) == 3  # capped by M
    assert policy(2, replicas=4).rate_target(10_000, s) == 2  # and by the fleet


def test_replicas_warmed_follow_the_rate_not_a_fixed_m():
    def copies_for(arrivals: int) -> int:
        view = FakeFleet(4)
        view.cached[0].update(PREFIX)
        pol = policy(4)
        for i in range(arrivals):
            route(pol, req(burst_chain(PREFIX, i), i * 0.9 / arrivals), view, i * 0.9 / arrivals)
            view.queued = [0.0] * 4  # idle fleet: only the rate target asks for copies
        return len({t for _, _, t, _, _ in view.copies})

    s = cost().prefill_time_s(BT, 256 * BT)  # one suffix at 64k context, ~0.04 s
    few, many = 2, 200
    assert copies_for(few) == math.ceil(few * s) - 1 == 0
    assert copies_for(many) == min(4, math.ceil(many * s)) - 1 >= 2


# -- rule 1: the deepest hot prefix ---------------------------------------------------------------------------------


def test_deepest_chain_match_beyond_y():
    pol = policy(2, prefix_blocks=2, threshold=2)
    shared = tuple(f"s{j}" for j in range(9))
    assert pol.depths(10) == [2, 4, 8]
    assert pol.detect(shared + ("a",), 0.0) is None
    det, since = pol.detect(shared + ("b",), 0.1)
    assert det.prefix == shared[:8] and since == 0.1  # 8 of the 9 shared blocks: the deepest power-of-two depth
    # a request sharing only 5 blocks is matched at depth 4 (Y = 2 stays the minimum)
    det, _ = pol.detect(shared[:5] + ("c",), 0.2)
    assert det.prefix == shared[:4]  # depth 4 has seen 3 arrivals; depth 8 does not cover this prompt
    assert pol.detect(("z",), 0.4) is None  # shorter than Y: never triggers
    assert pol.stats()["deepest_above_min"] == 2


# -- rule 5: expected-TTFT routing ----------------------------------------------------------------------------------


def test_routing_prefers_a_nearly_done_copy_over_a_long_queue():
    view = FakeFleet(3)
    view.cached[0].update(PREFIX)
    view.queued[0] = 12.0  # the holder: 12 s of prefill queued
    view.queued[2] = 0.0  # idle, but would recompute 64k tokens (~7.5 s)
    total = 256 * BT * view.cost.model.kv_bytes_per_token
    nearly = CopyStatus(0, total, total * 0.99, total, view.cost.nic_bytes_per_s)  # ~1 ms left
    view.arrive(1, PREFIX, status=nearly)
    view.queued[1] = 0.5
    pol = policy(3, threshold=100)  # no detection: pure routing
    q = req(burst_chain(PREFIX, 0))
    ests = [pol.expected_ttft_s(view, r, q, 0.0, pol.depths(257)) for r in range(3)]
    assert ests[1] < ests[2] < ests[0]
    assert route(pol, q, view, 0.0) == 1


def test_a_stalled_copy_is_priced_at_the_sources_remaining_prefill():
    view = FakeFleet(2)
    view.pending[0].update(PREFIX)  # replica 0 computes the prefix; 0 of its blocks resident yet
    total = 256 * BT * view.cost.model.kv_bytes_per_token
    view.arrive(1, PREFIX, status=CopyStatus(0, total, 0.0, 0.0, 0.0))
    pol = policy(2, threshold=2)
    pol.detect(burst_chain(PREFIX, 0), 0.0)
    pol.detect(burst_chain(PREFIX, 1), 0.0)  # hot: the policy knows the prefix chain
    st = view.copy_status(1, PREFIX)
    lands = pol.copy_lands_s(view, st, PREFIX[-1], 0.0)
    assert lands == pytest.approx(view.cost.prefill_time_s(256 * BT))
    q = req(burst_chain(PREFIX, 2))
    assert pol.expected_ttft_s(view, 1, q, 0.0, [256]) >= lands


def test_a_long_cold_prompt_avoids_a_burst_waiting_for_its_copy():
    view = FakeFleet(2)
    # replica 0: 100 requests wait for a copy that lands in 1 s; replica 1: 3 s of other work queued
    total = 256 * BT * view.cost.model.kv_bytes_per_token
    view.arrive(0, PREFIX, status=CopyStatus(1, total, 0.0, total, total / 1.0))
    view.groups[0] = [(PREFIX[-1], 100, 4.0)]
    view.queued[0] = 4.0
    view.queued[1] = 3.0
    pol = policy(2, threshold=2)
    pol.detect(burst_chain(PREFIX, 0), 0.0)
    pol.detect(burst_chain(PREFIX, 1), 0.0)
    cold = req(tuple(f"cold{j}" for j in range(257)))  # 64k tokens, ~7.5 s of prefill
    est0, harm0, _ = pol.estimate(view, 0, cold, 0.0)
    est1, harm1, _ = pol.estimate(view, 1, cold, 0.0)
    assert est0 < est1  # it would start at once on replica 0 ...
    assert harm0 > 100 * 5.0 and harm1 == 0.0  # ... delaying the 100 waiting requests by ~6.5 s each
    assert route(pol, cold, view, 0.0) == 1


def test_ties_are_broken_by_load_then_seeded_rng():
    view = FakeFleet(3)
    view.loads = [2, 1, 1]
    picks = {route(BtbPlus(3, random.Random(s)), req(("x",)), view, 0.0) for s in range(20)}
    assert picks == {1, 2}


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(st.sampled_from([1.0, 1.0 + 1e-12, 2.0, 3.0]), min_size=0, max_size=6),
    loads=st.lists(st.integers(0, 2), min_size=10, max_size=10),
    quiet=st.lists(st.integers(6, 9), unique=True, max_size=4),
    quiet_cost=st.sampled_from([1.0, 1.5, 4.0]),
    seed=st.integers(0, 3),
)
def test_the_choice_is_the_lowest_cost_then_the_lowest_load_then_one_seeded_draw(costs, loads, quiet, quiet_cost, seed):
    """``_best`` against its rule written out: the tie window, load 0 for the quiet replicas, then one draw from the
    tied replicas in ascending order (the same draw, so the same rng state after it)."""
    assume(costs or quiet)
    replicas = list(range(len(costs)))
    quiet = sorted(quiet)
    view = FakeFleet(10)
    view.loads = loads
    pol = BtbPlus(10, random.Random(seed))
    got = pol._best(view, replicas, costs, quiet, quiet_cost)
    every = list(zip(replicas, costs, strict=True)) + [(r, quiet_cost) for r in quiet]
    top = min(c for _, c in every) * (1 + 1e-9) + 1e-12
    tied = sorted(r for r, c in every if c <= top)
    load = {r: (0 if r in quiet else loads[r]) for r in tied}
    low = min(load.values())
    tied = [r for r in tied if load[r] == low]
    ref = random.Random(seed)
    want = tied[0] if len(tied) == 1 else ref.choice(tied)
    assert got == want
    assert pol.rng.random() == ref.random()


def test_set_constants_retunes_live():
    pol = policy(2, prefix_blocks=2)
    pol.detect(("a", "b", "c"), 0.0)
    pol.set_constants(BtbConstants(prefix_blocks=2, threshold=1))
    assert pol.detect(("a", "b", "d"), 0.1) is not None  # threshold 1: fires at once, state kept
    pol.set_constants(BtbConstants(prefix_blocks=3, threshold=1))
    assert pol.stats()["tracked_prefixes"] == 0  # a new Y drops the depth levels


# -- end to end -------------------------------------------------------------------------------------------------------


def test_small_simulation_end_to_end():
    params = BurstedParams(
        bursts=2,
        burst_size=60,
        spread_s=1.0,
        prefix_tokens=256 * BT,
        decoys=10,
        first_burst_s=5.0,
        burst_period_s=20.0,
        jitter_s=1.0,
        decoy_start_s=0.0,
        decoy_end_s=40.0,
    )
    trace = generate_bursted(params, seed=3)
    k = BtbConstants(prefix_blocks=16, threshold=2, window_s=1.0, replicas=4)
    cl = ClusterConfig()
    res = simulate(trace, "btb_plus", cl, k, seed=1)
    again = simulate(trace, "btb_plus", cl, k, seed=1)
    s = res.summary(replication_details=True)
    assert s == again.summary(replication_details=True)  # deterministic for a seed
    assert s["requests"] == len(trace)
    assert res.policy_stats["fires"] >= 2
    assert res.policy_stats["deepest_above_min"] > 0  # matched at 256 blocks although Y = 16
    assert s["replications"] >= 1 and 0 <= s["wasted_replications"] <= s["replications"]
    assert s["time_to_warm_s"]["mean"] > 0
    published = simulate(trace, "btb", cl, k, seed=1).summary()
    assert s["ttft_s"]["mean"] < published["ttft_s"]["mean"]
    assert make_policy("btb_plus", 4, random.Random(0), k).name == "btb_plus"


# -- rule 6: pacing a spread burst ----------------------------------------------------------------------------------


def test_a_burst_held_by_two_replicas_is_paced_by_its_own_prefill_and_one_held_once_is_not():
    from btbctl.engine.policies.btb_plus import PACE_HORIZON_S

    view = FakeFleet(4)
    view.cached[0].update(PREFIX)
    view.cached[1].update(PREFIX)
    pol = policy(4)
    first = pol.route(req(burst_chain(PREFIX, 0), 1.0), view, 1.0)
    assert first.pace == 0  # one arrival: not hot yet
    r = req(burst_chain(PREFIX, 1), 1.01)
    ttft, _, start = pol.estimate(view, 0, r, 1.01)  # replicas 0 and 1 are alike, idle, holding the prefix
    hot = pol.route(r, view, 1.01)
    assert hot.replica in (0, 1)
    own_s = ttft - start
    assert own_s > 0 and hot.pace == max(1, math.ceil(PACE_HORIZON_S / own_s))
    assert hot.pace > 1  # a 256-token suffix at a 64k context takes well under the horizon
    assert pol.stats()["paced_routes"] == 1

    lone = FakeFleet(1)  # nowhere to spread: the holder's queue is the bottleneck, never paced
    lone.cached[0].update(PREFIX)
    pol1 = policy(1)
    routes = [pol1.route(req(burst_chain(PREFIX, i), 2.0 + i * 0.01), lone, 2.0 + i * 0.01) for i in range(5)]
    assert [x.pace for x in routes] == [0] * 5 and pol1.stats()["hot_routes"] == 4
