"""BTB's burst detector: "this Y-block prefix arrived X times within the trailing Z seconds".

Rule (Birmiwal & Bhat, "Biting the Bullet", 2026-07-22; REFERENCE.md s1): a prompt's **Y-block prefix** is exactly
its first ``Y = prefix_blocks`` block hashes. Because block hashes are prefix-chained (the ``k``-th hash identifies
the whole prefix through block ``k``), the hash of block ``Y`` (``chain[Y - 1]``) is the key of the whole prefix.
When ``X = threshold`` arrivals of one key fall inside the trailing window ``(now - Z, now]`` (``Z = window_s``), the
prefix is **hot** and replication fires. Prompts shorter than ``Y`` blocks never trigger. Published defaults:
X = 2, Y = 256 blocks (of 256 tokens), Z = 1.0 s (see :class:`~btbctl.engine.constants.BtbConstants`).

**Active** (this module's definition; the published rule only says "while the prefix is active"): a prefix becomes
active on the arrival that makes it hot (``fired``) and stays active as long as its arrivals keep coming with gaps
shorter than ``window_s``; the first arrival after a gap of ``window_s`` or more ends the activation, and the
prefix must reach ``threshold`` arrivals in the window again to fire anew. Between arrivals,
:meth:`BurstDetector.is_active` answers ``now_s - last_arrival_s < window_s``. A burst of 500 requests spread
evenly over 60 s (one every 0.12 s, REFERENCE.md s3) therefore fires once, on its second request, and stays
active until it ends.

Memory is bounded: per key only the arrival times inside the window are kept; a key with no arrival for
``max(window_s, retention_s)`` seconds is dropped (checked in O(1) amortised on every :meth:`observe`, because keys
are kept in last-seen order); and at most ``max_tracked`` keys are kept (the least recently seen goes first).
Time is always a parameter and must be non-decreasing across calls (small disorder is tolerated: counts are then
approximate); the detector never reads a clock, so the same code runs live and simulated.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from heapq import nlargest
from typing import Final

from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import ConfigError

#: Default seconds a prefix with no arrival stays tracked (for heat views) when longer than the window.
#: A product choice, not from the paper: long enough for a dashboard refreshing every few seconds to show a burst
#: that just ended.
DEFAULT_RETENTION_S = 60.0


class Detection:
    """Answer of :meth:`BurstDetector.observe` for an arrival of a hot prefix, read only (``Final`` attributes: mypy
    refuses an assignment, the compiled build raises). A plain class: the compiled build (README "Compiled core") builds
    it natively, where a named tuple's ``__new__`` is Python (:meth:`BurstDetector.observe` of a hot prefix took 1.2 us
    with one, 0.8 us now; once per depth per routing decision during a burst).

    Attributes:
        key: ``chain[prefix_blocks - 1]``, the hash that identifies the whole prefix.
        prefix: the first ``prefix_blocks`` block hashes (the blocks to replicate).
        arrivals_in_window: arrivals of the key in ``(now_s - window_s, now_s]``, this one included.
        fired: True only on the arrival that made the prefix hot (the start of an activation).
        now_s: the arrival time, seconds.
    """

    __slots__ = ("key", "prefix", "arrivals_in_window", "fired", "now_s")

    def __init__(
        self, key: Hashable, prefix: tuple[Hashable, ...], arrivals_in_window: int, fired: bool, now_s: float
    ) -> None:
        self.key: Final[Hashable] = key
        self.prefix: Final[tuple[Hashable, ...]] = prefix
        self.arrivals_in_window: Final[int] = arrivals_in_window
        self.fired: Final[bool] = fired
        self.now_s: Final[float] = now_s

    def __reduce__(self) -> tuple[type[Detection], tuple[Hashable, tuple[Hashable, ...], int, bool, float]]:
        # pickle and copy (a compiled class has no default for its arguments)
        return Detection, (self.key, self.prefix, self.arrivals_in_window, self.fired, self.now_s)

    def __repr__(self) -> str:
        return (
            f"Detection(key={self.key!r}, prefix=<{len(self.prefix)} blocks>, "
            f"arrivals_in_window={self.arrivals_in_window}, fired={self.fired}, now_s={self.now_s})"
        )


@dataclass(frozen=True, slots=True)
class PrefixHeat:
    """One row of :meth:`BurstDetector.heat` (for the dashboard and the control API).

    Attributes:
        key: the prefix key (hash of its last block).
        prefix_blocks: prefix length in blocks (Y).
        arrivals_in_window: arrivals in ``(now_s - window_s, now_s]``.
        total_arrivals: arrivals since the key was (last) first tracked.
        first_seen_s: time of its first tracked arrival, seconds.
        last_seen_s: time of its latest arrival, seconds.
        hot: whether the prefix is active at ``now_s`` (see the module docstring).
        fires: activations so far.
    """

    key: Hashable
    prefix_blocks: int
    arrivals_in_window: int
    total_arrivals: int
    first_seen_s: float
    last_seen_s: float
    hot: bool
    fires: int


class _KeyState:
    __slots__ = ("times", "in_window", "total", "first_s", "last_s", "hot", "fires", "prefix")

    def __init__(self, now_s: float) -> None:
        #: ``(arrival time, arrivals)`` in the window, oldest first (a declared burst is one entry, not N)
        self.times: deque[tuple[float, int]] = deque()
        self.in_window = 0  # the sum of the arrivals in ``times``
        self.total = 0
        self.first_s = now_s
        self.last_s = now_s
        self.hot = False
        self.fires = 0
        self.prefix: tuple[Hashable, ...] | None = None


def tracked_key(chain: Sequence[Hashable], prefix_blocks: int) -> Hashable | None:
    """The key the detector tracks ``chain`` under (its ``prefix_blocks``-th block hash: the hot prefix's id that
    ``btbctl prefixes`` lists), None when the chain is shorter (never tracked). :meth:`BurstDetector.observe`
    takes the same block."""
    return chain[prefix_blocks - 1] if 0 < prefix_blocks <= len(chain) else None


class BurstDetector:
    """Detects hot prefixes from a stream of ``(block-hash chain, arrival time)``.

    Args:
        constants: BTB's four constants; ``prefix_blocks``, ``threshold`` and ``window_s`` are used here
            (``replicas`` is the policy's business).
        max_tracked: hard cap on tracked prefixes (>= 1); beyond it the least recently seen is dropped.
        retention_s: a prefix with no arrival for ``max(window_s, retention_s)`` seconds is dropped (> 0;
            default :data:`DEFAULT_RETENTION_S`).

    Raises:
        ConfigError: ``max_tracked`` < 1 or ``retention_s`` <= 0.
    """

    def __init__(
        self, constants: BtbConstants, max_tracked: int = 65536, retention_s: float = DEFAULT_RETENTION_S
    ) -> None:
        if not isinstance(max_tracked, int) or max_tracked < 1:
            raise ConfigError("max_tracked", f"must be an integer >= 1, got {max_tracked!r}")
        if not retention_s > 0:
            raise ConfigError("retention_s", f"must be a number > 0, got {retention_s!r}")
        self.constants = constants
        self.max_tracked = max_tracked
        self.retention_s = float(retention_s)
        self._keys: OrderedDict[Hashable, _KeyState] = OrderedDict()
        self._fires = 0
        #: Called with the :class:`Detection` of each arrival that makes a prefix hot (the gateway logs it).
        self.on_fire: Callable[[Detection], None] | None = None
        self._observed = 0
        self._dropped = 0
        self._latest_s = -math.inf

    # -- the hot path -------------------------------------------------------------------------------------------

    def observe(self, chain: Sequence[Hashable], now_s: float, arrivals: int = 1) -> Detection | None:
        """Record one arrival of a prompt whose block-hash chain is ``chain`` at ``now_s`` seconds, counted as
        ``arrivals`` arrivals (>= 1; a declared burst, bounded by the caller: see :class:`DeclaredBursts`).

        Returns:
            A :class:`Detection` when the prompt's Y-block prefix is hot after this arrival (``fired`` is True on
            the arrival that made it hot), else None. Prompts shorter than ``prefix_blocks`` blocks return None
            and are not tracked.

        Cost: O(1) amortised (plus one Y-element slice the first time a prefix fires).
        """
        y = self.constants.prefix_blocks
        if len(chain) < y:
            return None
        self._observed += 1
        key = chain[y - 1]
        st = self._count(key, now_s, arrivals)
        count = st.in_window
        self._sweep(now_s, st)
        if count < self.constants.threshold and not st.hot:
            return None
        fired = False
        if not st.hot:
            st.hot = True
            st.fires += 1
            self._fires += 1
            fired = True
        if st.prefix is None:
            st.prefix = tuple(chain[:y])
        det = Detection(key, st.prefix, count, fired, now_s)
        if fired and self.on_fire is not None:
            self.on_fire(det)
        return det

    def fold(self, key: Hashable, now_s: float, arrivals: int = 1) -> None:
        """Count ``arrivals`` (>= 1) of prefix ``key`` that arrived elsewhere (another gateway of the fleet) at
        ``now_s`` seconds (this detector's clock: the time the news came). They count towards the window and keep an
        activation alive like local arrivals, but never fire by themselves: only :meth:`observe` (a local arrival,
        which brings the prefix's block hashes to copy) makes a prefix hot, so the arrival after enough folded ones
        fires at once. Not counted in ``observed``.

        Cost: O(1) amortised.
        """
        self._sweep(now_s, self._count(key, now_s, arrivals))

    def _count(self, key: Hashable, now_s: float, arrivals: int) -> _KeyState:
        """Count ``arrivals`` (at least 1) of ``key`` at ``now_s`` (:meth:`observe` and :meth:`fold`): the key's
        state, created or moved to the newest end, its activation ended by a gap of a whole window, and its window
        count with the arrivals older than the window dropped."""
        window = self.constants.window_s
        keys = self._keys
        st = keys.get(key)
        if st is None:
            st = _KeyState(now_s)
            keys[key] = st
        else:
            if st.hot and now_s - st.last_s >= window:
                st.hot = False  # a gap of a whole window ended the activation
            keys.move_to_end(key)
        if now_s > st.last_s:
            st.last_s = now_s
        if now_s > self._latest_s:
            self._latest_s = now_s
        arrivals = max(1, int(arrivals))
        st.total += arrivals
        times = st.times
        times.append((now_s, arrivals))
        st.in_window += arrivals
        cutoff = now_s - window
        while times[0][0] <= cutoff:
            st.in_window -= times.popleft()[1]
        return st

    def _sweep(self, now_s: float, keep: _KeyState) -> None:
        """Drop keys unseen for the retention time (oldest first) and enforce ``max_tracked``."""
        keys = self._keys
        horizon = now_s - max(self.constants.window_s, self.retention_s)
        while keys:
            oldest = next(iter(keys.values()))
            if oldest is keep or oldest.last_s > horizon:
                break
            keys.popitem(last=False)
            self._dropped += 1
        while len(keys) > self.max_tracked:
            keys.popitem(last=False)
            self._dropped += 1

    # -- queries ------------------------------------------------------------------------------------------------

    def is_active(self, key: Hashable, now_s: float) -> bool:
        """Whether the prefix ``key`` is active at ``now_s``: it fired and no gap of ``window_s`` or more has
        passed since its latest arrival (see the module docstring)."""
        st = self._keys.get(key)
        return st is not None and st.hot and now_s - st.last_s < self.constants.window_s

    def last_arrival_s(self) -> float | None:
        """Time of the latest arrival of a tracked prefix, seconds (None when nothing is tracked); O(1). A prefix
        has arrivals in the window at ``now_s`` exactly when this is after ``now_s - window_s``."""
        return self._latest_s if self._keys else None

    def prefix_of(self, key: Hashable) -> tuple[Hashable, ...] | None:
        """The Y block hashes of a prefix that has fired and is still tracked, else None."""
        st = self._keys.get(key)
        return None if st is None else st.prefix

    def arrivals_in_window(self, key: Hashable, now_s: float) -> int:
        """Arrivals of ``key`` in ``(now_s - window_s, now_s]`` (0 for an untracked key)."""
        st = self._keys.get(key)
        if st is None:
            return 0
        lo = now_s - self.constants.window_s
        return sum(n for t, n in st.times if lo < t <= now_s)

    def heat(self, now_s: float, top: int = 10) -> list[PrefixHeat]:
        """The ``top`` tracked prefixes by arrivals in the window at ``now_s`` (then most recently seen first).

        Cost: O(tracked); meant for dashboards and the control API, not the request path.
        """
        if top <= 0 or not self._keys:
            return []
        window = self.constants.window_s
        lo = now_s - window
        y = self.constants.prefix_blocks
        rows = []
        for key, st in self._keys.items():
            n = sum(k for t, k in st.times if lo < t <= now_s)
            rows.append((n, st.last_s, key, st))
        best = nlargest(top, rows, key=lambda r: (r[0], r[1]))
        return [
            PrefixHeat(key, y, n, st.total, st.first_s, st.last_s, st.hot and now_s - st.last_s < window, st.fires)
            for n, _, key, st in best
        ]

    # -- control ------------------------------------------------------------------------------------------------

    def set_constants(self, constants: BtbConstants) -> None:
        """Retune at run time; takes effect from the next call.

        A new ``prefix_blocks`` changes what a key means, so all tracked state is dropped. A new ``window_s`` or
        ``threshold`` keeps the state: arrivals already dropped under a shorter window are not recovered, and an
        active prefix stays active until a gap of the (new) window ends it.
        """
        if constants.prefix_blocks != self.constants.prefix_blocks:
            self._dropped += len(self._keys)
            self._keys.clear()
        self.constants = constants

    def reset(self) -> None:
        """Forget every tracked prefix (counters are kept)."""
        self._dropped += len(self._keys)
        self._keys.clear()

    def stats(self) -> dict[str, int]:
        """Counters: ``fires`` (activations), ``tracked`` (prefixes held now), ``observed`` (arrivals of prompts
        with at least ``prefix_blocks`` blocks), ``dropped`` (prefixes forgotten by expiry, cap or retune)."""
        return {"fires": self._fires, "tracked": len(self._keys), "observed": self._observed, "dropped": self._dropped}

    def __len__(self) -> int:
        return len(self._keys)


class DeclaredBursts:
    """The per-client bound on declared bursts: a client (a bearer token or an address) may add at most
    ``max_extra`` arrivals beyond its requests' own within the trailing ``window_s`` seconds, so one client cannot
    make many prefixes hot at once.

    Args:
        max_extra: extra arrivals one client may declare per window (>= 0; 0 grants none).
        max_clients: clients tracked at most (the least recently seen is forgotten first).

    Time is a parameter (seconds, non-decreasing); nothing here reads a clock.

    Raises:
        ConfigError: ``max_extra`` < 0 or ``max_clients`` < 1.
    """

    def __init__(self, max_extra: int, max_clients: int = 4096) -> None:
        if not isinstance(max_extra, int) or max_extra < 0:
            raise ConfigError("declared_requests_max", f"must be an integer >= 0, got {max_extra!r}")
        if not isinstance(max_clients, int) or max_clients < 1:
            raise ConfigError("max_clients", f"must be an integer >= 1, got {max_clients!r}")
        self.max_extra = max_extra
        self.max_clients = max_clients
        # client -> [(time granted, extra arrivals)], last seen last; and the window a refusal was last logged in
        self._grants: OrderedDict[Hashable, deque[tuple[float, int]]] = OrderedDict()
        self._refused_at: dict[Hashable, float] = {}

    def grant(self, client: Hashable, extra: int, now_s: float, window_s: float) -> tuple[int, bool]:
        """Grant up to ``extra`` (>= 0) extra arrivals to ``client`` at ``now_s``: ``(granted, log_refusal)``.
        ``granted`` is what is left of the client's ``max_extra`` over ``(now_s - window_s, now_s]``;
        ``log_refusal`` is true on the first refusal (granted < extra) of the client in a window, so the caller
        logs one line per client and window."""
        if extra <= 0:
            return 0, False
        grants = self._grants.get(client)
        if grants is None:
            grants = deque()
            self._grants[client] = grants
        else:
            self._grants.move_to_end(client)
        cutoff = now_s - window_s
        while grants and grants[0][0] <= cutoff:
            grants.popleft()
        left = self.max_extra - sum(n for _, n in grants)
        granted = max(0, min(extra, left))
        if granted:
            grants.append((now_s, granted))
        while len(self._grants) > self.max_clients:
            gone, _ = self._grants.popitem(last=False)
            self._refused_at.pop(gone, None)
        if granted == extra:
            return granted, False
        last = self._refused_at.get(client)
        first = last is None or now_s - last >= window_s
        if first:
            self._refused_at[client] = now_s
        return granted, first
