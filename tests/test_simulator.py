"""Simulator behaviour on hand-made traces, checked against the cost model."""

import math
import random

import pytest

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan
from btbctl.engine.errors import ConfigError
from btbctl.engine.sim.results import check_fits
from btbctl.engine.sim.simulator import Simulator
from btbctl.engine.trace.model import Request, Trace
from helpers import Scripted

BT = 256
CLUSTER = ClusterConfig(model="llama-3.3-70b", gpu="h100", gpus_per_replica=4, replicas=2)
COST = CLUSTER.replica_cost()
CHUNK = CLUSTER.chunk_tokens()


def chain(tag, n):
    return tuple(f"{tag}-{k}" for k in range(n))


def req(rid, t, prefix, suffix_tag, out=1, suffix_blocks=1):
    blocks = prefix + chain(f"{rid}-{suffix_tag}", suffix_blocks)
    return Request(rid, t, len(blocks) * BT, out, blocks, "burst")


def run(reqs, route_fn=lambda r: 0, on_arrival=None, cluster=CLUSTER):
    tr = Trace(list(reqs), BT, "generated")
    sim = Simulator(tr, Scripted(cluster.replicas, route_fn, on_arrival), cluster, BtbConstants())
    res = sim.run()
    return sim, {r.request_id: r for r in res.records}, res


def chunked_prefill_time(tokens, context=0):
    t, done = 0.0, 0
    while done < tokens:
        c = min(CHUNK, tokens - done)
        t += COST.prefill_time_s(c, context + done)
        done += c
    return t


def test_single_request_ttft_is_chunked_prefill_time():
    r = req("a", 1.0, chain("p", 79), "s")  # 80 blocks = 20,480 tokens -> chunks 8192, 8192, 4096
    _, recs, _ = run([r])
    assert recs["a"].ttft_s == pytest.approx(chunked_prefill_time(80 * BT))
    assert recs["a"].cached_tokens == 0 and recs["a"].queue_wait_s == 0


def test_same_prefix_waits_for_the_prefill_in_progress_instead_of_recomputing():
    p = chain("p", 64)  # 16,384 tokens = two full chunks
    a, b = req("a", 0.0, p, "s"), req("b", 0.001, p, "s")
    _, recs, res = run([a, b])
    assert recs["b"].cached_tokens == 64 * BT
    assert res.summary()["recomputed_prefix_tokens"] == 0
    # b was admitted once a's two prefix chunks were committed, and rode in a's last step with its own block
    prefix_done = chunked_prefill_time(64 * BT)
    assert recs["b"].queue_wait_s == pytest.approx(prefix_done - 0.001)
    assert recs["b"].finish_s == pytest.approx(recs["a"].finish_s)


def test_new_request_shares_the_budget_of_the_last_partial_chunk():
    # SGLang-like: the request being chunked takes the chunk budget first; a newcomer gets what is left
    long_r = req("long", 0.0, chain("p", 79), "s")  # 20,480 tokens: chunks 8192, 8192, 4096
    short = req("short", 0.01, (), "x")
    _, recs, _ = run([long_r, short])
    assert recs["short"].finish_s == pytest.approx(recs["long"].finish_s)
    assert recs["short"].queue_wait_s == pytest.approx(
        COST.prefill_time_s(CHUNK) + COST.prefill_time_s(CHUNK, CHUNK) - 0.01
    )


def test_decode_closed_form_matches_step_by_step_sum():
    out = 300
    r = req("a", 0.0, chain("p", 7), "s", out=out)
    _, recs, _ = run([r])
    kv = 8 * BT + 1
    steps = sum(COST.decode_step_time_s(1, kv + j) for j in range(out - 1))
    assert recs["a"].finish_s - recs["a"].ttft_s == pytest.approx(steps, rel=1e-9)


def test_arrival_cuts_a_decode_run_at_the_next_step_boundary():
    long_decode = req("dec", 0.0, chain("p", 3), "s", out=2000)
    late = req("late", 5.0, (), "x")
    _, recs, _ = run([long_decode, late])
    step = COST.decode_step_time_s(1, 5000)
    assert recs["late"].ttft_s < COST.prefill_time_s(BT) + 2 * step
    assert recs["dec"].finish_s > recs["late"].finish_s


