"""Prometheus metrics of the gateway (one :class:`CollectorRegistry` per gateway, names prefixed ``btb_``).

=================================== ========= ==========================================================
name                                type      meaning
=================================== ========= ==========================================================
``btb_requests_total``              counter   answered requests by ``worker`` (see :func:`worker_label`, or
                                              ``none``), ``policy`` and ``status`` (HTTP status sent, or
                                              ``stream_error`` when a stream broke after its first byte,
                                              ``client_gone``)
``btb_rejected_requests_total``     counter   requests the gateway answered itself with an error, by
                                              ``reason`` (``bad_request``, ``body_too_large``,
                                              ``not_found``, ``method_not_allowed``, ``no_healthy_worker``;
                                              the 503s of the gateway's own limits: ``inflight``,
                                              ``over_cap``, ``descriptors``) and ``status``
``btb_ttft_seconds``                histogram time from the request's arrival at the gateway to the first
                                              byte (streaming: first SSE ``data:`` chunk) from ``worker``,
                                              by ``worker`` and ``policy`` (the policy in force when the
                                              request arrived: A/B across ``btbctl tune policy=``)
``btb_request_duration_seconds``    histogram arrival to last byte sent, by ``worker``
``btb_inflight_requests``           gauge     requests the gateway has in flight, by ``worker``
``btb_worker_healthy``              gauge     1 when ``worker`` is healthy
``btb_retries_total``               counter   attempts moved to another worker after a failure
``btb_replications_total``          counter   finished copies by ``result`` (``done``, ``failed``)
``btb_replicated_bytes_total``      counter   bytes of copies that finished ``done``
``btb_copy_duration_seconds``       histogram creation to end of each finished copy, by ``mode`` (``push``,
                                              ``l3``) and ``outcome`` (``done``, ``failed``)
``btb_copy_bytes_total``            counter   bytes moved by finished copies, by ``mode`` and ``outcome``
                                              (bytes on the wire: emulated workers scale KV bytes down,
                                              see ``--kv-bytes-scale``)
``btb_copies_in_flight``            gauge     copies not finished yet, by ``mode`` (read at scrape)
``btb_detector_fires_total``        counter   burst-detector activations (read from the detector at scrape)
``btb_hot_prefixes``                gauge     prefixes the detector holds active now (read at scrape)
``btb_constant``                    gauge     BTB's constants in force, one series per ``constant``
                                              (``prefix_blocks``, ``threshold``, ``window_s``,
                                              ``warm_replicas``; read at scrape)
``btb_policy_info``                 gauge     1, with the routing ``policy`` in force as a label (read at
                                              scrape)
``btb_copy_usable_seconds``         histogram start of a copy (a policy's: the detector's fire) until its
                                              target could serve the prefix (push: every block verified;
                                              l3: proved), by ``mode``
``btb_copy_phase_seconds``          histogram ``l3`` copies' phases by ``phase``: ``source`` (until the source's
                                              node held every page; the copy trails it), ``transfer`` (until
                                              the target's node did), ``proof`` (the warm-up)
``btb_copy_proofs_total``           counter   finished ``l3`` copies by ``result`` (:class:`CopyOutcome`):
                                              ``proved`` (the warm-up loaded the prefix from L3),
                                              ``computed`` (the target computed it itself: not a copy),
                                              ``short`` (it reused less), ``failed`` (a step failed)
``btb_proof_storage_tokens_total``  counter   prompt tokens proved loaded from L3 by warm-ups
``btb_worker_replication``          gauge     1 for each ``worker`` with its ``mode`` (``l3``, ``push``,
                                              ``none``)
``btb_cache_tree_blocks``           gauge     blocks (nodes) in the cache-aware prefix tree of the policy
                                              in force (``cache_aware``, ``btb``; 0 for a policy without
                                              one), all workers together; bounded by
                                              ``cache_tree_max_blocks`` (read at scrape)
``btb_cache_tree_bytes``            gauge     the same tree's estimated bytes, bounded by
                                              ``cache_tree_max_bytes`` (read at scrape)
``btb_kv_events_batches_total``     counter   KV-event batches applied from ``worker``'s publisher, by ``via``
                                              (``live``, ``replay``: recovered through its replay socket)
``btb_kv_events_blocks_total``      counter   blocks in those events by ``kind`` (``stored``, ``removed``,
                                              ``unkeyed``: pages the gateway could not key, skipped)
``btb_kv_events_resyncs_total``     counter   times ``worker``'s holdings were dropped and rebuilt after
                                              events were missed (or its publisher restarted)
``btb_kv_events_connected``         gauge     1 while the subscription to ``worker``'s publisher is set up
                                              (the four read at scrape; only for workers with KV events)
=================================== ========= ==========================================================

Every ``worker`` label comes from :func:`worker_label` (the worker's name, never its URL).

TTFT buckets span 1 ms to 60 s (sub-millisecond answers of zero-delay workers up to cold 64k-token prefills).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from btbctl.engine.constants import BtbConstants

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
#: Histogram buckets of ``btb_copy_duration_seconds``, seconds (loopback pushes of scaled bytes up to long waits
#: for a source still computing its prefix).
COPY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))

#: ``btb_rejected_requests_total`` reasons by the HTTP status the gateway answered with.
REJECT_REASONS = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    503: "no_healthy_worker",
}


def worker_label(worker: Any) -> str:
    """The ``worker`` label of a gateway worker (a :class:`~btbctl.engine.gateway.state.WorkerState`): its name.

    The one place metric labels name workers; URLs never become labels (they change with ports and leak hosts).
    """
    return str(worker.name)


def reject_reason(status: int) -> str:
    """The ``reason`` label of a request the gateway refused with ``status``."""
    return REJECT_REASONS.get(status, "other")


class LiveSource(Protocol):
    """What the scrape-time gauges read from the gateway."""

    @property
    def constants(self) -> BtbConstants: ...

    @property
    def policy(self) -> Any: ...

    @property
    def detector(self) -> Any: ...

    @property
    def state(self) -> Any: ...

    @property
    def kv_subscribers(self) -> Sequence[Any]:
        """The KV-event subscriptions (:class:`~btbctl.engine.gateway.kv_events.KvEventsSubscriber`), one per
        worker that publishes."""
        ...


class _FiresCollector:
    def __init__(self, fires: Callable[[], int]) -> None:
        self._fires = fires

    def collect(self):
        m = CounterMetricFamily("btb_detector_fires", "Burst-detector activations (prefix turned hot).")
        m.add_metric([], float(self._fires()))
        yield m

    def describe(self):
        return []


class _LiveCollector:
    """Gauges read from the gateway at scrape: constants, policy, hot prefixes, copies in flight, requests held at the
    gateway, the cache-aware tree's size."""

    def __init__(self, src: LiveSource) -> None:
        self._src = src

    def collect(self):
        src = self._src
        c = src.constants
        g = GaugeMetricFamily("btb_constant", "BTB constant in force.", labels=("constant",))
        for name in ("prefix_blocks", "threshold", "window_s", "warm_replicas"):
            g.add_metric([name], float(getattr(c, name)))
        yield g
        p = GaugeMetricFamily("btb_policy_info", "1 for the routing policy in force.", labels=("policy",))
        p.add_metric([str(src.policy.name)], 1.0)
        yield p
        state = src.state
        det = src.detector
        now = state.clock()
        hot = sum(1 for h in det.heat(now, top=len(det)) if h.hot) if len(det) else 0
        h = GaugeMetricFamily("btb_hot_prefixes", "Prefixes the burst detector holds active now.")
        h.add_metric([], float(hot))
        yield h
        modes: dict[str, int] = {}
        for t in list(state.transfers.active.values()):
            modes[t.mode] = modes.get(t.mode, 0) + 1
        f = GaugeMetricFamily("btb_copies_in_flight", "Prefix copies not finished yet.", labels=("mode",))
        for mode in sorted(modes.keys() | {"push"}):
            f.add_metric([mode], float(modes.get(mode, 0)))
        yield f
        held = GaugeMetricFamily(
            "btb_held_requests",
            "Requests routed to a worker and held at the gateway: waiting for a copy's proof (gated) or for their "
            "turn (paced).",
            labels=("worker", "reason"),
        )
        for w in state.workers:
            held.add_metric([worker_label(w), "gated"], float(w.gated))
            held.add_metric([worker_label(w), "paced"], float(w.paced))
        yield held
        stats = src.policy.stats()
        if "paced_routes" in stats:
            pr = CounterMetricFamily("btb_paced_routes", "Hot requests the policy sent with a pace (btb_plus rule 6).")
            pr.add_metric([], float(stats["paced_routes"]))
            yield pr
        if "copy_not_paying" in stats:
            cn = CounterMetricFamily(
                "btb_copies_not_paying",
                "Copy targets the policy priced and left out: the copy would land after a recompute there would be "
                "done (btb_plus rule 4).",
            )
            cn.add_metric([], float(stats["copy_not_paying"]))
            yield cn
        holder = src.policy.tree_holder()
        tree = holder.tree if holder is not None else None
        tb = GaugeMetricFamily(
            "btb_cache_tree_blocks", "Blocks in the cache-aware prefix tree, all workers together (bounded)."
        )
        tb.add_metric([], float(len(tree)) if tree is not None else 0.0)
        yield tb
        ty = GaugeMetricFamily("btb_cache_tree_bytes", "Estimated bytes of the cache-aware prefix tree (bounded).")
        ty.add_metric([], float(tree.estimated_bytes()) if tree is not None else 0.0)
        yield ty
        yield from _kv_events_families(src.kv_subscribers)

    def describe(self):
        return []


