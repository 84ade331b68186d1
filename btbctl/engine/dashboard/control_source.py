"""The dashboard's source for a running fleet: it follows the control API's event stream and falls back to polling
only while the stream is down.

**Stream.** :meth:`ControlApiSource.start` starts a task that follows ``GET /control/events`` with the one control
client (:class:`~btbctl.engine.control.client.AsyncControlClient`). Once the stream is open the source fetches the
whole picture once (fleet, prefixes, transfers and the TTFT series) and from then on applies each event
(``fleet``, ``prefixes``, ``transfers``, ``ttft``, ``constants``) to it, builds a snapshot and hands it to the
listener (:meth:`~ControlApiSource.set_listener`). While it streams, :meth:`~ControlApiSource.snapshot` returns the
latest pushed snapshot without a request. When the stream breaks the listener gets the last snapshot marked
``feed="poll"``, and the task reconnects after :data:`RECONNECT_MIN_S` doubling up to :data:`RECONNECT_MAX_S`.

**Polling.** While the stream is down, :meth:`~ControlApiSource.snapshot` fetches the four reads concurrently. When
the fleet cannot be reached the snapshot keeps the last known rows with ``connected=False`` and a message, and the
next attempt waits with the same backoff (attempts are not made more often, however often it is called).

The TTFT series is 1-second buckets over the last 60 s (:data:`TTFT_WINDOW_S`): polled whole
(``GET /control/ttft?window_s=60``), or, on the stream, the ``point`` of each ``ttft`` event (the trailing second at
the event) appended once a bucket further, empty buckets filled in as other events show time passing without first
bytes (:class:`TtftTrail`). The p50/p95 the dashboard states are over that window, computed by the gateway from
every first token in it (the poll's ``summary``, the event's ``last_60s``), never the latest bucket's.

A snapshot's ``now_s`` is the latest gateway time any answer or event carried (the gateway sends ``prefixes`` and
``ttft`` every second while arrivals or first tokens are leaving their windows, so heat decays on screen with no
new traffic).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from btbctl.engine.chains import SHORT_ID_CHARS
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.backoff import Backoff
from btbctl.engine.control.client import AsyncControlClient, ControlApiError, ControlEvent
from btbctl.engine.control.schema import (
    TTFT_RECENT_WINDOW_S,
    ConstantsAnswer,
    FleetAnswer,
    PrefixesAnswer,
    ReplicateAnswer,
    TransfersAnswer,
    TtftAnswer,
    TtftBucket,
    TtftEvent,
    TtftSummary,
)
from btbctl.engine.dashboard.snapshot import (
    FleetSnapshot,
    GpuRow,
    PrefixRow,
    ReplicateResult,
    SourceError,
    TransferRow,
    TtftPoint,
    WorkerRow,
)
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.netaddr import is_loopback
from btbctl.engine.telemetry.nvml import read_gpus

log = logging.getLogger(__name__)

#: Width of one TTFT-series bucket, seconds of fleet time.
TTFT_BUCKET_S = 1.0
#: Buckets kept in the TTFT series (the window the panel states, at 1 s).
TTFT_BUCKETS = int(TTFT_RECENT_WINDOW_S / TTFT_BUCKET_S)
#: First and largest wait between reconnection attempts (of the stream, and of polling while the fleet is
#: unreachable), seconds, doubling in between. A product choice: quick enough to notice a restarted fleet within
#: seconds, slow enough not to hammer a machine that is down.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
#: Per-request timeout of control-API calls, seconds.
REQUEST_TIMEOUT_S = 3.0
#: Seconds between two NVML reads (NVML's own utilisation sample period is about a second).
NVML_EVERY_S = 2.0
#: Trailing seconds of TTFT series asked from the control API.
TTFT_WINDOW_S = TTFT_BUCKETS * TTFT_BUCKET_S
#: Feeds of a snapshot (:attr:`~btbctl.engine.dashboard.snapshot.FleetSnapshot.feed`).
FEED_STREAM = "stream"
FEED_POLL = "poll"


def _is_loopback(url: str) -> bool:
    return is_loopback(urlsplit(url).hostname or "")


def _nan(x: float | None) -> float:
    return math.nan if x is None else float(x)


def _point(b: TtftBucket) -> TtftPoint:
    return TtftPoint(b.t_s, _nan(b.p50_s), _nan(b.p95_s), b.rps)


class TtftTrail:
    """The dashboard's TTFT series, ``step_s`` buckets, at most ``keep`` of them, oldest first.

    :meth:`reset` takes a polled series; :meth:`add` takes the ``point`` of a ``ttft`` event (a bucket ending at the
    event), appended when it ends a step or more after the latest bucket, else replacing it (the same second, seen
    later); :meth:`advance` appends empty buckets for time known to have passed without first bytes (every bucket
    that ends a whole step before ``now_s``: first bytes in the latest step may still be on their way)."""

    def __init__(self, step_s: float = TTFT_BUCKET_S, keep: int = TTFT_BUCKETS) -> None:
        self.step_s = step_s
        self.keep = keep
        self.points: list[TtftPoint] = []

    def reset(self, buckets: Iterable[TtftBucket]) -> None:
        self.points = [_point(b) for b in buckets][-self.keep :]

    def add(self, bucket: TtftBucket) -> None:
        p = _point(bucket)
        if self.points and p.t_s - self.points[-1].t_s < self.step_s:
            if p.t_s >= self.points[-1].t_s:
                self.points[-1] = p
            return
        self.points.append(p)
        del self.points[: -self.keep]

    def advance(self, now_s: float) -> None:
        if not self.points:
            return
        last = self.points[-1].t_s
        span = (self.keep + 1) * self.step_s
        if now_s - last > span:  # a silence longer than the series: every bucket kept is empty
            self.points = []
            last = now_s - span
        while last + self.step_s <= now_s - self.step_s:
            last += self.step_s
            self.points.append(TtftPoint(round(last, 6), math.nan, math.nan, 0.0))
        del self.points[: -self.keep]


class ControlApiSource:
    """A running fleet's control API behind the :class:`~btbctl.engine.dashboard.snapshot.StreamingSource`
    interface (see the module docstring for the stream and the polling fallback).

    Writes (``PUT /control/constants``, ``POST /control/replicate``) send the bearer token. GPUs: as the workers
    report them (``hbm_used_bytes``/``hbm_total_bytes`` in a worker row), else read through NVML when the control
    API is on this machine (loopback), else ``gpu_note`` says why there are none.

    Args:
        base_url: ``http://host:port`` of the control API.
        token: bearer token (None: writes raise :class:`SourceError`).
        top: prefixes asked for when polling (the ``prefixes`` event carries 10).
        nvml_module: passed to :func:`btbctl.engine.telemetry.nvml.read_gpus` (tests).
        local_gpus: read NVML (default: when the control API is on loopback).
        clock: monotonic seconds (tests).
        stream: follow the event stream once started (False: poll only).
        reconnect_min_s / reconnect_max_s: backoff of reconnection attempts, seconds.

    Attributes:
        streaming: the event stream is open and feeding snapshots.
        stream_error: why the stream is down (None while it streams or before it was tried).
        polls: snapshots fetched by polling (a count, for tests and diagnostics).
        events: events applied from the stream.
        failures: polls that found the fleet unreachable.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        top: int = 10,
        nvml_module: Any = None,
        local_gpus: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        stream: bool = True,
        reconnect_min_s: float = RECONNECT_MIN_S,
        reconnect_max_s: float = RECONNECT_MAX_S,
    ) -> None:
        self.api = AsyncControlClient(base_url, token, timeout_s=REQUEST_TIMEOUT_S)
        self.base_url = self.api.base_url
        self.token = token
        self.top = top
        self._nvml_module = nvml_module
        self._local = _is_loopback(self.base_url) if local_gpus is None else local_gpus
        self._clock = clock
        self._stream_enabled = stream
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self._listener: Callable[[FleetSnapshot], None] | None = None
        self._stream_task: asyncio.Task | None = None
        self.streaming = False
        self.stream_error: str | None = None
        self._last: FleetSnapshot | None = None
        self._next_try = 0.0
        self._poll_backoff = Backoff(reconnect_min_s, reconnect_max_s)
        self._nvml = None
        self._nvml_at = -math.inf
        self._fleet: FleetAnswer | None = None
        self._prefixes: PrefixesAnswer | None = None
        self._transfers: TransfersAnswer | None = None
        self._trail = TtftTrail()
        self._ttft_window: TtftSummary | None = None
        self._now_s = 0.0
        self.polls = 0
        self.events = 0
        self.failures = 0

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def set_listener(self, listener: Callable[[FleetSnapshot], None] | None) -> None:
        """Call ``listener(snapshot)`` with every snapshot the stream brings, and once when the stream goes down."""
        self._listener = listener

    async def start(self) -> None:
        """Start following the event stream (in the running loop), unless disabled or already started."""
        if self._stream_enabled and self._stream_task is None:
            self._stream_task = asyncio.get_running_loop().create_task(self._follow())

    async def close(self) -> None:
        if self._stream_task is not None:
            self._stream_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stream_task
            self._stream_task = None
        self.streaming = False
        await self.api.close()

    # -- polling ------------------------------------------------------------------------------------------------

    async def snapshot(self) -> FleetSnapshot:
        """The fleet's state: the latest streamed snapshot while the stream is open; otherwise fetched now (or,
        while the fleet is unreachable and the backoff runs, the last one marked ``connected=False``)."""
        if self.streaming and self._last is not None:
            return self._last
        if self._last is not None and not self._last.connected and self._clock() < self._next_try:
            return self._last
        try:
            answers = await self._fetch_all()
        except BtbctlError as e:
            if self.streaming and self._last is not None:  # the stream opened meanwhile: it knows better
                return self._last
            self._last = self._down(str(e))
            return self._last
        if self.streaming and self._last is not None:  # the stream opened meanwhile: its picture is newer
            return self._last
        self._take(*answers)
        self.polls += 1
        was_down = self._last is not None and not self._last.connected
        self._poll_backoff.reset()
        snap = await self._build(FEED_POLL)
        if was_down:
            snap = replace(snap, message=f"reconnected to {self.base_url}")
        self._last = snap
        return snap

    async def _fetch_all(self) -> tuple[FleetAnswer, PrefixesAnswer, TransfersAnswer, TtftAnswer]:
        """The four reads, concurrently (raises :class:`BtbctlError` when any fails)."""
        api = self.api
        return await asyncio.gather(
            api.fleet(), api.prefixes(self.top), api.transfers(), api.ttft(TTFT_WINDOW_S, TTFT_BUCKET_S)
        )

    def _take(self, fleet: FleetAnswer, prefixes: PrefixesAnswer, transfers: TransfersAnswer, ttft: TtftAnswer) -> None:
        """Make fetched answers the current picture."""
        self._fleet, self._prefixes, self._transfers = fleet, prefixes, transfers
        self._trail.reset(ttft.series)
        self._ttft_window = ttft.summary
        self._now_s = max(fleet.now_s, prefixes.now_s, transfers.now_s, ttft.now_s)

    def _down(self, why: str) -> FleetSnapshot:
        self.failures += 1
        now = self._clock()
        wait_s = self._poll_backoff.failed()
        self._next_try = now + wait_s
        msg = f"fleet unreachable at {self.base_url}: {why}; retrying in {wait_s:.1f} s"
        last = self._last
        if last is None:
            return FleetSnapshot(now_s=0.0, connected=False, message=msg, feed=FEED_POLL)
        return replace(last, connected=False, message=msg, feed=FEED_POLL)

    # -- the event stream ---------------------------------------------------------------------------------------

    async def _follow(self) -> None:
        backoff = Backoff(self.reconnect_min_s, self.reconnect_max_s)
        while True:
            try:
                async for event in self.api.events():
                    if not self.streaming:
                        self._take(*await self._fetch_all())  # the whole picture once; events update it
                        self.streaming = True
                        self.stream_error = None
                        backoff.reset()
                    self._apply(event)
                    await self._publish()
                why = "the gateway closed the event stream"
            except BtbctlError as e:
                why = str(e)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug here must not end the dashboard's updates: polling takes over
                log.exception("event stream consumer failed")
                why = f"internal error: {e!r}"
            was = self.streaming
            self.streaming = False
            self.stream_error = why
            if was and self._last is not None:
                self._last = replace(self._last, feed=FEED_POLL, message=self._message(FEED_POLL))
                self._notify(self._last)
            await asyncio.sleep(backoff.failed())

    def _apply(self, event: ControlEvent) -> None:
        p = event.payload
        self.events += 1
        now = getattr(p, "now_s", None)
        if isinstance(now, (int, float)):
            self._now_s = max(self._now_s, float(now))
        if isinstance(p, FleetAnswer):
            self._fleet = p
            self._trail.advance(p.now_s)
        elif isinstance(p, PrefixesAnswer):
            self._prefixes = p
            self._trail.advance(p.now_s)
        elif isinstance(p, TransfersAnswer):
            self._transfers = p
            self._trail.advance(p.now_s)
        elif isinstance(p, ConstantsAnswer):
            if self._fleet is not None:
                self._fleet = self._fleet.model_copy(update={"policy": p.policy, "constants": p.constants})
        elif isinstance(p, TtftEvent):
            self._trail.add(p.point)
            if p.last_60s is not None:
                self._ttft_window = p.last_60s
            self._trail.advance(p.now_s)

    async def _publish(self) -> None:
        self._last = await self._build(FEED_STREAM)
        self._notify(self._last)

    def _notify(self, snap: FleetSnapshot) -> None:
        if self._listener is not None:
            self._listener(snap)

    # -- snapshots ----------------------------------------------------------------------------------------------

    def _message(self, feed: str) -> str:
        fleet = self._fleet
        workers = fleet.workers if fleet is not None else []
        msg = f"fleet {self.base_url}: {sum(1 for w in workers if w.healthy)}/{len(workers)} workers healthy"
        if feed == FEED_POLL and self._stream_task is not None and self.stream_error:
            msg += f"; event stream down ({self.stream_error})"
        return msg

    async def _gpus(self, fleet: FleetAnswer) -> tuple[tuple[GpuRow, ...], str | None]:
        rows = tuple(
            GpuRow(
                w.name,
                w.hbm_used_bytes or 0.0,
                w.hbm_total_bytes,
                w.gpu_util_pct,
                "model" if w.hbm_modelled else "worker",
            )
            for w in fleet.workers
            if w.hbm_total_bytes
        )
        if rows:
            return rows, None
        if not self._local:
            return (), "NVML unavailable: the fleet is not on this machine and its workers report no HBM"
        now = self._clock()
        if self._nvml is None or now - self._nvml_at >= NVML_EVERY_S:
            self._nvml = await asyncio.to_thread(read_gpus, self._nvml_module)
            self._nvml_at = now
        res = self._nvml
        if not res.available:
            return (), f"NVML unavailable: {res.reason}"
        return tuple(GpuRow(f"gpu{g.index}", g.used_bytes, g.total_bytes, g.util_pct, "nvml") for g in res.gpus), None

    async def _build(self, feed: str) -> FleetSnapshot:
        fleet, prefixes, transfers = self._fleet, self._prefixes, self._transfers
        assert fleet is not None and prefixes is not None and transfers is not None
        names = {w.url: w.name for w in fleet.workers}
        workers = tuple(
            WorkerRow(
                w.name,
                w.healthy,
                w.running or 0,
                w.waiting or 0,
                w.kv_used_tokens,
                w.kv_capacity_tokens,
                w.error,
                kv_cached_tokens=w.kv_cached_tokens,
                host_tier_tokens=w.host_tier_tokens,
                host_tier_capacity_tokens=w.host_tier_capacity_tokens,
                storage_hit_tokens_total=w.storage_hit_tokens_total,
                storage_prefetched_tokens_total=w.storage_prefetched_tokens_total,
                storage_backup_tokens_total=w.storage_backup_tokens_total,
                load_back_tokens_total=w.load_back_tokens_total,
                source=w.metrics_source or "",
                metrics_note=w.metrics_note,
            )
            for w in fleet.workers
        )
        prows = tuple(
            PrefixRow(
                p.id, p.prefix_tokens, p.arrivals_in_window, p.threshold, len(p.holders), p.copies_in_flight, p.hot
            )
            for p in prefixes.prefixes
        )
        trows = tuple(
            TransferRow(
                t.copy_id,
                t.hot_prefix or t.prefix,
                names.get(t.source, t.source),
                names.get(t.target, t.target),
                float(t.bytes_sent),
                float(t.bytes_total),
                t.bytes_per_s,
                t.eta_s,
                str(t.state),
                t.error,
                _duration(t.started_s, t.finished_s, transfers.now_s),
                t.proof_storage_tokens,
                None if t.outcome is None else str(t.outcome),
                t.usable_s,
                (t.phase_source_s, t.phase_transfer_s, t.phase_proof_s) if t.mode == "l3" else None,
                copied_tokens=t.prefix_tokens,
                chain_id=t.prefix if t.hot_prefix and t.hot_prefix != t.prefix else "",
            )
            for t in transfers.transfers
        )
        pts = tuple(self._trail.points)
        gpus, note = await self._gpus(fleet)
        win = self._ttft_window
        return FleetSnapshot(
            now_s=max(self._now_s, fleet.now_s),
            connected=True,
            message=self._message(feed),
            workers=workers,
            gpus=gpus,
            gpu_note=note,
            prefixes=prows,
            transfers=trows,
            ttft=pts,
            constants=fleet.constants.as_dict(),
            policy=fleet.policy,
            replication=fleet.replication_mode,
            rps=pts[-1].rps if pts else 0.0,
            feed=feed,
            ttft_window_s=TTFT_WINDOW_S if win is not None else 0.0,
            ttft_n=win.n if win is not None else 0,
            ttft_p50_s=win.p50_s if win is not None else None,
            ttft_p95_s=win.p95_s if win is not None else None,
        )

    # -- actions ------------------------------------------------------------------------------------------------

    def _refused(self, e: ControlApiError) -> BtbctlError:
        """A refused write as the dashboard's errors: a 400 naming a key as :class:`ConfigError`, else
        :class:`SourceError`."""
        key = e.key
        if e.status == 400 and key:
            text = e.detail.message if e.detail is not None else str(e)
            return ConfigError(key, text.removeprefix(f"{key}: "))
        return SourceError(str(e))

    async def set_constants(self, **changes: Any) -> dict:
        """``PUT /control/constants`` with ``changes`` (validated here first); returns the four constants the
        fleet confirms. Raises :class:`ConfigError` (the key it refuses) or :class:`SourceError`."""
        current = self._last.constants if self._last is not None and self._last.constants else None
        (BtbConstants.parse(current) if current else BtbConstants()).with_updates(**changes)
        answer = await self._write(changes)
        out = answer.constants.as_dict()
        if self._last is not None:
            self._last = replace(self._last, constants=out)
        return out

    async def set_policy(self, name: str) -> str:
        """``PUT /control/constants`` with ``{"policy": name}``; returns the policy in force."""
        return (await self._write({"policy": name})).policy

    async def _write(self, body: dict) -> ConstantsAnswer:
        if not self.token:
            raise SourceError("no control token: pass --token/--token-file or use the run directory of 'btbctl up'")
        try:
            return await self.api.set_constants(body)
        except ControlApiError as e:
            raise self._refused(e) from None

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult:
        """``POST /control/replicate {"prefix", "n"}``."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        if not self.token:
            raise SourceError("no control token: pass --token/--token-file or use the run directory of 'btbctl up'")
        try:
            ans = await self.api.replicate(prefix_id, n)
        except ControlApiError as e:
            raise self._refused(e) from None
        return self._copying(ans)

    async def prewarm(self, prompt: dict, n: int) -> ReplicateResult:
        """``POST /control/prewarm`` with ``prompt`` (``{"text"}``, ``{"messages"}`` or ``{"input_ids"}``) and
        ``n``: one worker computes it, then it is copied to ``n`` more."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        if not self.token:
            raise SourceError("no control token: pass --token/--token-file or use the run directory of 'btbctl up'")
        try:
            ans = await self.api.prewarm(**prompt, n=n)
        except ControlApiError as e:
            raise self._refused(e) from None
        done = self._copying(ans)
        computed = self._names().get(ans.computed_by, ans.computed_by)
        msg = f"computed {ans.prompt_tokens} tokens on {computed}; {done.message}"
        return replace(done, message=msg)

    def _names(self) -> dict[str, str]:
        return {w.url: w.name for w in self._fleet.workers} if self._fleet is not None else {}

    def _copying(self, ans: ReplicateAnswer) -> ReplicateResult:
        """A replicate's (or prewarm's) answer as the screen says it: the copies started, or who holds it already."""
        names = self._names()
        targets = tuple(names.get(t, t) for t in ans.targets)
        source = names.get(ans.source, ans.source)
        short = ans.prefix[:SHORT_ID_CHARS]
        if not ans.copy_ids:
            held = [names.get(h, h) for h in ans.holders]
            msg = f"{short} already held by {len(held)} workers: {', '.join(held)}"
        else:
            msg = f"copying {short} from {source} to {', '.join(targets)}"
        return ReplicateResult(ans.prefix, tuple(ans.copy_ids), source, targets, msg)


__all__ = ["ControlApiSource", "FEED_POLL", "FEED_STREAM", "RECONNECT_MAX_S", "RECONNECT_MIN_S", "TtftTrail"]


def _duration(started_s: float | None, finished_s: float | None, now_s: float) -> float | None:
    """How long a copy ran: start to end once finished, start to now while in flight; None before it starts."""
    if started_s is None:
        return None
    return max(0.0, (now_s if finished_s is None else finished_s) - started_s)