def test_copy_trails_the_source_prefill_and_target_uses_it_only_after_arrival():
    p = chain("p", 128)

    def on_arrival(r, view, now):
        if r.request_id == "b":
            return [CopyPlan(p, 0, (1,), 1)]

    a = req("a", 0.0, p, "s")
    b = req("b", 0.1, p, "s")
    sim, recs, res = run([a, b], route_fn=lambda r: 0 if r.request_id == "a" else 1, on_arrival=on_arrival)
    assert [(tg, ok) for _, tg, ok in sim.policy.results] == [(1, True)]
    assert res.replications == 1
    assert res.replicated_bytes == pytest.approx(128 * BT * COST.model.kv_bytes_per_token)
    # b reused the whole copied prefix, and could not start before the source had computed it
    assert recs["b"].cached_tokens == 128 * BT
    copy_s = 128 * BT * COST.model.kv_bytes_per_token / COST.nic_bytes_per_s
    source_done = recs["a"].ttft_s  # a's prompt includes the prefix; its last chunk ends at a's TTFT
    assert recs["b"].finish_s >= source_done + copy_s / 16 - 1e-9
    assert sim.replicas[1].cache.match(p) == 128


def test_copy_is_refused_when_source_lacks_the_prefix_or_target_has_it():
    p = chain("p", 8)

    def on_arrival(r, view, now):
        return [
            CopyPlan(p, 1, (0,), 1),  # replica 1 has nothing
            CopyPlan(p, 0, (0,), 1),
        ]  # same replica

    sim, _, res = run([req("a", 0.0, p, "s")], on_arrival=on_arrival)
    assert [ok for _, _, ok in sim.policy.results] == [False, False]
    assert res.copies_refused == 2


def test_every_request_finishes_exactly_once_under_memory_pressure():
    tiny = ClusterConfig(model="llama-3.1-8b", gpu="a100", gpus_per_replica=1, replicas=2, mem_fraction=0.3)
    budget = tiny.replica_cost().kv_budget_tokens
    rng = random.Random(1)
    reqs = []
    for i in range(300):
        p = chain(f"p{rng.randrange(20)}", rng.randrange(1, 40))
        reqs.append(req(f"r{i}", rng.uniform(0, 30), p, "s", out=rng.randrange(1, 50)))
    sim, recs, res = run(reqs, route_fn=lambda r: int(r.request_id[1:]) % 2, cluster=tiny)
    assert sorted(recs) == sorted(r.request_id for r in reqs)
    assert all(rec.ttft_s > 0 and math.isfinite(rec.ttft_s) for rec in recs.values())
    assert sum(rep.cache.evictions for rep in sim.replicas) > 0
    for rep in sim.replicas:
        assert rep.cache.used_tokens <= budget
        assert rep.cache.private_tokens == 0 and rep.cache.reserved_blocks == 0 and not rep.cache.refs


def test_deterministic_for_a_seed():
    rng = random.Random(3)
    reqs = [req(f"r{i}", rng.uniform(0, 5), chain(f"p{i % 3}", 20), "s", out=5) for i in range(60)]
    pick = lambda r: hash(r.request_id) % 2
    _, a, _ = run(reqs, route_fn=pick)
    _, b, _ = run(reqs, route_fn=pick)
    assert [x.as_dict() for x in a.values()] == [x.as_dict() for x in b.values()]


def test_request_larger_than_kv_budget_is_a_config_error():
    budget = COST.kv_budget_tokens
    r = Request("huge", 0.0, budget + 10, 1, (), "background")
    with pytest.raises(ConfigError, match="gpus_per_replica"):
        check_fits(Trace([r], BT, "generated"), budget)


def test_incremental_use_matches_batch_replay_and_reports_hooks():
    p = chain("p", 40)
    reqs = [req("a", 0.0, p, "s", out=3), req("b", 0.5, p, "s", out=2)]
    _, batch, _ = run([Request(**{f: getattr(r, f) for f in r.__slots__}) for r in reqs])
    live = Simulator(Trace([], BT, "live"), Scripted(2, lambda r: 0), CLUSTER, BtbConstants())
    firsts, finishes = [], []
    live.on_first_token = lambda r, rep, ttft, cached: firsts.append((r.request_id, rep, ttft, cached))
    live.on_finish = lambda rec: finishes.append(rec)
    for r in reqs:
        live.advance_to(r.arrival_s)
        live.submit(r)
    while live.next_event_s() is not None:
        live.advance_to(live.next_event_s())
    got = {rec.request_id: rec for rec in finishes}
    for rid in ("a", "b"):
        assert got[rid].ttft_s == pytest.approx(batch[rid].ttft_s)
        assert got[rid].finish_s == pytest.approx(batch[rid].finish_s)
    assert [f[0] for f in firsts] == ["a", "b"] and firsts[1][3] == 40 * BT


