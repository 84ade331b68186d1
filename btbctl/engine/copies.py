"""KV-cache copies: the one state vocabulary, progress type and plan type used by the simulator, the policies, the
gateway's executors, the emulated worker, the control API and the dashboard.

A **copy** moves one prefix's KV blocks from a *source* replica (which holds them, or is computing them: the copy
then trails its prefill, block by block) to a *target* replica. The target serves the blocks only once every one of
them arrived and verified; until then requests there that need them wait for them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import Enum
from typing import Final

#: Provenance of a page in a node's L3 store that a worker of the node wrote through (``l3`` replication); with the
#: writing process when known: ``write:pid=<pid>`` (:func:`write_origin`).
ORIGIN_WRITE = "write"
#: Prefix of the provenance of a page a verified agent-to-agent copy brought: ``copy:<copy id>``.
ORIGIN_COPY_PREFIX = "copy:"


def write_origin(pid: int | None = None) -> str:
    """The provenance of a page the node's process ``pid`` (a worker's store) wrote through."""
    return ORIGIN_WRITE if pid is None else f"{ORIGIN_WRITE}:pid={pid}"


def is_write_origin(origin: object) -> bool:
    """Whether ``origin`` is a write-through's provenance (:func:`write_origin`)."""
    return isinstance(origin, str) and (origin == ORIGIN_WRITE or origin.startswith(ORIGIN_WRITE + ":"))


def copy_origin(copy_id: str) -> str:
    """The provenance of the pages copy ``copy_id`` brought."""
    return ORIGIN_COPY_PREFIX + copy_id


class CopyState(str, Enum):
    """Where a copy is. The values are what the control API, ``btbctl`` and the dashboard show.

    * ``stalled``: accepted, but no byte can move now: the source is being checked, or it has not computed the
      blocks the copy trails yet.
    * ``running``: bytes are moving.
    * ``done``: every block arrived and verified at the target, which now holds the prefix (final).
    * ``failed``: ended without that; the target is cold and the reason is given (final).
    """

    STALLED = "stalled"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """Whether the copy changes no more."""
        return self in (CopyState.DONE, CopyState.FAILED)

    def __str__(self) -> str:
        return self.value


#: The states after which a copy changes no more.
FINAL_STATES = frozenset({CopyState.DONE, CopyState.FAILED})


