"""Option types shared by commands that take the same flags (``dry-run`` and ``sweep``: the trace and the fleet).

Each is an ``Annotated`` type for a command parameter; the parameter's default (``None``: not given) stays at the
command. Only typer is imported here, so ``btbctl --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands.output import Format

RUN_DIR_HELP = (
    "Run directory of the fleet (default: runs/NAME of --fleet under the user state directory, else "
    "$BTBCTL_RUN_DIR, else runs/$BTBCTL_FLEET, else runs/default)."
)


def _select_fleet(value: str | None) -> str | None:
    """Typer callback of ``--fleet``: every run directory resolved afterwards is that fleet's (None: none named,
    so one command run in-process after another does not inherit the last one's fleet)."""
    from btbctl.engine.launcher.rundir import select_fleet

    select_fleet(value)
    return value


#: ``--run-dir DIR`` of every command that works on a fleet.
RunDirOpt = Annotated[str | None, typer.Option("--run-dir", metavar="DIR", help=RUN_DIR_HELP)]
#: ``--fleet NAME`` (or ``BTBCTL_FLEET``) of every command that works on a fleet, as compose has projects.
FleetOpt = Annotated[
    str | None,
    typer.Option(
        "--fleet",
        metavar="NAME",
        callback=_select_fleet,  # BTBCTL_FLEET is read where run directories are resolved, after BTBCTL_RUN_DIR
        help="Name of the fleet (its run directory is runs/NAME under the user state directory; `btbctl ls` lists "
        "them); env BTBCTL_FLEET. --run-dir wins over it.",
    ),
]

#: The one description of ``--format``, for every command that reports.
FORMAT_HELP = "Output format: human (text for people) or json (for programs, on stdout)."
OutputFormat = Annotated[Format, typer.Option("--format", help=FORMAT_HELP)]

TraceFormat = Annotated[
    str | None,
    typer.Option(
        "--trace-format", help="Format of --trace: mooncake, btb-mixed-trace-v1, azure2023. Default: detected."
    ),
]
Bursts = Annotated[int | None, typer.Option("--bursts", help="Generated trace: number of bursts (default: 8).")]
BurstSize = Annotated[
    int | None, typer.Option("--burst-size", help="Generated trace: requests per burst (default: 500).")
]
SpreadS = Annotated[
    float | None,
    typer.Option(
        "--spread-s",
        help="Generated trace: seconds over which one burst arrives (default: 60); 1 is the adversarial variant.",
    ),
]
Decoys = Annotated[
    int | None,
    typer.Option("--decoys", help="Generated trace: single requests with their own long prefix (default: 120)."),
]
Model = Annotated[str | None, typer.Option("--model", help="Model preset (btbctl presets) (default: llama-3.3-70b).")]
GpusPerReplica = Annotated[
    int | None, typer.Option("--gpus-per-replica", help="GPUs per replica, tensor parallel (default: 4).")
]

# BTB's four constants (btbctl.engine.constants.BtbConstants validates the values; the help only names them).
PrefixBlocks = Annotated[
    int | None,
    typer.Option("--prefix-blocks", help="BTB Y: prefix length matched and copied, in KV blocks (default: 256)."),
]
Threshold = Annotated[
    int | None,
    typer.Option(
        "--threshold", help="BTB X: arrivals of a prefix inside the window that fire replication (default: 2)."
    ),
]
WindowS = Annotated[
    float | None, typer.Option("--window-s", help="BTB Z: trailing detection window, seconds (default: 1.0).")
]
WarmReplicas = Annotated[
    int | None,
    typer.Option(
        "--warm-replicas",
        "--btb-replicas",
        help="BTB M (not the fleet size): replicas that should hold a hot prefix, the holder included; "
        "--btb-replicas is the old spelling (default: 4).",
    ),
]

#: ``[btb]`` key -> the flag that sets it.
CONSTANT_FLAGS = {
    "prefix_blocks": "--prefix-blocks",
    "threshold": "--threshold",
    "window_s": "--window-s",
    "warm_replicas": "--warm-replicas",
}

#: Dotted config key -> the flag above (or ``--trace``) that sets it.
TRACE_FLAGS = {
    "trace.path": "--trace",
    "trace.format": "--trace-format",
    "trace.generate.bursts": "--bursts",
    "trace.generate.burst_size": "--burst-size",
    "trace.generate.spread_s": "--spread-s",
    "trace.generate.decoys": "--decoys",
}


def trace_unset(cfg, trace: str | None) -> tuple[str, ...]:
    """Config keys that ``--trace`` clears: it replaces the file's trace path and format; the file's generate
    section stays only for an overlay."""
    if trace is None:
        return ()
    return ("trace.format",) if cfg.trace.overlay else ("trace.format", "trace.generate")


# Where the simulations of sweep and report run (btbctl.engine.executor). Typer has no option with an optional
# value, so `--ray` alone means a Ray started on this machine and `--ray-address ADDRESS` an existing cluster.
Jobs = Annotated[
    int | None,
    typer.Option(
        "-j",
        "--jobs",
        help="Worker processes, or CPUs of the Ray started by --ray (default: the CPUs available; 1 without "
        "--ray runs in this process).",
    ),
]
Ray = Annotated[
    bool,
    typer.Option(
        "--ray",
        help="Run every simulation as a Ray task: on a Ray started here for the run (with --jobs CPUs), or on the "
        "cluster of --ray-address. Needs the ray extra: pip install 'btbctl[ray]'.",
    ),
]
RayAddress = Annotated[
    str | None,
    typer.Option(
        "--ray-address",
        metavar="ADDRESS",
        help="Existing Ray cluster for --ray (implies it): auto, HOST:PORT of the head node, or ray://HOST:PORT "
        "(Ray Client). Every node needs this btbctl version installed.",
    ),
]


def ray_target(ray: bool, address: str | None) -> str | None:
    """The executor's ``ray`` setting for ``--ray``/``--ray-address`` (None: local processes). Checks that Ray is
    installed before anything runs: raises ``ConfigError('--ray', ...)`` with the install line otherwise."""
    if not ray and address is None:
        return None
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.executor import LOCAL_RAY, require_ray, valid_ray_address

    if address is not None and not valid_ray_address(address):
        raise ConfigError(
            "--ray-address",
            f"{address!r} is not a Ray address; valid: auto, HOST:PORT of the head node, ray://HOST:PORT",
        )
    try:
        require_ray()
    except ConfigError as e:
        raise ConfigError("--ray", e.reason) from None
    return address or LOCAL_RAY