def _kv_events_families(subs: Sequence[Any]):
    """The ``btb_kv_events_*`` families of the subscriptions ``subs`` (none when no worker publishes)."""
    if not subs:
        return
    batches = CounterMetricFamily(
        "btb_kv_events_batches", "KV-event batches applied, by worker and how they came.", labels=("worker", "via")
    )
    blocks = CounterMetricFamily(
        "btb_kv_events_blocks", "Blocks in applied KV events, by worker and kind.", labels=("worker", "kind")
    )
    resyncs = CounterMetricFamily(
        "btb_kv_events_resyncs", "Holdings dropped and rebuilt after missed KV events.", labels=("worker",)
    )
    connected = GaugeMetricFamily(
        "btb_kv_events_connected", "1 while the subscription to the worker's publisher is set up.", labels=("worker",)
    )
    for sub in subs:
        feed = sub.feed
        w = worker_label(feed.worker)
        batches.add_metric([w, "live"], float(sub.batches - sub.replayed))
        batches.add_metric([w, "replay"], float(sub.replayed))
        blocks.add_metric([w, "stored"], float(feed.stored_blocks))
        blocks.add_metric([w, "removed"], float(feed.removed_blocks))
        blocks.add_metric([w, "unkeyed"], float(feed.unkeyed_blocks))
        resyncs.add_metric([w], float(feed.resyncs))
        connected.add_metric([w], 1.0 if sub.connected else 0.0)
    yield from (batches, blocks, resyncs, connected)


