"""``btbctl tui``: the operations dashboard, attached to a running fleet or to a live simulation (``--sim``).

Textual and the dashboard are imported inside the command so ``btbctl --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands import options
from btbctl.commands.app import app
from btbctl.commands.options import FleetOpt, RunDirOpt


@app.command("tui")
def tui(
    url: Annotated[
        str | None,
        typer.Option(
            "--url", metavar="URL", help="Control API of the fleet (default: the one recorded in the run directory)."
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            "--token",
            help="Bearer token for control-API writes (default: read from --token-file or the run directory).",
        ),
    ] = None,
    token_file: Annotated[
        str | None, typer.Option("--token-file", metavar="FILE", help="File holding the bearer token.")
    ] = None,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    sim: Annotated[
        bool, typer.Option("--sim", help="Attach to a live simulation paced to the wall clock instead of a fleet.")
    ] = False,
    config: Annotated[
        str | None,
        typer.Option("-c", "--config", metavar="FILE", help="--sim: dry-run TOML config; flags override it."),
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option("--trace", metavar="FILE", help="--sim: trace file (default: a generated Bursted window)."),
    ] = None,
    model: Annotated[str | None, typer.Option("--model", help="--sim: model preset (default: llama-3.3-70b).")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="--sim: GPU preset (default: h100).")] = None,
    gpus_per_replica: Annotated[
        int | None, typer.Option("--gpus-per-replica", help="--sim: GPUs per replica (default: 4).")
    ] = None,
    replicas: Annotated[
        int | None, typer.Option("--replicas", help="--sim: replicas in the fleet (default: 4).")
    ] = None,
    policy: Annotated[str | None, typer.Option("--policy", help="--sim: routing policy (default: btb_plus).")] = None,
    prefix_blocks: options.PrefixBlocks = None,
    threshold: options.Threshold = None,
    window_s: options.WindowS = None,
    warm_replicas: options.WarmReplicas = None,
    speed: Annotated[float, typer.Option("--speed", help="--sim: simulated seconds per wall second.")] = 1.0,
    seed: Annotated[int | None, typer.Option("--seed", help="--sim: seed (default: 42).")] = None,
    poll_hz: Annotated[
        float,
        typer.Option(
            "--poll-hz",
            help="Snapshots asked for per second: the simulation's refresh rate, and a fleet's while its "
            "event stream is down (the stream pushes changes as they happen).",
        ),
    ] = 4.0,
) -> None:
    """Live dashboard: prefix heat, fleet and HBM, transfers, TTFT, and BTB's constants (editable)."""
    from btbctl.engine.errors import ConfigError

    if sim:
        from btbctl.engine.dashboard.sim_source import sim_source_from_config
        from btbctl.engine.dryrun import DryRunConfig, load_dryrun_config

        overrides = {
            "trace.path": trace,
            "cluster.model": model,
            "cluster.gpu": gpu,
            "cluster.gpus_per_replica": gpus_per_replica,
            "cluster.replicas": replicas,
            "btb.prefix_blocks": prefix_blocks,
            "btb.threshold": threshold,
            "btb.window_s": window_s,
            "btb.warm_replicas": warm_replicas,
            "seed": seed,
        }
        cfg = load_dryrun_config(config) if config is not None else DryRunConfig()
        from btbctl.commands.options import trace_unset

        cfg = cfg.with_overrides(overrides, unset=trace_unset(cfg, trace))
        source = sim_source_from_config(cfg, policy, speed=speed)
        title = f"simulation x{speed:g}"
    else:
        if (
            any(
                v is not None
                for v in (
                    trace,
                    model,
                    gpu,
                    gpus_per_replica,
                    replicas,
                    policy,
                    config,
                    prefix_blocks,
                    threshold,
                    window_s,
                    warm_replicas,
                    seed,
                )
            )
            or speed != 1.0
        ):
            raise ConfigError("--sim", "simulation options (--trace, --model, ...) need --sim")
        from btbctl.engine.dashboard.control_source import ControlApiSource
        from btbctl.engine.launcher.control import resolve_control_api

        base, tok = resolve_control_api(url=url, token=token, token_file=token_file, run_dir=run_dir)
        source = ControlApiSource(base, tok)
        title = base
    from btbctl.tui.app import build_app

    build_app(source, poll_hz=poll_hz, title=title).run()
