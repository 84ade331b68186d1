"""``btbctl dry-run``: simulate a fleet and a trace under several routing policies and compare TTFT.

Settings come from the defaults (the published BTB setting), then an optional TOML file (``-c``), then the flags;
a flag overrides the file. Engine modules are imported inside the command so ``btbctl --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands import options
from btbctl.commands.app import app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural

#: Dotted config key -> the flag that sets it (errors about a value that came from a flag name the flag).
_FLAGS = {
    **options.TRACE_FLAGS,
    "cluster.model": "--model",
    "cluster.gpu": "--gpu",
    "cluster.gpus_per_replica": "--gpus-per-replica",
    "cluster.replicas": "--replicas",
    "cluster.nic_gbps": "--nic-gbps",
    "fabric": "--fabric",
    **{f"btb.{k}": flag for k, flag in options.CONSTANT_FLAGS.items()},
    "policies": "--policies",
    "seed": "--seed",
    "fidelity": "--fidelity",
    "setup": "--setup",
    "requests_out": "--requests-out",
}


@app.command("dry-run")
def dry_run(
    config: Annotated[
        str | None,
        typer.Option(
            "-c",
            "--config",
            metavar="FILE",
            help="TOML config (see examples/). Relative trace paths in it resolve against its folder; flags override "
            "its values.",
        ),
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            help="Trace file (relative to the current directory). Default: a generated Bursted window.",
        ),
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
            help="Named setup of the published BTB table: 70b_h100x4, qwen3_8b_h100x4, glm45_h100x4, glm52_h100x8, "
            "kimi_k2_h100x8, dense1t_b300x4. Sets model, GPU, GPUs per replica, replicas and NIC; the flags "
            "below still override it.",
        ),
    ] = None,
    model: options.Model = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="GPU preset (btbctl presets) (default: h100).")] = None,
    gpus_per_replica: options.GpusPerReplica = None,
    replicas: Annotated[int | None, typer.Option("--replicas", help="Replicas in the fleet (default: 4).")] = None,
    nic_gbps: Annotated[
        float | None, typer.Option("--nic-gbps", help="NIC bandwidth per GPU, Gb/s (default: 400).")
    ] = None,
    fabric: Annotated[
        str | None,
        typer.Option(
            "--fabric",
            metavar="NAME",
            help="KV copy fabric preset (btbctl presets: rdma-8x400g, rdma-4x200g, rdma-1x400g, tcp, 100gbe): sets "
            "the NIC rate so a replica copies at the fabric's bandwidth; instead of --nic-gbps.",
            show_default=False,
        ),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            "--policies",
            metavar="A,B,C",
            help="Comma-separated routing policies, in report order (default: round_robin,least_load,cache_aware,"
            "cache_aware_spill,btb,btb_plus).",
        ),
    ] = None,
    prefix_blocks: options.PrefixBlocks = None,
    threshold: options.Threshold = None,
    window_s: options.WindowS = None,
    warm_replicas: options.WarmReplicas = None,
    seed: Annotated[
        int | None, typer.Option("--seed", help="Seed of the simulator and the trace generator (default: 42).")
    ] = None,
    fidelity: Annotated[
        str | None, typer.Option("--fidelity", help="Simulator profile: realistic or infersim (default: realistic).")
    ] = None,
    fmt: OutputFormat = Format.human,
    requests_out: Annotated[
        str | None,
        typer.Option(
            "--requests-out",
            metavar="FILE",
            help="Also write one JSON line per request per policy (arrival_s, policy, replica, ttft_s, queue_wait_s, "
            "cached_tokens, kind, request_id).",
        ),
    ] = None,
) -> None:
    """Simulate a fleet and a trace under several routing policies and compare time to first token."""
    from btbctl.engine.dryrun import DryRunConfig, load_dryrun_config, load_trace, run_dry_run
    from btbctl.engine.errors import ConfigError

    out = Output(fmt)
    policy_list = None
    if policies is not None:
        policy_list = [p.strip() for p in policies.split(",") if p.strip()]
    overrides = {
        "trace.path": trace,
        "trace.format": trace_format,
        "trace.generate.bursts": bursts,
        "trace.generate.burst_size": burst_size,
        "trace.generate.spread_s": spread_s,
        "trace.generate.decoys": decoys,
        "cluster.model": model,
        "cluster.gpu": gpu,
        "cluster.gpus_per_replica": gpus_per_replica,
        "cluster.replicas": replicas,
        "cluster.nic_gbps": nic_gbps,
        "btb.prefix_blocks": prefix_blocks,
        "btb.threshold": threshold,
        "btb.window_s": window_s,
        "btb.warm_replicas": warm_replicas,
        "policies": policy_list,
        "seed": seed,
        "fidelity": fidelity,
        "setup": setup,
    }
    given = {k for k, v in overrides.items() if v is not None}
    if requests_out is not None:
        given.add("requests_out")
    if fabric is not None:
        given.add("fabric")
    cfg = load_dryrun_config(config) if config is not None else DryRunConfig()
    unset = options.trace_unset(cfg, trace)
    try:
        cfg = cfg.with_overrides(overrides, unset=unset)
        if fabric is not None:
            from btbctl.engine.costmodel import fabric_nic_gbps

            if nic_gbps is not None:
                raise ConfigError("fabric", "give --fabric or --nic-gbps, not both")
            given.add("cluster.nic_gbps")
            nic = fabric_nic_gbps(fabric, cfg.cluster.gpus_per_replica)
            cfg = cfg.with_overrides({"cluster.nic_gbps": nic})
        cfg.check()
        trace_obj = load_trace(cfg)
        total = len(trace_obj) * len(cfg.policies)
        with out.progress(f"simulating {len(cfg.policies)} policies", total) as advance:
            report = run_dry_run(cfg, progress=advance, requests_out=requests_out, trace=trace_obj)
    except ConfigError as e:
        raise _flag_error(e, given) from None
    note = never_fired_note(report, trace_obj, cfg.btb)

    def human(r: dict) -> None:
        render_human(out, r)
        if note:
            out.console.print(note)

    out.result(report, human)


#: Policies whose copies start only when BTB's burst detector fires on the Y-block prefix.
_DETECTOR_POLICIES = ("btb", "btb_plus")


def never_fired_note(report: dict, trace, constants) -> str | None:
    """One line when a BTB policy made no copy because its burst detector never fired on the trace (the prefix of
    ``prefix_blocks`` blocks never arrived ``threshold`` times within ``window_s``), else None."""
    from btbctl.engine.detector import BurstDetector

    idle = [s["policy"] for s in report["results"] if s["policy"] in _DETECTOR_POLICIES and not s["replications"]]
    if not idle:
        return None
    det = BurstDetector(constants)
    for req in sorted(trace.requests, key=lambda q: q.arrival_s):
        if det.observe(req.block_hashes, req.arrival_s) is not None:
            return None
    c = constants
    return (
        f"note: {' and '.join(idle)} made no copy: the burst detector never fired (no {c.prefix_blocks}-block "
        f"prefix arrived {c.threshold} times within {c.window_s:g} s); see btbctl trace audit"
    )


def _flag_error(e, given: set[str]):
    """Rename a config key to the flag that set it, when the value came from a flag."""
    from btbctl.engine.errors import ConfigError

    key = e.key
    while key and key not in _FLAGS:  # policies.1 -> policies
        key = key.rpartition(".")[0]
    if key in given:
        return ConfigError(_FLAGS[key], e.reason, e.path)
    return e


# -- human rendering --------------------------------------------------------------------------------------------


def _f(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _t(x) -> str:
    """Seconds with 4 significant digits up to 1000 s (at most 5 characters below that), so tables fit 80 columns."""
    if x is None:
        return "-"
    if abs(x) < 10:
        return f"{x:.3f}"
    if abs(x) < 100:
        return f"{x:.2f}"
    return f"{x:.1f}"


def header_line(r: dict) -> str:
    """Short lines naming the trace, the fleet, the constants and the fidelity of a dry-run report."""
    t, c, k = r["trace"], r["cluster"], r["constants"]
    src = t["path"] if t["path"] is not None else "generated Bursted window"
    span = _f(t["span_s"], 1)
    return (
        f"trace: {src} ({t['format']}, {plural(t['requests'], 'request')} over {span} s, {t['block_tokens']}-token "
        f"blocks)\nfleet: {c['replicas']} x {c['model']} on {c['gpus_per_replica']} x {c['gpu']}, NIC "
        f"{c['nic_gbps']:g} Gb/s per GPU\nBTB: prefix_blocks={k['prefix_blocks']} threshold={k['threshold']} "
        f"window_s={float(k['window_s'])!r} warm_replicas={k['warm_replicas']}\n"
        f"fidelity: {r['fidelity']}, seed {r['seed']}"
    )


def _table(title: str):
    """A compact rich table (no outer edge, one space between columns) that fits 80 columns."""
    from rich import box
    from rich.table import Table

    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0), pad_edge=False
    )


def _mtok(tokens: int) -> str:
    return f"{tokens / 1e6:.2f}"


def render_human(out: Output, r: dict) -> None:
    """Print a dry-run report: header line, summary table, per-kind table, TTFT percentile chart."""

    con = out.console
    con.print(header_line(r))

    tab = _table("TTFT by policy (seconds)")
    tab.caption = (
        "hit % = prompt tokens served from cache; copies = KV replications; GB moved = bytes they "
        "copied / 1e9; recomp Mtok = prefix tokens recomputed, millions"
    )
    tab.caption_justify = "left"
    tab.add_column("policy", no_wrap=True)
    for name in ("reqs", "mean", "p50", "p95", "p99", "max", "hit\n%", "copies", "GB\nmoved", "recomp\nMtok"):
        tab.add_column(name, justify="right")
    for s in r["results"]:
        tt = s["ttft_s"]
        hit = s.get("prefix_hit_ratio")
        tab.add_row(
            s["policy"],
            f"{s['requests']:,}",
            _t(tt["mean"]),
            _t(tt["p50"]),
            _t(tt["p95"]),
            _t(tt["p99"]),
            _t(tt["max"]),
            "-" if hit is None else f"{100 * hit:.1f}",
            f"{s['replications']:,}",
            _f(s["replicated_bytes"] / 1e9, 1),
            _mtok(s["recomputed_prefix_tokens"]),
        )
    con.print(tab)

    kinds: list[str] = []
    for s in r["results"]:
        for kind in s.get("by_kind", {}):
            if kind not in kinds:
                kinds.append(kind)
    if kinds:
        kt = _table("TTFT by request kind (seconds)")
        kt.add_column("policy", no_wrap=True)
        for kind in kinds:
            kt.add_column(f"{kind}\nmean", justify="right")
            kt.add_column(f"{kind}\np95", justify="right")
        for s in r["results"]:
            row = [s["policy"]]
            for kind in kinds:
                bk = s.get("by_kind", {}).get(kind)
                row += ["-", "-"] if bk is None else [_t(bk["ttft_s"]["mean"]), _t(bk["ttft_s"]["p95"])]
            kt.add_row(*row)
        con.print(kt)

    chart = ttft_chart(r, width=min(con.width, 80))
    if chart is not None:
        con.print(chart, no_wrap=True, crop=False)


#: The percentiles of the TTFT chart: (key, glyph, colour). Distinct glyphs keep neighbouring bars apart without
#: colour (piped output, NO_COLOR); with colour each has its own as well.
CHART_SERIES = (("p50", "░", "green"), ("p95", "▒", "yellow"), ("p99", "█", "red"))


def ttft_chart(r: dict, width: int = 80):
    """TTFT p50 / p95 / p99 per policy as horizontal bars on one scale (seconds), as rich Text: a legend line,
    then per policy one bar per percentile, each with its own glyph and colour and its value at the end; None when
    a percentile is missing."""
    from rich.text import Text

    results = r["results"]
    if not results or any(s["ttft_s"][q] is None for s in results for q, _, _ in CHART_SERIES):
        return None
    top = max(s["ttft_s"][q] for s in results for q, _, _ in CHART_SERIES) or 1.0
    name_w = max(len(s["policy"]) for s in results)
    bar_w = max(10, width - name_w - 4 - 1 - 8)
    text = Text("TTFT per policy, seconds (bars on one scale):")
    for q, glyph, colour in CHART_SERIES:
        text.append("  ")
        text.append(glyph * 2, style=colour)
        text.append(f" {q}")
    for s in results:
        for i, (q, glyph, colour) in enumerate(CHART_SERIES):
            v = s["ttft_s"][q]
            n = int(round(v / top * bar_w))
            if v > 0 and n == 0:
                n = 1
            text.append(f"\n{s['policy'] if i == 0 else '':<{name_w}} {q} ")
            text.append(glyph * n, style=colour)
            text.append(f"{' ' * (bar_w - n)} {_t(v):>7}")
    return text
