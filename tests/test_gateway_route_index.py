"""What the gateway's fleet state keeps for ``btb_plus`` between decisions, over random sequences of the events that
change it (requests sent, first bytes, finishes, holdings, copies starting and ending, loads reports, health, the
prefill calibration): the route index (``FleetState.route_index``) keeps the RouteIndex contract and ``btb_plus``
routes the same with it as without it (every worker priced); the queued prefill and the waiting groups, extended
as requests are sent, are the numbers a count from scratch gives."""

from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyState
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.policies.base import ExcludingView
from btbctl.engine.policies.btb_plus import BtbPlus
from btbctl.engine.trace.model import Request

PAGE = 4
#: chains of a few roots, with shared prefixes (so holders, pending blocks and copies overlap)
CHAINS = [
    tuple(f"r{root}:{k}" if k < 3 else f"r{root}:{k}:{tail}" for k in range(length))
    for root in range(3)
    for tail in range(2)
    for length in (2, 4, 6)
]

_event = st.one_of(
    st.tuples(st.just("send"), st.integers(0, 4), st.integers(0, len(CHAINS) - 1), st.integers(1, 40)),
    st.tuples(st.just("first_byte"), st.integers(0, 4), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("finish"), st.integers(0, 4), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("hold"), st.integers(0, 4), st.integers(0, len(CHAINS) - 1), st.just(0)),
    st.tuples(st.just("copy"), st.integers(0, 4), st.integers(0, len(CHAINS) - 1), st.integers(0, 4)),
    st.tuples(st.just("copy_end"), st.integers(0, 4), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("loads"), st.integers(0, 4), st.integers(0, 3), st.integers(0, 1)),
    st.tuples(st.just("health"), st.integers(0, 4), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("short"), st.integers(0, 4), st.integers(1, 3), st.just(0)),
    st.tuples(st.just("calibrate"), st.integers(0, 4), st.integers(1, 1000), st.just(0)),
)


def _fleet(n: int) -> FleetState:
    state = FleetState([f"http://127.0.0.1:{9000 + i}" for i in range(n)])
    state.page_size = PAGE
    for w in state.workers:
        w.healthy, w.btb = True, True
        w.info = {"page_size": PAGE, "transfer_addr": f"127.0.0.1:{9100 + w.index}", "capacity_tokens": 4096}
    return state


#: request ids, unique as the gateway's (``Gateway.next_request_id``): an id counted from the requests still in flight
#: came back after a finish and overwrote a request in flight (a state the gateway never reaches)
_RIDS = itertools.count()


def _apply(state: FleetState, event: tuple, sent: list, copies: list) -> None:
    """One event on ``state``; ``sent``: ``(worker, rid, prefilling)`` in flight, ``copies``: transfers."""
    kind, r, a, b = event
    n = len(state.workers)
    w = state.workers[r % n]
    if kind == "send":
        rid = f"q{next(_RIDS)}-{a}"
        w.inflight += 1
        w.start_prefill(rid, CHAINS[a], b * PAGE)
        sent.append([w.index, rid, True])
    elif kind in ("first_byte", "finish") and sent:
        entry = sent[a % len(sent)]
        ws = state.workers[entry[0]]
        if entry[2]:
            ws.end_prefill(entry[1])
            entry[2] = False
        if kind == "finish":
            ws.inflight -= 1
            sent.remove(entry)
    elif kind == "hold":
        w.hold(CHAINS[a])
    elif kind == "copy":
        source = b % n
        if source != w.index and not state.transfers.in_flight(w.index, CHAINS[a][-1]):
            t = Transfer(copy_id=f"c{len(copies)}", key=CHAINS[a][-1], chain=CHAINS[a], source=source, target=w.index)
            t.bytes_total, t.blocks_available = 1 << 20, len(CHAINS[a]) // 2
            state.transfers.add(t)
            copies.append(t)
    elif kind == "copy_end":
        live = [t for t in copies if t.active]
        if live:
            t = live[a % len(live)]
            t.state = CopyState.DONE if a % 2 else CopyState.FAILED
            state.transfers.finish(t)
            if t.state is CopyState.DONE:
                state.workers[t.target].hold(t.chain)
    elif kind == "loads":
        w.new_loads(None if a == 0 else {"max_tokens": 4096 if b else 0, "used_tokens": 100 * a, "waiting": a - 1})
    elif kind == "health":
        w.healthy = bool(a)
    elif kind == "short":  # a prompt shorter than one block: tokens, no chain
        rid = f"q{next(_RIDS)}-short"
        w.inflight += 1
        w.start_prefill(rid, (), a)
        sent.append([w.index, rid, True])
    elif kind == "calibrate":  # a measured prefill moves the cost model
        state.observe_prefill(4096, 0, a / 100.0)


