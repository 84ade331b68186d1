"""Live fleet state of the gateway: workers, what they hold, copies, the chain index and the TTFT series.

**Holdings are the gateway's own approximate record**, like the SGLang router's approximate radix tree
(REFERENCE.md s4): the gateway does not ask workers on every request what their caches hold. A worker is recorded
as holding a prompt's chain

* when a request on it produced its first byte (its prefill, and so the prompt's KV, was computed there),
* when a copy towards it was confirmed ``done`` by the source (the target verified and committed every block),
* when ``POST /btb/match`` on it confirmed the chain (replication planning).

Until its first byte, an in-flight request's chain counts as *pending* on its worker (being computed there). A
worker that restarts or ages blocks out of its cache is not seen until the replicator confirms with ``/btb/match``
before every copy (so a copy never starts from a source that lost the blocks), and a worker marked unhealthy loses
its record (a process that died has lost its cache). The record per worker is an LRU over block hashes bounded by
the worker's capacity (``capacity_tokens`` of ``/btb/info`` / page size, else :data:`DEFAULT_HOLDING_BLOCKS`);
chains are inserted deepest block first, so a prefix's blocks are always at least as recent as its extensions,
eviction removes leaves first and the record stays prefix-closed (a leading-run query is a binary search).

Time here is monotonic seconds since the gateway started (``now_s``), the clock policies and the detector see.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice, takewhile

from btbctl.engine.chains import count_blocks, uncount_blocks
from btbctl.engine.config import ClusterConfig
from btbctl.engine.copies import CopyState, CopyStatus
from btbctl.engine.costmodel import ReplicaCost, default_chunked_prefill_tokens
from btbctl.engine.stats import TtftSeries

#: Holding-record bound per worker when its capacity is unknown, blocks. 2**24 tokens / 256-token pages, the
#: SGLang router's default per-worker tree bound (2**26 characters at about 4 characters per token; REFERENCE.md
#: s4) at BTB's block size.
DEFAULT_HOLDING_BLOCKS = 65536
#: Finished copies kept for ``/control/transfers``.
RECENT_TRANSFERS = 200
#: Block hashes kept in the chain index (parent pointers, to turn a prefix id back into its chain). A product
#: choice: 2**18 entries are at most about 40 MB and cover 1,000 distinct 256-block prefixes.
CHAIN_INDEX_BLOCKS = 1 << 18
#: Smoothing of the per-worker TTFT estimate behind :meth:`FleetState.admission_wait_s` (EWMA weight of a new
#: sample); a product choice.
TTFT_EWMA_ALPHA = 0.2
#: Smoothing of the measured copy figures (:class:`CopyMeasures`) and the prefill calibration; a product choice.
MEASURE_EWMA_ALPHA = 0.3
#: Bounds of :attr:`FleetState.prefill_scale` (a CPU test server is about 10^3 slower than the default guess).
MIN_PREFILL_SCALE = 1e-2
MAX_PREFILL_SCALE = 1e5


class Clock:
    """Monotonic seconds since construction (the gateway's ``now_s``)."""

    __slots__ = ("t0",)

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


@dataclass
class WorkerState:
    """One worker as the gateway sees it.

    Attributes:
        index: replica number the policies use (position in the configured list).
        url: base URL without a trailing slash.
        name: the launcher's process name (``worker-0``) when the gateway was given names, else ``w<index>``.
        healthy: passes health checks and had no connection error or 5xx since the last passing check.
        inflight: requests the gateway has in flight to it (the policies' load).
        prefilling: in-flight requests that have not produced a first byte yet.
        served / failed: requests completed / failed there (gateway count).
        health_error: why it is unhealthy (None when healthy).
        last_health_s: ``now_s`` of the latest health answer (None before the first).
        last_progress_s: ``now_s`` of its latest sign of life outside a passing health check: an answer (below
            500) or a stream chunk of a forwarded request, or a ``/health`` answer that came after its probe timed
            out (None before the first). Within :attr:`FleetState.progress_window_s` it tells a busy worker from a
            dead one (:meth:`alive`).
        degraded: why its health checks time out while it shows signs of life (it stays routed); None otherwise.
        failure_kind: how its latest failure looked: ``slow`` (no answer in time), ``refused`` (no connection, or
            the connection broke), ``error`` (an error answer); None after a passing check.
        loads: summary of its ``/v1/loads`` (``running``, ``waiting``, ``used_tokens``, ``max_tokens``,
            ``token_usage``) or None when unknown.
        loads_prefilling: the gateway's own requests at the worker when ``loads`` was read
            (:meth:`sent_prefilling`): the ones among its waiting requests that :meth:`FleetState.queued_prefill_s`
            models.
        kv_tokens_inflight: KV tokens (prompt + expected output, :meth:`kv_tokens_of`) of the gateway's requests
            in flight here, sent and not finished. ``loads_epoch`` counts the ``loads`` reports;
            ``kv_sent_since`` / ``kv_freed_since``: KV tokens of the requests sent here since the latest (and still
            in flight) / of the requests sent before it that finished since (:meth:`send_kv`, :meth:`finish_kv`;
            read by :meth:`FleetState.kv_headroom_tokens`).
        gated: requests routed here that wait at the gateway for an ``l3`` copy's proof (not at the worker yet).
        paced: requests routed here that wait at the gateway for their turn (a route's ``pace``; not at the worker
            yet).
        awaiting_first: the gateway's requests that left for the worker and have no first byte yet.
        released: requests held for their turn that were let go and have not left yet (they leave at once).
        info: its ``/btb/info`` answer (emulated workers) or None.
        server_info: what :class:`~btbctl.engine.gateway.sglang_metrics.MetricsScraper` needs of its
            ``/server_info`` (``{}`` when it has none; None: not read yet).
        metrics: its own numbers from SGLang's ``/metrics``
            (:func:`~btbctl.engine.gateway.sglang_metrics.parse_sglang_metrics`), None when unknown;
            ``metrics_note`` why, ``metrics_s`` when they were read.
        btb: True when it has the BTB extension routes, False when it answered 404 (a plain SGLang server:
            no replication to or from it), None before the first probe.
        ttft_ewma_s: smoothed TTFT of its recent requests, seconds (None before the first).
    """

    index: int
    url: str
    name: str
    healthy: bool = False
    inflight: int = 0
    prefilling: int = 0
    served: int = 0
    failed: int = 0
    health_error: str | None = "not checked yet"
    consecutive_failures: int = 0
    last_health_s: float | None = None
    last_progress_s: float | None = None
    degraded: str | None = None
    failure_kind: str | None = None
    loads: dict | None = None
    loads_prefilling: int = 0
    kv_tokens_inflight: int = 0
    loads_epoch: int = 0
    kv_sent_since: int = 0
    kv_freed_since: int = 0
    gated: int = 0
    paced: int = 0
    awaiting_first: int = 0
    released: int = 0
    info: dict | None = None
    server_info: dict | None = None
    metrics: dict | None = None
    metrics_note: str | None = None
    metrics_s: float | None = None
    btb: bool | None = None
    ttft_ewma_s: float | None = None
    capacity_blocks: int = DEFAULT_HOLDING_BLOCKS
    holdings: OrderedDict = field(default_factory=OrderedDict)
    pending: dict = field(default_factory=dict)
    prefill_chains: dict = field(default_factory=dict)
    prefill_tokens: dict = field(default_factory=dict)
    routing_holdings: bool = True
    """Whether a first byte here records the request's chain (:meth:`hold_routed`); off for a worker whose KV events
    alone record its holdings (``GatewayConfig.routing_holdings``)."""
    version: int = 0
    """Bumped whenever holdings or in-flight prefills change (keys the fleet state's queue estimates)."""
    reshaped: int = 0
    """Bumped by every change of :attr:`version` except a request with a chain joining the end of the in-flight
    prefills (:meth:`start_prefill`): while it stands, the queue estimate extends by the requests sent since."""
    roots: set = field(default_factory=set)
    """The roots (first blocks) of the chains recorded here (:meth:`hold`) that are still in :attr:`holdings`."""
    root_index: dict | None = None
    """The fleet's ``root -> {worker index}`` of the workers whose holdings or pending blocks hold that root
    (:attr:`FleetState.roots`, kept up to date by the methods below; None: a worker outside a fleet state)."""

    def kv_tokens_of(self, kv_tokens: int) -> int:
        """What a request of ``kv_tokens`` (prompt + requested output) can take of this worker's KV: at most all of
        it (``max_total_num_tokens`` of its loads, else its ``capacity_tokens``), so a client asking for a huge
        output cannot make the worker look full."""
        cap = (self.loads or {}).get("max_tokens") or (self.info or {}).get("capacity_tokens")
        return min(kv_tokens, int(cap)) if isinstance(cap, int) and cap > 0 else kv_tokens

    def send_kv(self, kv_tokens: int) -> int:
        """A request taking ``kv_tokens`` of KV leaves for this worker: counted; returns the ``loads_epoch`` to
        give :meth:`finish_kv` when it ends."""
        self.kv_tokens_inflight += kv_tokens
        self.kv_sent_since += kv_tokens
        return self.loads_epoch

    def finish_kv(self, kv_tokens: int, epoch: int) -> None:
        """The request :meth:`send_kv` counted (in ``epoch``) ended here."""
        self.kv_tokens_inflight -= kv_tokens
        if epoch == self.loads_epoch:
            self.kv_sent_since -= kv_tokens  # sent and finished since the report: no trace in it
        else:
            self.kv_freed_since += kv_tokens  # in the report's use (or waiting): freed since

    def sent_prefilling(self) -> int:
        """The gateway's requests at the worker without their first token, counting the ones let go by their turn
        (``awaiting_first + released``; ``prefilling`` also counts the ones still at the gateway: gated, paced, or
        waiting for a push to be accepted)."""
        return self.awaiting_first + self.released

    def new_loads(self, loads: dict | None) -> None:
        """A ``/v1/loads`` report (its summary) arrived: what was sent or freed before it is in it now."""
        self.loads = loads
        self.loads_prefilling = self.sent_prefilling()  # the gateway's own requests among those it counts
        self.loads_epoch += 1
        self.kv_sent_since = self.kv_freed_since = 0

    # -- liveness ----------------------------------------------------------------------------------------------

    def alive(self, now_s: float, window_s: float) -> bool:
        """Whether it showed a sign of life (:attr:`last_progress_s`) within the last ``window_s`` seconds."""
        return self.last_progress_s is not None and now_s - self.last_progress_s <= window_s

    # -- holdings ----------------------------------------------------------------------------------------------

    def hold(self, chain: Sequence[Hashable]) -> None:
        """Record ``chain`` as resident here (deepest block first; LRU-bounded by ``capacity_blocks``)."""
        h = self.holdings
        self.version += 1
        self.reshaped += 1
        for b in reversed(chain):
            if b in h:
                h.move_to_end(b)
            else:
                h[b] = None
        if chain and chain[0] not in self.roots:
            self.roots.add(chain[0])
            self._root_in(chain[0])
        over = len(h) - self.capacity_blocks
        while over > 0:
            self._left(h.popitem(last=False)[0])
            over -= 1

    def _root_in(self, root: Hashable) -> None:
        """``root`` is held or pending here now (:attr:`root_index`)."""
        index = self.root_index
        if index is not None:
            here = index.get(root)
            if here is None:
                index[root] = {self.index}
            else:
                here.add(self.index)

    def _root_out(self, root: Hashable) -> None:
        """``root`` is neither held nor pending here any more (:attr:`root_index`)."""
        index = self.root_index
        if index is not None:
            here = index.get(root)
            if here is not None:
                here.discard(self.index)
                if not here:
                    del index[root]

    def _left(self, block: Hashable) -> None:
        """``block`` left :attr:`holdings`: a root of the record leaves :attr:`roots` (and the fleet's index unless a
        request here still computes it)."""
        if block in self.roots:
            self.roots.discard(block)
            if block not in self.pending:
                self._root_out(block)

    def held_blocks(self, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` recorded as resident here (binary search; the record is prefix-closed)."""
        h = self.holdings
        if not chain or chain[0] not in h:
            return 0
        if chain[-1] in h:
            return len(chain)
        lo, hi = 1, len(chain) - 1  # chain[lo-1] held, chain[hi] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in h:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def pending_or_held(self, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` resident or being computed here."""
        h, p = self.holdings, self.pending
        if not chain or (chain[0] not in h and chain[0] not in p):
            return 0
        last = chain[-1]
        if last in h or last in p:
            return len(chain)
        lo, hi = 1, len(chain) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            b = chain[mid - 1]
            if b in h or b in p:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def start_prefill(self, rid: object, chain: Sequence[Hashable], tokens: int = 0) -> None:
        """A request ``rid`` with ``chain`` (and ``tokens`` prompt tokens, 0 when unknown) was sent here and has no
        first byte yet."""
        self.prefilling += 1
        self.version += 1
        if tokens > 0:
            self.prefill_tokens[rid] = tokens
        if chain:
            self.prefill_chains[rid] = chain
            self.add_pending(chain)
        else:
            self.reshaped += 1

    def leave(self) -> None:
        """A request :meth:`start_prefill` counted left the gateway for the worker (``awaiting_first``)."""
        self.awaiting_first += 1

    def end_prefill(self, rid: object, left: bool = False) -> None:
        """Request ``rid`` produced its first byte here or ended without one; ``left``: it had left the gateway
        (:meth:`leave`)."""
        self.prefilling -= 1
        if left:
            self.awaiting_first -= 1
        self.version += 1
        self.reshaped += 1
        self.prefill_tokens.pop(rid, None)
        chain = self.prefill_chains.pop(rid, None)
        if chain:
            self.drop_pending(chain)

    def add_pending(self, chain: Sequence[Hashable]) -> None:
        count_blocks(self.pending, chain)
        if chain:
            self._root_in(chain[0])

    def drop_pending(self, chain: Sequence[Hashable]) -> None:
        uncount_blocks(self.pending, chain)
        if chain and chain[0] not in self.pending and chain[0] not in self.roots:
            self._root_out(chain[0])

    def drop_blocks(self, keys: Iterable[Hashable]) -> None:
        """Remove ``keys`` from the record (its KV events said they left the cache; SGLang evicts leaves, so the
        record stays prefix-closed)."""
        h = self.holdings
        for k in keys:
            h.pop(k, None)
            self._left(k)
        self.version += 1
        self.reshaped += 1

    def hold_routed(self, chain: Sequence[Hashable]) -> None:
        """A request on this worker produced its first byte: record ``chain`` (:meth:`hold`) unless
        :attr:`routing_holdings` is off (its KV events alone record it)."""
        if self.routing_holdings:
            self.hold(chain)

    def forget(self) -> None:
        """Drop the holding record (the worker died or restarted)."""
        self.holdings.clear()
        for root in list(self.roots):
            self._left(root)
        self.version += 1
        self.reshaped += 1

    @property
    def replication_note(self) -> str:
        """Human text for the fleet view: whether copies to and from this worker are possible."""
        if self.btb is None:
            return "unknown (not probed yet)"
        if self.btb:
            return "supported (BTB extension routes)"
        return "unsupported: no /btb routes (plain SGLang); routing only"


@dataclass
class Transfer:
    """One prefix copy, as the replicator tracks it.

    Attributes:
        copy_id: id given to the source's ``/btb/push`` (hex).
        key: the id of the chain copied (hash of its last block).
        chain: the prefix's block hashes.
        hot_key: the id of the hot prefix the copy is for (hash of block ``prefix_blocks`` of ``chain``: the id the
            detector fires on and ``btbctl prefixes`` lists; a policy may copy a deeper chain than that, as
            btb_plus does); ``key`` when the chain is no longer than ``prefix_blocks`` or it is unknown.
        copied_tokens: tokens of ``chain`` (blocks x page size; None when the page size is unknown).
        ordered_by: the id of the gateway of the fleet that runs this copy, when another one does (it won the copy's
            claim, :mod:`~btbctl.engine.gateway.fleetshare`): this record then waits for that gateway's outcome, and
            the target is never routed to before it came ``done``. None: this gateway runs it.
        source / target: worker indices.
        state: :class:`~btbctl.engine.copies.CopyState`: ``stalled`` (accepted, not pushed yet: the source is being
            checked or is still computing the prefix), ``running`` (pushed; bytes moving), ``done`` or ``failed``.
        waited: the job had to wait for the source's compute.
        bytes_sent / bytes_total: bytes, from the source's ``/btb/copies/{id}`` (``bytes_total`` 0 until known).
        blocks_verified: blocks the target verified so far.
        blocks_available: leading blocks the source has computed so far (the copy trails its prefill until this
            reaches the chain's length); -1 while the source has not said.
        created_s / started_s / finished_s: gateway ``now_s`` (None until reached).
        error: the reason of a failure.
        manual: started through the control API (else by the policy).
        mode: ``push`` (the workers' ``/btb/push``) or ``l3`` (node agents + warm-up proof).
        routable: requests for the prefix may be routed to the target while the copy is in flight (the policies
            see it as arriving there, :meth:`FleetState.copy_status`).
        ready: ``l3``: resolved True once the target may take the prefix's requests (proved, or it computed the
            prefix itself), False when the copy failed; requests routed to the target wait for it at the gateway
            (:meth:`TransferTable.gate`). None for pushed copies, whose target waits for the arriving blocks itself.
        transfer_s: seconds the bytes took (push accepted to every page committed at the target), once known.
        proof: the target's warm-up answer, ``{"device", "host", "storage"}`` tokens (l3), once it came.
        proof_storage_tokens: ``proof["storage"]``: prompt tokens the target loaded from L3 (l3).
        covered_tokens: tokens the proof must cover (the prefix, whole pages).
        via_copy_id: ``l3``: the agents' copy whose pages the target's node received (this copy's id, or that of the
            copy to the same node it shared); None when no bytes moved (same node) or before the copy.
        outcome: how it ended (:class:`~btbctl.engine.copies.CopyOutcome` value; None while active).
        source_complete_s: ``now_s`` when the source's node held every page (l3; None until then).
        landed_s: ``now_s`` when the target's node held every page (l3; None until then).
        path: ``(source agent, target agent)`` names (l3), the key of the measured agent-to-agent rate.
        send_s: seconds the source agent spent sending this copy's bytes (l3), once known.
        overlap_s: ``l3``: seconds during which pages already moved while the source was still writing the prefix
            through (its first page out until its last page in; > 0: the copy streamed behind the prefill), once
            known.
    """

    copy_id: str
    key: str
    chain: tuple
    source: int
    target: int
    state: CopyState = CopyState.STALLED
    bytes_sent: int = 0
    bytes_total: int = 0
    blocks_verified: int = 0
    blocks_available: int = -1
    created_s: float = 0.0
    started_s: float | None = None
    finished_s: float | None = None
    error: str | None = None
    manual: bool = False
    waited: bool = False
    pushed: asyncio.Event | None = field(default=None, repr=False, compare=False)
    mode: str = "push"
    routable: bool = True
    ready: asyncio.Future | None = field(default=None, repr=False, compare=False)
    transfer_s: float | None = None
    proof: dict | None = None
    proof_storage_tokens: int | None = None
    covered_tokens: int | None = None
    via_copy_id: str | None = None
    outcome: str | None = None
    source_complete_s: float | None = None
    landed_s: float | None = None
    path: tuple[str, str] | None = None
    send_s: float | None = None
    overlap_s: float | None = None
    hot_key: str = ""
    copied_tokens: int | None = None
    ordered_by: str | None = None

    @property
    def hot_id(self) -> str:
        """The hot prefix's id (:attr:`hot_key`, else :attr:`key`)."""
        return str(self.hot_key or self.key)

    @property
    def active(self) -> bool:
        return not self.state.final

    @property
    def usable_s(self) -> float | None:
        """Seconds from the copy's start (the detector's fire, for a policy's copy) until the target could take
        the prefix's requests: a pushed copy's ``done``, an ``l3`` copy's proof. None unless it ended ``done``."""
        if self.state is not CopyState.DONE or self.finished_s is None:
            return None
        return self.finished_s - self.created_s

    def phases(self) -> dict[str, float | None]:
        """``l3``: seconds of each phase: ``source`` (start until the source's node held every page; the copy
        trails it), ``transfer`` (until the target's node held every page), ``proof`` (the warm-up); None where a
        phase was not reached."""
        out: dict[str, float | None] = {"source": None, "transfer": None, "proof": None}
        if self.source_complete_s is not None:
            out["source"] = self.source_complete_s - self.created_s
            if self.landed_s is not None:
                out["transfer"] = max(0.0, self.landed_s - self.source_complete_s)
                if self.finished_s is not None and self.proof is not None:
                    out["proof"] = self.finished_s - self.landed_s
        return out

    def bytes_per_s(self, now_s: float) -> float:
        """Average rate since sending started (bytes/s); for a finished copy, over its whole sending time."""
        if self.started_s is None:
            return 0.0
        end = self.finished_s if self.finished_s is not None else now_s
        dt = end - self.started_s
        return self.bytes_sent / dt if dt > 0 else 0.0

    def eta_s(self, now_s: float) -> float | None:
        """Seconds left at the current average rate (None when unknown; 0 when finished)."""
        if not self.active:
            return 0.0
        rate = self.bytes_per_s(now_s)
        if rate <= 0 or self.bytes_total <= 0:
            return None
        return max(0.0, (self.bytes_total - self.bytes_sent) / rate)


class TransferTable:
    """Copies in flight (indexed by ``(target, prefix key)``) and the most recent finished ones."""

    def __init__(self, recent: int = RECENT_TRANSFERS) -> None:
        self.by_id: dict[str, Transfer] = {}
        self.active: dict[tuple[int, Hashable], Transfer] = {}
        #: the active copies by target (``depth_to`` runs per worker on every routing decision)
        self._to: dict[int, dict[Hashable, Transfer]] = {}
        #: active copies from or to each worker (``nic_copies``, read per target while planning copies)
        self._nic: dict[int, int] = {}
        #: active copies by the first block of their chain: ``root -> {target: copies}`` (:meth:`targets_of`)
        self._roots: dict[Hashable, dict[int, int]] = {}
        self.recent: deque[Transfer] = deque(maxlen=recent)
        self.version = 0  # bumped when a copy starts or ends

    def _count(self, t: Transfer, step: int) -> None:
        nic = self._nic
        for r in {t.source, t.target}:
            n = nic.get(r, 0) + step
            if n:
                nic[r] = n
            else:
                del nic[r]
        if t.chain:
            to = self._roots.setdefault(t.chain[0], {})
            n = to.get(t.target, 0) + step
            if n:
                to[t.target] = n
            else:
                del to[t.target]
                if not to:
                    del self._roots[t.chain[0]]

    def add(self, t: Transfer) -> None:
        self.by_id[t.copy_id] = t
        old = self.active.get((t.target, t.key))
        if old is not None:
            self._count(old, -1)
        self.active[(t.target, t.key)] = t
        self._to.setdefault(t.target, {})[t.key] = t
        self._count(t, 1)
        self.version += 1

    def finish(self, t: Transfer) -> None:
        """Move ``t`` (already ``done`` or ``failed``) to the recent list."""
        self.version += 1
        if self.active.get((t.target, t.key)) is t:
            del self.active[(t.target, t.key)]
            self._count(t, -1)
            to = self._to[t.target]
            del to[t.key]
            if not to:
                del self._to[t.target]
        if len(self.recent) == self.recent.maxlen:
            old = self.recent[0]
            if self.by_id.get(old.copy_id) is old:
                del self.by_id[old.copy_id]
        self.recent.append(t)

    def in_flight(self, target: int, key: Hashable) -> bool:
        return (target, key) in self.active

    def nic_copies(self, replica: int) -> int:
        """Copies in flight from or to ``replica``."""
        return self._nic.get(replica, 0)

    def targets_of(self, root: Hashable) -> Collection[int]:
        """Targets of the copies in flight whose chain starts with block ``root``."""
        return self._roots.get(root, ())

    def depth_to(self, target: int, chain: Sequence[Hashable]) -> int:
        """Length of the longest copy in flight to ``target`` whose chain is a leading part of ``chain`` (0 when
        none). O(copies in flight to ``target``)."""
        to = self._to.get(target)
        if not to:
            return 0
        best = 0
        n = len(chain)
        for key, t in to.items():
            m = len(t.chain)
            if t.routable and best < m <= n and chain[m - 1] == key:
                best = m
        return best

    def gate(self, target: int, chain: Sequence[Hashable]) -> asyncio.Future | None:
        """The ``ready`` future of a copy in flight to ``target`` of a leading part of ``chain`` that is not ready
        yet (``l3``: a request for the prefix waits for it before it is sent there), or None."""
        to = self._to.get(target)
        if not to:
            return None
        n = len(chain)
        for key, t in to.items():
            m = len(t.chain)
            if t.ready is not None and not t.ready.done() and m <= n and chain[m - 1] == key:
                return t.ready
        return None

    def for_key(self, key: Hashable) -> list[Transfer]:
        """Copies of prefix ``key`` (the chain copied, or the hot prefix a deeper copy is for), in flight first, then
        recent (newest first)."""

        def of(t: Transfer) -> bool:
            return t.key == key or t.hot_id == str(key)

        out = [t for t in self.active.values() if of(t)]
        out.extend(t for t in reversed(self.recent) if of(t))
        return out

    def all(self) -> list[Transfer]:
        """In flight (oldest first), then recent (newest first)."""
        return list(self.active.values()) + list(reversed(self.recent))


@dataclass
class CopyMeasures:
    """What the fleet measured about ``l3`` copies, for the policies' landing estimates (EWMA, weight
    :data:`MEASURE_EWMA_ALPHA`).

    Attributes:
        path_bytes_per_s: ``(source agent, target agent)`` -> bytes/s while the source agent was sending (the agents'
            own send time, so a copy that trails a prefill does not read as a slow path).
        proof_s: seconds from the last page at the target's node to its proof (the warm-up: SGLang's prefetch from
            L3 and a one-token prefill); None before the first proof.
        page_bytes: bytes of one page (all TP ranks), from the copies' sizes; None before the first copy.
    """

    path_bytes_per_s: dict[tuple[str, str], float] = field(default_factory=dict)
    proof_s: float | None = None
    page_bytes: float | None = None

    @staticmethod
    def _mix(old: float | None, new: float) -> float:
        return new if old is None else old + MEASURE_EWMA_ALPHA * (new - old)

    def copied(self, path: tuple[str, str], nbytes: int, send_s: float, pages: int) -> None:
        """A copy of ``pages`` pages moved ``nbytes`` over ``path`` in ``send_s`` seconds of sending."""
        if nbytes > 0 and send_s > 0 and math.isfinite(nbytes / send_s):
            self.path_bytes_per_s[path] = self._mix(self.path_bytes_per_s.get(path), nbytes / send_s)
        if nbytes > 0 and pages > 0:
            self.page_bytes = self._mix(self.page_bytes, nbytes / pages)

    def proved(self, seconds: float) -> None:
        if math.isfinite(seconds):
            self.proof_s = self._mix(self.proof_s, max(0.0, seconds))


class ChainIndex:
    """Parent pointers of the block hashes the gateway has seen (``hash -> previous hash``), so a prefix id (the
    hash of a prefix's last block) can be turned back into its chain. Bounded: the oldest entries go first
    (:data:`CHAIN_INDEX_BLOCKS`); a chain whose ancestors were dropped is reported unknown.

    Cost: O(new blocks) per :meth:`add` (a known block implies its ancestors were added with it).
    """

    def __init__(self, max_blocks: int = CHAIN_INDEX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.parent: dict[Hashable, Hashable | None] = {}

    def add(self, chain: Sequence[Hashable]) -> None:
        p = self.parent
        k = len(chain) - 1
        while k >= 0 and chain[k] not in p:
            p[chain[k]] = chain[k - 1] if k else None
            k -= 1
        over = len(p) - self.max_blocks
        if over > 0:
            for h in list(islice(p, over)):
                del p[h]

    def chain_of(self, key: Hashable) -> tuple | None:
        """The chain ending with ``key`` (root first), or None when unknown or partly dropped."""
        p = self.parent
        if key not in p:
            return None
        out = [key]
        cur = p[key]
        while cur is not None:
            if cur not in p:
                return None
            out.append(cur)
            cur = p[cur]
        out.reverse()
        return tuple(out)

    def find(self, prefix: str, limit: int = 6) -> list[Hashable]:
        """Known hashes starting with ``prefix`` (case-insensitive hex), at most ``limit``."""
        prefix = prefix.lower()
        out: list[Hashable] = []
        for h in self.parent:
            if isinstance(h, str) and h.startswith(prefix):
                out.append(h)
                if len(out) >= limit:
                    break
        return out

    def __len__(self) -> int:
        return len(self.parent)


#: The groups of a worker with nothing queued (never written to).
_NO_GROUPS: dict = {}


class _Queue:
    """One worker's queued prefill as :meth:`FleetState._queue` counted it: ``total`` seconds, ``groups``
    (``{block: [requests, seconds]}``), the blocks the counted requests compute (``seen``) and how many requests
    (``requests``, in the order sent) it counted, under the worker's ``version`` / ``reshaped``, the copies'
    ``transfers`` version, the ``cost`` model and ``page_size`` it was counted with; ``short``: it counted prompts
    shorter than one block (they come last, so it cannot be extended)."""

    __slots__ = (
        "version",
        "reshaped",
        "transfers",
        "cost",
        "page_size",
        "total",
        "groups",
        "seen",
        "requests",
        "short",
        "listed",
    )

    def __init__(self, version: int, reshaped: int, transfers: int, cost: ReplicaCost, page_size: int) -> None:
        self.version, self.reshaped, self.transfers = version, reshaped, transfers
        self.cost, self.page_size = cost, page_size
        self.total = 0.0
        self.groups: dict[Hashable, list] = {}
        self.seen: set[Hashable] = set()
        self.requests = 0
        self.short = False
        #: ``groups`` as :meth:`FleetState.waiting_groups` answers them, built on first read (None: not yet)
        self.listed: list[tuple[Hashable, int, float]] | None = None


class WorkerIndex:
    """The gateway's :class:`~btbctl.engine.policies.base.RouteIndex` at one moment (:meth:`FleetState.route_index`).

    * :attr:`idle`: the workers with nothing of the gateway's in flight (no request, none without a first byte) and
      no ``/v1/loads`` report with a KV size (whose other requests and KV use :meth:`FleetState.admission_wait_s`
      reads): there the load, the queued prefill, the admission wait and the waiting groups are 0 / empty. Empty
      unless it is every worker with load 0 (so a worker left out of it has a higher load).
    * :meth:`holders`: the workers whose record holds a chain's root, or computes it, or that receive a copy of a
      chain starting with it (a superset of those where :meth:`FleetState.planned_blocks` can be > 0).
    """

    __slots__ = ("_state", "idle", "idle_order")

    def __init__(self, state: FleetState) -> None:
        self._state = state
        idle: list[int] = []
        for w in state.workers:
            if w.inflight:
                continue
            if w.prefilling or w.prefill_chains or w.prefill_tokens or (w.loads and w.loads.get("max_tokens")):
                idle = []  # a worker without a request that is not idle: none counts as idle
                break
            idle.append(w.index)
        #: idle workers, ascending; none unless every worker without a request is idle (a policy may skip a busy
        #: worker for an idle one only when the busy one loses a tie on load)
        self.idle_order: list[int] = idle
        self.idle: frozenset[int] = frozenset(self.idle_order)

    def holders(self, root: Hashable) -> list[int]:
        """Workers that may plan a block of a chain starting with ``root``, ascending (the fleet's root index,
        :attr:`FleetState.roots`, and the copies in flight: O(those workers))."""
        here = self._state.roots.get(root)
        more = self._state.transfers.targets_of(root)
        if not more:
            return sorted(here) if here else []
        return sorted(here.union(more) if here else more)


class FleetState:
    """The live :class:`~btbctl.engine.policies.base.FleetView` the policies route with.

    Replica ``r`` is ``workers[r]``. An unhealthy worker reports no cached or pending blocks, so BTB neither routes to
    it as a holder nor picks it as a source, and the replicator refuses it as a target; a retry wraps this view in
    :class:`~btbctl.engine.policies.base.ExcludingView` so the workers that failed the request look the same; the
    gateway also overrides any choice of an unavailable worker. Loads are the gateway's own in-flight counts, as the
    SGLang router's.

    A copy in flight towards a worker counts its chain as pending there (the worker waits for it), never as
    cached: a target becomes a holder only when the replicator saw the copy ``done``. The published ``btb`` rule
    routes hot requests to holders only, so until the copies are confirmed it sends them all to the source (they
    queue there while it prefills); ``btb_plus`` weighs each replica's expected TTFT (queued prefill from
    :meth:`queued_prefill_s`, copy landing from :meth:`copy_status`) and spreads them over the copy targets.
    """

    def __init__(
        self, urls: Iterable[str], clock: Callable[[], float] | None = None, names: Sequence[str] | None = None
    ) -> None:
        urls = list(urls)
        self.workers = [WorkerState(i, u.rstrip("/"), names[i] if names else f"w{i}") for i, u in enumerate(urls)]
        #: root block -> the workers whose holdings or pending blocks hold it (each worker keeps it up to date:
        #: :attr:`WorkerState.root_index`); a request's chain starts with its root, and every chain recorded here does
        self.roots: dict[Hashable, set[int]] = {}
        for w in self.workers:
            w.root_index = self.roots
        #: worker URL (as in :attr:`workers`) -> its index
        self.index_of_url: dict[str, int] = {w.url: w.index for w in self.workers}
        self.clock = clock or Clock()
        self.transfers = TransferTable()
        self.ttft = TtftSeries()
        self.chains = ChainIndex()
        self.page_size = 256
        #: Set by the gateway to its copy executor's rule (push: the BTB routes; l3: a node agent); None: the push
        #: rule below.
        self.copy_capable: Callable[[int], bool] | None = None
        #: ``l3``: what the copies measured (agent-to-agent rates, proof time), read by :meth:`copy_status`
        self.copy_measures = CopyMeasures()
        #: Set by the gateway to its copy executor's ``after_s`` (seconds from a copy's last byte at the target to
        #: the target serving it); None: 0, the push rule (blocks land in the target's KV cache).
        self.copy_after: Callable[[int, int], float] | None = None
        #: measured over modelled prefill time on workers that name no presets (None: not measured yet)
        self.prefill_scale: float | None = None
        self._log_scale: float | None = None
        self._cost: ReplicaCost | None = None
        self._cost_guessed = False
        self._scaled: tuple[float, ReplicaCost] | None = None
        self._queues: dict[int, _Queue] = {}  # replica -> its queued prefill (see _queue)
        #: how long a sign of life keeps a worker from counting as dead, seconds (the gateway's
        #: ``progress_window_s``; see :meth:`WorkerState.alive`)
        self.progress_window_s = 6.0

    def alive(self, w: WorkerState) -> bool:
        """Whether ``w`` showed a sign of life within :attr:`progress_window_s`."""
        return w.alive(self.clock(), self.progress_window_s)

    def fallback(self, excluded: Sequence[int]) -> list[WorkerState]:
        """The workers to try when none outside ``excluded`` is healthy: those outside it whose latest failure was
        not a refused or broken connection and that either showed a sign of life within :attr:`progress_window_s`
        (they are answering) or only time out on ``/health`` and have no request in flight from the gateway (one
        request at a time finds out whether it answers, so a frozen worker holds at most one)."""
        now = self.clock()
        win = self.progress_window_s
        return [
            w
            for w in self.workers
            if w.index not in excluded
            and w.failure_kind != "refused"
            and (w.alive(now, win) or (w.failure_kind == "slow" and w.inflight == 0))
        ]

    # -- FleetView ---------------------------------------------------------------------------------------------

    @property
    def n_replicas(self) -> int:
        return len(self.workers)

    def available(self, replica: int) -> bool:
        return self.workers[replica].healthy

    def load(self, replica: int) -> int:
        return self.workers[replica].inflight

    def route_index(self) -> WorkerIndex:
        """The fleet-wide lookups that let a policy skip workers (:class:`WorkerIndex`, read now)."""
        return WorkerIndex(self)

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        w = self.workers[replica]
        return w.held_blocks(chain) if w.healthy else 0

    def planned_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """Leading blocks of ``chain`` recorded as resident on ``replica``, being computed there by a request the
        gateway has in flight, or arriving there by a copy in flight (0 when unavailable). The gateway does not see
        the worker's own queue apart from its requests, so these are also its :meth:`pending_blocks`."""
        w = self.workers[replica]
        if not w.healthy:
            return 0
        n = w.pending_or_held(chain)
        if n < len(chain) and self.transfers.active:  # a copy brings at most the whole chain
            d = self.transfers.depth_to(replica, chain)
            if d > n:
                return d
        return n

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return bool(chain) and self.transfers.in_flight(replica, chain[-1])

    def accepts_copies(self, replica: int) -> bool:
        """Whether ``replica`` can send or receive a copy, by the rule of the gateway's copy executor
        (:attr:`copy_capable`); without one, the push rule: healthy, serving the BTB routes (a stock SGLang server
        does not) and naming its ``transfer_addr`` in ``/btb/info``."""
        if self.copy_capable is not None:
            return self.copy_capable(replica)
        w = self.workers[replica]
        return w.healthy and w.btb is True and bool((w.info or {}).get("transfer_addr"))

    def prefill_load(self, replica: int) -> int:
        """Requests the gateway has in flight to ``replica`` without a first byte yet."""
        return self.workers[replica].prefilling

    def _queue(self, replica: int) -> tuple[float, dict]:
        """``(seconds of queued prefill, {block: [requests, seconds]})`` of the requests the gateway has on
        ``replica`` without a first byte yet, modelled as the simulator's view does (``queued_prefill_s``,
        ``waiting_groups``): in the order they were sent, each reuses the leading blocks recorded as resident
        there, arriving by a copy in flight there, or computed by a request sent there before it, and computes
        the rest of its prompt, at the FLOPs of :attr:`cost` (attention term included) over its achieved FLOP/s.
        A request that reuses blocks not resident yet waits for the deepest of them: the groups.

        Kept per worker (:class:`_Queue`) until its requests, holdings, the copies or the cost model change; a
        request sent there since (:meth:`WorkerState.start_prefill`, nothing else changed) is added to it, O(its
        prompt blocks), the same floats as a new count (:meth:`_queue_scan`); any other change counts afresh,
        O(prompt blocks) per request."""
        w = self.workers[replica]
        if not w.prefill_chains and not w.prefill_tokens:
            return 0.0, _NO_GROUPS  # nothing queued: what a count from scratch gives, without the memo's keys
        tv = self.transfers.version
        cost = self.cost
        memo = self._queues.get(replica)
        if (
            memo is not None
            and memo.version == w.version
            and memo.transfers == tv
            and memo.cost is cost
            and memo.page_size == self.page_size
        ):
            return memo.total, memo.groups
        if (
            memo is None
            or memo.reshaped != w.reshaped
            or memo.transfers != tv
            or memo.cost is not cost
            or memo.page_size != self.page_size
            or memo.short
        ):
            memo = self._queues[replica] = _Queue(w.version, w.reshaped, tv, cost, self.page_size)
        self._queue_scan(replica, memo)
        memo.version = w.version
        memo.listed = None
        return memo.total, memo.groups

    def _queue_scan(self, replica: int, q: _Queue) -> None:
        """Add the requests in flight on ``replica`` after the first ``q.requests`` of them to ``q`` (all of them
        for a new one)."""
        w = self.workers[replica]
        cost = q.cost
        rate = cost.flops * cost.mfu
        bt = q.page_size
        total, groups, seen = q.total, q.groups, q.seen
        copies = bool(self.transfers.active)
        chains = w.prefill_chains
        for rid, chain in islice(chains.items(), q.requests, None):
            tokens = w.prefill_tokens.get(rid) or len(chain) * bt
            held = w.held_blocks(chain)
            k = held
            if copies:
                k = max(k, self.transfers.depth_to(replica, chain))
            if k < len(chain) and chain[k] in seen:  # the blocks a request sent before computes: in C, not per block
                k += len(list(takewhile(seen.__contains__, islice(chain, k, None))))
            seen.update(islice(chain, k, None))
            have = min(k * bt, tokens - 1) if tokens > 1 else 0
            work = cost.prefill_flops(tokens - have, have) / rate
            total += work
            if k > held:
                g = groups.setdefault(chain[k - 1], [0, 0.0])
                g[0] += 1
                g[1] += work
        q.requests = len(chains)
        if len(w.prefill_tokens) > len(chains) or not w.prefill_tokens.keys() <= chains.keys():
            q.short = True  # prompts shorter than one block count last: no request joins after them
            for rid in w.prefill_tokens.keys() - chains.keys():
                t = w.prefill_tokens[rid]
                total += cost.prefill_flops(t, 0) / rate
        q.total = total

    def queued_prefill_s(self, replica: int) -> float:
        """Seconds of prefill compute queued on ``replica``: the requests the gateway has there without a first
        byte yet, each for the prompt tokens it computes (see :meth:`_queue`). The gateway sees only its own
        requests, and counts a request's prefill as queued until its first byte (no elapsed part)."""
        w = self.workers[replica]
        if not w.prefill_chains and not w.prefill_tokens:
            return 0.0  # nothing queued (asked per worker per routing decision): _queue's answer without the call
        return self._queue(replica)[0]

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        """:meth:`planned_blocks` (a method of its own, not an alias: the compiled build, README "Compiled core")."""
        return self.planned_blocks(replica, chain)

    def waiting_groups(self, replica: int) -> list[tuple[Hashable, int, float]]:
        """Requests the gateway has on ``replica`` without a first byte that wait for blocks not resident there
        yet (arriving by a copy, or computed there by a request sent before them), grouped by the deepest such
        block: ``(block hash, requests, seconds of their prefill)`` (see :meth:`_queue`). The list is kept with the
        worker's queue until it changes: read it, never change it."""
        w = self.workers[replica]
        if not w.prefill_chains:
            return []  # no request with a chain: none waits for a block
        groups = self._queue(replica)[1]
        if not groups:
            return []
        memo = self._queues[replica]  # the list is built once per count of the queue (shared: read it only)
        if memo.listed is None:
            memo.listed = [(b, g[0], g[1]) for b, g in groups.items()]
        return memo.listed

    def _copy(self, replica: int, chain: Sequence[Hashable]) -> Transfer | None:
        t = self.transfers.active.get((replica, chain[-1])) if chain else None
        return t if t is not None and t.routable else None

    def has_copy(self, replica: int, chain: Sequence[Hashable]) -> bool:
        """Whether :meth:`copy_status` of ``chain`` towards ``replica`` is not None, without building the status (a
        policy asks it per covered worker per routing decision)."""
        return self._copy(replica, chain) is not None

    def copy_status(self, replica: int, chain: Sequence[Hashable]):
        """The in-flight copy of ``chain`` towards ``replica`` as a ``CopyStatus``, or None. Bytes come from the
        source's progress answers; ``available_bytes`` is the part of the chain the source has computed so far
        (0 before it said); ``rate_bytes_per_s`` is the average since sending started once every block is
        available, else 0 (while the copy trails the source's prefill its average rate says nothing about the
        fabric)."""
        t = self._copy(replica, chain)
        if t is None:
            return None
        total = float(t.bytes_total)
        path_rate, after = 0.0, 0.0
        if t.ready is not None:  # l3: the fleet's measured figures for what is not known yet
            m = self.copy_measures
            if not total and m.page_bytes:
                total = m.page_bytes * len(t.chain)
            path_rate = m.path_bytes_per_s.get(t.path, 0.0) if t.path is not None else 0.0
            after = self.copy_after_s(replica, len(t.chain))
        if t.blocks_available >= 0 and t.chain:  # the source said how far its prefill is
            avail = total * min(1.0, t.blocks_available / len(t.chain))
        else:
            avail = 0.0 if t.state is CopyState.STALLED else total
        rate = 0.0
        if avail >= total:
            if path_rate and t.source_complete_s is not None:
                rate = path_rate
            elif t.started_s is not None:  # else no byte went yet: 0
                rate = t.bytes_per_s(self.clock())
        # source, total_bytes, sent_bytes, available_bytes, rate_bytes_per_s, path_bytes_per_s, after_s (positional:
        # read per copy target per routing decision)
        return CopyStatus(t.source, total, float(t.bytes_sent), avail, rate, path_rate, after)

    def copy_after_s(self, replica: int, blocks: int) -> float:
        """Seconds from the last byte of a copy of ``blocks`` blocks at ``replica`` until it can serve them (the
        executor's :attr:`copy_after`; 0 without one)."""
        return 0.0 if self.copy_after is None else self.copy_after(replica, blocks)

    def nic_copies(self, replica: int) -> int:
        """Copies in flight from or to ``replica`` (:meth:`TransferTable.nic_copies`)."""
        return self.transfers.nic_copies(replica)

    def admission_wait_s(self, replica: int, kv_tokens: int) -> float:
        """Coarse estimate from the worker's last ``/v1/loads`` brought up to date with what the gateway sent since:
        0 when nothing but the gateway's own requests (whose queueing :meth:`queued_prefill_s` models) waits there
        and :meth:`kv_headroom_tokens` (its free KV now, the gateway's requests sent or finished since the report
        counted) holds ``kv_tokens`` (or loads are unknown); otherwise the other requests waiting there plus the new
        one, each x the worker's smoothed TTFT (:meth:`ttft_estimate_s`; the gateway has no decode model of the
        workers; this is what it measures)."""
        w = self.workers[replica]
        loads = w.loads
        if not loads or not loads.get("max_tokens"):
            return 0.0
        waiting = max(0, int(loads.get("waiting") or 0) - w.loads_prefilling)
        if waiting == 0 and self.kv_headroom_tokens(replica) >= kv_tokens:
            return 0.0
        return (waiting + 1) * self.ttft_estimate_s(replica)

    def ttft_estimate_s(self, replica: int) -> float:
        """The worker's smoothed TTFT; before its first (a worker just started, or back after being down), the mean
        of the healthy workers' (0 when none has one): a fresh worker is not free just because it has no record."""
        own = self.workers[replica].ttft_ewma_s
        if own is not None:
            return own
        known = [w.ttft_ewma_s for w in self.workers if w.ttft_ewma_s is not None and w.healthy]
        return sum(known) / len(known) if known else 0.0

    def kv_headroom_tokens(self, replica: int) -> int:
        """Free KV tokens on ``replica`` now: ``max_total_num_tokens - num_used_tokens`` of its last ``/v1/loads``
        less the KV tokens of the gateway's requests sent there since (plus those of its requests that finished
        since, but never more than the report had in use: a finished request counted its whole requested output);
        unknown evictable space is not counted; at most its whole KV. Without loads: its ``capacity_tokens``
        (``/btb/info``) less the gateway's requests in flight there, else 0."""
        w = self.workers[replica]
        if w.loads and w.loads.get("max_tokens"):
            cap = int(w.loads["max_tokens"])
            used = int(w.loads.get("used_tokens") or 0)
            # requests finished since freed at most what the report had in use (they counted their whole output)
            return max(0, min(cap, cap - used - w.kv_sent_since + min(w.kv_freed_since, used)))
        capacity = (w.info or {}).get("capacity_tokens")
        return max(0, capacity - w.kv_tokens_inflight) if isinstance(capacity, int) else 0

    @property
    def block_tokens(self) -> int:
        """Tokens per block of the chains (the gateway's page size)."""
        return self.page_size

    @property
    def chunk_tokens(self) -> int:
        """Prefill chunk of the workers: ``chunked_prefill_size`` of a worker's ``/btb/info`` when given, else
        SGLang's default for the GPU of :attr:`cost` (``costmodel.default_chunked_prefill_tokens``)."""
        for w in self.workers:
            v = (w.info or {}).get("chunked_prefill_size")
            if isinstance(v, int) and v > 0:
                return v
        return default_chunked_prefill_tokens(self.cost.gpu)

    @property
    def cost(self) -> ReplicaCost:
        """Cost model of one replica: from the first worker whose ``/btb/info`` names known model/GPU presets
        (``model_preset``, ``gpu``, ``tp_size``); else (real SGLang workers, which name none) the default cluster's
        (Llama-3.3-70B on 4xH100) **calibrated** by what the fleet measured: its prefill and decode times scaled by
        :attr:`prefill_scale` (:meth:`observe_prefill`)."""
        if self._cost is None:
            cost = None
            for w in self.workers:
                info = w.info or {}
                try:
                    cfg = ClusterConfig(
                        model=str(info.get("model_preset") or info.get("model")),
                        gpu=str(info.get("gpu")),
                        gpus_per_replica=int(info.get("tp_size") or 1),
                    )
                    cost = cfg.replica_cost()
                    break
                except Exception:  # noqa: BLE001 - untrusted /btb/info: unknown preset names (a real model), missing fields
                    continue
            self._cost_guessed = cost is None
            self._cost = cost or ClusterConfig().replica_cost()
            self._scaled = None
        if not self._cost_guessed or self.prefill_scale is None:
            return self._cost
        if self._scaled is None or abs(self._scaled[0] / self.prefill_scale - 1.0) > 0.05:
            base = self._cost
            k = self.prefill_scale
            self._scaled = (k, replace(base, mfu=base.mfu / k, hbm_efficiency=base.hbm_efficiency / k))
        return self._scaled[1]

    @property
    def calibrating(self) -> bool:
        """Whether the cost model is a guess that the fleet's measurements calibrate (no worker names presets)."""
        if self._cost is None:
            self.cost  # noqa: B018 - settles the guess
        return self._cost_guessed

    def observe_prefill(self, new_tokens: int, cached_tokens: int, seconds: float) -> None:
        """A request of ``new_tokens`` prompt tokens (``cached_tokens`` of them recorded as cached on its worker)
        that was alone on its worker got its first byte ``seconds`` after it was sent: move :attr:`prefill_scale`
        (measured over modelled time, EWMA of its logarithm, weight :data:`MEASURE_EWMA_ALPHA`, clamped to
        [:data:`MIN_PREFILL_SCALE`, :data:`MAX_PREFILL_SCALE`])."""
        base = self._cost if self.calibrating else None  # ``calibrating`` settles the model
        if base is None or seconds <= 0:
            return
        cached = min(cached_tokens, max(0, new_tokens - 1))
        modelled = base.prefill_time_s(new_tokens - cached, cached)
        if modelled <= 0:
            return
        x = math.log(min(MAX_PREFILL_SCALE, max(MIN_PREFILL_SCALE, seconds / modelled)))
        if self._log_scale is not None:  # one odd sample (a stall, a hiccup) moves the scale at most 10x
            x = min(self._log_scale + math.log(10), max(self._log_scale - math.log(10), x))
        self._log_scale = x if self._log_scale is None else self._log_scale + MEASURE_EWMA_ALPHA * (x - self._log_scale)
        self.prefill_scale = math.exp(self._log_scale)

    def reset_cost(self) -> None:
        """Forget :attr:`cost` (a worker's ``/btb/info`` may now name the presets); it is rebuilt when next read."""
        self._cost = None

    # -- bookkeeping -------------------------------------------------------------------------------------------

    def record_ttft(self, replica: int, now_s: float, ttft_s: float, worker_s: float | None = None) -> None:
        """A first byte: ``ttft_s`` from the request's arrival (the fleet's TTFT series), ``worker_s`` from the
        moment it was sent to ``replica`` (default ``ttft_s``; the worker's smoothed TTFT learns from it, so a
        request that waited at the gateway for a copy does not make the worker look slow)."""
        self.ttft.add(now_s, ttft_s)
        w = self.workers[replica]
        x = ttft_s if worker_s is None else worker_s
        w.ttft_ewma_s = x if w.ttft_ewma_s is None else (w.ttft_ewma_s + TTFT_EWMA_ALPHA * (x - w.ttft_ewma_s))

    def holders(self, key: Hashable) -> list[int]:
        """Workers recorded as holding the prefix whose last block hash is ``key``."""
        return [w.index for w in self.workers if key in w.holdings]

    def known_hashes(self) -> Iterable[Hashable]:
        seen: set = set()
        for w in self.workers:
            for h in w.holdings:
                if h not in seen:
                    seen.add(h)
                    yield h