class CopyOutcome(str, Enum):
    """How a finished copy ended, beyond its :class:`CopyState` (the gateway's log lines, the control API, the
    dashboard and ``btbctl bench`` show these values).

    * ``done``: a pushed copy; every block arrived and verified at the target (state ``done``).
    * ``proved``: an ``l3`` copy; the target's warm-up loaded the whole prefix from L3 (SGLang's
      ``cached_tokens_details.storage`` covers it; state ``done``).
    * ``computed``: an ``l3`` copy whose target computed the prefix itself (its warm-up found it on the device or
      in the host tier, not in L3): the target is warm, but not by this copy, so it is not reported ``done``
      (state ``failed``).
    * ``short``: an ``l3`` warm-up reused less than the prefix (state ``failed``).
    * ``failed``: any other failure (state ``failed``; the reason is given).
    """

    DONE = "done"
    PROVED = "proved"
    COMPUTED = "computed"
    SHORT = "short"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class CopyStatus:
    """Progress of a copy in flight towards a replica (what policies read through the cost view): a value (equal when
    every field is), read only (``Final`` attributes: mypy refuses an assignment, the compiled build raises). A plain
    class: the compiled build (README "Compiled core") builds it natively, where a named tuple's ``__new__`` is Python
    (a ``FleetState.copy_status`` answer took 0.8 us with one, 0.3 us now; a routing decision reads one per copy
    target).

    Attributes:
        source: the replica sending it.
        total_bytes: bytes the copy moves (the blocks the target lacked when it started).
        sent_bytes: bytes delivered so far.
        available_bytes: bytes the source has computed so far (<= ``total_bytes``; a copy trails a source still
            prefilling).
        rate_bytes_per_s: current sending rate, bytes/s; 0 while the copy waits for the source's compute.
        path_bytes_per_s: the rate copies measured on this source-target path, bytes/s (0: none measured; the
            cost model's NIC share is used instead).
        after_s: seconds from the last byte until the target can use the copy (an ``l3`` copy's warm-up proof, as
            measured; 0 for a pushed copy).
    """

    __slots__ = (
        "source",
        "total_bytes",
        "sent_bytes",
        "available_bytes",
        "rate_bytes_per_s",
        "path_bytes_per_s",
        "after_s",
    )

    def __init__(
        self,
        source: int,
        total_bytes: float,
        sent_bytes: float,
        available_bytes: float,
        rate_bytes_per_s: float,
        path_bytes_per_s: float = 0.0,
        after_s: float = 0.0,
    ) -> None:
        self.source: Final[int] = source
        self.total_bytes: Final[float] = total_bytes
        self.sent_bytes: Final[float] = sent_bytes
        self.available_bytes: Final[float] = available_bytes
        self.rate_bytes_per_s: Final[float] = rate_bytes_per_s
        self.path_bytes_per_s: Final[float] = path_bytes_per_s
        self.after_s: Final[float] = after_s

    def _fields(self) -> tuple[int, float, float, float, float, float, float]:
        return (
            self.source,
            self.total_bytes,
            self.sent_bytes,
            self.available_bytes,
            self.rate_bytes_per_s,
            self.path_bytes_per_s,
            self.after_s,
        )

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, CopyStatus) and self._fields() == other._fields())

    def __hash__(self) -> int:
        return hash(self._fields())

    def __reduce__(self) -> tuple[type[CopyStatus], tuple[int, float, float, float, float, float, float]]:
        return CopyStatus, self._fields()  # pickle and copy (a compiled class has no default for its arguments)

    def __repr__(self) -> str:
        return (
            f"CopyStatus(source={self.source!r}, total_bytes={self.total_bytes!r}, sent_bytes={self.sent_bytes!r}, "
            f"available_bytes={self.available_bytes!r}, rate_bytes_per_s={self.rate_bytes_per_s!r}, "
            f"path_bytes_per_s={self.path_bytes_per_s!r}, after_s={self.after_s!r})"
        )

    @property
    def state(self) -> CopyState:
        """``running`` while bytes move, else ``stalled``."""
        return CopyState.RUNNING if self.rate_bytes_per_s > 0 else CopyState.STALLED


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """A policy's wish to copy one prefix to more replicas; an executor (the simulator, the gateway's replicator)
    carries it out after the route is returned.

    The executor tries ``targets`` in order and starts a copy from ``source`` to each one it accepts, until
    ``want`` copies started (so later targets are fallbacks for refused ones). Each attempt is reported back to
    the policy through :meth:`~btbctl.engine.policies.base.Policy.on_copy_result`.

    Attributes:
        prefix: the prefix's block hashes, root first (its key is ``prefix[-1]``).
        source: the replica to copy from (holds the prefix, or is computing it).
        targets: candidate targets, best first (each at most once, never ``source``).
        want: copies to start (1 <= want <= len(targets)).
        hot_since_s: when the policy saw the need (its detector fired), seconds; time-to-warm is measured from it
            (None: the time the copy starts).
    """

    prefix: tuple[Hashable, ...]
    source: int
    targets: tuple[int, ...]
    want: int
    hot_since_s: float | None = None

    def __post_init__(self) -> None:
        if not self.prefix or not self.targets or not 1 <= self.want <= len(self.targets):
            raise ValueError(
                f"malformed copy plan: {len(self.prefix)} blocks, targets {self.targets}, want {self.want}"
            )


def carry_out(
    plan: CopyPlan, start: Callable[[int], bool], report: Callable[[int, bool], None] | None = None
) -> list[int]:
    """Execute ``plan``: try its targets in order with ``start(target)`` (True: the copy started) until
    ``plan.want`` started; ``report(target, started)`` hears of every attempt. Returns the targets started."""
    started: list[int] = []
    for target in plan.targets:
        ok = start(target)
        if report is not None:
            report(target, ok)
        if ok:
            started.append(target)
            if len(started) == plan.want:
                break
    return started


__all__ = [
    "CopyPlan",
    "CopyState",
    "CopyStatus",
    "FINAL_STATES",
    "ORIGIN_COPY_PREFIX",
    "ORIGIN_WRITE",
    "carry_out",
    "copy_origin",
    "is_write_origin",
    "write_origin",
]