def _check_contract(state: FleetState) -> None:
    index = state.route_index()
    # empty, or every worker with load 0 in ascending order (read through the view, not the index's own lists)
    assert index.idle_order in ([], [r for r in range(state.n_replicas) if state.load(r) == 0])
    assert index.idle == set(index.idle_order)
    for r in index.idle:
        assert state.prefill_load(r) == 0
        assert state.queued_prefill_s(r) == 0.0 and state.admission_wait_s(r, 10**9) == 0.0
        assert state.waiting_groups(r) == []
    for chain in CHAINS:
        held = set(index.holders(chain[0]))
        planned = {r for r in range(state.n_replicas) if state.planned_blocks(r, chain)}
        assert planned <= held, (chain, planned, held)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.lists(_event, max_size=40), st.integers(0, 2**16))
def test_the_index_keeps_its_contract_and_btb_plus_routes_the_same(n, events, seed):
    state = _fleet(n)
    constants = BtbConstants(prefix_blocks=2, threshold=2, window_s=5.0, warm_replicas=3)
    indexed = BtbPlus(n, random.Random(seed), constants)
    full = BtbPlus(n, random.Random(seed), constants)
    full.use_route_index = False
    sent: list = []
    copies: list = []
    now = 0.0
    for i, event in enumerate(events):
        _apply(state, event, sent, copies)
        _check_contract(state)
        now += 0.01
        chain = CHAINS[(seed + i) % len(CHAINS)]
        req = Request(str(i), now, len(chain) * PAGE, 4, chain)
        assert indexed.route(req, state, now) == full.route(req, state, now)
    assert indexed.stats() == full.stats()


