"""``btbctl doctor``: check every host of a cluster file (SSH reachability and authentication, Python, btbctl or
SGLang, free worker ports, GPUs, RDMA devices) and print one row per host. Exits 1 when any host has a problem."""

from __future__ import annotations

from typing import Annotated

import typer

from btbctl.commands.app import app
from btbctl.commands.options import OutputFormat
from btbctl.commands.output import Format, Output


def _render(out: Output, res: dict) -> None:
    from rich.table import Table

    t = Table(box=None, pad_edge=False)
    for col in ("host", "address", "reachable", "auth", "python", "btbctl", "sglang", "ports", "gpus", "rdma"):
        t.add_column(col)

    def cell(v) -> str:
        return "-" if v is None else str(v)

    for r in res["hosts"]:
        ports = r.get("ports") or {}
        free = [p for p, st in ports.items() if st == "free"]
        busy = [p for p, st in ports.items() if st != "free"]
        port_cell = (
            "none fixed"
            if not ports
            else ", ".join([f"{p} free" for p in free] + [f"[red]{p} busy[/red]" for p in busy])
        )
        gpus = r.get("gpus")
        gpu_cell = "none (no nvidia-smi)" if gpus is None else (str(len(gpus)) if gpus else "none")
        rdma = r.get("rdma")
        probed = r["python"] not in (None, "not found")
        if not probed:  # not reached, or no Python there: nothing else is known
            port_cell = gpu_cell = "-"
        t.add_row(
            r["host"],
            r["address"],
            cell(r["reachable"]),
            cell(r["auth"]),
            cell(r["python"]),
            (r["btbctl"] or "no") if probed else "-",
            (r["sglang"] or "no") if probed else "-",
            port_cell,
            gpu_cell,
            (", ".join(rdma) if rdma else "none") if probed else "-",
        )
    out.console.print(t)
    for r in res["hosts"]:
        for p in r["problems"]:
            out.console.print(f"{r['host']}: {p}")
        if str(r.get("register") or "").startswith("not checked"):
            out.console.print(f"{r['host']}: registration address {r['register']}")
    out.console.print("all hosts ready" if res["ok"] else "problems found")


@app.command("doctor")
def doctor(
    config: Annotated[
        str | None,
        typer.Option(
            "-c", "--config", metavar="FILE", help="Cluster file (TOML; default: the embedded 4-worker fleet)."
        ),
    ] = None,
    fmt: OutputFormat = Format.human,
) -> None:
    """Check that every host can run its workers: SSH, Python, btbctl/SGLang, free ports, GPUs, RDMA."""
    from btbctl.engine.launcher.cluster import default_cluster, load_cluster
    from btbctl.engine.launcher.doctor import doctor as run_doctor

    out = Output(fmt)
    cluster = load_cluster(config) if config else default_cluster()
    res = run_doctor(cluster)
    out.result(res, lambda d: _render(out, d))
    if not res["ok"]:
        raise typer.Exit(1)
