"""``btbctl report``: run a declared experiment matrix (TOML) and write a Markdown report, with PNG charts when
matplotlib is installed (``pip install 'btbctl[report]'``). Engine modules are imported inside the command."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands import options
from btbctl.commands.app import app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output
from btbctl.engine.wording import plural


@app.command("report")
def report(
    matrix: Annotated[
        str, typer.Argument(metavar="MATRIX", help="Experiment matrix, TOML (see examples/evidence-matrix.toml).")
    ],
    out_dir: Annotated[
        str,
        typer.Option("-o", "--out", metavar="DIR", help="Folder for README.md and the charts (created if missing)."),
    ] = "report",
    jobs: options.Jobs = None,
    ray: options.Ray = False,
    ray_address: options.RayAddress = None,
    charts: Annotated[
        bool,
        typer.Option("--charts/--no-charts", help="Write PNG charts (needs matplotlib: pip install 'btbctl[report]')."),
    ] = True,
    fmt: OutputFormat = Format.human,
) -> None:
    """Run an experiment matrix (setups x workloads x fidelities x policies) and write a Markdown report."""
    import shlex

    from btbctl.engine.errors import ConfigError
    from btbctl.engine.report import load_matrix, run_matrix, write_report

    out = Output(fmt)
    ray_at = options.ray_target(ray, ray_address)
    m = load_matrix(matrix)
    if jobs is not None and jobs < 1:
        raise ConfigError("--jobs", f"must be an integer >= 1, got {jobs}")
    # Fail on an unusable --out now, not after every simulation ran (the evidence matrix takes minutes).
    import os

    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("--out", f"cannot create {out_dir}: {e.strerror or e}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConfigError("--out", f"cannot write into {out_dir}: permission denied")
    total = len(m.setups) * len(m.workloads) * len(m.fidelities) * len(m.policies)
    with out.progress(f"running {plural(total, 'simulation')}", total, lines_when_piped=True) as advance:
        rep = run_matrix(m, progress=advance, jobs=jobs, ray=ray_at)
    command = " ".join(["btbctl", "report", shlex.quote(matrix), "--out", shlex.quote(out_dir)])
    files = write_report(rep, out_dir, command, charts=charts)
    if files["charts_skipped"] and files["charts_skipped"] != "disabled":
        out.warn(f"charts skipped: {files['charts_skipped']}; the Markdown has the tables")
    summary = {
        "markdown": files["markdown"],
        "charts": files["charts"],
        "charts_skipped": files["charts_skipped"],
        "cells": len(rep["cells"]),
        "timing": rep["timing"],
    }
    out.result(
        summary,
        lambda s: out.console.print(
            f"wrote {s['markdown']} ({plural(s['cells'], 'simulation')}, {plural(len(s['charts']), 'chart')}) in "
            f"{s['timing']['wall_s']:.0f} s on "
            + plural(s["timing"]["jobs"], "Ray CPU" if s["timing"].get("executor") == "ray" else "worker")
        ),
    )
