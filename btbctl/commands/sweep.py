"""``btbctl sweep``: simulate one trace over a grid of BTB's four constants (optionally fleet size, NIC bandwidth,
fidelity and policy) in parallel; rank the grid points and draw a heatmap over two axes.

Trace and fleet options are those of ``dry-run`` (defaults, then ``-c FILE``, then flags). Each grid flag takes a
comma-separated list. Engine modules are imported inside the command so ``btbctl --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands import options
from btbctl.commands.app import app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural


@app.command("sweep")
def sweep(
    config: Annotated[
        str | None,
        typer.Option(
            "-c",
            "--config",
            metavar="FILE",
            help="Dry-run TOML config for the trace and the fleet (see examples/); flags override its values.",
        ),
    ] = None,
    trace: Annotated[
        str | None, typer.Option("--trace", metavar="FILE", help="Trace file. Default: one generated Bursted window.")
    ] = None,
    trace_format: options.TraceFormat = None,
    bursts: options.Bursts = None,
    burst_size: options.BurstSize = None,
    spread_s: options.SpreadS = None,
    decoys: options.Decoys = None,
    setup: Annotated[
        str | None,
        typer.Option(
            "--setup",
            metavar="NAME",
            help="Named setup of the published BTB table (70b_h100x4, qwen3_8b_h100x4, "
            "glm45_h100x4, glm52_h100x8, kimi_k2_h100x8, dense1t_b300x4).",
        ),
    ] = None,
    model: options.Model = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU preset (default: h100).")] = None,
    gpus_per_replica: options.GpusPerReplica = None,
    prefix_blocks: Annotated[
        str | None,
        typer.Option("--prefix-blocks", metavar="A,B,..", help="Grid of BTB Y: prefix lengths in trace blocks."),
    ] = None,
    threshold: Annotated[
        str | None,
        typer.Option("--threshold", metavar="A,B,..", help="Grid of BTB X: arrivals inside the window that fire."),
    ] = None,
    window_s: Annotated[
        str | None, typer.Option("--window-s", metavar="A,B,..", help="Grid of BTB Z: detection windows, seconds.")
    ] = None,
    warm_replicas: Annotated[
        str | None,
        typer.Option(
            "--warm-replicas",
            "--btb-replicas",
            metavar="A,B,..",
            help="Grid of BTB M: replicas that should hold a hot prefix (--btb-replicas is the old spelling).",
        ),
    ] = None,
    replicas: Annotated[
        str | None, typer.Option("--replicas", metavar="A,B,..", help="Grid of fleet sizes (default: the config's, 4).")
    ] = None,
    nic_gbps: Annotated[
        str | None,
        typer.Option(
            "--nic-gbps", metavar="A,B,..", help="Grid of NIC bandwidths per GPU, Gb/s (default: the config's, 400)."
        ),
    ] = None,
    fidelity: Annotated[
        str | None,
        typer.Option(
            "--fidelity", metavar="A,B", help="Grid of simulator profiles: realistic, infersim (default: realistic)."
        ),
    ] = None,
    policies: Annotated[
        str | None, typer.Option("--policies", metavar="A,B,..", help="Grid of routing policies (default: btb).")
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of every run and of the trace generator (default: 42).")
    ] = None,
    jobs: options.Jobs = None,
    ray: options.Ray = False,
    ray_address: options.RayAddress = None,
    rank_by: Annotated[str, typer.Option("--rank-by", help="Rank grid points by TTFT mean or p95.")] = "mean",
    heatmap: Annotated[
        str | None,
        typer.Option(
            "--heatmap",
            metavar="X,Y",
            help="Draw the best ranked TTFT for each pair of values of two axes, e.g. "
            "threshold,window_s (axes: prefix_blocks, threshold, window_s, "
            "warm_replicas, replicas, nic_gbps, fidelity, policy).",
        ),
    ] = None,
    top: Annotated[int, typer.Option("--top", help="Rows of the ranked table (human output; 0 = all).")] = 20,
    fmt: OutputFormat = Format.human,
) -> None:
    """Run a grid of BTB constants (and optionally fleet, fabric, fidelity, policy) over one trace, ranked by TTFT."""
    from btbctl.engine.dryrun import DryRunConfig, load_dryrun_config, load_trace
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.sweep import DEFAULT_SWEEP_POLICY, SweepGrid, SweepSpec, parse_list, run_sweep
    from btbctl.engine.sweep import heatmap as make_heatmap

    out = Output(fmt)
    ray_at = options.ray_target(ray, ray_address)
    flags = {
        "prefix_blocks": "--prefix-blocks",
        "threshold": "--threshold",
        "window_s": "--window-s",
        "warm_replicas": "--warm-replicas",
        "replicas": "--replicas",
        "nic_gbps": "--nic-gbps",
        "fidelity": "--fidelity",
        "policy": "--policies",
        "rank_by": "--rank-by",
        "jobs": "--jobs",
        "heatmap": "--heatmap",
        "ray": "--ray-address",
    }
    try:
        grid = SweepGrid(
            prefix_blocks=parse_list("prefix_blocks", prefix_blocks, int),
            threshold=parse_list("threshold", threshold, int),
            window_s=parse_list("window_s", window_s, float),
            warm_replicas=parse_list("warm_replicas", warm_replicas, int),
            replicas=parse_list("replicas", replicas, int),
            nic_gbps=parse_list("nic_gbps", nic_gbps, float),
            fidelity=parse_list("fidelity", fidelity, str),
            policy=parse_list("policy", policies, str) or (DEFAULT_SWEEP_POLICY,),
        )
        axes_pair = None
        if heatmap is not None:
            axes_pair = [a.strip() for a in heatmap.split(",") if a.strip()]
            if len(axes_pair) != 2:
                raise ConfigError("heatmap", f"needs two axes separated by a comma, got {heatmap!r}")
    except ConfigError as e:
        raise ConfigError(flags.get(e.key, e.key), e.reason) from None

    cfg = load_dryrun_config(config) if config is not None else DryRunConfig()
    unset = options.trace_unset(cfg, trace)
    overrides = {
        "trace.path": trace,
        "trace.format": trace_format,
        "trace.generate.bursts": bursts,
        "trace.generate.burst_size": burst_size,
        "trace.generate.spread_s": spread_s,
        "trace.generate.decoys": decoys,
        "setup": setup,
        "cluster.model": model,
        "cluster.gpu": gpu,
        "cluster.gpus_per_replica": gpus_per_replica,
        "seed": seed,
    }
    dashed = {
        **options.TRACE_FLAGS,
        "setup": "--setup",
        "cluster.model": "--model",
        "cluster.gpu": "--gpu",
        "cluster.gpus_per_replica": "--gpus-per-replica",
        "seed": "--seed",
    }
    try:
        cfg = cfg.with_overrides(overrides, unset=unset)
        spec = SweepSpec(base=cfg, grid=grid, rank_by=rank_by, jobs=jobs, ray=ray_at)
        n_points = 1
        for values in spec.validate().values():
            n_points *= len(values)
        if axes_pair is not None:  # check the axes before running anything
            from btbctl.engine.sweep import AXES

            for a in axes_pair:
                if a not in AXES:
                    raise ConfigError("heatmap", f"unknown axis {a!r}; valid: {', '.join(AXES)}")
            if axes_pair[0] == axes_pair[1]:
                raise ConfigError("heatmap", f"needs two different axes, got {axes_pair[0]!r} twice")
        trace_obj = load_trace(cfg)
        with out.progress(f"sweeping {n_points} grid points", n_points) as advance:
            report = run_sweep(spec, progress=advance, trace=trace_obj)
        if axes_pair is not None:
            report["heatmap"] = make_heatmap(report, axes_pair[0], axes_pair[1])
    except ConfigError as e:
        key = dashed.get(e.key) or flags.get(e.key) or e.key
        if key == e.key and e.key.startswith("cluster.") and e.key[8:] in ("replicas", "nic_gbps"):
            key = flags[e.key[8:]]
        raise ConfigError(key, e.reason, e.path) from None
    out.result(report, lambda r: render_human(out, r, top))


# -- human rendering ------------------------------------------------------------------------------------------------

#: Column headers of the grid axes (the four constants by their BTB letters).
_SHORT = {
    "prefix_blocks": "Y",
    "threshold": "X",
    "window_s": "Z",
    "warm_replicas": "M",
    "replicas": "fleet",
    "nic_gbps": "Gb/s",
    "fidelity": "fidelity",
    "policy": "policy",
}


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _v(x) -> str:
    if isinstance(x, float):
        return f"{x:g}"
    return str(x)


def render_human(out: Output, r: dict, top: int = 20) -> None:
    """The ranked table, then the heatmap (if any), on the output console."""
    from rich.table import Table

    console = out.console
    varying = [a for a, vals in r["axes"].items() if len(vals) > 1]
    fixed = ", ".join(f"{a}={_v(vals[0])}" for a, vals in r["axes"].items() if len(vals) == 1)
    t = r["trace"]
    console.print(
        f"sweep of {plural(r['points'], 'grid point')} over {plural(t['requests'], 'request')} ({t['format']}), "
        f"{r['cluster']['model']} on {r['cluster']['gpus_per_replica']} x {r['cluster']['gpu']}, "
        f"seed {r['seed']}; ranked by TTFT {r['rank_by']}"
    )
    if fixed:
        console.print(f"fixed: {fixed}")
    table = Table(title="TTFT by grid point, seconds", show_edge=False, header_style="bold")
    table.caption = (
        "Y prefix blocks, X threshold, Z window s, M replicas holding a hot prefix; copies = KV "
        "replications, wasted = copies never reused"
    )
    table.caption_justify = "left"
    table.add_column("#", justify="right")
    for a in varying:
        table.add_column(_SHORT[a], justify="right", no_wrap=True)
    for col in ("mean", "p95", "p99", "copies", "wasted"):
        table.add_column(col, justify="right", no_wrap=True)
    rows = r["results"] if top <= 0 else r["results"][:top]
    for row in rows:
        tt = row["ttft_s"]
        wasted = row.get("wasted_replications")
        table.add_row(
            str(row["rank"]),
            *(_v(row["point"][a]) for a in varying),
            _f(tt["mean"]),
            _f(tt["p95"]),
            _f(tt["p99"]),
            str(row["replications"]),
            "-" if wasted is None else str(wasted),
        )
    console.print(table)
    if top > 0 and len(r["results"]) > top:
        console.print(f"({len(r['results']) - top} more; --top 0 shows all)")
    tm = r["timing"]
    where = "Ray CPU" if tm.get("executor") == "ray" else "worker"
    out.info(f"{plural(r['points'], 'run')} in {tm['wall_s']:.1f} s on {plural(tm['jobs'], where)}")
    hm = r.get("heatmap")
    if hm:
        console.print(heatmap_chart(hm), no_wrap=True, crop=False)


#: Shades of the heatmap, best (lowest TTFT) first, with their colours: readable without colour (the glyph
#: alone orders the cells) and with it.
HEAT_SHADES = (("·", "green"), ("░", "green_yellow"), ("▒", "yellow"), ("▓", "dark_orange"), ("█", "red"))


def heatmap_chart(hm: dict, cell_w: int = 8):
    """A sweep heatmap as rich Text: one row per y value, one cell per x value, each cell ``cell_w`` characters
    of a shade by its TTFT (:data:`HEAT_SHADES`: ``·`` best .. ``█`` worst, also coloured green .. red) then its
    value, and a legend line with the value range of each shade."""
    from rich.text import Text

    vals = [v for row in hm["values"] for v in row if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    span = (hi - lo) or 1.0
    n = len(HEAT_SHADES)

    def shade(v):
        return HEAT_SHADES[min(n - 1, int((v - lo) / span * n))]

    ys = [_v(y) for y in hm["y"]]
    label_w = max(len(hm["y_axis"]), *(len(y) for y in ys))
    col_w = max(cell_w, *(len(_v(x)) for x in hm["x"]))
    text = Text(f"best TTFT {hm['metric']} (s) by {hm['y_axis']} (down) and {hm['x_axis']} (across)\n", style="bold")
    text.append(f"{hm['y_axis']:>{label_w}} " + " ".join(f"{_v(x):>{col_w}}" for x in hm["x"]))
    for y, row in zip(ys, hm["values"], strict=True):
        text.append(f"\n{y:>{label_w}} ")
        for i, v in enumerate(row):
            if i:
                text.append(" ")
            if v is None:
                text.append(f"{'-':>{col_w}}", style="dim")
                continue
            glyph, colour = shade(v)
            value = _f(v)
            text.append(glyph * max(1, col_w - len(value) - 1) + " ", style=colour)
            text.append(value)
    if hi == lo:
        text.append(f"\nshades: every cell {_f(lo)}")
        return text
    text.append("\nshades: ")
    for i, (glyph, colour) in enumerate(HEAT_SHADES):
        text.append(glyph * 2, style=colour)
        text.append(f" {_f(lo + span * i / n)}-{_f(lo + span * (i + 1) / n)}  ")
    text.append("(lower is better)")
    return text
