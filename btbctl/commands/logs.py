"""``btbctl logs NAME``: a worker's (or the gateway's) output; for a worker on another host, fetched over SSH."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.fleet import RUN_DIR_HELP


@app.command("logs")
def logs(
    name: Annotated[str, typer.Argument(help="Process name as `btbctl status` lists it (worker-0, gateway, ...).")],
    run_dir: Annotated[str | None, typer.Option("--run-dir", metavar="DIR", help=RUN_DIR_HELP)] = None,
    lines: Annotated[int, typer.Option("-n", "--lines", help="Last N lines (0 = the whole log).")] = 50,
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing new lines until Ctrl-C.")] = False,
) -> None:
    """Print a process's log (stdout and stderr); remote workers' logs are fetched from their host first."""
    from btbctl.engine.launcher import logs as engine_logs
    from btbctl.engine.launcher.rundir import RunDir

    rec = engine_logs.find_record(RunDir(run_dir), name)
    why = engine_logs.refresh(rec)
    if why:
        sys.stderr.write(f"btbctl: warning: showing the copy fetched earlier; {why}\n")
    sys.stdout.write(engine_logs.tail(rec, lines))
    sys.stdout.flush()
    if not follow:
        return
    from pathlib import Path

    path = Path(rec.log)
    pos = path.stat().st_size if path.exists() else 0
    while True:
        time.sleep(1.0)
        engine_logs.refresh(rec)
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read()
        except FileNotFoundError:
            continue
        pos += len(data)
        if data:
            sys.stdout.write(data.decode("utf-8", "replace"))
            sys.stdout.flush()
