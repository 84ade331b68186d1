"""Prometheus metrics of the gateway (one :class:`CollectorRegistry` per gateway, names prefixed ``btb_``).

=================================== ========= ==========================================================
name                                type      meaning
=================================== ========= ==========================================================
``btb_requests_total``              counter   answered requests by ``worker`` (URL or ``none``), ``policy``
                                              and ``status`` (HTTP status sent, or ``stream_error`` when a
                                              stream broke after its first byte, ``client_gone``)
``btb_ttft_seconds``                histogram time from the request's arrival at the gateway to the first
                                              byte (streaming: first SSE ``data:`` chunk) from ``worker``
``btb_request_duration_seconds``    histogram arrival to last byte sent, by ``worker``
``btb_inflight_requests``           gauge     requests the gateway has in flight, by ``worker``
``btb_worker_healthy``              gauge     1 when ``worker`` is healthy
``btb_retries_total``               counter   attempts moved to another worker after a failure
``btb_replications_total``          counter   finished copies by ``result`` (``done``, ``failed``)
``btb_replicated_bytes_total``      counter   bytes of copies that finished ``done``
``btb_detector_fires_total``        counter   burst-detector activations (read from the detector at scrape)
``btb_copy_proofs_total``           counter   finished ``l3`` copies by ``result``: ``proved`` (the warm-up
                                              covered the prefix), ``short`` (it did not), ``failed`` (an
                                              earlier step failed)
``btb_proof_storage_tokens_total``  counter   prompt tokens proved loaded from L3 by warm-ups
``btb_worker_replication``          gauge     1 for each ``worker`` with its ``mode`` (``l3``, ``push``,
                                              ``none``)
=================================== ========= ==========================================================

TTFT buckets span 1 ms to 60 s (sub-millisecond answers of zero-delay workers up to cold 64k-token prefills).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

#: Histogram buckets of ``btb_ttft_seconds`` and ``btb_request_duration_seconds``, seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    float("inf"),
)


class _FiresCollector:
    def __init__(self, fires: Callable[[], int]) -> None:
        self._fires = fires

    def collect(self):
        m = CounterMetricFamily("btb_detector_fires", "Burst-detector activations (prefix turned hot).")
        m.add_metric([], float(self._fires()))
        yield m

    def describe(self):
        return []


class GatewayMetrics:
    """The gateway's metrics; label children are cached so the request path does one dict lookup each."""

    def __init__(self, fires: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "btb_requests", "Requests answered by the gateway.", ("worker", "policy", "status"), registry=r
        )
        self.ttft = Histogram(
            "btb_ttft_seconds",
            "Time to first byte from the worker, measured at the gateway.",
            ("worker",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "btb_request_duration_seconds",
            "Arrival to last byte sent, at the gateway.",
            ("worker",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge("btb_inflight_requests", "Requests in flight to a worker.", ("worker",), registry=r)
        self.healthy = Gauge("btb_worker_healthy", "1 when the worker is healthy.", ("worker",), registry=r)
        self.retries = Counter("btb_retries", "Attempts moved to another worker after a failure.", registry=r)
        self.rejected = Counter(
            "btb_rejected",
            "Requests answered 503 with Retry-After at a limit of the gateway's own (inflight: the in-flight cap; "
            "over_cap: the connection cap with every connection busy; descriptors: no descriptor left to connect "
            "upstream).",
            ("reason",),
            registry=r,
        )
        self.connections_closed = Counter(
            "btb_connections_closed",
            "Client connections the gateway closed itself (header_timeout: no complete request head in time; "
            "evicted: closed for a new one at the connection cap).",
            ("listener", "reason"),
            registry=r,
        )
        self.replications = Counter("btb_replications", "Finished prefix copies.", ("result",), registry=r)
        self.replicated_bytes = Counter("btb_replicated_bytes", "Bytes of copies that finished done.", registry=r)
        self.proofs = Counter("btb_copy_proofs", "Finished l3 copies by proof result.", ("result",), registry=r)
        self.proof_storage_tokens = Counter(
            "btb_proof_storage_tokens", "Prompt tokens proved loaded from L3 by warm-ups.", registry=r
        )
        self.worker_mode = Gauge(
            "btb_worker_replication", "1 for each worker with its replication mode.", ("worker", "mode"), registry=r
        )
        r.register(_FiresCollector(fires))
        self._req: dict[tuple, object] = {}
        self._ttft: dict[str, object] = {}
        self._dur: dict[str, object] = {}
        self._inflight: dict[str, object] = {}

    def request(self, worker: str, policy: str, status: str) -> None:
        k = (worker, policy, status)
        c = self._req.get(k)
        if c is None:
            c = self._req[k] = self.requests.labels(worker, policy, status)
        c.inc()

    def observe_ttft(self, worker: str, seconds: float) -> None:
        h = self._ttft.get(worker)
        if h is None:
            h = self._ttft[worker] = self.ttft.labels(worker)
        h.observe(seconds)

    def observe_duration(self, worker: str, seconds: float) -> None:
        h = self._dur.get(worker)
        if h is None:
            h = self._dur[worker] = self.duration.labels(worker)
        h.observe(seconds)

    def inflight_gauge(self, worker: str):
        g = self._inflight.get(worker)
        if g is None:
            g = self._inflight[worker] = self.inflight.labels(worker)
        return g

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
