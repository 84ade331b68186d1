"""``btbctl logs [NAME]``: a fleet process's log (the gateway's is its operations log); for a worker on another
host, fetched over SSH first. The logs stay in the run directory after ``down``; the next ``up`` moves them to
``logs.previous`` (``--previous`` reads them)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.options import FleetOpt, OutputFormat, RunDirOpt
from btbctl.commands.output import Format


@app.command("logs")
def logs(
    name: Annotated[
        str | None,
        typer.Argument(
            metavar="NAME",
            help="Log name: gateway (one line per event: control writes, detector fires, copies, errors, health), "
            "worker-0, ... (an emulated worker's: one line per request), gateway.out (the gateway's own output). "
            "None: list the names.",
            show_default=False,
        ),
    ] = None,
    run_dir: RunDirOpt = None,
    fleet: FleetOpt = None,
    lines: Annotated[int, typer.Option("-n", "--lines", help="Last N lines (0 = the whole log).")] = 50,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines until Ctrl-C.")] = False,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            metavar="WHEN",
            help="Only lines from WHEN on: a duration back from now (30s, 10m, 2h, 1d) or a timestamp "
            "(2026-01-02T03:04:05, UTC unless a zone is given). Reads the whole log (rotated copies too).",
        ),
    ] = None,
    fmt: OutputFormat = Format.human,
    as_json: Annotated[bool, typer.Option("--json", hidden=True, help="The old spelling of --format json.")] = False,
    previous: Annotated[
        bool,
        typer.Option(
            "--previous",
            help="The logs of the run before the last `up` (kept in logs.previous under the run directory; one "
            "run back).",
        ),
    ] = False,
) -> None:
    """Print a process's log; without NAME, list the logs of the run directory.

    The logs outlive `btbctl down`; the next `btbctl up` on the same run directory keeps them in logs.previous
    (read them with --previous) and starts fresh ones. With --format json: one JSON object per line (logfmt fields,
    numbers as numbers; other lines as {"msg": ...})."""
    from btbctl.engine.errors import BtbctlError

    as_json = as_json or fmt is Format.json
    from btbctl.engine.launcher import logs as engine_logs
    from btbctl.engine.launcher.rundir import RunDir

    rd = RunDir(run_dir)
    if previous and follow:
        raise BtbctlError("--follow shows new lines of the running fleet; drop it with --previous")
    if name is None:
        names = engine_logs.log_names(rd, previous)
        if not names:
            if previous:
                raise BtbctlError(f"no logs in {rd.previous_logs_dir}: `btbctl up` keeps the last run's logs there")
            raise BtbctlError(f"no logs in {rd.logs_dir}; start a fleet with `btbctl up`")
        if as_json:
            folder = rd.previous_logs_dir if previous else rd.logs_dir
            sys.stdout.write(json.dumps({"run_dir": str(rd.path), "logs_dir": str(folder), "logs": names}) + "\n")
        else:
            sys.stdout.write("\n".join(names) + "\n")
        return
    start = engine_logs.parse_since(since) if since is not None else None
    path, rec = engine_logs.find_log(rd, name, previous)
    why = engine_logs.refresh(rec)
    if why:
        sys.stderr.write(f"btbctl: warning: showing the copy fetched earlier; {why}\n")

    def emit(text: str) -> None:
        if start is not None:
            text = engine_logs.since_filter(text, start)
        if as_json:
            text = "".join(json.dumps(engine_logs.as_json(ln)) + "\n" for ln in text.splitlines() if ln.strip())
        sys.stdout.write(text)
        sys.stdout.flush()

    if start is None:
        emit(engine_logs.read_tail(path, lines))
    else:  # the whole log, rotated copies first, filtered, then the last N lines
        text = engine_logs.since_filter(engine_logs.read_tail(path, 0, whole=True), start)
        emit("".join(text.splitlines(keepends=True)[-lines:]) if lines > 0 else text)
    if not follow:
        return
    pos = path.stat().st_size if path.exists() else 0
    buf = ""
    while True:
        time.sleep(1.0)
        engine_logs.refresh(rec)
        try:
            size = path.stat().st_size
            if size < pos:  # rotated (or truncated by a new `up`): start again at its beginning
                pos = 0
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
        except FileNotFoundError:
            continue
        pos += len(data)
        buf += data.decode("utf-8", "replace")
        done, _, buf = buf.rpartition("\n")
        if done:
            emit(done + "\n")
