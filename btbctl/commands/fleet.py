"""``btbctl up``, ``down`` and ``status``: start a fleet (workers + gateway) on this machine, stop it, look at it.

``up`` without ``-c`` starts the embedded default (4 emulated Llama-3.3-70B workers on 4 x H100 each, the BTB
gateway, all on loopback). In the foreground it stops everything on Ctrl-C; ``-d`` detaches and leaves the fleet
recorded in the run directory, where ``down``, ``status``, ``bench``, ``tune``, ``replicate`` and ``tui`` find it.
"""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.options import RUN_DIR_HELP, FleetOpt, OutputFormat, RunDirOpt
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural

__all__ = ["RUN_DIR_HELP", "SOURCE_WORDS", "count_cell", "kv_cell"]


#: How a table names where a worker's numbers come from (``metrics_source``).
SOURCE_WORDS = {"sglang_metrics": "sglang /metrics", "sglang_loads": "sglang /v1/loads", "modelled": "modelled"}


def kv_cell(w: dict) -> str:
    """A worker's KV cache for a table, in tokens: ``used+cached/size`` (``0+5648/8192``: held by running requests,
    cached prefixes, capacity), ``used/size`` when it reports no cached part, ``-`` when unknown."""
    used, cached, cap = w.get("kv_used_tokens"), w.get("kv_cached_tokens"), w.get("kv_capacity_tokens")
    if cap is None:
        return "-"
    head = "-" if used is None else str(used)
    return f"{head}+{cached}/{cap}" if cached is not None else f"{head}/{cap}"


def count_cell(v: int | None) -> str:
    """A count for a table, ``-`` when the worker does not report it."""
    return "-" if v is None else str(v)


#: The columns of the status table before its note, and the optional ones, dropped last first on a narrow console.
STATUS_COLUMNS = (
    "name",
    "host",
    "url",
    "healthy",
    "process",
    "in flight",
    "copies",
    "KV used+cached/size",
    "host tier",
)
STATUS_COLUMNS += ("numbers",)
STATUS_OPTIONAL = ("KV used+cached/size", "host tier", "numbers")
#: Cells the status table keeps for its note when it decides which optional columns fit.
NOTE_MIN_WIDTH = 12


def _fitting(width: int, rows: list[dict], cols: tuple[str, ...], optional: tuple[str, ...]) -> tuple[str, ...]:
    """``cols`` less as many of ``optional`` (the last one first) as needed for the table to fit ``width`` cells
    without cutting a cell (two cells between columns, and room for a note)."""
    from rich.text import Text

    def need(col: str) -> int:
        return max([len(col), *(Text.from_markup(r[col]).cell_len for r in rows)])

    keep = list(cols)
    for drop in (None, *reversed(optional)):
        if drop is not None:
            keep.remove(drop)
        if sum(need(c) + 2 for c in keep) + NOTE_MIN_WIDTH <= width:
            break
    return tuple(keep)


def _render_status(out: Output, st: dict) -> None:
    from rich.markup import escape
    from rich.table import Table

    c = out.console
    gw = st.get("gateway") or {}
    state = "up" if gw.get("reachable") else ("process running, API not answering" if gw.get("alive") else "down")
    c.print(f"gateway {st.get('gateway_url') or '-'} ({state}), policy {st.get('policy') or '-'}")
    c.print(f"control {st.get('control_url') or '-'}")
    for g in (st.get("gateways") or [])[1:]:  # [gateway] replicas
        gstate = "up" if g.get("reachable") else ("process running, API not answering" if g.get("alive") else "down")
        c.print(f"{g['name']} {g.get('url') or '-'} ({gstate}), control {g.get('control_url') or '-'}")
    rows = [
        {
            "name": w["name"],
            "host": w.get("host") or "local",
            "url": w["url"] or "-",
            "healthy": "yes" if w["healthy"] else "[red]no[/red]",
            "process": f"pid {w['pid']}" if w["alive"] else f"[red]{w.get('exit') or 'exited'}[/red]",
            "in flight": "-" if w.get("inflight") is None else str(w["inflight"]),
            "copies": w.get("replication") or "-",
            "KV used+cached/size": kv_cell(w),
            "host tier": count_cell(w.get("host_tier_tokens")),
            "numbers": SOURCE_WORDS.get(w.get("metrics_source") or "", "-"),
            "note": w.get("health_error") or "",
            "metrics note": w.get("metrics_note") or "",
        }
        for w in st["workers"]
    ]
    cols = _fitting(c.width, rows, STATUS_COLUMNS, STATUS_OPTIONAL)
    t = Table(box=None, pad_edge=False)
    for col in (*cols, "note"):
        # URLs and names are never cut (a script or a reader copies them): the worker's own numbers are left out
        # on a console too narrow for them, and the note folds
        t.add_column(col, no_wrap=col != "note", overflow="fold", min_width=min(len(col), 9))
    for r in rows:
        note = r["note"] or (r["metrics note"] if "KV used+cached/size" in cols else "")
        t.add_row(*(r[col] for col in cols), note)
    c.print(t)
    for a in st.get("agents") or []:
        alive = f"pid {a['pid']}" if a["alive"] else "[red]exited[/red]"
        bad = f", [red]{escape(a['problem'])}[/red]" if a.get("problem") and a["alive"] else ""
        c.print(
            f"{a['name']} on {a['host']}: control {a['control_url'] or '-'}, peer {a['peer'] or '-'}, {alive}{bad}",
            soft_wrap=True,
        )
    c.print(f"run directory {st['run_dir']}")
    verdict = st.get("verdict")
    if verdict and verdict != "up":
        c.print(f"[red]{verdict}[/red]: {'; '.join(st.get('problems') or [])}")


