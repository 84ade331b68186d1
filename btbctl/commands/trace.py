"""``btbctl trace``: generate Bursted workloads and audit traces for prefix bursts.

``btbctl trace gen --out PATH`` writes one Bursted window (REFERENCE.md s3) as ``btb-mixed-trace-v1`` JSONL, optionally
overlaid on a real trace (``--base``). ``btbctl trace audit PATH`` prints sizes, rates and the fan-out table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from btbctl.commands.app import BtbTyper, app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural

trace_app = BtbTyper(
    name="trace",
    help="Generate Bursted workloads and audit traces for prefix bursts.",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(trace_app, name="trace", help="Generate Bursted workloads and audit traces for prefix bursts.")

_FORMATS_HELP = "mooncake, btb-mixed-trace-v1 or azure2023"

# Defaults below are BurstedParams' defaults (REFERENCE.md s3); a test checks they agree.


@trace_app.command("gen")
def gen(
    out_path: Annotated[
        Path,
        typer.Option("--out", "-o", help="Output file (btb-mixed-trace-v1 JSONL; .gz compresses).", dir_okay=False),
    ],
    bursts: Annotated[int, typer.Option(help="Burst jobs in the window.")] = 8,
    burst_size: Annotated[int, typer.Option(help="Requests per burst.")] = 500,
    first_burst_s: Annotated[float, typer.Option(help="Nominal start of the first burst, seconds.")] = 20.0,
    burst_period_s: Annotated[float, typer.Option(help="Nominal gap between burst starts, seconds.")] = 40.0,
    jitter_s: Annotated[float, typer.Option(help="Uniform +- jitter of each burst start, seconds.")] = 2.0,
    spread_s: Annotated[
        float,
        typer.Option(help="Seconds over which a burst's requests arrive evenly (1.0 is the adversarial variant)."),
    ] = 60.0,
    prefix_tokens: Annotated[
        int, typer.Option(help="Tokens of each burst's shared prefix (and of each decoy's own prefix).")
    ] = 65536,
    suffix_tokens: Annotated[int, typer.Option(help="Unique tokens each request adds after the prefix.")] = 256,
    output_tokens: Annotated[int, typer.Option(help="Output tokens per burst or decoy request.")] = 1,
    decoys: Annotated[int, typer.Option(help="Single requests with their own unique prefix.")] = 120,
    decoy_start_s: Annotated[float, typer.Option(help="Earliest decoy arrival, seconds.")] = 14.0,
    decoy_end_s: Annotated[float, typer.Option(help="Latest decoy arrival, seconds.")] = 340.0,
    block_tokens: Annotated[
        int, typer.Option(help="Tokens per hash block (ignored with --base: the base trace's block size is used).")
    ] = 256,
    background_rps: Annotated[
        float, typer.Option(help="Mean rate of background requests (Poisson, unique prompts), requests/s; 0 = none.")
    ] = 0.0,
    background_end_s: Annotated[
        float | None,
        typer.Option(help="End of background arrivals, seconds (default: end of the window).", show_default=False),
    ] = None,
    background_input_min_tokens: Annotated[int, typer.Option(help="Shortest background prompt, tokens.")] = 256,
    background_input_max_tokens: Annotated[int, typer.Option(help="Longest background prompt, tokens.")] = 8192,
    background_output_tokens: Annotated[int, typer.Option(help="Output tokens per background request.")] = 128,
    offset_s: Annotated[
        float,
        typer.Option(
            help="Seconds added to every generated arrival (to place the window inside a longer --base trace)."
        ),
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Random seed; equal seeds give identical traces.")] = 42,
    base: Annotated[
        Path | None,
        typer.Option(
            help="Trace to overlay the window on (its requests are kept).", dir_okay=False, show_default=False
        ),
    ] = None,
    base_format: Annotated[
        str | None,
        typer.Option(help=f"Format of --base: {_FORMATS_HELP} (default: detect from content).", show_default=False),
    ] = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Write a Bursted workload: bursts of requests sharing one long prefix, plus decoys (REFERENCE.md s3)."""
    from btbctl.engine.trace.audit import audit_trace
    from btbctl.engine.trace.generate import BurstedParams, generate_bursted
    from btbctl.engine.trace.readers import read_trace
    from btbctl.engine.trace.writer import write_btb_mixed

    out = Output(fmt)
    params = BurstedParams(
        bursts=bursts,
        burst_size=burst_size,
        first_burst_s=first_burst_s,
        burst_period_s=burst_period_s,
        jitter_s=jitter_s,
        spread_s=spread_s,
        prefix_tokens=prefix_tokens,
        suffix_tokens=suffix_tokens,
        output_tokens=output_tokens,
        decoys=decoys,
        decoy_start_s=decoy_start_s,
        decoy_end_s=decoy_end_s,
        block_tokens=block_tokens,
        background_rps=background_rps,
        background_end_s=background_end_s,
        background_input_min_tokens=background_input_min_tokens,
        background_input_max_tokens=background_input_max_tokens,
        background_output_tokens=background_output_tokens,
        offset_s=offset_s,
    )
    base_trace = read_trace(base, base_format) if base is not None else None
    trace = generate_bursted(params, seed=seed, base=base_trace)
    if not len(trace):
        from btbctl.engine.errors import BtbctlError

        # An empty file would be refused by every reader ("no requests"); say so now and write nothing.
        raise BtbctlError(
            "the window has no requests (no bursts, no decoys, no background arrivals); set --bursts, "
            "--decoys or --background-rps; nothing written"
        )
    rows = write_btb_mixed(trace, out_path)
    summary = audit_trace(trace, ks=(), windows_s=())
    kinds = ", ".join(f"{k} {n}" for k, n in summary["kinds"].items())
    on = f" on {base} ({base_trace.format})" if base_trace is not None else ""
    _info_line(
        out,
        f"wrote {plural(rows, 'request')} ({kinds}) over {trace.span_s:.1f} s, {trace.block_tokens}-token blocks, "
        f"seed {seed}{on} to {out_path}",
    )
    if out.format is Format.json:
        out.result(
            {
                "path": str(out_path),
                "format": "btb-mixed-trace-v1",
                "requests": rows,
                "span_s": trace.span_s,
                "block_tokens": trace.block_tokens,
                "kinds": summary["kinds"],
                "seed": seed,
                "base": None
                if base_trace is None
                else {"path": str(base), "format": base_trace.format, "requests": len(base_trace)},
                "params": params.as_dict(),
            }
        )