def test_insert_prefix_makes_blocks_resident_for_the_next_request():
    p = chain("p", 30)
    live = Simulator(Trace([], BT, "live"), Scripted(2, lambda r: 1), CLUSTER, BtbConstants())
    assert live.insert_prefix(1, p) == 30
    assert live.insert_prefix(1, p) == 0
    live.submit(req("x", 0.0, p, "s"))
    while live.next_event_s() is not None:
        live.advance_to(live.next_event_s())
    assert live.records[0].cached_tokens == 30 * BT
    assert live.replica_state(1).cached_blocks == 31


def test_abort_frees_a_decoding_request_and_cuts_a_prefilling_one_at_its_first_token():
    live = Simulator(Trace([], BT, "live"), Scripted(2, lambda r: 0), CLUSTER, BtbConstants())
    finishes = {}
    live.on_finish = lambda rec: finishes.setdefault(rec.request_id, rec)
    long_a = req("a", 0.0, chain("p", 7), "s", out=5000)
    long_b = req("b", 0.0, chain("q", 7), "s", out=5000)
    live.submit(long_a)
    live.submit(long_b)
    live.advance_to(2.0)  # both decoding by now
    assert live.replica_state(0).running == 2
    assert live.abort("a") is True
    assert finishes["a"].finish_s == pytest.approx(2.0)
    assert live.replica_state(0).running == 1
    assert live.abort("a") is False  # already finished
    # a request aborted before its first token ends right after its prefill
    c = req("c", 0.0, chain("r", 60), "s", out=5000)
    live.submit(c)
    assert live.abort("c") is True
    while "c" not in finishes:
        live.advance_to(live.next_event_s())
    assert finishes["c"].finish_s == pytest.approx(finishes["c"].arrival_s + finishes["c"].ttft_s)
    live.abort("b")
    while live.next_event_s() is not None:
        live.advance_to(live.next_event_s())
    cache = live.replicas[0].cache
    assert cache.private_tokens == 0 and cache.reserved_blocks == 0 and not cache.refs
    assert live.replica_state(0).running == 0


def test_read_api_reports_copies_holders_and_replica_state():
    p = chain("p", 64)
    live = Simulator(Trace([], BT, "live"), Scripted(2, lambda r: 0), CLUSTER, BtbConstants())
    assert live.n_replicas == 2 and live.policy_name == "scripted" and live.detector is None
    live.submit(req("a", 0.0, p, "s", out=50))
    assert live.replica_state(0).busy and live.replica_state(0).running == 1
    assert live.holders(p) == [] and live.copies_in_flight() == []
    assert live.start_copy(p, 0, 1, live.now)  # trails a's prefill
    (c,) = live.copies_in_flight()
    assert (c.source, c.target, c.prefix, str(c.state)) == (0, 1, p, "stalled")  # nothing computed yet
    assert c.eta_s is None and c.sent_bytes == 0 and c.done_s is None
    assert live.copy_info(1, p) == c and live.copy_info(0, p) is None
    live.advance_to(live.next_event_s())  # the first chunk commits: the copy can send
    (c,) = live.copies_in_flight()
    assert str(c.state) == "running" and c.rate_bytes_per_s > 0 and c.eta_s > 0
    while live.copies_in_flight():
        live.advance_to(live.next_event_s())
    (done,) = live.finished_copies()
    assert str(done.state) == "done" and done.sent_bytes == done.total_bytes == c.total_bytes
    assert done.done_s == live.now and live.finished_copies(0) == []
    assert live.holders(p) == [0, 1]
    st = live.replica_state(1)
    assert st.cached_blocks == 64 and st.running == 0 and not st.busy
    # the copied blocks are cached but no request uses them: evictable, so not "used" (SGLang's num_used_tokens)
    assert st.used_tokens == 0 and st.capacity_tokens == COST.kv_budget_tokens


def test_set_constants_and_policy_reach_the_policy():
    from btbctl.engine.policies import make_policy

    pol = make_policy("btb", 2, random.Random(0), BtbConstants())
    live = Simulator(Trace([], BT, "live"), pol, CLUSTER, BtbConstants())
    assert live.detector is pol.detector and live.policy_name == "btb"
    live.set_constants(BtbConstants(threshold=5))
    assert live.constants.threshold == 5 and pol.detector.constants.threshold == 5
    live.set_policy(make_policy("round_robin", 2, random.Random(0)))
    assert live.policy_name == "round_robin" and live.detector is None
