"""The dashboard's snapshot types and the interface its sources implement."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from btbctl.engine.chains import SHORT_ID_CHARS
from btbctl.engine.errors import BtbctlError


class SourceError(BtbctlError):
    """An action the fleet refused or could not carry out (message says why)."""


# -- the snapshot -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker (a replica: one model instance over ``gpus`` GPUs). Token counts are None where the worker does
    not report them.

    Attributes:
        name: worker name (``w0`` ...).
        healthy: answers health checks; ``error`` says why not.
        running: requests running (prefill or decode).
        queued: requests waiting for admission.
        kv_used_tokens / kv_capacity_tokens: KV cache held by running requests / its size, tokens.
        kv_cached_tokens: KV cache holding cached prefixes no running request uses (evictable), tokens.
        host_tier_tokens / host_tier_capacity_tokens: HiCache host tier (L2) in use / its size, tokens.
        storage_hit_tokens_total: tokens its L3 prefetch queries found, since it started.
        storage_prefetched_tokens_total / storage_backup_tokens_total: tokens read from / written to L3.
        load_back_tokens_total: tokens loaded back from the host tier to the GPU.
        source: whose numbers these are: ``sglang_metrics`` (a real SGLang server's ``/metrics``), ``sglang_loads``
            (only its ``/v1/loads``), ``modelled`` (the cost model: an emulated worker, the simulation), or empty
            when unknown.
        metrics_note: why its ``/metrics`` numbers are missing (None when they are there).
    """

    name: str
    healthy: bool
    running: int
    queued: int
    kv_used_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    error: str | None = None
    kv_cached_tokens: int | None = None
    host_tier_tokens: int | None = None
    host_tier_capacity_tokens: int | None = None
    storage_hit_tokens_total: int | None = None
    storage_prefetched_tokens_total: int | None = None
    storage_backup_tokens_total: int | None = None
    load_back_tokens_total: int | None = None
    source: str = ""
    metrics_note: str | None = None

    @property
    def kv_held_fraction(self) -> float | None:
        """Share of the KV cache holding tokens (in use or cached), 0..1; None when the size is unknown."""
        if not self.kv_capacity_tokens:
            return None
        held = (self.kv_used_tokens or 0) + (self.kv_cached_tokens or 0)
        return min(1.0, held / self.kv_capacity_tokens)


