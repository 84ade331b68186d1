"""Report matrix on a local Ray against the process pool (not a test; never gates CI; needs the ``ray`` extra).

Runs a report matrix (default: the evidence matrix, ``examples/evidence-matrix.toml``, 288 simulations) twice in
the same run, with the same number of CPUs: over the process pool (``btbctl report -j N``) and on a Ray started
for the run (``btbctl report --ray -j N``), and prints both wall times and ``ratio = ray / pool``. Each wall time
covers what a user waits for: the trace loading, the pool's or Ray's start and stop, and every simulation. It also
checks that both give the same report (everything but ``timing``). ``--setups``, ``--workloads``, ``--policies``
and ``--fidelities`` run a part of the matrix (comma-separated names). On 2 cores::

    taskset -c 0,1 python benchmarks/bench_executor.py --jobs 2

The same two runs from the command line (compare their ``timing.wall_s``, which does not count the trace loading)::

    btbctl report examples/evidence-matrix.toml --out /tmp/pool -j 2 --no-charts --format json
    btbctl report examples/evidence-matrix.toml --out /tmp/ray --ray -j 2 --no-charts --format json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from btbctl.engine import report as rp
from btbctl.engine.executor import default_jobs

MATRIX = Path(__file__).resolve().parents[1] / "examples" / "evidence-matrix.toml"


def _part(matrix: rp.ReportMatrix, args: argparse.Namespace) -> rp.ReportMatrix:
    update: dict = {}
    for key in ("setups", "policies", "fidelities"):
        names = getattr(args, key)
        if names:
            update[key] = [n for n in getattr(matrix, key) if n in names.split(",")]
    if args.workloads:
        update["workloads"] = [w for w in matrix.workloads if w.name in args.workloads.split(",")]
    if any(not v for v in update.values()):
        sys.exit("bench_executor: a filter matches nothing in the matrix")
    return matrix.model_copy(update=update)


def _timed(matrix: rp.ReportMatrix, **where) -> tuple[float, dict]:
    t0 = time.perf_counter()
    result = rp.run_matrix(matrix, **where)
    return time.perf_counter() - t0, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("matrix", nargs="?", default=str(MATRIX))
    ap.add_argument("--jobs", type=int, default=None, help="pool workers and Ray CPUs (default: the CPUs available)")
    ap.add_argument("--setups", default="")
    ap.add_argument("--workloads", default="")
    ap.add_argument("--policies", default="")
    ap.add_argument("--fidelities", default="")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args()
    jobs = args.jobs or default_jobs()
    matrix = _part(rp.load_matrix(args.matrix), args)
    pool_s, pool = _timed(matrix, jobs=jobs)
    ray_s, ray = _timed(matrix, jobs=jobs, ray="local")
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k != "timing"}, sort_keys=True)
    out = {
        "matrix": os.path.relpath(args.matrix),
        "cells": len(pool["cells"]),
        "jobs": jobs,
        "cpus": default_jobs(),
        "pool_wall_s": round(pool_s, 2),
        "ray_wall_s": round(ray_s, 2),
        "ratio_ray_over_pool": round(ray_s / pool_s, 3),
        "pool_timing": pool["timing"],
        "ray_timing": ray["timing"],
        "same_report": strip(pool) == strip(ray),
    }
    if args.format == "json":
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['matrix']}: {out['cells']} simulations, {jobs} CPUs (this process may use {out['cpus']})")
        print(f"  process pool  {pool_s:8.1f} s")
        print(f"  local Ray     {ray_s:8.1f} s")
        print(f"  ratio Ray / pool: {out['ratio_ray_over_pool']:.3f}; same report: {out['same_report']}")
    return 0 if out["same_report"] else 1


if __name__ == "__main__":
    sys.exit(main())
