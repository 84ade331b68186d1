"""``btbctl gateway``: run the BTB gateway (data plane + control API) in front of running workers."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands import options
from btbctl.commands.app import app

# The ports `btbctl up` gives its gateway (defined once, with the launcher's cluster defaults): a gateway started by
# hand listens where the rest of btbctl looks by default.
from btbctl.engine.launcher.cluster import DEFAULT_CONTROL_PORT
from btbctl.engine.launcher.cluster import DEFAULT_GATEWAY_PORT as DEFAULT_PORT


@app.command("gateway")
def gateway(
    worker: Annotated[
        list[str] | None,
        typer.Option(
            "--worker", "-w", metavar="URL", help="Worker base URL (http://host:port); repeat for each worker."
        ),
    ] = None,
    config: Annotated[
        str | None,
        typer.Option(
            "--config",
            "-c",
            metavar="FILE",
            help="TOML file of gateway settings (GatewayConfig fields, top level); the flags below override it. "
            "A .json file is still read as JSON.",
        ),
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Data-plane address (default: 127.0.0.1).")] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", help=f"Data-plane port, 0 = any free one (default: {DEFAULT_PORT}, as btbctl up)."),
    ] = None,
    control_host: Annotated[
        str | None, typer.Option("--control-host", help="Control API address (default: 127.0.0.1).")
    ] = None,
    control_port: Annotated[
        int | None,
        typer.Option(
            "--control-port",
            help=f"Control API port, 0 = any free one (default: {DEFAULT_CONTROL_PORT}, as btbctl up).",
        ),
    ] = None,
    policy: Annotated[
        str | None, typer.Option("--policy", help="Routing policy (default: btb_plus; btb is the published rule).")
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option("--seed", help="Seed of the policy's tie-breaks, for reproducible runs (default: fresh per run)."),
    ] = None,
    page_size: Annotated[
        int | None,
        typer.Option("--page-size", help="Tokens per block (default: the workers' /btb/info page_size, else 256)."),
    ] = None,
    prefix_blocks: options.PrefixBlocks = None,
    threshold: options.Threshold = None,
    window_s: options.WindowS = None,
    warm_replicas: options.WarmReplicas = None,
    token_file: Annotated[
        str | None,
        typer.Option("--token-file", help="Bearer token of control-API writes; created (mode 0600) when missing."),
    ] = None,
    worker_token_file: Annotated[
        str | None, typer.Option("--worker-token-file", help="Bearer token sent to the workers' /btb/push.")
    ] = None,
    max_retries: Annotated[
        int | None,
        typer.Option("--max-retries", help="Further workers tried when one fails before the first byte (default: 2)."),
    ] = None,
    health_interval_s: Annotated[
        float | None, typer.Option("--health-interval-s", help="Seconds between health checks (default: 1.0).")
    ] = None,
    max_body_bytes: Annotated[
        int | None,
        typer.Option("--max-body-bytes", help="Largest request body, bytes (default: 8388608)."),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--log-level", help="Diagnostics on stderr: debug, info, warning.")
    ] = "info",
) -> None:
    """Run the gateway until SIGINT/SIGTERM. Prints 'ready http://HOST:PORT control http://HOST:CPORT' when both
    listeners accept connections."""
    import logging
    import sys

    from btbctl.engine.config import validate
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.gateway.config import GatewayConfig
    from btbctl.engine.gateway.server import run_gateway

    data: dict = {"port": DEFAULT_PORT, "control_port": DEFAULT_CONTROL_PORT}
    if config:
        data.update(_read_settings(config))
    flags = {
        "host": host,
        "port": port,
        "control_host": control_host,
        "control_port": control_port,
        "policy": policy,
        "seed": seed,
        "page_size": page_size,
        "token_file": token_file,
        "worker_token_file": worker_token_file,
        "max_retries": max_retries,
        "health_interval_s": health_interval_s,
        "max_body_bytes": max_body_bytes,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    if worker:
        data["workers"] = list(worker)
    consts = {
        "prefix_blocks": prefix_blocks,
        "threshold": threshold,
        "window_s": window_s,
        "warm_replicas": warm_replicas,
    }
    consts = {k: v for k, v in consts.items() if v is not None}
    if consts:
        data["constants"] = {**(data.get("constants") or {}), **consts}
    if not data.get("workers"):
        raise ConfigError("workers", "give at least one --worker URL (or 'workers' in --config)")
    level = getattr(logging, log_level.upper(), None)
    if not isinstance(level, int):
        raise ConfigError("log-level", f"unknown level {log_level!r}; valid: debug, info, warning, error")
    cfg = validate(GatewayConfig, data, config)
    from btbctl.engine.logfmt import configure_logging

    try:
        configure_logging(level, cfg.log_file, sys.stderr)
    except OSError as e:
        raise ConfigError("log_file", f"cannot open {cfg.log_file}: {e.strerror or e}") from None

    def ready(gw) -> None:
        sys.stdout.write(f"ready {gw.data_url} control {gw.control_url}\n")
        sys.stdout.flush()

    run_gateway(cfg, on_ready=ready)


def _read_settings(path: str) -> dict:
    """Gateway settings from a TOML file (as every other btbctl config), or JSON for a ``.json`` file (the format
    this command read first)."""
    from btbctl.engine.config import read_toml
    from btbctl.engine.errors import ConfigError

    if path.lower().endswith(".json"):
        import json

        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError("config", f"cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError("config", f"{path} must hold a JSON object")
        return data
    return read_toml(path, "gateway settings")
