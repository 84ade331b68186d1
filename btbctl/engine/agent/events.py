"""The agent's structured log lines and Prometheus metrics.

Every state change is one log line ``event=<name> key=value ...`` on the ``btbctl.agent`` logger (values with spaces
are quoted): copies accepted/refused (with the reason), started, finished (outcome, pages, bytes, duration),
evictions, authentication failures, local writes refused. Refusals of a peer or client (:data:`REFUSAL_EVENTS`)
are counted every time but logged at most once per kind and :data:`~btbctl.engine.logfmt.REPEAT_WINDOW_S` (the
next line carries ``repeats_held=N``), so a client that fails authentication in a loop cannot fill the log.

Metrics (their own registry, served at the control endpoint's ``/metrics``):

* ``btbctl_agent_pages_total{direction}`` and ``btbctl_agent_bytes_total{direction}``: pages/bytes sent (``out``) and
  received and verified (``in``) over peer copies;
* ``btbctl_agent_copies_total{role,outcome}``: copies by role (``source``, ``target``) and outcome (``done``,
  ``failed``, ``refused``);
* ``btbctl_agent_copy_duration_seconds{role}``: histogram of finished copies' durations;
* ``btbctl_agent_evictions_total``, ``btbctl_agent_evicted_bytes_total``: LRU evictions;
* ``btbctl_agent_auth_failures_total``: peers that failed authentication, and control API requests without the
  right token (``listener="control"`` in the log line);
* ``btbctl_agent_peer_errors_total``: peer connections ended by an unexpected error (a bug; one ``peer_error``
  line, the traceback only with ``BTBCTL_DEBUG=1``);
* ``btbctl_agent_pages_refused_total{reason}``: pages of a peer copy refused (``digest_mismatch``: the bytes do not
  hash to the digest the sender sent; the copy ends there, and only the pages that verified before it are
  served);
* ``btbctl_agent_requests_refused_total{reason}``: control API requests refused for their ``Host`` (``host``) or
  ``Origin`` (``origin``);
* ``btbctl_agent_arena_bytes``, ``btbctl_agent_used_bytes``, ``btbctl_agent_ready_pages``: the store's use (gauges
  read at scrape time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from btbctl.engine.logfmt import REPEAT_WINDOW_S, RateLimiter, format_event

log = logging.getLogger("btbctl.agent")

#: Copy-duration histogram buckets, seconds (a 16k-token prefix of a 70B model is 5 GiB: 0.1 s over RDMA, seconds
#: over TCP).
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


#: Events that record a refusal of a peer or client: counted each time, logged once per kind and window.
#: ``peer_error``: a peer connection ended by an unexpected error (its reason; the traceback with BTBCTL_DEBUG=1).
REFUSAL_EVENTS = frozenset({"auth_failed", "request_refused", "peer_error"})


class AgentMetrics:
    """The agent's metrics and event sink. ``stats`` is a callable returning the store's :meth:`PageStore.stats`."""

    def __init__(self, stats: Callable[[], dict] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pages = Counter("btbctl_agent_pages", "Pages moved by peer copies", ["direction"], registry=r)
        self.bytes = Counter("btbctl_agent_bytes", "Bytes moved by peer copies", ["direction"], registry=r)
        self.copies = Counter("btbctl_agent_copies", "Copies by role and outcome", ["role", "outcome"], registry=r)
        self.duration = Histogram(
            "btbctl_agent_copy_duration_seconds",
            "Duration of finished copies",
            ["role"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.evictions = Counter("btbctl_agent_evictions", "Pages evicted (LRU)", registry=r)
        self.evicted_bytes = Counter("btbctl_agent_evicted_bytes", "Bytes evicted (LRU)", registry=r)
        self.auth_failures = Counter("btbctl_agent_auth_failures", "Peers that failed authentication", registry=r)
        self.refused = Counter(
            "btbctl_agent_requests_refused",
            "Control API requests refused for their Host or Origin (DNS rebinding, cross-site writes)",
            ["reason"],
            registry=r,
        )
        self.peer_errors = Counter(
            "btbctl_agent_peer_errors", "Peer connections ended by an unexpected error", registry=r
        )
        self.pages_refused = Counter(
            "btbctl_agent_pages_refused", "Pages of peer copies refused, by reason", ["reason"], registry=r
        )
        self._stats = stats
        self.limiter = RateLimiter(REPEAT_WINDOW_S)
        if stats is not None:
            for name, key, doc in (
                ("btbctl_agent_arena_bytes", "arena_bytes", "Arena size (byte budget)"),
                ("btbctl_agent_used_bytes", "used_bytes", "Arena bytes in use (ready + pending)"),
                ("btbctl_agent_ready_pages", "ready_pages", "Pages ready to serve"),
            ):
                g = Gauge(name, doc, registry=r)
                g.set_function(lambda key=key: float(self._stats()[key]))

    def event(self, event: str, fields: dict) -> None:
        """Log one structured line (a refusal: at most one per kind and window) and update the counters the event
        implies."""
        if event in REFUSAL_EVENTS:
            kind = f"{event}:{fields.get('listener', 'peer')}:{fields.get('direction', '')}"
            if event == "request_refused":
                kind += f":{fields.get('reason', '')}"
            ok, held = self.limiter.allow(kind)
            if ok:
                log.warning("%s", format_event(event, {**fields, "repeats_held": held or None}))
        else:
            log.info("%s", format_event(event, fields))
        if event == "evicted":
            self.evictions.inc(fields.get("pages", 0))
            self.evicted_bytes.inc(fields.get("bytes", 0))
        elif event == "auth_failed":
            self.auth_failures.inc()
        elif event == "request_refused":
            self.refused.labels(fields.get("reason", "other")).inc()
        elif event == "peer_error":
            self.peer_errors.inc()
        elif event == "page_refused":
            self.pages_refused.labels(fields.get("reason", "other")).inc()
        elif event == "copy_refused":
            self.copies.labels(fields.get("role", "target"), "refused").inc()
        elif event == "copy_finished":
            role = fields.get("role", "target")
            self.copies.labels(role, fields.get("outcome", "failed")).inc()
            if fields.get("duration_s") is not None:
                self.duration.labels(role).observe(float(fields["duration_s"]))

    def exposition(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


__all__ = ["AgentMetrics", "DURATION_BUCKETS_S", "REFUSAL_EVENTS", "format_event"]
