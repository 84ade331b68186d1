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
        enable_metrics=enable_metrics,
        gpu=gpu,
        time_scale=time_scale,
        zero_delay=zero_delay,
        kv_bytes_scale=kv_bytes_scale,
        transfer_port=transfer_port,
        btb_token=load_token(btb_token_file),
    )
    serve(cfg)
