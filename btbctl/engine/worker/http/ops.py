"""Operational routes of the worker's HTTP API: health, server/model info, version, models, loads, Prometheus
metrics and the authenticated cache flush (SGLang 0.5's shapes)."""

from __future__ import annotations

import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from btbctl import __version__
from btbctl.engine.costmodel import model_preset
from btbctl.engine.worker.http.base import Routes
from btbctl.engine.worker.http.errors import ApiError


class OpsRoutes(Routes):
    """``/health``, ``/health_generate``, ``/server_info``, ``/model_info``, ``/version``, ``/v1/models``,
    ``/v1/loads``, ``/metrics``, ``/flush_cache``."""

    async def health(self, request: web.Request) -> web.Response:
        if not self.is_ready():
            raise ApiError(503, "starting or stopping")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self.is_ready():
            raise ApiError(503, "starting or stopping")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"btbctl-emulated-{__version__}"})

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.cfg
        st = self.model.state()
        return web.json_response(
            {
                "model_path": c.model_path,
                "served_model_name": c.served_name,
                "tp_size": c.tp_size,
                "host": c.host,
                "port": self.w.http_port,
                "mem_fraction_static": c.mem_fraction_static,
                "page_size": c.page_size,
                "chunked_prefill_size": (
                    c.chunked_prefill_size if c.chunked_prefill_size is not None else self.model.cluster.chunk_tokens()
                ),
                "max_running_requests": c.max_running_requests,
                "enable_metrics": c.enable_metrics,
                "max_total_num_tokens": st.capacity_tokens,
                "enable_hierarchical_cache": c.enable_hierarchical_cache,
                "hicache_storage_backend": c.hicache_storage_backend,
                "hicache_storage_prefetch_policy": c.hicache_storage_prefetch_policy,
                "hicache_write_policy": c.hicache_write_policy,
                "hicache_mem_layout": c.hicache_mem_layout,
                "kv_cache_dtype": c.kv_cache_dtype,
                "version": f"btbctl-emulated-{__version__}",
                "internal_states": [{"num_running_reqs": st.running, "num_waiting_reqs": st.waiting}],
                "btb": {
                    "emulated": True,
                    "model_preset": c.preset_name(),
                    "gpu": c.gpu,
                    "time_scale": c.time_scale,
                    "zero_delay": c.zero,
                    "kv_bytes_scale": c.kv_bytes_scale,
                    "block_bytes": self.w.block_bytes,
                    "transfer_addr": self.w.transfer_addr,
                    "token_required": c.btb_token is not None,
                    "hicache": self.w.hicache.describe() if self.w.hicache is not None else None,
                },
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": self.cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.cfg.preset_name(),
                "architectures": None,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.served_name,
                        "object": "model",
                        "created": int(self.w.started_unix),
                        "owned_by": "sglang",
                        "root": self.cfg.model_path,
                        "max_model_len": model_preset(self.cfg.preset_name()).context_tokens,
                    }
                ],
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        st = self.model.state()
        cap = st.capacity_tokens
        return web.json_response(
            {
                "timestamp": time.time(),
                "dp_rank_count": 1,
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": st.running,
                        "num_waiting_reqs": st.waiting,
                        "num_used_tokens": st.used_tokens,
                        "max_total_num_tokens": cap,
                        "token_usage": st.used_tokens / cap if cap else 0.0,
                        "cache_hit_rate": self.model.cache_hit_rate(),
                    }
                ],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_metrics:
            raise ApiError(404, "metrics are off; start the worker with --enable-metrics")
        body = self.w.metrics.render(self.model, self.w.hicache)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.auth(request)
        if self.model.busy() or self.w.copies.any_in_flight():
            return web.Response(
                status=400, text="Cache not flushed: there are running or waiting requests or copies in flight.\n"
            )
        dropped = self.model.flush()
        self.w.store.clear()
        if self.w.hicache is not None:
            self.w.hicache.flush()
        if self.w.kv_events is not None:
            self.w.kv_events.cleared()
        return web.Response(status=200, text=f"Cache flushed. {dropped} blocks dropped.\n")


__all__ = ["OpsRoutes"]
