"""The emulated worker's Prometheus metrics (``GET /metrics`` with ``--enable-metrics``): SGLang's metric names, in
a registry of the worker's own. Latencies are wall-clock seconds as a client sees them.

``sglang:cached_tokens_total`` carries SGLang's ``cache_source`` label (``device``, ``host``, ``storage``; ``total``
for a request without a breakdown). With ``--enable-hierarchical-cache`` the HiCache metrics of SGLang 0.5.23 are
there too (``srt/observability/metrics_collector.py``): ``sglang:hicache_host_used_tokens``,
``sglang:hicache_host_total_tokens``, ``sglang:prefetched_tokens_total`` (tokens read from L3),
``sglang:backuped_tokens_total`` (tokens written to L3), ``sglang:storage_prefetch_hit_tokens_total`` (L3 hits
found by prefetch queries) and ``sglang:load_back_tokens_total`` (host tier to device, pool ``kv``).

The KV gauges are SGLang's too: ``sglang:num_used_tokens`` and ``sglang:kv_used_tokens`` (tokens of running
requests), ``sglang:kv_evictable_tokens`` (cached prefixes no request holds), ``sglang:kv_available_tokens`` (free)
and ``sglang:max_total_num_tokens``; all of them are the cost model's, not a GPU's."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from btbctl.engine.worker.model import LiveRequest, ModelDriver

#: Latency histogram buckets, seconds (a spread like SGLang's collector: milliseconds to minutes).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
E2E_BUCKETS = (0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
)


class WorkerMetrics:
    """SGLang-named Prometheus metrics in a registry of this worker's own.

    Args:
        model_name: the ``model_name`` label (the served model name).
    """

    def __init__(self, model_name: str, hicache: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ["model_name"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        # counters (exposed with the _total suffix, as SGLang's)
        self.prompt_tokens = Counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "sglang:generation_tokens", "Number of generation tokens processed.", ["model_name"], registry=r
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            ["model_name", "cache_source"],
            registry=r,
        )
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.", ["model_name"], registry=r)
        self.auth_failures = Counter(
            "btbctl_worker_auth_failures",
            "Requests to the /btb routes refused for a missing or wrong bearer token.",
            ["reason"],
            registry=r,
        )
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        self.gauges = {
            name: Gauge(f"sglang:{name}", doc, labels, registry=r)
            for name, doc in (
                ("num_running_reqs", "The number of running requests."),
                ("num_queue_reqs", "The number of requests in the waiting queue."),
                ("num_used_tokens", "The number of used tokens."),
                ("kv_used_tokens", "KV-cache tokens held by running requests."),
                ("kv_evictable_tokens", "KV-cache tokens of cached prefixes no request holds (evictable)."),
                ("kv_available_tokens", "Free KV-cache tokens."),
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
                ("token_usage", "The token usage."),
                ("cache_hit_rate", "The prefix cache hit rate."),
            )
        }
        self.lv = (model_name, "unified", "0", "0")
        self.hicache = hicache
        if hicache:
            hl = ["model_name", "tp_rank", "pp_rank"]
            self.host_used = Gauge(
                "sglang:hicache_host_used_tokens",
                "Number of tokens currently used in the host KV cache.",
                hl,
                registry=r,
            )
            self.host_total = Gauge(
                "sglang:hicache_host_total_tokens", "Total capacity of the host KV cache in tokens.", hl, registry=r
            )
            self.prefetched_tokens = Counter(
                "sglang:prefetched_tokens",
                "Prompt tokens successfully transferred from L3 storage into host memory.",
                hl,
                registry=r,
            ).labels(model_name, "0", "0")
            self.backuped_tokens = Counter(
                "sglang:backuped_tokens", "Number of backuped tokens.", hl, registry=r
            ).labels(model_name, "0", "0")
            self.storage_hit_tokens = Counter(
                "sglang:storage_prefetch_hit_tokens",
                "Storage-hit tokens returned by an L3 query.",
                hl,
                registry=r,
            ).labels(model_name, "0", "0")
            self.load_back_tokens = Counter(
                "sglang:load_back_tokens",
                "The number of tokens loaded back from local host DRAM (L2) to GPU, by host pool.",
                [*hl, "pool"],
                registry=r,
            ).labels(model_name, "0", "0", "kv")

    def observe(self, lr: LiveRequest, details: dict | None = None) -> None:
        """Record one finished request (latencies in wall seconds); ``details`` is its ``cached_tokens_details``."""
        name = self.model_name
        self.num_requests.labels(name).inc()
        self.prompt_tokens.labels(name).inc(lr.prompt_tokens)
        self.generation_tokens.labels(name).inc(lr.max_new_tokens)
        if lr.cached_tokens > 0:
            if details:
                for src in ("device", "host", "storage"):
                    if details.get(src, 0) > 0:
                        self.cached_tokens.labels(name, src).inc(details[src])
            else:
                self.cached_tokens.labels(name, "total").inc(lr.cached_tokens)
        if not math.isnan(lr.first_wall):
            self.ttft.labels(name).observe(max(0.0, lr.first_wall - lr.arrival_wall))
        if not math.isnan(lr.finish_wall):
            self.e2e.labels(name).observe(max(0.0, lr.finish_wall - lr.arrival_wall))
            if lr.max_new_tokens > 1 and not math.isnan(lr.first_wall):
                self.itl.labels(name).observe(max(0.0, (lr.finish_wall - lr.first_wall) / (lr.max_new_tokens - 1)))

    def render(self, model: ModelDriver, hicache=None) -> bytes:
        """The exposition text, with the gauges set from ``model``'s counters (and ``hicache``'s) now."""
        st = model.state()
        cap = st.capacity_tokens
        vals = {
            "num_running_reqs": st.running,
            "num_queue_reqs": st.waiting,
            "num_used_tokens": st.used_tokens,
            "kv_used_tokens": st.used_tokens,
            "kv_evictable_tokens": st.evictable_tokens,
            "kv_available_tokens": max(0, cap - st.used_tokens - st.evictable_tokens),
            "max_total_num_tokens": cap,
            "token_usage": st.used_tokens / cap if cap else 0.0,
            "cache_hit_rate": model.cache_hit_rate(),
        }
        for k, v in vals.items():
            self.gauges[k].labels(*self.lv).set(v)
        if self.hicache and hicache is not None:
            self.host_used.labels(self.model_name, "0", "0").set(hicache.host_used_tokens)
            self.host_total.labels(self.model_name, "0", "0").set(hicache.host_capacity_tokens)
        return generate_latest(self.registry)


__all__ = ["E2E_BUCKETS", "ITL_BUCKETS", "TTFT_BUCKETS", "WorkerMetrics"]
