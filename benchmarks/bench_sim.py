"""Simulator throughput per policy (not a test; never gates CI).

Runs each default policy over (a) the Mooncake conversation trace on 4 replicas of Llama-3.3-70B on 8xH100 and
(b) one generated Bursted window (~4,100 requests of 65,792 tokens) on the default fleet, and prints simulated
requests per wall-clock second for each, with the ratio to ``round_robin`` measured in the same run (the cheapest
policy, so the ratio shows what a policy's routing costs on top of the simulator itself).

    python benchmarks/bench_sim.py [--mooncake PATH | --no-mooncake] [--repeat N] [--format json]
    python benchmarks/bench_sim.py --against OTHER_CHECKOUT [--rounds R] [--repeat N] ...

The Mooncake trace is looked up at ``../shared/data/traces/mooncake_conversation_trace.jsonl`` relative to the
repository root when ``--mooncake`` is not given; without it that part is skipped.

``--against`` compares this checkout with another one (a directory holding a ``btbctl`` package, e.g. an export of
the base commit): ``R`` rounds, each running the same benchmark once in a subprocess per checkout, alternating so
that both see the same machine load; per policy the best wall time of each checkout is kept and the speed ratio
``other / this`` is printed (above 1: this checkout is faster), with totals per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
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
        rows.append(
            {
                "policy": pol,
                "wall_s": best,
                "requests_per_s": len(trace) / best,
                "ttft_mean_s": summary["ttft_s"]["mean"],
                "replications": summary["replications"],
            }
        )
    base = next((r for r in rows if r["policy"] == "round_robin"), rows[0])
    for r in rows:
        r["ratio_vs_" + base["policy"]] = r["requests_per_s"] / base["requests_per_s"]
    return rows


def compare(args) -> int:
    """``--against``: alternate subprocess runs of this benchmark on this checkout and on ``args.against``."""
    other = args.against.resolve()
    if not (other / "btbctl" / "__init__.py").is_file():
        print(f"--against {other}: no btbctl package there", file=sys.stderr)
        return 2
    cmd = [sys.executable, str(Path(__file__).resolve()), "--format", "json", "--repeat", str(args.repeat)]
    cmd += ["--no-mooncake"] if args.no_mooncake else ["--mooncake", str(args.mooncake)]
    best: dict[str, dict[tuple[str, str], float]] = {"this": {}, "other": {}}
    for _ in range(args.rounds):
        for name, root in (("other", other), ("this", ROOT)):
            env = {**os.environ, "PYTHONPATH": str(root)}
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for part, v in res.items():
                for r in v["rows"]:
                    key = (part, r["policy"])
                    best[name][key] = min(best[name].get(key, float("inf")), r["wall_s"])
    rows = []
    for key in best["this"]:
        rows.append(
            {
                "workload": key[0],
                "policy": key[1],
                "this_s": best["this"][key],
                "other_s": best["other"][key],
                "speed_ratio": best["other"][key] / best["this"][key],
            }
        )
    totals = {}
    for r in rows:
        t = totals.setdefault(r["workload"], {"this_s": 0.0, "other_s": 0.0})
        t["this_s"] += r["this_s"]
        t["other_s"] += r["other_s"]
    for t in totals.values():
        t["speed_ratio"] = t["other_s"] / t["this_s"]
    if args.format == "json":
        print(json.dumps({"against": str(other), "rounds": args.rounds, "rows": rows, "totals": totals}, indent=2))
        return 0
    print(f"this checkout ({ROOT}) against {other}: best of {args.rounds} rounds x {args.repeat} runs")
    print(f"  {'workload':<16}{'policy':<20}{'this s':>8}{'other s':>9}{'ratio':>8}")
    for r in rows:
        print(f"  {r['workload']:<16}{r['policy']:<20}{r['this_s']:>8.3f}{r['other_s']:>9.3f}{r['speed_ratio']:>8.3f}")
    for w, t in totals.items():
        print(f"  {w:<16}{'(total)':<20}{t['this_s']:>8.3f}{t['other_s']:>9.3f}{t['speed_ratio']:>8.3f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mooncake", type=Path, default=DEFAULT_MOONCAKE)
    ap.add_argument("--no-mooncake", action="store_true", help="time the Bursted window only")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--format", choices=("human", "json"), default="human")
    ap.add_argument("--against", type=Path, help="another checkout to compare with (see the module docstring)")
    ap.add_argument("--rounds", type=int, default=3, help="with --against: alternating rounds")
    args = ap.parse_args()
    if args.against is not None:
        return compare(args)
    policies = list(DEFAULT_POLICIES)
    out = {}
    bursted = generate_bursted(BurstedParams(), seed=42)
    out["bursted_window"] = {
        "requests": len(bursted),
        "cluster": "4 x llama-3.3-70b on 4xh100",
        "rows": bench(bursted, ClusterConfig(), policies, args.repeat),
    }
    if args.no_mooncake:
        pass
    elif args.mooncake.exists():
        mc = read_trace(str(args.mooncake))
        out["mooncake"] = {
            "requests": len(mc),
            "cluster": "4 x llama-3.3-70b on 8xh100",
            "rows": bench(mc, ClusterConfig(gpus_per_replica=8), policies, args.repeat),
        }
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
            print(
                f"  {r['policy']:<20}{r['wall_s']:>8.2f}{r['requests_per_s']:>10.0f}{ratio:>8.2f}"
                f"{r['ttft_mean_s']:>13.3f}{r['replications']:>8}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
