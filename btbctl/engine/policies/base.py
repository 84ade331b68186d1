"""The routing-policy protocol, the route it returns, and the fleet views policies read.

A policy is asked, for each arriving request, which replica serves it. It sees the fleet only through a
:class:`FleetView` (loads, what each replica's prefix cache holds, copies in flight); ``btb_plus`` also reads a
:class:`CostView` (queued work, copy progress, the cost model). It **changes nothing**: it answers with a
:class:`Route`, the replica plus any :class:`~btbctl.engine.copies.CopyPlan` it wants carried out, and an executor
(the simulator, the gateway's replicator) carries the plans out and reports each attempt back through
:meth:`Policy.on_copy_result`. Time is always passed in (``now_s``); no policy reads the wall clock, so the same code
runs live (gateway) and simulated.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan, CopyStatus
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.trace.model import Request

if TYPE_CHECKING:
    from btbctl.engine.detector import BurstDetector


@dataclass(frozen=True, slots=True)
class Route:
    """A policy's answer: the replica that serves the request, and copies to start.

    Attributes:
        replica: index of the serving replica (``0 .. n_replicas - 1``).
        copies: copy plans for the executor, in order.
        pace: 0 to send the request at once; else the most requests that may wait for their first token at the
            replica when this one is sent: a gateway holds it (in arrival order) until fewer do, so that a burst's
            queue reaches the replica in small prefill batches (a batch's first tokens all come at its end). The
            simulator sends every request at once.
    """

    replica: int
    copies: tuple[CopyPlan, ...] = ()
    pace: int = 0


@runtime_checkable
class FleetView(Protocol):
    """What every policy may read about the fleet. Replicas are numbered ``0 .. n_replicas - 1``.

    Invariants (checked for every implementation by the view conformance test):
    ``0 <= cached_blocks <= pending_blocks <= len(chain)``; a copy in flight towards a replica counts as pending
    there, never as cached.
    """

    @property
    def n_replicas(self) -> int:
        """Number of replicas."""
        ...

    def load(self, replica: int) -> int:
        """Requests the router has in flight to ``replica`` (running + waiting there)."""
        ...

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are computed and resident in ``replica``'s KV cache now."""
        ...

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are resident *or on their way* to ``replica`` (being prefilled
        there or arriving by copy). Always >= :meth:`cached_blocks`."""
        ...

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether a copy of (a prefix ending with) ``chain[-1]`` towards ``replica`` is in flight."""
        ...

    def accepts_copies(self, replica: int) -> bool:
        """Whether ``replica`` can take part in a copy now, as its source or its target (the simulators' replicas
        always can; a gateway's worker can while it is healthy and serves the BTB routes). A policy plans no copy
        to or from a replica that cannot."""
        ...


@runtime_checkable
class CostView(FleetView, Protocol):
    """What ``btb_plus`` reads besides :class:`FleetView`: queued work, copy progress and the cost model."""

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are resident, on their way, or will be computed by a request already
        queued on ``replica`` (so a new request there would reuse them). >= :meth:`pending_blocks` up to
        evictions."""
        ...

    def queued_prefill_s(self, replica: int) -> float:
        """Seconds of prefill compute queued on ``replica`` ahead of a new request, counting for each queued request
        only the prompt tokens it must compute itself (attention included). O(1)."""
        ...

    def prefill_load(self, replica: int) -> int:
        """Requests on ``replica`` that have not produced their first token yet (waiting or prefilling there): the
        part of :meth:`load` whose time to first token a new prefill there can still delay. O(1)."""
        ...

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        """Requests waiting on ``replica`` for a block not resident there yet, grouped by that block:
        ``(block hash, requests, seconds of their queued prefill)``. Part of :meth:`queued_prefill_s`, but they
        cannot start before the block is there (meanwhile later requests may run)."""
        ...

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        """The in-flight copy of ``chain`` (keyed by its last block) towards ``replica``, or None."""
        ...

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether :meth:`copy_status` is not None (a view may answer it without building the status)."""
        ...

    def nic_copies(self, replica: int) -> int:
        """Copies in flight sending from or received by ``replica`` (they share its NIC)."""
        ...

    def copy_after_s(self, replica: int, blocks: int) -> float:
        """Seconds (>= 0) a copy of ``blocks`` blocks towards ``replica`` takes beyond its bytes and the source's
        prefill before ``replica`` can use it: 0 where blocks land in its KV cache as they arrive (push, the
        simulators); an ``l3`` copy's write-through and proof (the gateway's ``L3Replicator.after_s``)."""
        ...

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        """Seconds of decoding ``replica`` must do before its KV cache has room for the requests waiting there plus
        a new one needing ``kv_tokens`` tokens; 0 when they fit now. Adds to :meth:`queued_prefill_s`."""
        ...

    def kv_headroom_tokens(self, replica: int) -> int:
        """KV-cache tokens ``replica`` could free for a new copy now (free + evictable)."""
        ...

    @property
    def cost(self) -> ReplicaCost:
        """The cost model of one replica (all replicas are alike)."""
        ...

    @property
    def block_tokens(self) -> int:
        """Tokens per block of the chains the policy sees."""
        ...

    @property
    def chunk_tokens(self) -> int:
        """Most new prompt tokens one prefill step computes on a replica (chunked prefill); 0: not chunked."""
        ...


class RouteIndex(Protocol):
    """Fleet-wide lookups a view may offer (``view.route_index()``, optional: a view without the method, or one
    returning None, offers none) so that a policy can skip replicas instead of pricing each per request."""

    @property
    def idle(self) -> Collection[int]:
        """Exactly the replicas with no request (waiting, prefilling or decoding) and no step running: there
        :meth:`FleetView.load` is 0, :meth:`CostView.queued_prefill_s` and :meth:`CostView.admission_wait_s` are
        0.0 and :meth:`CostView.waiting_groups` is empty."""
        ...

    @property
    def idle_order(self) -> Sequence[int]:
        """:attr:`idle` in ascending order."""
        ...

    def holders(self, root: Hashable) -> Collection[int]:
        """A superset of the replicas where :meth:`CostView.planned_blocks` may be > 0 for a chain whose first
        block is ``root``."""
        ...


def route_index(view: FleetView) -> RouteIndex | None:
    """The view's :class:`RouteIndex`, or None when it offers none."""
    get = getattr(view, "route_index", None)
    return get() if get is not None else None


#: The view a policy reads: :class:`FleetView`, or :class:`CostView` for a policy that sets ``needs_cost_view``
#: (contravariant: a policy that reads a FleetView can be given any richer view).
ViewT = TypeVar("ViewT", bound=FleetView, contravariant=True)


class ExcludingView:
    """A view of ``inner`` in which the replicas in ``excluded`` are unavailable (a retry after they failed this
    request): they hold, compute and receive nothing and have no KV headroom, so no policy routes a hot request to
    them as holders, picks them as a copy source or plans a copy to them (:meth:`accepts_copies` is False there).
    Everything else is ``inner``'s."""

    __slots__ = ("_inner", "_excluded")

    def __init__(self, inner: FleetView, excluded: Collection[int]) -> None:
        self._inner = inner
        self._excluded = frozenset(excluded)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def n_replicas(self) -> int:
        return self._inner.n_replicas

    def route_index(self) -> None:
        """None: the inner view's index knows nothing of the excluded replicas."""
        return None

    def load(self, replica: int) -> int:
        return self._inner.load(replica)

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return 0 if replica in self._excluded else self._inner.cached_blocks(replica, chain)

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return 0 if replica in self._excluded else self._inner.pending_blocks(replica, chain)

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return 0 if replica in self._excluded else self._inner.planned_blocks(replica, chain)  # type: ignore[attr-defined]

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return replica not in self._excluded and self._inner.copy_in_flight(replica, chain)

    def accepts_copies(self, replica: int) -> bool:
        return replica not in self._excluded and self._inner.accepts_copies(replica)

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        return None if replica in self._excluded else self._inner.copy_status(replica, chain)  # type: ignore[attr-defined]

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether :meth:`copy_status` is not None (defined here so that the inner view's own ``has_copy``, when it
        has one, is never reached past the exclusion)."""
        return self.copy_status(replica, chain) is not None

    def kv_headroom_tokens(self, replica: int) -> int:
        return 0 if replica in self._excluded else self._inner.kv_headroom_tokens(replica)  # type: ignore[attr-defined]

    def copy_after_s(self, replica: int, blocks: int) -> float:
        return float(self._inner.copy_after_s(replica, blocks))  # type: ignore[attr-defined]


class Policy(Generic[ViewT]):
    """Base class of routing policies; subclasses set ``name`` and implement :meth:`route`. A subclass names the
    view it reads: ``Policy[FleetView]``, or ``Policy[CostView]`` with ``needs_cost_view = True``.

    Args:
        n_replicas: fleet size.
        rng: the policy's own seeded random source (ties, sampling); never the global ``random``.
        constants: BTB's four constants (ignored by policies that do not use them).
    """

    name: ClassVar[str] = ""
    #: One line for ``btbctl dry-run --help`` and reports.
    summary: ClassVar[str] = ""
    #: Whether :meth:`route` reads a :class:`CostView` (else a :class:`FleetView` is enough).
    needs_cost_view: ClassVar[bool] = False

    def __init__(self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None) -> None:
        self.n_replicas = n_replicas
        self.rng = rng
        self.constants = constants or BtbConstants()

    def route(self, req: Request, view: ViewT, now_s: float) -> Route:
        """The replica that serves ``req`` and the copies to start; changes nothing outside the policy."""
        raise NotImplementedError

    def on_copy_result(self, plan: CopyPlan, target: int, started: bool, now_s: float) -> None:
        """Hook: the executor tried to start a copy of ``plan`` to ``target`` (``started``: it accepted; else it
        refused). No-op by default; the policies that copy remember refusals (see
        :class:`CopyRefusals`) so that a replica that refused is not planned as a target again at once."""

    def on_finish(self, req: Request, replica: int, now_s: float) -> None:
        """Hook: ``req`` finished on ``replica`` (no-op by default)."""

    def configure(self, *, block_tokens: int | None = None) -> None:
        """Hook: facts about the workload, given before the first request (no-op by default).

        Args:
            block_tokens: tokens per block of the requests' ``block_hashes`` (the trace's or gateway's block size);
                policies that turn matched blocks into matched tokens use it.
        """

    def set_constants(self, constants: BtbConstants) -> None:
        """Retune at run time; takes effect from the next request."""
        self.constants = constants

    def share_detector(self, detector: BurstDetector) -> bool:
        """Hook: observe arrivals at the prefix depth Y (``constants.prefix_blocks``) through ``detector`` (the
        gateway's: its heat views and fire events read it, and it outlives policy swaps) instead of a detector of the
        policy's own. Returns True when the policy now feeds it (its caller must not feed it too); False, the
        default, for policies without a detector."""
        return False

    def tree_holder(self) -> Any:
        """Declared capability: the policy whose cache-aware prefix tree (``.tree``, a
        :class:`~btbctl.engine.policies.cache_aware.PrefixTree`) routes this policy's requests -- itself, or the
        cache-aware policy it falls back to -- so the gateway can bound the tree, report it and carry it across a
        policy swap; None, the default: it routes by none."""
        return None

    def stats(self) -> dict[str, int]:
        """Counters for reports (e.g. detector fires); empty by default."""
        return {}


class CopyRefusals:
    """Replicas an executor refused a copy to recently, for the policies that plan copies (``btb``, ``btb_plus``).

    A refusal reported through :meth:`Policy.on_copy_result` marks its target; for ``hold_s`` seconds of the time
    passed in (the policies use BTB's window Z) the target is not planned as a copy target again, so an arrival does
    not keep asking for copies the fleet will not make, and the policy knows its holder set cannot grow there. A
    copy the executor starts towards the target clears the mark. Memory: one entry per replica at most.
    """

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: dict[int, float] = {}

    def note(self, target: int, started: bool, now_s: float) -> None:
        """Record the executor's answer for a copy to ``target`` at ``now_s``."""
        if started:
            self._at.pop(target, None)
        else:
            self._at[target] = now_s

    def __bool__(self) -> bool:
        """Whether any target is marked (False: :meth:`refused` is False for every target)."""
        return bool(self._at)

    def refused(self, target: int, now_s: float, hold_s: float) -> bool:
        """Whether ``target`` refused a copy within the last ``hold_s`` seconds before ``now_s``."""
        at = self._at.get(target)
        return at is not None and now_s - at < hold_s


def least_loaded(view: FleetView, candidates: Sequence[int], rng: random.Random | None = None) -> int:
    """The candidate with the lowest load; ties go to a random one when ``rng`` is given, else to the first."""
    best = min(view.load(r) for r in candidates)
    tied = [r for r in candidates if view.load(r) == best]
    if rng is None or len(tied) == 1:
        return tied[0]
    return rng.choice(tied)


__all__ = ["CopyRefusals", "CostView", "ExcludingView", "FleetView", "Policy", "Route", "ViewT", "least_loaded"]