class _FromScratch:
    """The queued prefill counted afresh on every call, with the cost model in force (the fleet state's definition,
    kept here as the reference; nothing remembered, so it cannot go stale with the state)."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def queue(self, replica: int) -> tuple[float, dict]:
        state = self.state
        w = state.workers[replica]
        cost = state.cost
        rate = cost.flops * cost.mfu
        bt = state.page_size
        total = 0.0
        groups: dict = {}
        seen: set = set()
        for rid, chain in w.prefill_chains.items():
            tokens = w.prefill_tokens.get(rid) or len(chain) * bt
            held = k = w.held_blocks(chain)
            if state.transfers.active:
                k = max(k, state.transfers.depth_to(replica, chain))
            while k < len(chain) and chain[k] in seen:
                k += 1
            seen.update(chain[k:])
            have = min(k * bt, tokens - 1) if tokens > 1 else 0
            work = cost.prefill_flops(tokens - have, have) / rate
            total += work
            if k > held:
                g = groups.setdefault(chain[k - 1], [0, 0.0])
                g[0] += 1
                g[1] += work
        for rid in w.prefill_tokens.keys() - w.prefill_chains.keys():
            total += cost.prefill_flops(w.prefill_tokens[rid], 0) / rate
        return total, groups


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.lists(_event, max_size=60))
def test_the_queue_extended_as_requests_are_sent_equals_a_count_from_scratch(n, events):
    state = _fleet(n)
    ref = _FromScratch(state)
    sent: list = []
    copies: list = []
    for event in events:
        _apply(state, event, sent, copies)
        for r in range(n):
            total, groups = ref.queue(r)
            assert state.queued_prefill_s(r) == total  # the same float, not a close one
            assert state.waiting_groups(r) == [(b, g[0], g[1]) for b, g in groups.items()]


def _pending_from_scratch(state: FleetState, replica: int, chain: tuple) -> int:
    """Leading blocks of ``chain`` held, computed by a request in flight, or arriving by a routable copy in flight
    on ``replica``, counted block by block (the fleet state's definition, nothing remembered or skipped)."""
    w = state.workers[replica]
    if not w.healthy:
        return 0
    k = 0
    while k < len(chain) and (chain[k] in w.holdings or chain[k] in w.pending):
        k += 1
    for t in state.transfers.active.values():
        m = len(t.chain)
        if t.target == replica and t.routable and m <= len(chain) and tuple(chain[:m]) == tuple(t.chain):
            k = max(k, m)
    return k


def _idle_from_scratch(state: FleetState) -> list[int]:
    free = [w for w in state.workers if not w.inflight]
    idle = [
        w.index
        for w in free
        if not (w.prefilling or w.prefill_chains or w.prefill_tokens or (w.loads and w.loads.get("max_tokens")))
    ]
    return idle if len(idle) == len(free) else []


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.lists(_event, max_size=60))
def test_the_reads_kept_between_decisions_equal_a_count_from_scratch(n, events):
    """After every event: the queued prefill and the waiting groups (kept per worker, and 0 / none without reading
    the memo on a worker with nothing queued), the leading blocks planned on every worker for every chain (the
    copies' scan skipped when the whole chain is held or pending), whether a copy is arriving (``has_copy``, also
    through a retry's view that excludes the worker), and the idle workers of the route index are what a count from
    scratch gives."""
    state = _fleet(n)
    ref = _FromScratch(state)
    sent: list = []
    copies: list = []
    for event in events:
        _apply(state, event, sent, copies)
        for r in range(n):
            total, groups = ref.queue(r)
            assert state.queued_prefill_s(r) == total
            assert state.waiting_groups(r) == [(b, g[0], g[1]) for b, g in groups.items()]
            for chain in CHAINS:
                assert state.planned_blocks(r, chain) == _pending_from_scratch(state, r, chain), (r, chain)
                assert state.has_copy(r, chain) == (state.copy_status(r, chain) is not None)
                assert not ExcludingView(state, [r]).has_copy(r, chain)
        assert state.route_index().idle_order == _idle_from_scratch(state)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.lists(_event, max_size=40), st.integers(0, 2**16))
def test_btb_plus_prices_every_worker_as_its_one_by_one_estimate(n, events, seed):
    """``BtbPlus._estimates`` (the pass over the priced workers, with its common cases inlined) gives each worker the
    very floats of :meth:`BtbPlus.estimate`, after random events (copies in flight, holdings, queues, loads)."""
    from btbctl.engine.policies.btb_plus import _LazyGroups

    state = _fleet(n)
    policy = BtbPlus(n, random.Random(seed), BtbConstants(prefix_blocks=2, threshold=2, window_s=5.0, warm_replicas=3))
    sent: list = []
    copies: list = []
    now = 0.0
    for i, event in enumerate(events):
        _apply(state, event, sent, copies)
        now += 0.01
        chain = CHAINS[(seed + i) % len(CHAINS)]
        req = Request(str(i), now, len(chain) * PAGE + i % 3, 4, chain)
        policy.detect(chain, now)  # the hot prefixes' chains, as a route records them
        depths = policy.depths(len(chain))
        ests: dict = {}
        own0 = policy._cold_prefill_s(state, req)
        policy._estimates(state, req, now, depths, _LazyGroups(policy, state, now), range(n), ests, own0)
        for r in range(n):
            assert ests[r] == policy.estimate(state, r, req, now, depths), (r, ests[r])
