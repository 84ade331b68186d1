"""The gateway's live fleet state: the holding record, pending prefills, the chain index (the FleetView protocol
itself is checked for every implementation in test_fleet_views.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.gateway.state import ChainIndex, FleetState, WorkerState
from btbctl.engine.policies.base import ExcludingView
from btbctl.engine.stats import TtftSeries


def test_holding_record_is_prefix_closed_under_lru_eviction():
    w = WorkerState(0, "http://x", "w0", capacity_blocks=6)
    a = ("a1", "a2", "a3", "a4")
    b = ("a1", "a2", "b3", "b4")
    w.hold(a)
    assert w.held_blocks(a) == 4 and w.held_blocks(("a1", "zz")) == 1 and w.held_blocks(("zz",)) == 0
    w.hold(b)  # 6 distinct blocks: a4 and a3 are the oldest leaves
    assert len(w.holdings) == 6 and w.held_blocks(a) == 4 and w.held_blocks(b) == 4
    w.hold(("c1",))
    assert len(w.holdings) == 6
    assert w.held_blocks(a) == 3 and w.held_blocks(b) == 4  # the oldest leaf went first, the root stayed
    assert w.held_blocks(a[:2]) == 2


# a chain: a root (tree t) and its first k blocks of branch b; roots are never inner blocks (hashes are chained)
_chains = st.builds(
    lambda t, b, k: (f"r{t}", *(f"r{t}/{b}/{i}" for i in range(1, k))),
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(1, 5),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("hold"), st.integers(0, 2), _chains),
        st.tuples(st.just("start"), st.integers(0, 2), _chains),
        st.tuples(st.just("end"), st.integers(0, 2), st.integers(0, 30)),
        st.tuples(st.just("drop"), st.integers(0, 2), _chains),
        st.tuples(st.just("forget"), st.integers(0, 2), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(_ops, st.integers(2, 12))
def test_the_root_index_is_the_scan_of_holdings_and_pending_blocks(ops, capacity):
    """:attr:`FleetState.roots` (what :meth:`WorkerIndex.holders` reads) equals the scan it replaced, ``root in
    holdings or root in pending`` per worker, through holds with LRU eviction, drops, forgets and requests starting
    and ending."""
    fs = FleetState(["http://a", "http://b", "http://c"])
    started: list[tuple[int, str]] = []
    for w in fs.workers:
        w.capacity_blocks = capacity
    for n, (op, r, arg) in enumerate(ops):
        w = fs.workers[r]
        if op == "hold":
            w.hold(arg)
        elif op == "start":
            w.start_prefill(f"q{n}", arg)
            started.append((r, f"q{n}"))
        elif op == "end" and started:
            r0, rid = started.pop(arg % len(started))
            fs.workers[r0].end_prefill(rid)
        elif op == "drop":
            w.drop_blocks(arg[-2:])
        elif op == "forget":
            w.forget()
        for t in range(4):
            root = f"r{t}"
            scan = [x.index for x in fs.workers if root in x.holdings or root in x.pending]
            assert sorted(fs.roots.get(root, ())) == scan, (n, op, root)
            assert fs.route_index().holders(root) == scan
        assert all(fs.roots.values())  # no empty entry is kept


def test_pending_counts_until_the_first_byte():
    st = FleetState(["http://a", "http://b"])
    for w in st.workers:
        w.healthy = True
    chain = ("p1", "p2", "p3")
    st.workers[1].start_prefill("r1", chain)
    assert st.pending_blocks(1, chain) == 3 and st.cached_blocks(1, chain) == 0
    # a request computing its own chain waits for nobody; a second one with the same chain waits for its blocks
    assert st.waiting_groups(1) == [] and st.queued_prefill_s(1) > 0
    st.workers[1].start_prefill("r2", chain + ("q4",), 4 * 256)
    ((key, n, work),) = st.waiting_groups(1)
    assert (key, n) == ("p3", 1) and 0 < work < st.queued_prefill_s(1) / 2  # it computes one block of four
    st.workers[1].end_prefill("r2")
    st.workers[1].end_prefill("r1")
    assert st.pending_blocks(1, chain) == 0 and not st.workers[1].pending and st.workers[1].prefilling == 0
    st.workers[1].hold(chain)
    assert st.cached_blocks(1, chain) == 3
    assert ExcludingView(st, {1}).cached_blocks(1, chain) == 0  # excluded for this request: not a holder
    assert ExcludingView(st, {0}).cached_blocks(1, chain) == 3
    st.workers[1].healthy = False
    assert st.cached_blocks(1, chain) == 0 and st.pending_blocks(1, chain) == 0


def test_chain_index_turns_ids_back_into_chains():
    idx = ChainIndex(max_blocks=5)
    idx.add(("aa01", "aa02", "aa03"))
    idx.add(("aa01", "aa02", "bb03"))
    assert idx.chain_of("bb03") == ("aa01", "aa02", "bb03") and idx.chain_of("aa02") == ("aa01", "aa02")
    assert sorted(idx.find("aa0")) == ["aa01", "aa02", "aa03"] and idx.find("bb") == ["bb03"]
    idx.add(("cc01", "cc02"))  # over the bound: the oldest entries go; broken chains read as unknown
    assert len(idx) == 5 and idx.chain_of("aa03") is None and idx.chain_of("cc02") == ("cc01", "cc02")


def test_ttft_series_buckets():
    s = TtftSeries()
    for t, v in [(0.5, 0.1), (1.5, 0.2), (1.7, 0.4), (2.9, 1.0)]:
        s.add(t, v)
    rows = s.series(3.0, 3.0, 1.0)
    assert [r["n"] for r in rows] == [1, 2, 1]
    assert rows[1]["p50_s"] == 0.30000000000000004 or abs(rows[1]["p50_s"] - 0.3) < 1e-12
    assert rows[1]["rps"] == 2.0 and rows[0]["t_s"] == 1.0
    assert s.summary(3.0, 1.0)["n"] == 1 and s.summary(10.0, 1.0)["p50_s"] is None


def test_admission_wait_estimate_from_loads():
    st = FleetState(["http://a"])
    w = st.workers[0]
    assert st.admission_wait_s(0, 100) == 0.0  # unknown loads
    w.loads = {"running": 1, "waiting": 0, "used_tokens": 900, "max_tokens": 1000, "token_usage": 0.9}
    w.ttft_ewma_s = 0.5
    assert st.admission_wait_s(0, 100) == 0.0 and st.kv_headroom_tokens(0) == 100
    assert st.admission_wait_s(0, 101) == 0.5
    w.loads["waiting"] = 3
    assert st.admission_wait_s(0, 1) == 2.0


def test_kv_headroom_counts_what_the_gateway_sent_or_finished_since_the_last_load_report():
    st = FleetState(["http://a", "http://b"])
    w = st.workers[0]
    before = [w.send_kv(1000), w.send_kv(1000)]  # the gateway's requests there when the worker reported
    w.new_loads({"running": 2, "waiting": 0, "used_tokens": 2000, "max_tokens": 10000})
    w.ttft_ewma_s = 0.5
    assert st.kv_headroom_tokens(0) == 8000 and st.admission_wait_s(0, 4000) == 0.0
    new = [w.send_kv(2000) for _ in range(3)]  # three more sent since, not in the report yet
    assert st.kv_headroom_tokens(0) == 2000
    assert st.admission_wait_s(0, 4000) == 0.5  # the worker's KV cannot hold it until a request ends
    w.finish_kv(1000, before[0])  # one of the reported ones finished: it frees what it used
    w.finish_kv(2000, new[0])  # one of the new ones finished: it never was in the report
    assert st.kv_headroom_tokens(0) == 5000 and st.admission_wait_s(0, 4000) == 0.0
    w.send_kv(100_000)
    assert st.kv_headroom_tokens(0) == 0  # never negative
    w.new_loads({"running": 3, "waiting": 0, "used_tokens": 9000, "max_tokens": 10000})  # the next report
    assert st.kv_headroom_tokens(0) == 1000
    b = st.workers[1]  # without loads: its capacity less the gateway's requests in flight
    b.info = {"capacity_tokens": 5000}
    b.send_kv(1500)
    assert st.kv_headroom_tokens(1) == 3500


def test_a_worker_without_a_ttft_record_waits_like_the_others_not_zero():
    st = FleetState(["http://a", "http://b", "http://c", "http://d"])
    for w in st.workers:
        w.loads = {"running": 4, "waiting": 2, "used_tokens": 0, "max_tokens": 1000}
        w.healthy = True
    st.workers[0].ttft_ewma_s, st.workers[1].ttft_ewma_s = 1.0, 2.0
    st.workers[3].ttft_ewma_s, st.workers[3].healthy = 90.0, False  # down: its old figure says nothing
    assert st.admission_wait_s(0, 1) == 3.0 and st.admission_wait_s(1, 1) == 6.0
    assert st.admission_wait_s(2, 1) == 4.5  # just restarted: the mean of the healthy others' (1.5 s) x 3
    assert FleetState(["http://a"]).ttft_estimate_s(0) == 0.0


def test_kv_headroom_stays_within_the_workers_kv_whatever_clients_ask_for():
    st = FleetState(["http://a"])
    w = st.workers[0]
    epochs = [w.send_kv(20_000), w.send_kv(20_000)]  # two requests that asked for long outputs
    w.new_loads({"running": 2, "waiting": 0, "used_tokens": 3000, "max_tokens": 10000})
    for e in epochs:  # both finished: they freed what they had in use, not what they asked for
        w.finish_kv(20_000, e)
    assert st.kv_headroom_tokens(0) == 10000
    assert w.kv_tokens_of(10**9) == 10000  # a huge max_tokens counts as the whole KV, no more
    w.send_kv(w.kv_tokens_of(10**9))
    assert st.kv_headroom_tokens(0) == 0


def test_nic_copies_follow_copies_starting_ending_and_replaced():
    from btbctl.engine.copies import CopyState
    from btbctl.engine.gateway.state import Transfer

    st = FleetState(["http://a", "http://b", "http://c"])

    def naive(r: int) -> int:
        return sum(1 for t in st.transfers.active.values() if r in (t.source, t.target))

    t1 = Transfer("c1", "k1", ("x", "k1"), source=0, target=1)
    t2 = Transfer("c2", "k2", ("k2",), source=0, target=2)
    t1b = Transfer("c3", "k1", ("x", "k1"), source=2, target=1)  # the same (target, prefix): replaces t1
    for step in (t1, t2, t1b):
        st.transfers.add(step)
        assert [st.nic_copies(r) for r in range(3)] == [naive(r) for r in range(3)]
    assert [st.nic_copies(r) for r in range(3)] == [1, 1, 2]
    t1.state = CopyState.FAILED
    st.transfers.finish(t1)  # replaced already: changes nothing
    assert [st.nic_copies(r) for r in range(3)] == [1, 1, 2]
    for t in (t2, t1b):
        t.state = CopyState.DONE
        st.transfers.finish(t)
        assert [st.nic_copies(r) for r in range(3)] == [naive(r) for r in range(3)]
    assert [st.nic_copies(r) for r in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("policy", ["btb_plus", "btb", "cache_aware"])
def test_the_gateways_detector_sees_each_request_once_whoever_feeds_it_and_keeps_its_heat_across_swaps(policy):
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.gateway.config import GatewayConfig
    from btbctl.engine.gateway.server import Gateway
    from btbctl.engine.trace.model import Request

    urls = [f"http://127.0.0.1:{20000 + i}" for i in range(4)]
    constants = BtbConstants(prefix_blocks=2, threshold=2, window_s=60.0, warm_replicas=2)
    gw = Gateway(GatewayConfig(workers=urls, policy=policy, page_size=16, seed=1, token="x", constants=constants))
    for w in gw.state.workers:
        w.healthy = True
    gw._install_policy(gw.policy, None)
    chain = tuple(f"b{i}" for i in range(8))  # deeper than Y = 2: btb_plus also tracks depths 4 and 8 itself

    def arrive(i: int) -> None:
        gw.lifecycle.pick(Request(f"r{i}", 0.0, 8 * 16, 4, block_hashes=chain), [])

    for i in range(3):
        arrive(i)
    now = gw.clock()
    key = chain[1]  # the detector tracks a prefix under its Y-th block
    assert gw.detector.arrivals_in_window(key, now) == 3  # once per request: not by both the policy and the gateway
    if policy == "btb_plus":  # its depth Y is the gateway's detector (one observation per request, not two)
        assert gw.policy._level(2) is gw.detector and gw.policy._level(4) is not gw.detector
    gw.set_policy("round_robin")  # the gateway feeds it now
    arrive(3)
    gw.set_policy(policy)
    arrive(4)
    assert gw.detector.arrivals_in_window(key, gw.clock()) == 5


def test_a_copys_rate_is_its_bytes_over_the_time_since_it_started_and_0_before():
    from btbctl.engine.copies import CopyState
    from btbctl.engine.gateway.state import Transfer

    now = [10.0]
    reads = []

    def clock() -> float:
        reads.append(now[0])
        return now[0]

    st = FleetState(["http://a", "http://b"], clock=clock)  # type: ignore[arg-type]
    for w in st.workers:
        w.healthy = True
    t = Transfer(copy_id="c0", key="k2", chain=("k1", "k2"), source=0, target=1, state=CopyState.RUNNING)
    t.bytes_total = 1000
    st.transfers.add(t)
    status = st.copy_status(1, ("k1", "k2"))
    assert status is not None and status.rate_bytes_per_s == 0.0 and status.available_bytes == 1000.0
    assert reads == []  # nothing sent yet: no rate to read the clock for
    t.started_s, t.bytes_sent = 8.0, 500
    status = st.copy_status(1, ("k1", "k2"))
    assert status is not None and status.rate_bytes_per_s == 250.0 and status.sent_bytes == 500.0
    assert reads == [10.0]
