"""``btbctl worker``: run an emulated SGLang worker (SGLang's flags plus emulation flags)."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands.app import app


@app.command("worker")
def worker(
    model_path: Annotated[
        str,
        typer.Option(
            "--model-path", help="Model preset name or any model id/path (an unknown one is served as --model-preset)."
        ),
    ],
    served_model_name: Annotated[
        str | None, typer.Option("--served-model-name", help="Model id in the API (default: model path).")
    ] = None,
    model_preset: Annotated[
        str, typer.Option("--model-preset", help="Architecture when --model-path names no preset.")
    ] = "llama-3.3-70b",
    tp_size: Annotated[int, typer.Option("--tp-size", help="GPUs the model is split over.")] = 4,
    host: Annotated[str, typer.Option("--host", help="Address of the HTTP API and the transfer port.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="HTTP port (0 = ephemeral).")] = 30000,
    mem_fraction_static: Annotated[
        float, typer.Option("--mem-fraction-static", help="Fraction of HBM for weights + KV.")
    ] = 0.9,
    page_size: Annotated[int, typer.Option("--page-size", help="Tokens per KV page (prefix block).")] = 256,
    chunked_prefill_size: Annotated[
        int | None, typer.Option("--chunked-prefill-size", help="Prefill chunk in tokens; -1 disables.")
    ] = None,
    max_running_requests: Annotated[
        int, typer.Option("--max-running-requests", help="Most requests running at once.")
    ] = 256,
    max_total_tokens: Annotated[
        int | None,
        typer.Option("--max-total-tokens", help="Device KV pool, tokens (default: what the presets leave in HBM)."),
    ] = None,
    enable_metrics: Annotated[bool, typer.Option("--enable-metrics", help="Serve Prometheus /metrics.")] = False,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU preset pretended (btbctl presets).")] = "h100",
    time_scale: Annotated[
        float, typer.Option("--time-scale", help="Model seconds per wall second (0 = zero delay).")
    ] = 1.0,
    zero_delay: Annotated[bool, typer.Option("--zero-delay", help="Answer at once (cache bookkeeping kept).")] = False,
    kv_bytes_scale: Annotated[
        int, typer.Option("--kv-bytes-scale", help="Divisor of real KV block sizes in the block store.")
    ] = 65536,
    transfer_port: Annotated[
        int, typer.Option("--transfer-port", help="TCP port for replicated blocks (0 = ephemeral).")
    ] = 0,
    btb_token_file: Annotated[
        str | None,
        typer.Option("--btb-token-file", help="File holding the bearer token required by /btb/push and /flush_cache."),
    ] = None,
    enable_hierarchical_cache: Annotated[
        bool,
        typer.Option(
            "--enable-hierarchical-cache", "--enable-hicache", help="SGLang's HiCache: a host tier (and L3 tier)."
        ),
    ] = False,
    hicache_ratio: Annotated[
        float | None, typer.Option("--hicache-ratio", help="Host pool / device pool (default: 2.0).")
    ] = None,
    hicache_size: Annotated[int, typer.Option("--hicache-size", help="Host pool per TP rank, GB (0: ratio).")] = 0,
    hicache_write_policy: Annotated[
        str,
        typer.Option("--hicache-write-policy", help="write_through, write_through_selective or write_back."),
    ] = "write_through",
    hicache_mem_layout: Annotated[
        str, typer.Option("--hicache-mem-layout", help="Host pool layout (part of the L3 namespace).")
    ] = "page_first",
    hicache_io_backend: Annotated[
        str, typer.Option("--hicache-io-backend", help="Accepted for SGLang compatibility (no effect).")
    ] = "kernel",
    hicache_storage_backend: Annotated[
        str | None,
        typer.Option("--hicache-storage-backend", help="L3 backend: dynamic (btbctl's BtbL3Store, the node agent)."),
    ] = None,
    hicache_storage_prefetch_policy: Annotated[
        str,
        typer.Option("--hicache-storage-prefetch-policy", help="best_effort, wait_complete or timeout."),
    ] = "timeout",
    hicache_storage_backend_extra_config: Annotated[
        str | None,
        typer.Option(
            "--hicache-storage-backend-extra-config", help="JSON (or @FILE) of the L3 backend, as SGLang takes it."
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        str, typer.Option("--kv-cache-dtype", help="KV dtype (auto, bf16, fp8_e4m3, ...; part of the L3 namespace).")
    ] = "auto",
    kv_events_config: Annotated[
        str | None,
        typer.Option(
            "--kv-events-config", help="SGLang's KV events (JSON, publisher zmq): publish stored/removed pages."
        ),
    ] = None,
    enable_cache_report: Annotated[
        bool, typer.Option("--enable-cache-report", help="Accepted for SGLang compatibility (always on here).")
    ] = False,
) -> None:
    """Run an emulated SGLang worker. Prints 'ready http://HOST:PORT transfer HOST:TPORT' when listening."""
    from btbctl.engine.worker.config import load_token, make_config
    from btbctl.engine.worker.server import serve

    cfg = make_config(
        model_path=model_path,
        served_model_name=served_model_name,
        model_preset=model_preset,
        tp_size=tp_size,
        host=host,
        port=port,
        mem_fraction_static=mem_fraction_static,
        page_size=page_size,
        chunked_prefill_size=chunked_prefill_size,
        max_running_requests=max_running_requests,
        max_total_tokens=max_total_tokens,
        enable_metrics=enable_metrics,
        gpu=gpu,
        time_scale=time_scale,
        zero_delay=zero_delay,
        kv_bytes_scale=kv_bytes_scale,
        transfer_port=transfer_port,
        btb_token=load_token(btb_token_file),
        enable_hierarchical_cache=enable_hierarchical_cache,
        hicache_ratio=hicache_ratio,
        hicache_size=hicache_size,
        hicache_write_policy=hicache_write_policy,
        hicache_mem_layout=hicache_mem_layout,
        hicache_io_backend=hicache_io_backend,
        hicache_storage_backend=hicache_storage_backend,
        hicache_storage_prefetch_policy=hicache_storage_prefetch_policy,
        hicache_storage_backend_extra_config=hicache_storage_backend_extra_config,
        kv_cache_dtype=kv_cache_dtype,
        kv_events_config=kv_events_config,
        enable_cache_report=enable_cache_report,
    )
    serve(cfg)