class GatewayMetrics:
    """The gateway's metrics; label children are cached so the request path does one dict lookup each.

    Args:
        fires: the detector's activation count (read at scrape).
        live: the gateway, read at scrape for the constants, policy, hot-prefix and copies-in-flight gauges
            (None: those gauges are left out).
    """

    def __init__(self, fires: Callable[[], int], live: LiveSource | None = None) -> None:
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "btb_requests", "Requests answered by the gateway.", ("worker", "policy", "status"), registry=r
        )
        self.rejected = Counter(
            "btb_rejected_requests",
            "Requests the gateway refused itself (never forwarded).",
            ("reason", "status"),
            registry=r,
        )
        self.ttft = Histogram(
            "btb_ttft_seconds",
            "Time to first byte from the worker, measured at the gateway.",
            ("worker", "policy"),
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
        self.retries_denied = Counter(
            "btb_retries_denied", "Retries refused by the retry budget (the request was answered 503).", registry=r
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
        self.copy_duration = Histogram(
            "btb_copy_duration_seconds",
            "Creation to end of finished prefix copies.",
            ("mode", "outcome"),
            buckets=COPY_BUCKETS,
            registry=r,
        )
        self.copy_bytes = Counter(
            "btb_copy_bytes", "Bytes moved by finished prefix copies.", ("mode", "outcome"), registry=r
        )
        self.usable = Histogram(
            "btb_copy_usable_seconds",
            "Start of a copy until its target could serve the prefix (push: verified; l3: proved).",
            ("mode",),
            buckets=COPY_BUCKETS,
            registry=r,
        )
        self.copy_phase = Histogram(
            "btb_copy_phase_seconds",
            "Phases of l3 copies: source (until the source's node held every page), transfer, proof.",
            ("phase",),
            buckets=COPY_BUCKETS,
            registry=r,
        )
        self.proofs = Counter("btb_copy_proofs", "Finished l3 copies by proof result.", ("result",), registry=r)
        self.proof_storage_tokens = Counter(
            "btb_proof_storage_tokens", "Prompt tokens proved loaded from L3 by warm-ups.", registry=r
        )
        self.worker_mode = Gauge(
            "btb_worker_replication", "1 for each worker with its replication mode.", ("worker", "mode"), registry=r
        )
        r.register(_FiresCollector(fires))
        if live is not None:
            r.register(_LiveCollector(live))
        self._req: dict[tuple, Any] = {}
        self._ttft: dict[tuple[str, str], Any] = {}
        self._dur: dict[str, Any] = {}
        self._inflight: dict[str, Any] = {}

    def request(self, worker: str, policy: str, status: str) -> None:
        k = (worker, policy, status)
        c = self._req.get(k)
        if c is None:
            c = self._req[k] = self.requests.labels(worker, policy, status)
        c.inc()

    def reject(self, status: int, reason: str | None = None) -> None:
        """Count a request the gateway refused with ``status`` (never forwarded to a worker); ``reason`` overrides
        the one :func:`reject_reason` derives from the status (the 503s of the gateway's own limits: ``inflight``,
        ``over_cap``, ``descriptors``)."""
        self.rejected.labels(reason or reject_reason(status), str(status)).inc()

    def observe_ttft(self, worker: str, seconds: float, policy: str = "") -> None:
        k = (worker, policy)
        h = self._ttft.get(k)
        if h is None:
            h = self._ttft[k] = self.ttft.labels(worker, policy)
        h.observe(seconds)

    def observe_duration(self, worker: str, seconds: float) -> None:
        h = self._dur.get(worker)
        if h is None:
            h = self._dur[worker] = self.duration.labels(worker)
        h.observe(seconds)

    def observe_copy(self, mode: str, outcome: str, seconds: float | None, nbytes: int) -> None:
        """Count a finished copy: its duration (when known) and the bytes it moved."""
        if seconds is not None and seconds >= 0:
            self.copy_duration.labels(mode, outcome).observe(seconds)
        self.copy_bytes.labels(mode, outcome).inc(max(0, nbytes))

    def inflight_gauge(self, worker: str):
        g = self._inflight.get(worker)
        if g is None:
            g = self._inflight[worker] = self.inflight.labels(worker)
        return g

    def render(self) -> bytes:
        """The text exposition format (``text/plain; version=0.0.4``)."""
        return generate_latest(self.registry)
