"""A worker's own numbers from SGLang's Prometheus ``/metrics`` (``--enable-metrics``): KV cache in use and cached,
requests running and queued, and the HiCache tiers (host tier use, L3 hits, tokens read from and written to L3,
tokens loaded back from the host to the GPU).

``/v1/loads`` (what the health prober reads every round) counts only the tokens of running requests
(``num_used_tokens``): a prefix SGLang keeps cached for the next request is evictable and is not in it, so a worker
holding a warm prefix reads as an empty cache there. ``sglang:kv_evictable_tokens`` is that cached part and
``sglang:hicache_host_used_tokens`` the host tier; this module reads them.

* :func:`parse_sglang_metrics`: the exposition text to ``{field: tokens or requests}`` (:data:`SGLANG_SAMPLES`),
  with ``prometheus_client``'s parser. Lines of other metrics (the histograms are most of the text) are dropped by
  name before parsing, so a scrape costs about a millisecond.
* :class:`MetricsScraper`: every ``interval_s``, each healthy worker's ``/server_info`` (once per start: whether
  metrics are on, whether it is btbctl's emulated worker, how its ranks group) and ``/metrics`` (bounded by a
  timeout and a body size; parsed in a thread), kept on the :class:`~btbctl.engine.gateway.state.WorkerState`.
  It runs beside the health prober, never on a request's path, and a missing or bad ``/metrics`` only says so in
  ``metrics_note``: it never makes a worker unhealthy.

Ranks: SGLang labels every series with its rank (``tp_rank``, ``pp_rank``, ``dp_rank`` ...). The token counts are
logical: every TP (and PP) rank of one data-parallel group reports the same count (SGLang's own help text for
``sglang:load_back_tokens_total``: "read one rank rather than summing ranks"), and by default only attention-TP
rank 0 of each group reports the scheduler's gauges at all. So the series of one group count once (their largest
value) and the groups add up: a group is the ``dp_rank`` label where there is one, else ``tp_rank`` divided by the
attention-TP size (``tp_size / dp_size`` with DP attention, else ``tp_size``, from ``/server_info``; 1 when
unknown, so each reporting ``tp_rank`` is then its own group).
"""

from __future__ import annotations

import asyncio
import json
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from btbctl.engine.aiotasks import cancel_and_wait, every
from btbctl.engine.gateway.state import WorkerState

#: What :func:`parse_sglang_metrics` reads: field -> (SGLang 0.5.23 sample names, first found wins; labels a
#: series must carry). Gauges are "now"; ``*_total`` fields are counters since the server started.
SGLANG_SAMPLES: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "running": (("sglang:num_running_reqs",), {}),
    "waiting": (("sglang:num_queue_reqs",), {}),
    "kv_used_tokens": (("sglang:kv_used_tokens", "sglang:num_used_tokens"), {}),
    "kv_cached_tokens": (("sglang:kv_evictable_tokens",), {}),
    "kv_capacity_tokens": (("sglang:max_total_num_tokens",), {}),
    "host_tier_tokens": (("sglang:hicache_host_used_tokens",), {}),
    "host_tier_capacity_tokens": (("sglang:hicache_host_total_tokens",), {}),
    "storage_hit_tokens_total": (("sglang:storage_prefetch_hit_tokens_total",), {}),
    "storage_prefetched_tokens_total": (("sglang:prefetched_tokens_total",), {}),
    "storage_backup_tokens_total": (("sglang:backuped_tokens_total",), {}),
    "load_back_tokens_total": (("sglang:load_back_tokens_total",), {"pool": "kv"}),
}

#: Sample name -> the labels its series must carry.
_NEED = {n: need for names, need in SGLANG_SAMPLES.values() for n in names}

#: Largest ``/metrics`` body read, bytes (one SGLang rank's is about 100 kB, most of it histograms).
MAX_METRICS_BYTES = 8 << 20
#: Largest ``/server_info`` body read, bytes (about 50 kB).
MAX_SERVER_INFO_BYTES = 1 << 20


class BodyTooLarge(Exception):
    """An answer over its size limit."""


