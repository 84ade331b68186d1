"""Helpers shared by several test files."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

import pytest

from btbctl.commands.app import main
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyStatus, carry_out
from btbctl.engine.costmodel import ReplicaCost, gpu_preset, model_preset
from btbctl.engine.policies.base import Policy, Route


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI entry point in-process (with its error funnel); return (exit code, stdout, stderr)."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def assert_close(a, b, path: str = "") -> None:
    """Assert two JSON-like values are equal, floats to 1e-9 relative (NaN equals NaN); ``path`` names the spot."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ"
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) or isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def leading_run(chain, blocks) -> int:
    """How many of ``chain``'s first blocks are in ``blocks``, counting up to the first one that is not."""
    n = 0
    for h in chain:
        if h not in blocks:
            break
        n += 1
    return n


class Copy(NamedTuple):
    """A copy the fake fleet's executor accepted (:meth:`FakeFleet.replicate`)."""

    prefix: tuple
    source: int
    target: int
    now_s: float
    hot_since_s: float | None


class FakeFleet:
    """A :class:`~btbctl.engine.policies.base.FleetView` and ``CostView`` with settable state, plus the executor
    the policy tests carry copy plans out on (:meth:`replicate`, see :func:`route`).

    Per replica ``r`` (lists indexed by replica; change them at will):

    * ``loads[r]``: requests in flight there.
    * ``cached[r]``: resident block hashes (a chain's leading run inside counts).
    * ``pending[r]``: blocks being computed there (count as pending and planned, never as cached).
    * ``planned[r]``: blocks a request queued there will compute (count as planned only).
    * ``in_flight[r]``: copies arriving there, ``{last block: (prefix, CopyStatus)}`` (pending, never cached).
    * ``queued[r]``: seconds of queued prefill; ``groups[r]``: waiting groups; ``headroom[r]``: KV tokens a copy
      may use.

    * ``after_s``: seconds a copy takes beyond its bytes and the source's prefill (``copy_after_s``; 0: push).
    * ``no_copies``: replicas that cannot take part in a copy (``accepts_copies`` False: a worker without the BTB
      routes); ``prefilling``: per replica, requests without a first token yet (None: ``loads``).

    ``copies`` logs every copy :meth:`replicate` accepted; it refuses a copy to itself, to a replica in ``refuse``
    or ``no_copies``, from a source in ``no_copies``, or of a chain already arriving there. :meth:`land_copies`
    makes every copy in flight resident at its target.
    The cost view is Llama-3.3-70B on 4 x H100 (``cost`` to change it), 256-token blocks, chunks of 8192 tokens.
    """

    block_tokens = 256
    chunk_tokens = 8192

    def __init__(self, n: int, loads: Sequence[int] | None = None, cost: ReplicaCost | None = None) -> None:
        self.n_replicas = n
        self.cost = cost or ReplicaCost(model_preset("llama-3.3-70b"), gpu_preset("h100"), 4)
        self.loads = list(loads) if loads is not None else [0] * n
        self.cached: list[set] = [set() for _ in range(n)]
        self.pending: list[set] = [set() for _ in range(n)]
        self.planned: list[set] = [set() for _ in range(n)]
        self.in_flight: list[dict] = [{} for _ in range(n)]
        self.queued = [0.0] * n
        self.groups: list[list] = [[] for _ in range(n)]
        self.headroom = [self.cost.kv_budget_tokens] * n
        self.copies: list[Copy] = []
        self.refuse: set[int] = set()
        self.no_copies: set[int] = set()
        self.prefilling: list[int] | None = None
        self.after_s = 0.0

    # -- FleetView ---------------------------------------------------------------------------------------------

    def load(self, replica: int) -> int:
        return self.loads[replica]

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return leading_run(chain, self.cached[replica])

    def _arriving(self, replica: int) -> set:
        out: set = set()
        for prefix, _ in self.in_flight[replica].values():
            out.update(prefix)
        return out

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return leading_run(chain, self.cached[replica] | self.pending[replica] | self._arriving(replica))

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return bool(chain) and chain[-1] in self.in_flight[replica]

    def accepts_copies(self, replica: int) -> bool:
        return replica not in self.no_copies

    # -- CostView ----------------------------------------------------------------------------------------------

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return leading_run(
            chain, self.cached[replica] | self.pending[replica] | self._arriving(replica) | self.planned[replica]
        )

    def queued_prefill_s(self, replica: int) -> float:
        return self.queued[replica]

    def prefill_load(self, replica: int) -> int:
        return self.loads[replica] if self.prefilling is None else self.prefilling[replica]

    def waiting_groups(self, replica: int) -> list:
        return list(self.groups[replica])

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        got = self.in_flight[replica].get(chain[-1]) if chain else None
        return None if got is None else got[1]

    def nic_copies(self, replica: int) -> int:
        return sum(
            1 for r in range(self.n_replicas) for _, st in self.in_flight[r].values() if replica in (r, st.source)
        )

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        return 0.0

    def kv_headroom_tokens(self, replica: int) -> int:
        return self.headroom[replica]

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return self.copy_status(replica, chain) is not None

    def copy_after_s(self, replica: int, blocks: int) -> float:
        return self.after_s

    # -- the executor and test controls -------------------------------------------------------------------------

    def arrive(
        self, replica: int, prefix: Sequence[Hashable], source: int = 0, status: CopyStatus | None = None
    ) -> None:
        """Put a copy of ``prefix`` in flight towards ``replica`` (nothing sent yet unless ``status`` says)."""
        prefix = tuple(prefix)
        if status is None:
            total = len(prefix) * self.block_tokens * self.cost.model.kv_bytes_per_token
            status = CopyStatus(source, total, 0.0, total, self.cost.nic_bytes_per_s)
        self.in_flight[replica][prefix[-1]] = (prefix, status)

    def replicate(
        self, chain: Sequence[Hashable], source: int, target: int, now_s: float, hot_since_s: float | None = None
    ) -> bool:
        if source == target or target in self.refuse or chain[-1] in self.in_flight[target]:
            return False
        if source in self.no_copies or target in self.no_copies:
            return False
        self.arrive(target, chain, source)
        self.copies.append(Copy(tuple(chain), source, target, now_s, hot_since_s))
        return True

    def land_copies(self) -> None:
        for r in range(self.n_replicas):
            for prefix, _ in self.in_flight[r].values():
                self.cached[r].update(prefix)
            self.in_flight[r].clear()

    def give(self, replica: int, blocks: Sequence[Hashable]) -> None:
        self.cached[replica].update(blocks)