@trace_app.command("audit")
def audit(
    path: Annotated[Path, typer.Argument(help="Trace file (.gz is decompressed).", dir_okay=False, show_default=False)],
    fmt: OutputFormat = Format.human,
    trace_format: Annotated[
        str | None,
        typer.Option(help=f"Trace format: {_FORMATS_HELP} (default: detect from content).", show_default=False),
    ] = None,
    blocks: Annotated[
        list[int] | None,
        typer.Option(
            "--k-blocks",
            "-k",
            help="Prefix depth in blocks for the fan-out table (repeat; default: 1 16 64 256).",
            show_default=False,
        ),
    ] = None,
    windows_s: Annotated[
        list[float] | None,
        typer.Option(
            "--window-s",
            "-t",
            help="Window in seconds for the fan-out table (repeat; default: 1 10 60).",
            show_default=False,
        ),
    ] = None,
    event_min_requests: Annotated[int, typer.Option(help="Fan-out a prefix group needs to count as an event.")] = 8,
    prefix_blocks: Annotated[
        int | None,
        typer.Option(
            "--prefix-blocks", help="BTB Y for the verdict, in the trace's blocks (default: 256).", show_default=False
        ),
    ] = None,
    threshold: Annotated[
        int | None,
        typer.Option("--threshold", help="BTB X for the verdict (default: 2).", show_default=False),
    ] = None,
    btb_window_s: Annotated[
        float | None,
        typer.Option(
            "--btb-window-s",
            help="BTB Z for the verdict, seconds (default: 1.0; --window-s sets the fan-out table's windows).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Sizes, arrival rates, prefix fan-out (how many requests share >= k blocks within t seconds) and a verdict:
    does BTB fire on this trace with these constants, and if not, why and with which prefix_blocks it would."""
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.trace.audit import DEFAULT_KS, DEFAULT_WINDOWS_S, audit_trace, btb_verdict
    from btbctl.engine.trace.readers import read_trace

    out = Output(fmt)
    given = {"prefix_blocks": prefix_blocks, "threshold": threshold, "window_s": btb_window_s}
    consts = BtbConstants.parse({k: v for k, v in given.items() if v is not None}, where="btbctl trace audit")
    trace = read_trace(path, trace_format)
    report = audit_trace(
        trace,
        ks=tuple(blocks) if blocks else DEFAULT_KS,
        windows_s=tuple(windows_s) if windows_s else DEFAULT_WINDOWS_S,
        event_min_requests=event_min_requests,
    )
    verdict = btb_verdict(trace, consts.prefix_blocks, consts.threshold, consts.window_s)
    data = {"path": str(path), "format": trace.format, **report, "verdict": verdict}
    out.result(data, lambda d: _print_audit(out, d))


def _info_line(out: Output, text: str) -> None:
    """One diagnostic line on stderr, never wrapped (``Output.info`` wraps at the console width)."""
    from rich.markup import escape

    if not out.quiet:
        out.err_console.print(escape(text), soft_wrap=True)


def _num(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}"


def _print_audit(out: Output, d: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    c = out.console
    head = Table(title=escape(f"{d['path']} ({d['format']})"), show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_row("requests", _num(d["requests"]))
    head.add_row("span", f"{_num(d['span_s'])} s")
    head.add_row("block size", f"{d['block_tokens']} tokens")
    head.add_row("mean rate", f"{_num(d['rate_rps']['mean'], 2)} req/s")
    head.add_row("peak rate (1 s)", f"{d['rate_rps']['peak_1s']} req/s")
    for kind, n in d["kinds"].items():
        head.add_row(escape(f"kind {kind}"), _num(n))
    c.print(head)

    sizes = Table(title="tokens per request", title_justify="left")
    sizes.add_column("")
    for col in ("mean", "p50", "p95", "max"):
        sizes.add_column(col, justify="right")
    for name in ("input_tokens", "output_tokens"):
        s = d[name]
        sizes.add_row(name.split("_")[0], _num(s["mean"]), _num(s["p50"]), _num(s["p95"]), _num(s["max"]))
    c.print(sizes)

    fan = d["fan_out"]
    if fan:
        _print_fan_out(c, d, fan)
    _print_verdict(out, d["verdict"])


def _print_fan_out(c, d: dict, fan: list) -> None:
    from rich.table import Table

    windows = list(dict.fromkeys(e["window_s"] for e in fan))
    ks = list(dict.fromkeys(e["k_blocks"] for e in fan))
    cell = {(e["k_blocks"], e["window_s"]): e for e in fan}
    table = Table(
        title=f"fan-out: most requests sharing >= k blocks within t s (events: prefix groups reaching "
        f"{d['event_min_requests']})",
        title_justify="left",
    )
    table.add_column("k blocks", justify="right")
    table.add_column("tokens", justify="right")
    for t in windows:
        table.add_column(f"t = {t:g} s", justify="right")
    for k in ks:
        row = [str(k), _num(k * d["block_tokens"])]
        for t in windows:
            e = cell[(k, t)]
            events = e["events"]
            row.append(f"{e['max_requests']} ({plural(events, 'event')})" if events else str(e["max_requests"]))
        table.add_row(*row)
    c.print(table)


def _print_verdict(out: Output, v: dict) -> None:
    from rich.text import Text

    out.console.print(Text.assemble(("verdict: ", "bold"), (v["reason"], "green" if v["fires"] else "yellow")))
