"""The replica model on its own: driven by a minimal event loop, without a simulator."""

import math

import pytest

from btbctl.engine.config import ClusterConfig
from btbctl.engine.sim.replica import ReplicaModel, ReplicaRequest
from btbctl.engine.trace.model import Request

BT = 256
CLUSTER = ClusterConfig(model="llama-3.3-70b", gpu="h100", gpus_per_replica=4, replicas=1)
COST = CLUSTER.replica_cost()


def chain(tag, n):
    return tuple(f"{tag}-{k}" for k in range(n))


class Driver:
    """The smallest driver: one replica, its latest scheduled step end, and a log of what it reported."""

    def __init__(self):
        self.step = None
        self.log = []
        self.inserted = []
        self.evicted = []
        self.now = 0.0
        self.rep = ReplicaModel(
            0, COST, block_tokens=BT, chunk_tokens=CLUSTER.chunk_tokens(), max_running=CLUSTER.max_running, events=self
        )
        self.seq = 0

    # ReplicaEvents
    def step_scheduled(self, replica, end_s, version):
        self.step = (end_s, version)

    def admitted(self, replica, rq, matched_blocks):
        self.log.append(("admitted", rq.req.request_id, matched_blocks))

    def computed(self, replica, rq, start, stop):
        self.log.append(("computed", rq.req.request_id, start, stop))

    def first_token(self, replica, rq):
        self.log.append(("first", rq.req.request_id, rq.ttft_s, rq.cached_tokens))

    def finished(self, replica, rq, now_s):
        self.log.append(("finished", rq.req.request_id, now_s))

    def blocks_committed(self, replica):
        self.log.append(("committed",))

    def block_inserted(self, h):
        self.inserted.append(h)

    def block_evicted(self, h):
        self.evicted.append(h)

    # driving
    def submit(self, rid, blocks, out=1, at=None):
        if at is not None:
            self.run_until(at)
        self.seq += 1
        rq = ReplicaRequest(Request(rid, self.now, len(blocks) * BT, out, tuple(blocks), "burst"), self.seq)
        self.rep.enqueue(rq, self.now)
        return rq

    def run_until(self, t=math.inf):
        while self.step is not None and self.step[0] <= t:
            end, version = self.step
            self.step = None
            self.now = max(self.now, end)
            if version == self.rep.version:
                self.rep.end_step(self.now)
        if t != math.inf:
            self.now = max(self.now, t)

    def events(self, kind):
        return [e for e in self.log if e[0] == kind]


def test_a_request_runs_through_prefill_and_decode_and_reports_each_stage():
    d = Driver()
    rq = d.submit("a", chain("p", 40), out=3)
    assert d.rep.load == 1 and d.rep.state().busy
    d.run_until()
    assert d.events("admitted") == [("admitted", "a", 0)]
    assert d.events("computed") == [("computed", "a", 0, 32), ("computed", "a", 32, 40)]  # two 8192-token chunks
    ((_, _, ttft, cached),) = d.events("first")
    assert ttft == pytest.approx(COST.prefill_time_s(8192) + COST.prefill_time_s(40 * BT - 8192, 8192))
    assert cached == 0 and rq.ttft_s == ttft
    ((_, _, finish),) = d.events("finished")
    assert finish > ttft
    assert d.inserted == list(chain("p", 40))
    st = d.rep.state()
    assert (st.running, st.waiting, st.cached_blocks, st.busy) == (0, 0, 40, False)
    cache = d.rep.cache
    assert cache.private_tokens == 0 and cache.reserved_blocks == 0 and not cache.refs


def test_queue_estimates_count_queued_work_and_planned_blocks():
    d = Driver()
    p = chain("p", 64)
    d.submit("a", p)
    d.submit("b", p + chain("b", 4))
    # a is prefilling the prefix, b waits for it: b plans only its own 4 blocks of work
    assert d.rep.planned_blocks(p + chain("b", 4)) == 68
    assert d.rep.pending_blocks(p) == 64 and d.rep.cached_blocks(p) == 0
    groups = d.rep.waiting_groups()
    assert len(groups) == 1 and groups[0][:2] == (p[-1], 1)
    assert groups[0][2] == pytest.approx(COST.prefill_flops(4 * BT, 64 * BT) / (COST.flops * COST.mfu))
    assert d.rep.queued_prefill_s(d.now) > groups[0][2]
    d.run_until()
    assert d.rep.queued_prefill_s(d.now) == 0.0 and d.rep.waiting_groups() == []
    assert [e[3] for e in d.events("first") if e[1] == "b"] == [64 * BT]