class Scripted(Policy):
    """A test policy: routes by ``route_fn(request)``; ``on_arrival(request, view, now_s)`` may read the view and
    return copy plans for the executor. Every copy attempt is recorded in ``results`` as
    ``(plan, target, started)``."""

    name = "scripted"

    def __init__(self, n, route_fn=lambda r: 0, on_arrival=None):
        super().__init__(n, random.Random(0), BtbConstants())
        self.route_fn = route_fn
        self.on_arrival = on_arrival
        self.results = []

    def route(self, req, view, now_s):
        plans = self.on_arrival(req, view, now_s) if self.on_arrival else None
        return Route(self.route_fn(req), tuple(plans or ()))

    def on_copy_result(self, plan, target, started, now_s):
        self.results.append((plan, target, started))


def route(policy, req, view, now_s):
    """Route ``req`` with ``policy`` and carry its copy plans out on ``view.replicate(chain, source, target, now_s,
    hot_since_s)`` (a fake view's executor), reporting each attempt to the policy; returns the chosen replica."""
    r = policy.route(req, view, now_s)
    for plan in r.copies:
        carry_out(
            plan,
            lambda t, p=plan: view.replicate(p.prefix, p.source, t, now_s, p.hot_since_s),
            lambda t, ok, p=plan: policy.on_copy_result(p, t, ok, now_s),
        )
    return r.replica


class PlainInferSimKv:
    """Infer-Sim's ``Node.match`` / ``Node.insert``, block by block, with the fleet counts the model keeps: the
    reference the infersim model's run cache (``sim.infersim._KvCache``, same constructor and methods) must agree
    with."""

    def __init__(self, budget_blocks: int, chains: object, fleet: dict[Hashable, int]) -> None:
        self.budget = budget_blocks
        self.fleet = fleet
        self.hbm: OrderedDict[Hashable, None] = OrderedDict()
        self.hwhere: dict[Hashable, None] = {}  # the host set

    def blocks(self) -> Iterator[Hashable]:
        return iter(list(self.hbm))

    def match(self, chain: Sequence[Hashable]) -> tuple[int, int]:
        a = b = 0
        for h in chain:
            if h in self.hbm:
                a += 1
            elif h in self.hwhere:
                b += 1
            else:
                break
        return a, b

    def hbm_run(self, chain: Sequence[Hashable]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.hbm:
            n += 1
        return n

    def insert(self, chain: Sequence[Hashable], extra: tuple = ()) -> None:
        for h in (*chain, *extra):
            if h in self.hbm:
                self.hbm.move_to_end(h)
                continue
            if h in self.hwhere:
                del self.hwhere[h]
            else:
                self.fleet[h] = self.fleet.get(h, 0) + 1
            self.hbm[h] = None
        while len(self.hbm) > self.budget:
            h, _ = self.hbm.popitem(last=False)
            self.hwhere[h] = None
