"""``btbctl tune``, ``btbctl replicate``, ``btbctl prewarm``, ``btbctl prefixes`` and ``btbctl flush``: look at and
steer a running fleet through its control API."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.fleet import SOURCE_WORDS, count_cell, kv_cell
from btbctl.commands.options import FleetOpt, OutputFormat, RunDirOpt
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import human_bytes, plural


class PromptKind(str, enum.Enum):
    """How ``btbctl prewarm`` reads its prompt file."""

    auto = "auto"
    text = "text"
    chat = "chat"
    ids = "ids"


def copy_size(moved: int, modelled: float | None, scale: int | None, copies: int = 1) -> str:
    """What the copies weigh, all of them together: the modelled KV size of the prefix when known, and what really
    moved when an emulated worker scaled the bytes down (``--kv-bytes-scale``), e.g. ``1.34 GB modelled (20.5 kB
    moved, KV bytes scaled 1/65,536)``; ``in all`` after the size when ``copies`` is more than one."""
    all_ = " in all" if copies > 1 else ""
    if modelled is None:
        return f"{human_bytes(moved)} copied{all_}"
    if scale is not None and scale > 1:
        return f"{human_bytes(modelled)} modelled{all_} ({human_bytes(moved)} moved, KV bytes scaled 1/{scale:,})"
    return f"{human_bytes(modelled)} copied{all_}"


def _modelled(fleet, res: dict) -> tuple[float | None, int | None]:
    """``(modelled KV bytes of the copies that arrived, the workers' KV byte scale)`` from the fleet's
    ``/btb/info`` figures (``fleet``: :func:`_fleet_or_none`; None, None when the workers do not report them, e.g.
    real SGLang servers, or the fleet could not be read)."""
    if fleet is None:
        return None, None
    by_url = {w.url: w for w in fleet.workers}
    total = 0.0
    scale = None
    for row in res.get("copies") or []:
        if row.get("state") != "done":
            continue
        w = by_url.get(row.get("target") or "") or by_url.get(row.get("source") or "")
        if w is None or w.kv_bytes_per_token is None:
            return None, None
        total += (row.get("prefix_blocks") or 0) * fleet.page_size * w.kv_bytes_per_token
        scale = w.kv_bytes_scale if w.kv_bytes_scale is not None else scale
    return (total if total > 0 else None), scale


@app.command("tune")
def tune(
    settings: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="KEY=VALUE...",
            help="prefix_blocks=N threshold=N window_s=SECONDS warm_replicas=N policy=NAME (none: show the current "
            "ones; replicas= is the old spelling of warm_replicas).",
            show_default=False,
        ),
    ] = None,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Change BTB's constants or the routing policy of the running fleet, without a restart."""
    from btbctl.engine.control.steering import parse_tune_args
    from btbctl.engine.launcher.control import client_for_run

    out = Output(fmt)
    updates = parse_tune_args(settings or [])
    with client_for_run(run_dir, token=bool(updates)) as api:
        if updates:
            _warn_replicas(out, api, updates)
            answer = api.set_constants(updates)  # the gateway records it in tuned.json, or undoes it
        else:
            answer = api.constants()
    res = answer.model_dump(mode="json")

    def human(d: dict) -> None:
        c = d.get("constants", {})
        out.console.print(
            f"policy {d.get('policy')}  prefix_blocks {c.get('prefix_blocks')}  "
            f"threshold {c.get('threshold')}  window_s {c.get('window_s')}  "
            f"warm_replicas {c.get('warm_replicas')}"
            + (f"  ({plural(d['prefix_tokens'], 'token')} per prefix)" if d.get("prefix_tokens") else "")
        )

    if updates:
        out.info("the gateway now holds:")
    out.result(res, human)


def _warn_replicas(out: Output, api, updates: dict) -> None:
    """A warning line when ``warm_replicas`` asks for more workers than the fleet has (accepted: the policy then
    replicates to every other worker, and the fleet may grow)."""
    from btbctl.engine.constants import WARM_REPLICAS_ALIAS

    want = updates.get("warm_replicas", updates.get(WARM_REPLICAS_ALIAS))
    if want is None:
        return
    try:
        n = len(api.fleet().workers)
    except Exception:  # noqa: BLE001 - the warning is best effort; the write below reports real errors
        return
    try:
        want_n = int(want)
    except (TypeError, ValueError):
        return
    if want_n > n:
        out.warn(
            f"warm_replicas={want_n} is more than the {plural(n, 'worker')} of this fleet; a hot prefix can be on at "
            f"most {n}"
        )


#: The exit statuses of ``replicate`` and ``prewarm``, for their help.
COPY_EXIT_HELP = (
    "Exit status: 0 every copy arrived, or nothing to copy (every eligible worker already holds the prefix: "
    '"already held by N workers: ..."); 1 not every copy arrived (failed, partial or timed out); 2 a user error '
    "or a refusal (an unknown or ambiguous prefix, a bad option, no running fleet, no worker holding the prefix, "
    "every free worker refusing the copy)."
)
REPLICAS_HELP = "How many more workers should receive a copy."


def _fleet_or_none(api):
    """The fleet (``GET /control/fleet``), read once per command for the workers' names and the copies' modelled
    size; None when it cannot be read (both are extra: URLs stand in for names, and the size note is left out)."""
    try:
        return api.fleet()
    except Exception:  # noqa: BLE001 - names and sizes are extra; the command's result stands without them
        return None


def _worker_names(fleet) -> dict[str, str]:
    """``{worker URL: name}`` of ``fleet`` (:func:`_fleet_or_none`), as `btbctl status` and the dashboard name them
    (empty without a fleet)."""
    return {w.url: w.name for w in fleet.workers} if fleet is not None else {}


def _copy_progress(out: Output, names: dict[str, str]) -> Callable[[list[dict]], None]:
    """Progress lines (stderr) for the copies' rows, as ``btbctl replicate`` and ``btbctl prewarm`` print them, with
    workers by name (``names``: :func:`_worker_names`)."""

    def progress(rows: list[dict]) -> None:
        for r in rows:
            total = r.get("bytes_total") or 0
            pct = f" {100 * (r.get('bytes_sent') or 0) / total:.0f}%" if total else ""
            err = f": {r['error']}" if r.get("error") else ""
            target = r.get("target", "?")
            out.info(
                f"copy {r.get('copy_id')} -> {names.get(target, target)}: {r.get('state')}{pct} "
                f"({human_bytes(r.get('bytes_sent'))}){err}"
            )

    return progress


def _tracked_blocks(api) -> int:
    """The gateway's ``prefix_blocks`` (how long a prefix the detector tracks), 0 when it cannot be read."""
    try:
        return api.constants().constants.prefix_blocks
    except Exception:  # noqa: BLE001 - the note is extra
        return 0


def _copy_result(out: Output, fleet, res: dict, names: dict[str, str]) -> None:
    """Print a replicate's (or prewarm's) result and exit as :data:`COPY_EXIT_HELP` says (prefix ids as `btbctl
    prefixes` shows them; the JSON keeps the full ones)."""
    from btbctl.engine.chains import short_id
    from btbctl.engine.control.steering import HELD

    res["modelled_bytes"], res["kv_bytes_scale"] = _modelled(fleet, res)
    res["holder_names"] = [names.get(u, u) for u in res.get("holders") or []]

    def human(d: dict) -> None:
        if d["status"] == HELD:
            held = d["holder_names"]
            out.console.print(
                f"prefix {short_id(d['prefix'])} already held by {len(held)} workers: {', '.join(held)}", soft_wrap=True
            )
            return
        size = copy_size(d["bytes"], d.get("modelled_bytes"), d.get("kv_bytes_scale"), len(d["targets"]))
        out.console.print(
            f"prefix {short_id(d['prefix'])} from {names.get(d['source'], d['source'])} to "
            f"{plural(len(d['targets']), 'worker')}: {d['status']}, {size}",
            soft_wrap=True,
        )
        for url in d["targets"]:
            out.console.print(f"  {names.get(url, url)}", soft_wrap=True)
        if d.get("skipped"):
            out.console.print(f"  ({d['skipped']} fewer than asked: no other eligible worker)", soft_wrap=True)

    out.result(res, human)
    if res["status"] not in ("done", HELD):
        raise typer.Exit(1)


@app.command("replicate", epilog=COPY_EXIT_HELP)
def replicate(
    prefix: Annotated[
        str,
        typer.Option(
            "--prefix",
            metavar="HASH",
            help="Prefix id (or at least 8 leading hex digits of it), as `btbctl tui` and "
            "GET /control/prefixes show it.",
            show_default=False,
        ),
    ],
    n: Annotated[int, typer.Option("-n", "--replicas", help=REPLICAS_HELP)] = 1,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Longest wait for the copies, seconds.")] = 120.0,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Copy one prefix's KV cache to N more workers now; progress on stderr, the result on stdout."""
    from btbctl.engine.control.steering import replicate_and_wait
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.control import client_for_run

    out = Output(fmt)
    if not timeout_s > 0:
        raise BtbctlError(f"--timeout-s must be > 0, got {timeout_s}")
    with client_for_run(run_dir) as api:
        fleet = _fleet_or_none(api)
        names = _worker_names(fleet)
        res = replicate_and_wait(api, prefix, n, timeout_s=timeout_s, on_progress=_copy_progress(out, names))
        _copy_result(out, fleet, res, names)


@app.command("prewarm", epilog=COPY_EXIT_HELP)
def prewarm(
    prompt_file: Annotated[
        str,
        typer.Argument(
            metavar="PROMPT_FILE",
            help="The prompt: a file, or - for stdin. Plain text, or JSON: a chat (a list of messages, or an object "
            'with "messages"), token ids (a list of integers, or an object with "input_ids") or {"text": ...}.',
            show_default=False,
        ),
    ],
    n: Annotated[int, typer.Option("-n", "--replicas", help=REPLICAS_HELP)] = 1,
    kind: Annotated[
        PromptKind,
        typer.Option("--as", help="Read the prompt as: auto (JSON shapes above, else text), text, chat or ids."),
    ] = PromptKind.auto,
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", help="Longest wait for the computation, then for the copies, seconds.")
    ] = 330.0,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Keep a prompt warm before its batch starts: one worker computes it (the routing policy's choice), then its KV
    cache is copied to N more workers, as `replicate` does; progress on stderr, the result on stdout."""
    from btbctl.engine.chains import short_id
    from btbctl.engine.control.steering import check_replicas, follow_copies, read_prompt
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.control import client_for_run

    out = Output(fmt)
    if not timeout_s > 0:
        raise BtbctlError(f"--timeout-s must be > 0, got {timeout_s}")
    check_replicas(n)
    prompt = read_prompt(prompt_file, kind.value)
    with client_for_run(run_dir) as api:
        started = api.prewarm(**prompt, n=n, timeout_s=timeout_s)
        fleet = _fleet_or_none(api)
        names = _worker_names(fleet)
        computed = names.get(started.computed_by, started.computed_by or "a worker")
        out.info(
            f"computed {started.prompt_tokens} tokens ({started.prefix_blocks} blocks) on {computed}; "
            f"prefix {short_id(started.prefix)}"
            + (
                f" (btbctl prefixes tracks it as {short_id(started.hot_prefix)}: its first {plural(y, 'block')})"
                if started.hot_prefix and started.hot_prefix != started.prefix and (y := _tracked_blocks(api))
                else ""
            )
        )
        res = follow_copies(api, started, timeout_s=timeout_s, on_progress=_copy_progress(out, names))
        res.update(
            computed_by=started.computed_by, prompt_tokens=started.prompt_tokens, prefix_blocks=started.prefix_blocks
        )
        _copy_result(out, fleet, res, names)


@app.command("prefixes")
def prefixes(
    top: Annotated[int, typer.Option("--top", help="How many prefixes (most arrivals in the window first).")] = 10,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """List the hot prefixes the gateway tracks, with ids `btbctl replicate --prefix` takes."""
    from btbctl.engine.chains import short_id
    from btbctl.engine.control.schema import WORKER_NUMBERS
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher.control import client_for_run

    out = Output(fmt)
    if not 1 <= top <= 1000:
        raise BtbctlError(f"--top must be in 1..1000, got {top}")
    with client_for_run(run_dir, token=False) as api:
        res = api.prefixes(top).model_dump(mode="json")
        fleet = api.fleet()
    names = {w.url: w.name for w in fleet.workers}
    # where the prefixes are cached: each worker's own numbers (SGLang's /metrics, or the emulated worker's model)
    keys = set(WORKER_NUMBERS)
    res["workers"] = [{"name": w.name, "url": w.url, **w.model_dump(include=keys)} for w in fleet.workers]

    def human(d: dict) -> None:
        from rich.table import Table

        out.console.print(
            f"prefix {plural(d['prefix_blocks'], 'block')} ({plural(d['prefix_tokens'], 'token')}); hot at "
            f"{plural(d['threshold'], 'arrival')} "
            f"within {d['window_s']:g} s"
        )
        if not d["prefixes"]:
            out.console.print("no prefix tracked yet (prompts shorter than prefix_blocks are not tracked)")
            return
        t = Table(box=None, pad_edge=False)
        for col in ("id", "hot", "in window", "total", "fires", "holders", "copying"):
            t.add_column(col, no_wrap=True)
        for p in d["prefixes"]:
            t.add_row(
                short_id(p["id"]),
                "yes" if p["hot"] else "no",
                str(p["arrivals_in_window"]),
                str(p["total_arrivals"]),
                str(p["fires"]),
                ", ".join(names.get(u, u) for u in p["holders"]) or "-",
                str(p["copies_in_flight"]),
            )
        out.console.print(t)

    def cache(d: dict) -> None:
        from rich.table import Table

        title = "KV cache per worker, tokens (KV: used by running requests + cached / size)"
        t = Table(box=None, pad_edge=False, title=title, title_justify="left")
        widest = {
            "worker": max((len(w["name"]) for w in d["workers"]), default=6),
            "KV": max((len(kv_cell(w)) for w in d["workers"]), default=2),
        }
        # worker names and the KV cell are never cut; the other headers wrap on a narrow console
        t.add_column("worker", no_wrap=True, min_width=widest["worker"])
        t.add_column("KV", justify="right", no_wrap=True, min_width=widest["KV"])
        for col in ("host tier", "L3 hits", "L3 read", "L3 written", "loaded back"):
            t.add_column(col, justify="right", overflow="fold")
        t.add_column("numbers", overflow="fold")
        for w in d["workers"]:
            t.add_row(
                w["name"],
                kv_cell(w),
                count_cell(w["host_tier_tokens"]),
                count_cell(w["storage_hit_tokens_total"]),
                count_cell(w["storage_prefetched_tokens_total"]),
                count_cell(w["storage_backup_tokens_total"]),
                count_cell(w["load_back_tokens_total"]),
                SOURCE_WORDS.get(w["metrics_source"] or "", "-"),
            )
        out.console.print(t)

    def both(d: dict) -> None:
        human(d)
        cache(d)

    out.result(res, both)


@app.command("flush")
def flush(
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Empty every worker's KV cache and the gateway's records of them (prefix tree, holdings, detector), for instance
    between the two runs of an A/B bench; exit status 1 when a worker did not flush (busy: try again)."""
    from btbctl.engine.launcher.control import client_for_run

    out = Output(fmt)
    with client_for_run(run_dir) as api:
        res = api.flush().model_dump(mode="json")

    def human(d: dict) -> None:
        out.console.print(f"flushed {d['flushed']} of {plural(len(d['workers']), 'worker')}")
        for name, result in d["workers"].items():
            if result != "flushed":
                out.console.print(f"  {name}: {result}")

    out.result(res, human)
    if res["flushed"] != len(res["workers"]):
        raise typer.Exit(1)