def _wanted_lines(text: str) -> str:
    """The sample lines of the metrics :data:`SGLANG_SAMPLES` reads (comments and every other metric dropped, by
    name)."""
    keep = []
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        if line[:end] in _NEED:
            keep.append(line)
    return "\n".join(keep) + "\n" if keep else ""


def _group(labels: dict[str, str], attn_tp_size: int) -> tuple:
    """The data-parallel group a series belongs to (see the module docstring); a series without rank labels is a
    group of its own."""
    if "dp_rank" in labels:
        return ("dp", labels["dp_rank"])
    tp = labels.get("tp_rank")
    if tp is not None:
        try:
            return ("tp", int(tp) // max(1, attn_tp_size))
        except ValueError:
            return ("tp", tp)
    return ("series", tuple(sorted(labels.items())))


def parse_sglang_metrics(text: str, attn_tp_size: int = 1) -> dict[str, int]:
    """SGLang's Prometheus text as ``{field: value}`` for the fields of :data:`SGLANG_SAMPLES` it has (rounded to
    whole tokens or requests; series of one data-parallel group count once, groups add up: module docstring).
    Fields the text does not have are left out; NaN, infinite and negative values are ignored.

    Raises:
        ValueError: the lines of those metrics are not valid Prometheus text.
    """
    by_name: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(_wanted_lines(text)):
        for s in fam.samples:
            need = _NEED.get(s.name)
            if need is None or not math.isfinite(s.value) or s.value < 0:
                continue
            if any(s.labels.get(k) != v for k, v in need.items()):
                continue
            groups = by_name.setdefault(s.name, {})
            g = _group(s.labels, attn_tp_size)
            groups[g] = max(groups.get(g, 0.0), s.value)
    out: dict[str, int] = {}
    for field, (names, _) in SGLANG_SAMPLES.items():
        found = next((by_name[n] for n in names if n in by_name), None)
        if found is not None:
            out[field] = int(round(sum(found.values())))
    return out


def summarize_server_info(body: Any) -> dict:
    """What the scraper needs of a ``/server_info`` answer: ``{"emulated", "enable_metrics", "attn_tp_size",
    "version"}`` (``emulated``: btbctl's emulated worker, whose numbers are the cost model's; ``enable_metrics``
    None when not said). ``{}`` for an answer that is not a JSON object."""
    if not isinstance(body, dict):
        return {}
    btb = body.get("btb")

    def _int(key: str) -> int:
        v = body.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1

    tp, dp = _int("tp_size"), _int("dp_size")
    attn_tp = max(1, tp // dp) if body.get("enable_dp_attention") is True else tp
    metrics = body.get("enable_metrics")
    version = body.get("version")
    return {
        "emulated": isinstance(btb, dict) and btb.get("emulated") is True,
        "enable_metrics": metrics if isinstance(metrics, bool) else None,
        "attn_tp_size": attn_tp,
        "version": version if isinstance(version, str) else None,
    }


#: Asked of every worker: the plain body. prometheus_client (SGLang's ``/metrics``) gzips its answer when the client
#: accepts gzip, and the gateway's session passes bodies through undecoded.
_HEADERS = {"Accept-Encoding": "identity"}


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``resp``, at most ``limit`` bytes; a gzip body (a server that compresses anyway) is
    decompressed, to at most ``limit`` bytes too.

    Raises:
        BodyTooLarge: it is longer.
        ValueError: a gzip body that does not decompress (``zlib.error`` is not one: it is turned into one).
    """
    if resp.content_length is not None and resp.content_length > limit:
        raise BodyTooLarge(f"{resp.content_length} bytes")
    chunks, n = [], 0
    async for chunk in resp.content.iter_chunked(1 << 16):
        n += len(chunk)
        if n > limit:
            raise BodyTooLarge(f"over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if body[:2] != b"\x1f\x8b":  # not gzip (Prometheus text and JSON never start so)
        return body
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise ValueError(f"bad gzip body: {e}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise BodyTooLarge(f"over {limit} bytes decompressed")
    return out


#: Exceptions that mean "no usable answer" from a worker.
_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError, BodyTooLarge, ValueError, UnicodeDecodeError)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


class MetricsScraper:
    """Reads every healthy worker's ``/metrics`` every ``interval_s`` (see the module docstring).

    It keeps what it read on each :class:`~btbctl.engine.gateway.state.WorkerState`: ``server_info``
    (:func:`summarize_server_info`, ``{}`` when the worker has none; set back to None to have it read again, e.g.
    after a restart), ``metrics`` (:func:`parse_sglang_metrics`, None when unknown), ``metrics_note`` (why there are
    none) and ``metrics_s`` (when they were read), then calls ``on_change(worker)``.

    Args:
        workers: the workers (their URLs, health and the fields above).
        session: returns the shared :class:`aiohttp.ClientSession`.
        clock: the gateway's ``now_s``.
        interval_s: seconds between rounds.
        timeout_s: limit of one request, seconds.
        on_change: ``(worker)``: after each of its scrapes.
        max_bytes: largest ``/metrics`` body read.
    """

    def __init__(
        self,
        workers: Sequence[WorkerState],
        session: Callable[[], aiohttp.ClientSession],
        clock: Callable[[], float],
        *,
        interval_s: float,
        timeout_s: float,
        on_change: Callable[[WorkerState], None],
        max_bytes: int = MAX_METRICS_BYTES,
    ) -> None:
        self.workers = workers
        self._session = session
        self._clock = clock
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_change = on_change
        self.max_bytes = max_bytes
        self._task: asyncio.Task | None = None

    async def _get(self, url: str, limit: int) -> tuple[int, bytes]:
        async with self._session().get(url, timeout=self.timeout, headers=_HEADERS) as resp:
            if resp.status != 200:
                return resp.status, b""
            return 200, await _read_bounded(resp, limit)

    async def _server_info(self, w: WorkerState) -> None:
        """Read ``w``'s ``/server_info`` into ``w.server_info`` (``{}`` when it answers without one; left None to
        try again after a connection error)."""
        try:
            status, raw = await self._get(f"{w.url}/server_info", MAX_SERVER_INFO_BYTES)
        except BodyTooLarge:
            w.server_info = {}
            return
        except _ERRORS:
            return
        if status != 200:
            w.server_info = {}
            return
        try:
            w.server_info = summarize_server_info(json.loads(raw))
        except ValueError:  # not JSON (UnicodeDecodeError is one too)
            w.server_info = {}

    async def scrape(self, w: WorkerState) -> None:
        """One scrape of ``w``: its ``/server_info`` when not read yet, then its ``/metrics``."""
        if w.server_info is None:
            await self._server_info(w)
        si = w.server_info or {}
        metrics: dict | None = None
        if si.get("enable_metrics") is False:
            note: str | None = "metrics off: the worker runs without --enable-metrics"
        else:
            try:
                status, raw = await self._get(f"{w.url}/metrics", self.max_bytes)
                if status != 200:
                    note = f"/metrics answered HTTP {status}"
                else:
                    metrics = await asyncio.to_thread(
                        parse_sglang_metrics, raw.decode("utf-8"), si.get("attn_tp_size", 1)
                    )
                    note = None if metrics else "/metrics has none of SGLang's KV or queue metrics"
                    metrics = metrics or None
            except _ERRORS as e:
                note = f"/metrics failed: {_why(e)}"
        w.metrics = metrics
        w.metrics_note = note
        if metrics is not None:
            w.metrics_s = self._clock()
        self.on_change(w)

    async def scrape_all(self) -> None:
        """One scrape of every healthy worker, concurrently (one failing does not stop the others)."""
        await asyncio.gather(*(self.scrape(w) for w in self.workers if w.healthy), return_exceptions=True)

    def start(self) -> None:
        """Scrape now and then every ``interval_s`` in a background task."""
        if self._task is None:
            self._task = every(self.interval_s, self.scrape_all, at_once=True)

    async def stop(self) -> None:
        """Stop scraping (idempotent)."""
        await cancel_and_wait(self._task)
        self._task = None


__all__ = [
    "MAX_METRICS_BYTES",
    "SGLANG_SAMPLES",
    "MetricsScraper",
    "parse_sglang_metrics",
    "summarize_server_info",
]