@app.command("up")
def up(
    config: Annotated[
        str | None,
        typer.Option(
            "-c", "--config", metavar="FILE", help="Cluster file (TOML; default: the embedded 4-worker fleet)."
        ),
    ] = None,
    detach: Annotated[bool, typer.Option("-d", "--detach", help="Start in the background and return.")] = False,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy", help="Routing policy instead of the cluster file's (btb, cache_aware, least_load, ...)."
        ),
    ] = None,
    port: Annotated[
        int | None,
        typer.Option("--port", help="Gateway data-plane port instead of the cluster file's (0 = a free port)."),
    ] = None,
    control_port: Annotated[
        int | None,
        typer.Option("--control-port", help="Control-API port instead of the cluster file's (0 = a free port)."),
    ] = None,
    keep_partial: Annotated[
        bool,
        typer.Option(
            "--keep-partial",
            help="If a worker fails to start, leave the others running (stop them with `btbctl "
            "down`) instead of stopping everything.",
        ),
    ] = False,
    gateway_only: Annotated[
        bool,
        typer.Option(
            "--gateway-only",
            help="Restart only the gateway in front of the workers recorded in the run directory (after it died; "
            "the workers keep their caches). Same settings, ports and tokens; the last `tune` is reapplied.",
        ),
    ] = False,
    fmt: OutputFormat = Format.human,
) -> None:
    """Start workers and the gateway; Ctrl-C stops them (with -d: run in the background, stop with `btbctl down`).

    Fixed ports (the gateway's, and workers' with a fixed port) are checked before anything starts."""
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.cluster import default_cluster, load_cluster
    from btbctl.engine.launcher.rundir import RunDir, fleet_name

    out = Output(fmt)
    if gateway_only:
        given = [
            n
            for n, v in (("-c", config), ("--policy", policy), ("--port", port), ("--control-port", control_port))
            if v is not None
        ]
        if given:
            raise BtbctlError(f"--gateway-only reuses the recorded settings; drop {', '.join(given)}")
        rd = RunDir(run_dir)
        fleet.up_gateway_only(rd, log=out.info)
        out.result(fleet.status(rd), lambda d: _render_status(out, d))
        return
    for name, value in (("--port", port), ("--control-port", control_port)):
        if value is not None and not 0 <= value <= 65535:
            raise BtbctlError(f"{name} must be in 0..65535, got {value}")
    cluster = load_cluster(config) if config else default_cluster()
    rd = RunDir(run_dir)

    def _term(_signum, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    try:
        state, started = fleet.up(
            cluster,
            rd,
            detach=detach,
            policy=policy,
            port=port,
            control_port=control_port,
            cluster_path=config,
            log=out.info,
            keep_partial=keep_partial,
            pick_free_ports=run_dir is None and fleet_name() is not None,
        )
        if detach:
            out.result(fleet.status(rd), lambda d: _render_status(out, d))
            out.info(f"running in the background; stop it with `btbctl down{rd.selector()}`")
            return
        interrupted = False
        try:  # a Ctrl-C before supervise() starts watching must still stop what up started
            out.result(fleet.status(rd), lambda d: _render_status(out, d))
            out.info("press Ctrl-C to stop the fleet; detector fires, copies, control writes and worker health follow")
        except KeyboardInterrupt:
            interrupted = True
            out.info("stopping the fleet")
        fleet.supervise(rd, state, started, log=out.info, should_stop=(lambda: True) if interrupted else None)
    finally:
        signal.signal(signal.SIGTERM, old)


@app.command("rm")
def rm(
    names: Annotated[
        list[str],
        typer.Argument(
            metavar="NAME...", help="Names of stopped fleets, as `btbctl ls` lists them.", show_default=False
        ),
    ],
) -> None:
    """Forget stopped fleets: remove their run directories (logs, tuning, records); a running one is refused."""
    from btbctl.engine.launcher.fleet import remove_fleet

    out = Output(Format.human)
    for name in names:
        out.console.print(f"removed fleet {name} ({remove_fleet(name)})", soft_wrap=True)


@app.command("ls")
def ls(
    fmt: OutputFormat = Format.human,
) -> None:
    """List the fleets (run directories under the user state directory's runs folder): name, state, gateway and
    control URLs, run directory.

    state: running (every recorded process alive), degraded (some), stopped (none; its logs and tuning remain:
    `btbctl rm NAME` forgets it), unreadable (a damaged state.json). A fleet started with --run-dir
    elsewhere is not listed."""
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.rundir import runs_root

    out = Output(fmt)
    rows = fleet.list_fleets()

    def human(d: dict) -> None:
        from rich.table import Table

        if not d["fleets"]:
            out.console.print(f"no fleets under {d['root']}; start one with `btbctl up` (or `btbctl up --fleet NAME`)")
            return
        t = Table(box=None, pad_edge=False)
        for col in ("name", "state", "gateway", "control", "run directory"):
            t.add_column(col, no_wrap=True)
        for r in d["fleets"]:
            colour = {"running": "green", "degraded": "yellow"}.get(r["state"], "dim")
            t.add_row(
                r["name"],
                f"[{colour}]{r['state']}[/{colour}]",
                r["gateway_url"] or "-",
                r["control_url"] or "-",
                r["run_dir"],
            )
        out.console.print(t)

    out.result({"root": str(runs_root()), "fleets": rows}, human)


@app.command("down")
def down(
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    grace_s: Annotated[
        float, typer.Option("--grace-s", help="Seconds between SIGTERM and SIGKILL for each process group.")
    ] = 10.0,
    fmt: OutputFormat = Format.human,
) -> None:
    """Stop exactly the processes `btbctl up` started (gateway first, then workers)."""
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.rundir import RunDir

    out = Output(fmt)
    res = fleet.down(RunDir(run_dir), grace_s=grace_s, log=out.info)

    def human(d: dict) -> None:
        if d.get("nothing"):
            out.console.print(f"nothing to stop: no fleet is recorded in {d['run_dir']}")
            return
        parts = [f"{k} {', '.join(d[k])}" for k in ("stopped", "killed", "gone", "unreachable") if d.get(k)]
        out.console.print("; ".join(parts) if parts else "nothing was running")

    out.result(res, human)
    if res.get("unreachable"):
        from btbctl.engine.errors import BtbctlError

        raise BtbctlError(
            f"could not reach {plural(len(res['unreachable']), 'worker')}, still recorded for another "
            f"`btbctl down`: " + "; ".join(res["errors"])
        )


@app.command("status")
def status(
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Show the running fleet: gateway and control URLs, and each worker's health.

    Exit status (like `docker compose ps --status` scripts and `kubectl wait` expect): 0 every process is up and
    the gateway answers; 1 degraded (the gateway or a worker or agent is down or unhealthy; the table says which);
    2 no fleet is recorded, or the run directory cannot be read."""
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.rundir import RunDir

    out = Output(fmt)
    st = fleet.status(RunDir(run_dir))
    out.result(st, lambda d: _render_status(out, d))
    if st.get("verdict") != "up":
        raise typer.Exit(1)


@app.command("restart")
def restart(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The process: worker-0 ..., agent-local, or gateway.")],
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    grace_s: Annotated[
        float, typer.Option("--grace-s", help="Seconds between SIGTERM and SIGKILL for its process group.")
    ] = 10.0,
    timeout_s: Annotated[
        float | None,
        typer.Option("--timeout-s", help="Seconds it has to become ready again (default: the cluster file's)."),
    ] = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Restart one worker, node agent or the gateway of a detached fleet in place, keeping the others (and their
    caches) running: same command line, environment and ports; the gateway keeps its tokens and tuned settings."""
    from btbctl.engine.launcher.restart import restart as restart_one
    from btbctl.engine.launcher.rundir import RunDir

    out = Output(fmt)
    res = restart_one(RunDir(run_dir), name, grace_s=grace_s, timeout_s=timeout_s, log=out.info)
    out.result(res, lambda d: out.console.print(f"restarted {d['name']} (pid {d['old_pid']} -> {d['pid']})"))
