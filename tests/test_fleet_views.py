"""One conformance test for every implementation of the fleet views policies read (``FleetView``, ``CostView`` in
:mod:`btbctl.engine.policies.base`): the simulator's, the infersim model's, the gateway's ``FleetState``, the test
fake, and ``ExcludingView`` wrapping each.

Each implementation is put in the same small situation: replica ``HOLDER`` holds chain ``A``, replica ``BUSY``
has requests in flight that compute chain ``B``, a copy of ``A`` is in flight towards replica ``TARGET``, and
replica ``SPARE`` is idle. The checks are the protocol's documented invariants: ``0 <= cached_blocks <=
pending_blocks <= len(chain)``; ``planned_blocks >= pending_blocks`` (no eviction here); a copy in flight counts
as pending and ``copy_in_flight`` there, never as cached; ``load`` counts requests; an ``ExcludingView`` hides the
excluded replicas' holdings, copies and headroom and changes nothing else.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import pytest

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan, CopyState
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.policies.base import CostView, ExcludingView, FleetView, Policy, Route
from btbctl.engine.sim.infersim import InferSimulator
from btbctl.engine.sim.simulator import Simulator
from btbctl.engine.trace.model import Request, Trace
from helpers import FakeFleet

HOLDER, BUSY, TARGET, SPARE = 0, 1, 2, 3
A = tuple(f"a{i}" for i in range(4))
B = tuple(f"b{i}" for i in range(3))
BT = 256
#: Chains every check reads: the two of the scenario, their leading parts, longer chains and unknown ones.
CHAINS: tuple[tuple[Hashable, ...], ...] = (A, A[:2], A + ("a-more",), B, B[:1], B + ("b-more",), ("zz0", "zz1"))

FLEET_MEMBERS = ("n_replicas", "load", "cached_blocks", "pending_blocks", "copy_in_flight", "accepts_copies")
COST_MEMBERS = (
    "planned_blocks",
    "queued_prefill_s",
    "prefill_load",
    "waiting_groups",
    "copy_status",
    "nic_copies",
    "admission_wait_s",
    "kv_headroom_tokens",
    "cost",
    "block_tokens",
    "chunk_tokens",
)


@dataclass
class Scenario:
    view: FleetView
    #: requests in flight on each replica
    loads: list[int]
    #: whether the implementation counts blocks a request is computing as pending (infersim does not model it)
    counts_prefill: bool = True


def _req(rid: str, chain: Sequence[Hashable], t: float = 0.0) -> Request:
    return Request(rid, t, len(chain) * BT + 16, 4, tuple(chain))


class _Probe(Policy[FleetView]):
    """Routes every request to BUSY; the first route also asks for a copy of A from HOLDER to TARGET; the second
    route hands the view to ``check`` (the simulators' state exists only while they run)."""

    name = "probe"

    def __init__(self, check: Callable[[FleetView], None] | None = None) -> None:
        super().__init__(4, random.Random(0), BtbConstants())
        self.check = check
        self.calls = 0
        self.checked = False

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        self.calls += 1
        if self.calls == 1:
            return Route(BUSY, (CopyPlan(A, HOLDER, (TARGET,), 1),))
        if self.calls == 2 and self.check is not None:
            self.check(view)
            self.checked = True
        return Route(BUSY)


def _cluster() -> ClusterConfig:
    return ClusterConfig(replicas=4)


def simulator(check: Callable[[Scenario], None]) -> None:
    """The realistic simulator, driven through its incremental API."""
    sim = Simulator(Trace([], BT, "generated"), _Probe(), _cluster(), BtbConstants())
    assert sim.insert_prefix(HOLDER, A) == len(A)
    sim.submit(_req("r1", B), replica=BUSY)
    sim.submit(_req("r2", B), replica=BUSY)
    assert sim.start_copy(A, HOLDER, TARGET, sim.now)
    check(Scenario(sim.view, [0, 2, 0, 0]))


def infersim(check: Callable[[Scenario], None]) -> None:
    """The infersim model, looked at from inside a run (its state exists only while it runs)."""
    probe = _Probe(lambda view: check(Scenario(view, [0, 1, 0, 0], counts_prefill=False)))
    sim = InferSimulator([_req("r1", B), _req("r2", B)], BT, probe, _cluster())
    sim.replicas[HOLDER].insert(A)
    sim.run()
    assert probe.checked


def gateway(check: Callable[[Scenario], None]) -> None:
    """The gateway's live state, set the way the data plane and the replicator set it."""
    st = FleetState([f"http://w{i}" for i in range(4)])
    for w in st.workers:  # as the health checker leaves them: up, with their /v1/loads and /btb/info
        w.healthy = True
        w.loads = {"running": 0, "waiting": 0, "used_tokens": 0, "max_tokens": 100_000, "token_usage": 0.0}
        w.btb = True
        w.info = {"transfer_addr": f"127.0.0.1:{4000 + w.index}"}
    st.workers[HOLDER].hold(A)
    busy = st.workers[BUSY]
    for rid in ("r1", "r2"):
        busy.inflight += 1
        busy.start_prefill(rid, B, len(B) * BT)
    # pushed, and the source has reported its first progress
    st.transfers.add(
        Transfer(
            "c1",
            str(A[-1]),
            A,
            HOLDER,
            TARGET,
            state=CopyState.RUNNING,
            bytes_sent=1000,
            bytes_total=4000,
            started_s=0.0,
        )
    )
    check(Scenario(st, [0, 2, 0, 0]))


def fake(check: Callable[[Scenario], None]) -> None:
    """The fake the policy tests route against."""
    f = FakeFleet(4)
    f.give(HOLDER, A)
    f.loads[BUSY] = 2
    f.pending[BUSY].update(B)
    assert f.replicate(A, HOLDER, TARGET, 0.0)
    check(Scenario(f, [0, 2, 0, 0]))


IMPLEMENTATIONS = [simulator, infersim, gateway, fake]


def _check_members(view: FleetView, protocol: type, names: Sequence[str]) -> None:
    """Every member exists; methods take the protocol's parameters, by name, first."""
    for name in names:
        assert hasattr(view, name), name
        want = inspect.getattr_static(protocol, name)
        if inspect.isfunction(want):
            wp = list(inspect.signature(want).parameters)[1:]  # without self
            hp = list(inspect.signature(getattr(view, name)).parameters)
            assert hp[: len(wp)] == wp, (name, wp, hp)


def _check_protocol(view: FleetView) -> bool:
    """The protocol members exist (isinstance on the runtime-checkable protocols, and each member with its
    parameters); returns whether ``view`` is a CostView too."""
    assert isinstance(view, FleetView)
    _check_members(view, FleetView, FLEET_MEMBERS)
    is_cost = isinstance(view, CostView)
    if is_cost:
        _check_members(view, CostView, COST_MEMBERS)
    return is_cost


def _check_invariants(view: FleetView, is_cost: bool) -> None:
    for r in range(view.n_replicas):
        assert view.load(r) >= 0
        for chain in CHAINS:
            cached, pending = view.cached_blocks(r, chain), view.pending_blocks(r, chain)
            assert 0 <= cached <= pending <= len(chain), (r, chain, cached, pending)
            if view.copy_in_flight(r, chain):
                assert pending == len(chain), (r, chain)
            if is_cost:
                assert view.planned_blocks(r, chain) >= pending, (r, chain)


def _check_scenario(view: FleetView, s: Scenario, is_cost: bool, spare_excluded: bool) -> None:
    assert view.n_replicas == 4
    assert [view.load(r) for r in range(4)] == s.loads  # load counts requests
    # the holder
    assert view.cached_blocks(HOLDER, A) == view.pending_blocks(HOLDER, A) == len(A)
    assert view.cached_blocks(HOLDER, A[:2]) == 2 and view.cached_blocks(HOLDER, A + ("a-more",)) == len(A)
    assert not view.copy_in_flight(HOLDER, A)
    # the copy in flight: pending and copy_in_flight at the target, never cached
    assert view.copy_in_flight(TARGET, A)
    assert view.cached_blocks(TARGET, A) == 0 and view.pending_blocks(TARGET, A) == len(A)
    # the requests computing B
    if s.counts_prefill:
        assert view.cached_blocks(BUSY, B) == 0 and view.pending_blocks(BUSY, B) == len(B)
    # the idle replica knows nothing
    assert all(view.pending_blocks(SPARE, c) == 0 for c in CHAINS)
    assert not any(view.copy_in_flight(SPARE, c) for c in CHAINS)
    # every replica takes part in copies, except one a wrapping view excludes
    assert [view.accepts_copies(r) for r in range(4)] == [not (spare_excluded and r == SPARE) for r in range(4)]
    if is_cost:
        cv: CostView = view
        st = cv.copy_status(TARGET, A)
        assert st is not None and st.source == HOLDER and st.total_bytes > 0
        assert 0 <= st.sent_bytes <= st.total_bytes
        assert cv.copy_status(HOLDER, A) is None and cv.copy_status(SPARE, A) is None
        assert cv.planned_blocks(TARGET, A) == len(A)
        assert cv.nic_copies(TARGET) >= 1 and cv.nic_copies(SPARE) == 0
        assert (cv.kv_headroom_tokens(SPARE) == 0) is spare_excluded  # an excluded replica has no room
        assert cv.kv_headroom_tokens(BUSY) > 0 and cv.block_tokens > 0 and cv.chunk_tokens >= 0
        assert cv.queued_prefill_s(SPARE) == 0.0 and cv.waiting_groups(SPARE) == []
        # requests without a first token yet: part of the load; the two computing B have none yet
        assert all(0 <= cv.prefill_load(r) <= cv.load(r) for r in range(4)) and cv.prefill_load(SPARE) == 0
        if s.counts_prefill:
            assert cv.prefill_load(BUSY) == 2
        assert cv.admission_wait_s(SPARE, 1) == 0.0
        assert cv.cost.model.kv_bytes_per_token > 0


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "excluding_spare"])
@pytest.mark.parametrize("build", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_every_fleet_view_keeps_the_protocols_invariants(build, wrapped):
    def check(s: Scenario) -> None:
        # excluding a replica that holds and receives nothing changes nothing the scenario checks
        view = ExcludingView(s.view, {SPARE}) if wrapped else s.view
        is_cost = _check_protocol(view)
        assert is_cost == isinstance(s.view, CostView)
        _check_invariants(view, is_cost)
        _check_scenario(view, s, is_cost, spare_excluded=wrapped)

    build(check)


@pytest.mark.parametrize("build", IMPLEMENTATIONS, ids=lambda f: f.__name__)
def test_excluding_view_hides_the_excluded_replicas_holdings_copies_and_headroom(build):
    def check(s: Scenario) -> None:
        inner = s.view
        view = ExcludingView(inner, {HOLDER, TARGET})
        is_cost = _check_protocol(view)
        _check_invariants(view, is_cost)
        for r in (HOLDER, TARGET):
            for chain in CHAINS:
                assert view.cached_blocks(r, chain) == view.pending_blocks(r, chain) == 0
                assert not view.copy_in_flight(r, chain)
                if is_cost:
                    assert view.planned_blocks(r, chain) == 0
                    assert view.copy_status(r, chain) is None
            if is_cost:
                assert view.kv_headroom_tokens(r) == 0
            assert not view.accepts_copies(r)
        # loads and everything about the other replicas are the inner view's
        assert view.n_replicas == inner.n_replicas
        assert [view.load(r) for r in range(4)] == [inner.load(r) for r in range(4)]
        for r in (BUSY, SPARE):
            for chain in CHAINS:
                assert view.cached_blocks(r, chain) == inner.cached_blocks(r, chain)
                assert view.pending_blocks(r, chain) == inner.pending_blocks(r, chain)
                assert view.copy_in_flight(r, chain) == inner.copy_in_flight(r, chain)
            assert view.accepts_copies(r) == inner.accepts_copies(r)
            if is_cost:
                assert view.kv_headroom_tokens(r) == inner.kv_headroom_tokens(r)
                assert view.queued_prefill_s(r) == inner.queued_prefill_s(r)
                assert view.prefill_load(r) == inner.prefill_load(r)

    build(check)


def test_a_view_without_the_cost_members_is_a_fleet_view_only():
    class Minimal:
        n_replicas = 1

        def load(self, replica: int) -> int:
            return 0

        def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
            return 0

        def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
            return 0

        def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
            return False

        def accepts_copies(self, replica: int) -> bool:
            return True

    m = Minimal()
    assert isinstance(m, FleetView) and not isinstance(m, CostView)
    assert isinstance(ExcludingView(m, {0}), FleetView) and not isinstance(ExcludingView(m, {0}), CostView)
    assert isinstance(ExcludingView(FakeFleet(1), {0}), CostView)
