"""The routing-policy protocol and the fleet view policies read.

A policy is asked, for each arriving request, which replica serves it. It sees the fleet only through a
:class:`FleetView` (loads, what each replica's prefix cache holds, copies in flight) and may ask the fleet to copy a
prefix's KV cache between replicas through :meth:`FleetView.replicate` (BTB-style policies). Time is always passed
in (``now_s``); no policy reads the wall clock, so the same code runs live (gateway) and simulated.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Hashable, Protocol, Sequence

from btbctl.engine.constants import BtbConstants
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.trace.model import Request


@dataclass(frozen=True, slots=True)
class CopyStatus:
    """A KV-cache copy in flight towards a replica (:meth:`FleetView.copy_status`).

    Attributes:
        source: the replica sending it.
        total_bytes: bytes the copy moves (the blocks the target lacked when it started).
        sent_bytes: bytes delivered so far.
        available_bytes: bytes the source has computed so far (a copy trails a source still prefilling);
            <= ``total_bytes``.
        rate_bytes_per_s: current sending rate, bytes/s; 0 while the copy waits for the source's compute.
    """

    source: int
    total_bytes: float
    sent_bytes: float
    available_bytes: float
    rate_bytes_per_s: float


class FleetView(Protocol):
    """What a policy may read about the fleet (and the one action it may take: start a copy).

    Replicas are numbered ``0 .. n_replicas - 1``.
    """

    @property
    def n_replicas(self) -> int:
        """Number of replicas."""

    def load(self, replica: int) -> int:
        """Requests the router has in flight to ``replica`` (running + waiting there)."""

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are computed and resident in ``replica``'s KV cache now."""

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are resident *or on their way* to ``replica`` (being prefilled
        there or arriving by copy). Always >= :meth:`cached_blocks`."""

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether a copy of (a prefix ending with) ``chain[-1]`` towards ``replica`` is in flight."""

    def replicate(self, chain: Sequence[Hashable], source: int, target: int, now_s: float,
                  hot_since_s: float | None = None) -> bool:
        """Start copying the KV cache of ``chain``'s blocks from ``source`` to ``target``. Returns False when the
        fleet refuses (same replica, a copy already in flight, no room, or a source that neither holds the blocks
        nor will have them: see :meth:`planned_blocks`). Only blocks the source has computed are sent, so a copy
        trails a source still prefilling. The target serves the blocks as cached only once they have all arrived.
        ``hot_since_s`` (optional): when the policy saw the need for the copy
        (e.g. its detector fired), seconds; reports measure time to warm from it (default ``now_s``)."""

    def expected_wait_s(self, replica: int) -> float:
        """Estimated seconds of queued prefill work ahead of a new request on ``replica`` (0 when idle)."""

    def copy_eta_s(self, replica: int, chain: Sequence[Hashable]) -> float | None:
        """Seconds until the in-flight copy of ``chain`` towards ``replica`` completes at current rates (None: no
        copy in flight, or it is stalled behind the source's prefill)."""

    def queued_prefill_s(self, replica: int) -> float:
        """Seconds of prefill compute queued on ``replica`` ahead of a new request, counting for each queued request
        only the prompt tokens it must compute itself (attention included). O(1)."""

    def copy_status(self, replica: int, chain: Sequence[Hashable]) -> CopyStatus | None:
        """The in-flight copy of ``chain`` (keyed by its last block) towards ``replica``, or None."""

    def nic_copies(self, replica: int) -> int:
        """Copies in flight sending from or received by ``replica`` (they share its NIC)."""

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """How many leading blocks of ``chain`` are resident, on their way, or will be computed by a request already
        queued on ``replica`` (so a new request there would reuse them). Always >= :meth:`pending_blocks` except
        after evictions."""

    def dependent_prefill_s(self, replica: int, chain: Sequence[Hashable]) -> float:
        """Seconds of :meth:`queued_prefill_s` on ``replica`` that belong to requests waiting there for the same
        not-yet-resident block a new request with ``chain`` would wait for (they cannot start before it arrives
        or is computed); 0 when the blocks a new request would reuse are all resident."""

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        """Requests waiting on ``replica`` for a block not resident there yet, grouped by that block:
        ``(block hash, requests, seconds of their queued prefill)``. Part of :meth:`queued_prefill_s`, but they
        cannot start before the block is there (meanwhile later requests may run)."""

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        """Seconds of decoding ``replica`` must do before its KV cache has room for the requests waiting there plus
        a new one needing ``kv_tokens`` tokens; 0 when they fit now. Adds to :meth:`queued_prefill_s`."""

    def kv_headroom_tokens(self, replica: int) -> int:
        """KV-cache tokens ``replica`` could free for a new copy now (free + evictable)."""

    @property
    def cost(self) -> ReplicaCost:
        """The cost model of one replica (all replicas are alike)."""

    @property
    def block_tokens(self) -> int:
        """Tokens per block of the chains the policy sees."""

    @property
    def chunk_tokens(self) -> int:
        """Most new prompt tokens one prefill step computes on a replica (chunked prefill)."""


class Policy:
    """Base class of routing policies; subclasses set ``name`` and implement :meth:`route`.

    Args:
        n_replicas: fleet size.
        rng: the policy's own seeded random source (ties, sampling); never the global ``random``.
        constants: BTB's four constants (ignored by policies that do not use them).
    """

    name: ClassVar[str] = ""
    #: One line for ``btbctl dry-run --help`` and reports.
    summary: ClassVar[str] = ""

    def __init__(self, n_replicas: int, rng: random.Random, constants: BtbConstants | None = None) -> None:
        self.n_replicas = n_replicas
        self.rng = rng
        self.constants = constants or BtbConstants()

    def route(self, req: Request, view: FleetView, now_s: float) -> int:
        """Return the replica index that serves ``req``."""
        raise NotImplementedError

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

    def stats(self) -> dict:
        """Counters for reports (e.g. detector fires); empty by default."""
        return {}


def least_loaded(view: FleetView, candidates: Sequence[int], rng: random.Random | None = None) -> int:
    """The candidate with the lowest load; ties go to a random one when ``rng`` is given, else to the first."""
    best = min(view.load(r) for r in candidates)
    tied = [r for r in candidates if view.load(r) == best]
    if rng is None or len(tied) == 1:
        return tied[0]
    return rng.choice(tied)
