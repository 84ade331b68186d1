"""``btb_plus`` keeps rule 5's estimates and rule 4's copy checks between routing decisions under the gateway's change
stamps (``FleetState.change_stamps``): every input the kept answers read (load, health, KV use, queued prefill,
holdings, copy progress, the other workers' TTFT, the cost model, the policy's own expectations) changed between two
decisions is seen by the second one, and over random sequences of events a policy that keeps its prices routes
exactly as one that prices everything afresh."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyState
from btbctl.engine.gateway.state import FleetState, Stamps, Transfer
from btbctl.engine.policies.btb_plus import BtbPlus, _LazyGroups
from btbctl.engine.trace.model import Request
from test_gateway_route_index import CHAINS, PAGE, _apply, _fleet

CONSTANTS = BtbConstants(prefix_blocks=2, threshold=2, window_s=5.0, warm_replicas=3)
#: tokens per block in the two-decision checks (large enough for a held prefix to shorten the prefill)
BIG_PAGE = 2048


class _Clock:
    """The fleet state's clock, moved by the test (copies' measured rates read it)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def _pair(n: int, seed: int) -> tuple[BtbPlus, BtbPlus]:
    kept = BtbPlus(n, random.Random(seed), CONSTANTS)
    fresh = BtbPlus(n, random.Random(seed), CONSTANTS)
    fresh.keep_prices = False
    return kept, fresh


def _estimates(policy: BtbPlus, state: FleetState, req: Request, now_s: float) -> dict[int, tuple]:
    """``_estimates`` of ``req`` on every worker, as ``route`` reads them (with the view's stamps)."""
    depths = policy.depths(len(req.block_hashes))
    out: dict = {}
    own0 = policy._cold_prefill_s(state, req)
    groups = _LazyGroups(policy, state, now_s)
    stamps = state.change_stamps() if policy.keep_prices else None
    n = state.n_replicas
    policy._estimates(state, req, now_s, depths, groups, range(n), out, own0, planned_out={}, stamps=stamps)
    return out


def _running_copy(state: FleetState, chain: tuple, source: int, target: int) -> Transfer:
    t = Transfer(copy_id="c1", key=chain[-1], chain=chain, source=source, target=target)
    t.bytes_total, t.blocks_available = 1 << 34, 0
    state.transfers.add(t)
    return t


#: the copied prefix in the two-decision checks: a depth the policy looks for copies at (Y = 2: 2, 4, ...)
COPIED = CHAINS[2][:4]


def _set_loads(state: FleetState) -> None:
    state.workers[1].ttft_ewma_s = 0.3
    state.workers[1].new_loads({"max_tokens": 4096, "used_tokens": 4000, "waiting": 3})


def _more_kv(state: FleetState) -> None:
    state.workers[1].send_kv(4096)


def _copy(state: FleetState) -> Transfer:
    return state.transfers.active[(3, COPIED[-1])]


#: (what changes, setup before the first decision, the change between the two decisions)
CHANGES: list[tuple[str, Callable[[FleetState], None], Callable[[FleetState], None]]] = [
    ("queued prefill", lambda s: None, lambda s: s.workers[1].start_prefill("q", CHAINS[4], 8 * BIG_PAGE)),
    ("health", lambda s: None, lambda s: setattr(s.workers[1], "healthy", False)),
    ("holdings", lambda s: None, lambda s: s.workers[2].hold(CHAINS[2])),
    ("evicted blocks", lambda s: None, lambda s: s.workers[1].drop_blocks([CHAINS[2][-1]])),
    ("loads report", lambda s: None, _set_loads),
    (
        "KV sent since the report",
        lambda s: (
            setattr(s.workers[1], "ttft_ewma_s", 0.3),
            s.workers[1].new_loads({"max_tokens": 4096, "used_tokens": 100, "waiting": 0}),
        ),
        _more_kv,
    ),
    (
        "the other workers' TTFT",
        lambda s: (
            s.workers[1].new_loads({"max_tokens": 4096, "used_tokens": 4000, "waiting": 3}),
            setattr(s.workers[0], "ttft_ewma_s", 0.5),
        ),
        lambda s: setattr(s.workers[0], "ttft_ewma_s", 2.0),
    ),
    (
        "copy progress",
        lambda s: _running_copy(s, COPIED, 1, 3),
        lambda s: setattr(_copy(s), "bytes_sent", 1 << 33),
    ),
    (
        "a copy's end",
        lambda s: _running_copy(s, COPIED, 1, 3),
        lambda s: (setattr(_copy(s), "state", CopyState.FAILED), s.transfers.finish(_copy(s))),
    ),
    ("a copy's start", lambda s: None, lambda s: _running_copy(s, COPIED, 1, 3)),
    ("cost model (calibration)", lambda s: None, lambda s: s.observe_prefill(4096, 0, 50.0)),
]
#: changes caught without the stamps too (a new cost model object)
NOT_BY_STAMPS = {"cost model (calibration)"}