#: Where a GPU row's figures come from (:attr:`GpuRow.source`), as the dashboard's legend explains them.
GPU_SOURCES = {
    "nvml": "read here through NVML",
    "worker": "as the worker reports it",
    "model": "an emulated worker's model: weights plus the KV it holds",
    "sim": "the simulation's model: weights plus the KV it holds",
}


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU's memory. ``source``: a key of :data:`GPU_SOURCES`: ``nvml`` (read locally), ``worker`` (as its
    worker reports it), ``model`` (an emulated worker's modelled HBM: weights plus the KV tokens it holds, running
    requests' and cached prefixes') or ``sim`` (the simulation's, the same sum). ``util_pct`` 0..100 or None when
    unknown."""

    name: str
    used_bytes: float
    total_bytes: float
    util_pct: float | None
    source: str


@dataclass(frozen=True, slots=True)
class PrefixRow:
    """One prefix in the detector window.

    Attributes:
        prefix_id: the prefix id ``btbctl replicate --prefix`` takes (hash of its last block, hex).
        prefix_tokens: prefix length, tokens.
        arrivals_in_window: arrivals in the trailing ``window_s``.
        threshold: arrivals that make it hot.
        holders: workers holding all of it.
        copies_in_flight: copies of it under way.
        hot: whether the detector has it active.
    """

    prefix_id: str
    prefix_tokens: int
    arrivals_in_window: int
    threshold: int
    holders: int
    copies_in_flight: int
    hot: bool

    @property
    def short_id(self) -> str:
        return self.prefix_id[:SHORT_ID_CHARS]


@dataclass(frozen=True, slots=True)
class TransferRow:
    """One KV-cache copy. ``prefix_id``: the hot prefix it is for, the id the heat panel, ``btbctl prefixes`` and
    ``btbctl replicate --prefix`` use (a policy may copy a deeper chain: ``chain_id`` is that chain's id, empty when
    the same or unknown; ``copied_tokens`` its length, tokens, None when unknown). ``state``: ``running``,
    ``stalled`` (waiting for the source's prefill), ``done`` or ``failed`` (``error`` says why). ``eta_s`` None when
    unknown (stalled, finished). ``duration_s``: seconds
    since it started while in flight, start to end once finished (None when unknown). ``proof_storage_tokens``: an
    ``l3`` copy's proof, the tokens its target's warm-up loaded from L3 (None before, and for pushed copies).
    ``outcome``: how it ended (:class:`~btbctl.engine.copies.CopyOutcome` value; None in flight); ``usable_s``:
    seconds from its start (the detector's fire) until the target could serve the prefix; ``phases_s``: an ``l3``
    copy's ``(source, transfer, proof)`` seconds (None where not reached)."""

    copy_id: str
    prefix_id: str
    source: str
    target: str
    bytes_sent: float
    bytes_total: float
    bytes_per_s: float
    eta_s: float | None
    state: str
    error: str | None = None
    duration_s: float | None = None
    proof_storage_tokens: int | None = None
    outcome: str | None = None
    usable_s: float | None = None
    phases_s: tuple[float | None, float | None, float | None] | None = None
    copied_tokens: int | None = None
    chain_id: str = ""

    @property
    def fraction(self) -> float:
        return 1.0 if self.bytes_total <= 0 else min(1.0, self.bytes_sent / self.bytes_total)


@dataclass(frozen=True, slots=True)
class TtftPoint:
    """TTFT over one bucket of fleet time ending at ``t_s``: percentiles in seconds (NaN: no first token in the
    bucket) and arrivals per second ``rps``."""

    t_s: float
    p50_s: float
    p95_s: float
    rps: float


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Everything a dashboard shows at one moment.

    Attributes:
        now_s: fleet time of the snapshot, seconds (simulated time for the simulation).
        connected: the source answered; when False the other fields are the last known values and ``message``
            says what is wrong.
        message: one line about the source (``simulation x10``, ``fleet unreachable: ...; retry in 2.0 s``).
        workers, gpus, prefixes, transfers, ttft: rows as above (transfers: in flight first, then recent).
        gpu_note: why no GPU rows exist (``NVML unavailable: <reason>``), else None.
        constants: the four constants in force (``BtbConstants.as_dict()``).
        policy: the routing policy in force.
        rps: arrivals per second over the latest complete bucket.
        finished: the simulation replayed its whole trace (always False for a live fleet).
        feed: how this snapshot arrived from a live fleet: ``stream`` (pushed by the control API's event stream)
            or ``poll`` (fetched on request, while the stream is down); empty for a source without a stream.
        replication: the fleet's replication mode (``l3``, ``push``, ``none``); empty when unknown (simulation).
        ttft_window_s: the window the TTFT summary covers, seconds (the trailing ``ttft_window_s`` before
            ``now_s``; 0 when there is no summary).
        ttft_n / ttft_p50_s / ttft_p95_s: first tokens in that window and their TTFT percentiles, seconds (None
            when none).
    """

    now_s: float
    connected: bool
    message: str
    workers: tuple[WorkerRow, ...] = ()
    gpus: tuple[GpuRow, ...] = ()
    gpu_note: str | None = None
    prefixes: tuple[PrefixRow, ...] = ()
    transfers: tuple[TransferRow, ...] = ()
    ttft: tuple[TtftPoint, ...] = ()
    constants: dict = field(default_factory=dict)
    policy: str = ""
    rps: float = 0.0
    finished: bool = False
    feed: str = ""
    replication: str = ""
    ttft_window_s: float = 0.0
    ttft_n: int = 0
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None


@dataclass(frozen=True, slots=True)
class ReplicateResult:
    """Outcome of :meth:`DashboardSource.replicate`: ``copy_ids`` of the copies started (may be fewer than asked),
    the ``source`` worker and ``targets``; ``message`` one line for the screen."""

    prefix_id: str
    copy_ids: tuple[str, ...]
    source: str
    targets: tuple[str, ...]
    message: str


class DashboardSource(Protocol):
    """What the dashboard talks to. All methods are coroutines and never block the event loop.

    ``set_constants`` returns the constants the fleet confirms (a dict of the four) and raises
    :class:`~btbctl.engine.errors.ConfigError` naming the key it refuses; ``set_policy`` returns the policy in
    force; ``replicate`` raises :class:`SourceError` when nothing can be copied; ``prewarm`` (a prompt as
    ``{"text"}``, ``{"messages"}`` or ``{"input_ids"}``, computed once and copied to ``n`` workers) raises it when
    the source cannot (a simulation has no prompts).
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def snapshot(self) -> FleetSnapshot: ...

    async def set_constants(self, **changes: Any) -> dict: ...

    async def set_policy(self, name: str) -> str: ...

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult: ...

    async def prewarm(self, prompt: dict, n: int) -> ReplicateResult: ...


@runtime_checkable
class StreamingSource(DashboardSource, Protocol):
    """A source that can push snapshots as the fleet changes (the control API's event stream).

    While :attr:`streaming` is true the source calls the listener with every new snapshot and a dashboard need not
    ask for any; while it is false (the stream is down and being reconnected) the dashboard falls back to asking
    with :meth:`~DashboardSource.snapshot`. The listener is also called once when the stream goes down, with the
    last snapshot marked ``feed="poll"``. It runs in the source's event loop (the one :meth:`start` ran in) and must
    not block.
    """

    @property
    def streaming(self) -> bool: ...

    def set_listener(self, listener: Callable[[FleetSnapshot], None] | None) -> None: ...
