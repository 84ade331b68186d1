"""Sweep throughput (not a test; never gates CI).

Runs the 4 x 4 x 3 x 4 grid of BTB's constants (192 runs: prefix blocks 32,64,128,256; threshold 2,3,4,8; window
0.5,1,2 s; replicas 1,2,3,4) of the ``btb`` policy over one generated Bursted window (about 4,120 requests) on the
default fleet, in parallel over the available CPUs, and prints the wall time. The baseline, measured in the same
run, is the same sweep's first ``--baseline-points`` points run one after the other in this process; the ratio
``speedup = baseline seconds per run x runs / wall seconds`` shows how well the pool uses the CPUs (at most the
number of workers). The same sweep from the command line::

    btbctl sweep --prefix-blocks 32,64,128,256 --threshold 2,3,4,8 --window-s 0.5,1,2 --warm-replicas 1,2,3,4

    python benchmarks/bench_sweep.py [--jobs N] [--spread-s 60] [--baseline-points 4] [--format json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from btbctl.engine.dryrun import DryRunConfig, load_trace
from btbctl.engine.sweep import SweepGrid, SweepSpec, default_jobs, grid_points, run_point, run_sweep

GRID = SweepGrid(
    prefix_blocks=(32, 64, 128, 256),
    threshold=(2, 3, 4, 8),
    window_s=(0.5, 1.0, 2.0),
    warm_replicas=(1, 2, 3, 4),
    policy=("btb",),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--spread-s", type=float, default=60.0)
    ap.add_argument("--baseline-points", type=int, default=4)
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args()
    base = DryRunConfig().with_overrides({"trace.generate.spread_s": args.spread_s, "policies": ["btb"]})
    spec = SweepSpec(base=base, grid=GRID, jobs=args.jobs)
    points = grid_points(spec.validate())
    trace = load_trace(base)
    t0 = time.perf_counter()
    for p in points[: args.baseline_points]:
        run_point(trace, base, p)
    per_run = (time.perf_counter() - t0) / max(1, args.baseline_points)
    report = run_sweep(spec, trace=trace)
    wall = report["timing"]["wall_s"]
    jobs = report["timing"]["jobs"]
    out = {
        "runs": report["points"],
        "requests": report["trace"]["requests"],
        "jobs": jobs,
        "cpus": default_jobs(),
        "wall_s": wall,
        "baseline_s_per_run": per_run,
        "speedup": per_run * report["points"] / wall,
        "best": report["results"][0]["point"],
        "best_ttft_mean_s": report["results"][0]["ttft_s"]["mean"],
    }
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{out['runs']} runs over {out['requests']} requests on {jobs} worker(s): {wall:.1f} s wall "
        f"({per_run:.2f} s per run alone; speedup {out['speedup']:.2f}x)"
    )
    print(f"best: {out['best']} -> mean TTFT {out['best_ttft_mean_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