@pytest.mark.parametrize("what,setup,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_change_between_two_decisions_is_seen_by_the_second(what, setup, change, monkeypatch):
    """The kept estimates after the change are the fresh ones, and differ from those before it (so the change is one
    the estimates read). With the stamps frozen (no writer stamping), the kept estimates would be stale: the check
    fails without the invalidation."""

    def run(frozen: bool) -> tuple[dict, dict, dict]:
        state = _fleet(4)
        state.page_size = BIG_PAGE
        state.workers[1].hold(CHAINS[2])
        setup(state)
        kept, fresh = _pair(4, 1)
        req = Request("a", 0.0, len(CHAINS[2]) * BIG_PAGE, 4, CHAINS[2])
        before = _estimates(kept, state, req, 0.0)
        assert before == _estimates(fresh, state, req, 0.0)
        with monkeypatch.context() as m:
            if frozen:
                for name in ("worker_changed", "copy_changed", "fleet_changed"):
                    m.setattr(Stamps, name, lambda *a, **k: None)
            change(state)
        return before, _estimates(kept, state, req, 0.0), _estimates(fresh, state, req, 0.0)

    before, after, want = run(frozen=False)
    assert after == want
    assert after != before, f"{what}: the change must move an estimate"
    if what in NOT_BY_STAMPS:
        return
    _, stale, want = run(frozen=True)
    assert stale != want, f"{what}: without the stamps the kept estimates would be stale"


def test_a_queue_on_the_chosen_worker_moves_the_next_request_elsewhere():
    """Two holders, the first request's worker then gets a long prefill queue: the next request of the same shape
    goes to the other holder (its kept price is not reused)."""
    state = _fleet(4)
    for r in (1, 2):
        state.workers[r].hold(CHAINS[2])
        state.workers[r].inflight = 1  # not idle: only the holders are priced one by one
    for r in (0, 3):
        state.workers[r].inflight = 2
    kept, fresh = _pair(4, 3)
    first = kept.route(Request("a", 0.0, 24, 4, CHAINS[2]), state, 0.0)
    assert first == fresh.route(Request("a", 0.0, 24, 4, CHAINS[2]), state, 0.0)
    for i in range(5):
        state.workers[first.replica].start_prefill(f"long{i}", CHAINS[5], 4000)
    second = kept.route(Request("b", 0.01, 24, 4, CHAINS[2]), state, 0.01)
    assert second == fresh.route(Request("b", 0.01, 24, 4, CHAINS[2]), state, 0.01)
    assert second.replica != first.replica


#: event kinds of the random sequences, weighted towards what the kept prices read across decisions (copies of the
#: decisions' chains and their progress, loads reports, TTFT)
KINDS = ["send", "first_byte", "finish", "hold", "copy", "copy", "copy_end", "loads", "loads", "health", "short"] + [
    "calibrate",
    "progress",
    "progress",
    "progress",
    "ttft",
    "ttft",
    "tick",
]


def _apply_more(state: FleetState, clock: _Clock, event: tuple, sent: list, copies: list) -> None:
    """One event (``_apply``'s, and a copy's progress, a worker's TTFT, the clock moving)."""
    kind, r, a, b = event
    w = state.workers[r % len(state.workers)]
    if kind == "progress":  # a copy's source reports: running, bytes moved, blocks computed
        live = [t for t in copies if t.active]
        if live:
            t = live[a % len(live)]
            t.state = CopyState.RUNNING
            if t.started_s is None:
                t.started_s = clock.now_s
            t.bytes_total = 1 << 34  # seconds of bytes: their progress moves the landing
            t.bytes_sent = min(t.bytes_total, t.bytes_sent + (b << 31))
            t.blocks_available = min(len(t.chain), b)
    elif kind == "ttft":
        w.ttft_ewma_s = None if a == 0 else a / 10.0
    elif kind == "tick":
        clock.now_s += a / 100.0
    else:
        _apply(state, event, sent, copies)


@pytest.mark.parametrize("part", range(4))
def test_kept_prices_route_exactly_as_fresh_ones(part):
    """Seeded random events between decisions (two decisions per event, of root 0's chains, so kept prices are
    reused, also over events that change nothing they read): every worker's estimate, and the routes, plans and
    counters of a policy that keeps its prices equal those of one that prices afresh. (Without the stamping of a
    copy's progress, or of the other workers' TTFT, about one sequence in eight fails.)"""
    for trial in range(part * 50, part * 50 + 50):
        rng = random.Random(trial)
        n = rng.randint(2, 4)
        state = _fleet(n)
        clock = _Clock()
        state.clock = clock
        kept, fresh = _pair(n, trial)
        sent: list = []
        copies: list = []
        for i in range(30):
            kind = rng.choice(KINDS)
            if kind in ("copy", "hold", "send"):
                a = rng.randint(0, 5)  # root 0's chains
            else:
                a = rng.randint(0, 3) if kind == "loads" else rng.randint(0, 30)
            b = rng.randint(0, 1) if kind == "loads" else rng.randint(0, 6)
            _apply_more(state, clock, (kind, rng.randint(0, 4), a, b), sent, copies)
            k = rng.randint(0, 5)
            for j in range(2):
                now = clock.now_s + 0.001 * j
                chain = CHAINS[(k + j) % 6]
                req = Request(f"{i}.{j}", now, len(chain) * PAGE, 4, chain)
                assert _estimates(kept, state, req, now) == _estimates(fresh, state, req, now), (trial, i, j)
                assert kept.route(req, state, now) == fresh.route(req, state, now), (trial, i, j)
        assert kept.stats() == fresh.stats(), trial