def test_incoming_copy_makes_requests_wait_then_commits_or_is_dropped():
    d = Driver()
    p = chain("p", 16)
    inc = d.rep.begin_incoming(p)
    assert inc is not None and inc.have == 0 and inc.reserved == 16
    assert d.rep.pending_blocks(p) == 16 and d.rep.cached_blocks(p) == 0
    d.submit("a", p + chain("a", 1))
    d.run_until(10.0)
    assert d.events("admitted") == []  # waits for the copy instead of recomputing
    assert d.rep.end_incoming(inc, True) is True
    assert d.rep.end_incoming(inc, True) is False  # idempotent
    d.rep.kick(d.now)
    d.run_until()
    assert d.events("admitted") == [("admitted", "a", 16)]
    # a failed copy leaves nothing behind and the waiting request computes the blocks itself
    q = chain("q", 8)
    inc = d.rep.begin_incoming(q)
    d.submit("b", q + chain("b", 1))
    assert d.rep.end_incoming(inc, False) is False
    d.rep.kick(d.now)
    d.run_until()
    assert ("admitted", "b", 0) in d.log
    cache = d.rep.cache
    assert cache.reserved_blocks == 0 and not cache.refs
    for ch in (q, q + chain("b", 1)):  # nothing is left pending: every block is resident or unknown
        assert d.rep.pending_blocks(ch) == cache.match(ch) == len(ch)


def test_an_incoming_copy_claims_blocks_a_prefill_computes_only_when_asked():
    for claim in (True, False):
        d = Driver()
        p = chain("p", 64)
        d.submit("a", p)
        d.run_until(d.now)  # a is admitted: p is pending as a's
        inc = d.rep.begin_incoming(p + chain("x", 2), claim_pending=claim)
        assert d.rep.pending_blocks(p + chain("x", 2)) == 66  # a's blocks, then the copy's own
        d.rep.end_incoming(inc, False)
        # the failed copy takes the blocks it owns with it: the two of its own, and p's when it claimed them
        assert d.rep.pending_blocks(p + chain("x", 2)) == (0 if claim else 64)
        assert d.rep.cache.match(p) == 0


def test_room_for_an_incoming_copy_is_refused_when_the_cache_cannot_hold_it():
    d = Driver()
    too_many = COST.kv_budget_tokens // BT + 1
    assert d.rep.begin_incoming(chain("p", too_many)) is None
    assert d.rep.cache.reserved_blocks == 0 and not d.rep.cache.refs


def test_abort_ends_a_decoding_request_now_and_a_prefilling_one_at_its_first_token():
    d = Driver()
    a = d.submit("a", chain("p", 7), out=5000)
    d.run_until(2.0)
    assert d.rep.state().running == 1 and d.rep.abort(a, d.now) is True
    assert d.events("finished") == [("finished", "a", 2.0)]
    assert d.rep.abort(a, d.now) is False
    b = d.submit("b", chain("q", 60), out=5000)
    assert d.rep.abort(b, d.now) is True
    d.run_until()
    ((_, _, ttft, _),) = [e for e in d.events("first") if e[1] == "b"]
    assert [e for e in d.events("finished") if e[1] == "b"] == [("finished", "b", pytest.approx(2.0 + ttft))]


def test_insert_prefix_and_resident_chains():
    d = Driver()
    assert d.rep.insert_prefix(chain("p", 5), d.now) == 5
    assert d.rep.insert_prefix(chain("p", 5), d.now) == 0
    assert d.rep.insert_prefix(chain("p", 3) + chain("q", 2), d.now) == 2
    assert d.rep.is_resident("q-1") and d.rep.cached_blocks(chain("p", 5)) == 5
    assert d.rep.resident_chains(10) == [("q-1", 5), ("p-4", 5)]  # most recently used first
    assert d.rep.resident_chains(1) == [("q-1", 5)]
    assert d.rep.flush() == 7 and d.evicted and d.rep.state().cached_blocks == 0
