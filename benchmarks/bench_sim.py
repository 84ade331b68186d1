"""Simulator throughput per policy (not a test; never gates CI).

Runs each default policy over (a) the Mooncake conversation trace on 4 replicas of Llama-3.3-70B on 8xH100 and
(b) one generated Bursted window (~4,100 requests of 65,792 tokens) on the default fleet, and prints simulated
requests per wall-clock second for each, with the ratio to ``round_robin`` measured in the same run (the cheapest
policy, so the ratio shows what a policy's routing costs on top of the simulator itself).

    python benchmarks/bench_sim.py [--mooncake PATH] [--repeat N] [--format json]

The Mooncake trace is looked up at ``../shared/data/traces/mooncake_conversation_trace.jsonl`` relative to the
repository root when ``--mooncake`` is not given; without it that part is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.policies import DEFAULT_POLICIES
from btbctl.engine.sim import simulate
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.readers import read_trace

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def bench(trace, cluster, policies, repeat):
    rows = []
    for pol in policies:
        best = float("inf")
        summary = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            res = simulate(trace, pol, cluster, BtbConstants(), seed=42)
            best = min(best, time.perf_counter() - t0)
            summary = res.summary()
        rows.append({"policy": pol, "wall_s": best, "requests_per_s": len(trace) / best,
                     "ttft_mean_s": summary["ttft_s"]["mean"], "replications": summary["replications"]})
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    for r in rows:
        r["ratio_vs_" + base["policy"]] = r["requests_per_s"] / base["requests_per_s"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake", type=Path, default=DEFAULT_MOONCAKE)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args()
    policies = list(DEFAULT_POLICIES)
    out = {}
    bursted = generate_bursted(BurstedParams(), seed=42)
    out["bursted_window"] = {"requests": len(bursted), "cluster": "4 x llama-3.3-70b on 4xh100",
                             "rows": bench(bursted, ClusterConfig(), policies, args.repeat)}
    if args.mooncake.exists():
        mc = read_trace(str(args.mooncake))
        out["mooncake"] = {"requests": len(mc), "cluster": "4 x llama-3.3-70b on 8xh100",
                           "rows": bench(mc, ClusterConfig(gpus_per_replica=8), policies, args.repeat)}
    else:
        print(f"skipping Mooncake: {args.mooncake} not found", file=sys.stderr)
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    for name, part in out.items():
        print(f"{name}: {part['requests']} requests on {part['cluster']}")
        print(f"  {'policy':<20}{'wall s':>8}{'req/s':>10}{'ratio':>8}{'TTFT mean s':>13}{'copies':>8}")
        for r in part["rows"]:
            ratio = next(v for k, v in r.items() if k.startswith("ratio_vs_"))
            print(f"  {r['policy']:<20}{r['wall_s']:>8.2f}{r['requests_per_s']:>10.0f}{ratio:>8.2f}"
                  f"{r['ttft_mean_s']:>13.3f}{r['replications']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
