"""``btbctl bench``: replay a trace against an SGLang-compatible endpoint at its arrival times and report the
client-side TTFT (table or stable JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.options import FleetOpt, OutputFormat, RunDirOpt
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import human_bytes, plural


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def _render(out: Output, d: dict, names: dict[str, str] | None = None) -> None:
    """The human report of ``d`` (the JSON result); workers by their names (``names``: URL -> name, from the
    fleet's control API) as ``status`` shows them, by URL where no name is known."""
    from rich.table import Table

    names = names or {}

    c = out.console
    c.print(
        f"{plural(d['requests'], 'request')} to {d['target']} ({d['endpoint']}): {d['ok']} ok, "
        f"{plural(d['errors'], 'error')}"
        + (f" ({', '.join(f'{k}: {v}' for k, v in d['errors_by_status'].items())})" if d["errors"] else "")
        + f", {d['duration_s']:.2f} s"
    )
    t = Table(box=None, pad_edge=False)
    t.add_column("ms")
    for k in ("mean", "p50", "p95", "p99", "max"):
        t.add_column(k, justify="right")
    t.add_row("TTFT", *(_ms(d["ttft_s"][k]) for k in ("mean", "p50", "p95", "p99", "max")))
    t.add_row("e2e", *(_ms(d["e2e_s"][k]) for k in ("mean", "p50", "p95", "p99", "max")))
    c.print(t)
    if d["by_worker"]:
        w = Table(box=None, pad_edge=False)
        w.add_column("worker")
        w.add_column("requests", justify="right")
        for url, n in d["by_worker"].items():
            w.add_row(names.get(url, url), str(n))
        c.print(w)
    if d.get("cached_fraction") is not None:
        c.print(
            f"prompt tokens served from cache: {d['cached_fraction']:.1%} "
            f"({d['cached_tokens']:,} of {d['served_prompt_tokens']:,}, as the server counted them)"
        )
    if d.get("copies"):
        cp = Table(box=None, pad_edge=False)
        for col in ("copy", "source", "target", "state", "bytes", "seconds", "proof (L3 tokens)"):
            cp.add_column(col)
        for x in d["copies"]:
            proof = "-" if x.get("proof_storage_tokens") is None else str(x["proof_storage_tokens"])
            secs = "-" if x.get("duration_s") is None else f"{x['duration_s']:.3f}"
            cp.add_row(
                x["copy_id"][:8],
                names.get(x["source"], x["source"]),
                names.get(x["target"], x["target"]),
                x["state"],
                human_bytes(x["bytes"]),
                secs,
                proof,
            )
        c.print(cp)


def _transfers(control_url: str | None):
    """The gateway's ``GET /control/transfers`` answer (the latest 200 copies), or None."""
    if control_url is None:
        return None
    from btbctl.engine.control.client import ControlClient
    from btbctl.engine.errors import BtbctlError

    try:
        with ControlClient(control_url, timeout_s=3.0) as api:
            return api.transfers(limit=200).model_dump(mode="json")
    except BtbctlError:
        return None


def _names_at(control_url: str | None) -> dict[str, str]:
    """Each worker's name by its URL (``GET /control/fleet``); empty without a control API that answers."""
    if control_url is None:
        return {}
    from btbctl.commands.steer import _fleet_or_none, _worker_names
    from btbctl.engine.control.client import ControlClient
    from btbctl.engine.errors import BtbctlError

    try:
        with ControlClient(control_url, timeout_s=3.0) as api:
            return _worker_names(_fleet_or_none(api))
    except BtbctlError:  # not a URL the client takes
        return {}


def _served(control_url: str | None):
    """The gateway's per-worker ``served`` counters, or None (no control API known, or it does not answer)."""
    if control_url is None:
        return None
    from btbctl.engine.control.client import ControlClient
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.bench import served_counts

    try:
        with ControlClient(control_url, timeout_s=3.0) as api:
            return served_counts(api.fleet().model_dump(mode="json"))
    except BtbctlError:
        return None


#: Tokens per block of the default burst (``--prefix-blocks`` counts these).
BENCH_BLOCK_TOKENS = 256


def _constants(control_url: str) -> dict | None:
    """The gateway's ``GET /control/constants`` answer, or None when it does not answer."""
    from btbctl.engine.control.client import ControlClient
    from btbctl.engine.errors import BtbctlError

    try:
        with ControlClient(control_url, timeout_s=3.0) as api:
            return api.constants().model_dump(mode="json")
    except BtbctlError:
        return None


@app.command("bench")
def bench(
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            metavar="FILE",
            dir_okay=False,
            help="Trace to replay (default: one generated burst, see --burst-size).",
        ),
    ] = None,
    trace_format: Annotated[
        str | None, typer.Option("--trace-format", help="mooncake, btb-mixed-trace-v1 or azure2023 (default: detect).")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            "--target", metavar="URL", help="SGLang-compatible endpoint (default: the running fleet's gateway)."
        ),
    ] = None,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    time_scale: Annotated[
        float, typer.Option("--time-scale", help="Trace seconds per wall second (10 replays ten times faster).")
    ] = 1.0,
    max_requests: Annotated[
        int | None, typer.Option("--max-requests", help="Send only the first N requests (default: all).")
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option("--concurrency", help="Most requests in flight at once (default: no limit).")
    ] = None,
    endpoint: Annotated[
        str, typer.Option("--endpoint", help="generate (POST /generate) or completions (POST /v1/completions).")
    ] = "generate",
    prompt: Annotated[
        str,
        typer.Option("--prompt", help="Send synthesised text, or ids (input_ids) for servers with a real tokenizer."),
    ] = "text",
    model: Annotated[
        str | None,
        typer.Option("--model", help="Model name for --endpoint completions (default: the endpoint's first model)."),
    ] = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Per-request limit, seconds.")] = 300.0,
    burst_size: Annotated[int, typer.Option("--burst-size", help="Generated trace: requests in the burst.")] = 64,
    prefix_blocks: Annotated[
        int,
        typer.Option(
            "--prefix-blocks", help="Generated trace: shared prefix in 256-token blocks (256 = 65,536 tokens)."
        ),
    ] = 256,
    spread_s: Annotated[
        float, typer.Option("--spread-s", help="Generated trace: seconds over which the burst arrives.")
    ] = 1.0,
    seed: Annotated[
        int | None,
        typer.Option(
            "--seed", help="Generated trace: random seed (default: 42; refused with --trace, which fixes the requests)."
        ),
    ] = None,
    requests_out: Annotated[
        Path | None,
        typer.Option("--requests-out", metavar="FILE", dir_okay=False, help="Write one JSON line per request."),
    ] = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Replay a trace against an SGLang-compatible endpoint and report client-side TTFT."""
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.bench import (
        BenchOptions,
        copies_during,
        default_burst_trace,
        replay,
        select_requests,
        served_delta,
        short_prefix_warning,
        write_results_jsonl,
    )
    from btbctl.engine.launcher.rundir import RunDir

    out = Output(fmt)
    if trace is not None:
        from btbctl.engine.trace.readers import read_trace

        if seed is not None:
            raise BtbctlError("--seed shapes the default trace only; with --trace the requests come from the file")

        tr = read_trace(trace, trace_format)
    else:
        if burst_size < 1 or prefix_blocks < 1 or spread_s < 0:
            raise BtbctlError("--burst-size and --prefix-blocks must be >= 1 and --spread-s >= 0")
        tr = default_burst_trace(
            seed=42 if seed is None else seed,
            burst_size=burst_size,
            prefix_blocks=prefix_blocks,
            spread_s=spread_s,
            block_tokens=BENCH_BLOCK_TOKENS,
        )
    control = None
    if target is None:
        state = RunDir(run_dir).live_state()
        if not state.gateway_url:
            raise BtbctlError("the recorded fleet has no gateway URL yet (still starting?); pass --target")
        target = state.gateway_url
        control = state.control_url
    else:
        state = RunDir(run_dir).load()
        if state is not None and state.gateway_url and state.gateway_url.rstrip("/") == target.rstrip("/"):
            control = state.control_url
    opts = BenchOptions(
        target=target,
        time_scale=time_scale,
        max_requests=max_requests,
        concurrency=concurrency,
        endpoint=endpoint,
        prompt_mode=prompt,
        model=model,
        timeout_s=timeout_s,
    )
    opts.check()
    if requests_out is not None:  # fail before the replay, not after it
        try:
            with open(requests_out, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise BtbctlError(f"--requests-out: cannot write {requests_out}: {e.strerror or e}") from None
    if trace is None and control is not None:
        why = short_prefix_warning(prefix_blocks, BENCH_BLOCK_TOKENS, _constants(control))
        if why:
            out.warn(why)
    chosen = select_requests(tr, max_requests)
    n = len(chosen)
    span = (chosen[-1].arrival_s - chosen[0].arrival_s) if chosen else 0.0
    out.info(f"replaying {plural(n, 'request')} over {span / time_scale:.2f} s against {target}")
    before = _served(control)
    copies_before = _transfers(control)
    with out.progress("requests", n) as advance:
        report = replay(tr, opts, on_result=lambda _r: advance(1))
    report.served_by = served_delta(before, _served(control))
    report.copies = copies_during(copies_before, _transfers(control))
    if requests_out is not None:
        try:
            write_results_jsonl(report.results, requests_out)
        except OSError as e:
            raise BtbctlError(f"--requests-out: cannot write {requests_out}: {e.strerror or e}") from None
    data = report.as_dict()
    names = _names_at(control) if out.format is Format.human else {}
    out.result(data, lambda d: _render(out, d, names))
    if data["requests"] and data["errors"] == data["requests"]:
        raise BtbctlError(f"every request failed ({data['errors']} of {data['requests']}); is {target} serving?")
