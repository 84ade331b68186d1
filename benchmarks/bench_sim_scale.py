"""Simulator throughput at fleet scale: a generated trace of bursts plus Poisson background on N replicas.

Not a test; never gates CI. The workload keeps the load per replica fixed, so runs at different fleet sizes are
comparable: per 40 s one burst of ``4 x N`` requests sharing a 16,384-token prefix (each with a unique 256-token
suffix, 1 output token, spread over 60 s), and background at ``1.9 x N`` requests/s (unique prompts of 256-4,096
tokens, 16 output tokens); the window is as long as ``--requests`` needs. Hash chains are compact: a burst's prefix
is one tuple shared by its requests; a background prompt's chain is a ``range`` of integers (unique, 48 bytes
whatever its length). Model: Qwen3-8B on 1 x H100 per replica (realistic fidelity).

    python benchmarks/bench_sim_scale.py [--replicas 16,256] [--requests 1000000] [--policy btb_plus]
        [--format json] [--profile FILE]

Each fleet size runs in its own subprocess (peak RSS is that process's ``ru_maxrss``, trace included); printed:
requests, wall seconds (the simulation only; trace generation separately), requests/s, peak RSS, and the ratio
of each size's requests/s to the first size's.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

from btbctl.engine.trace.model import Request, Trace

BLOCK = 256
PREFIX_BLOCKS = 64
BURST_PER_REPLICA = 4
BACKGROUND_RPS_PER_REPLICA = 1.9
PERIOD_S = 40.0
SPREAD_S = 60.0


def scale_trace(replicas: int, requests: int, seed: int = 42) -> Trace:
    """About ``requests`` requests (bursts plus background) for ``replicas`` replicas; deterministic for a seed."""
    rng = random.Random(seed)
    per_s = BURST_PER_REPLICA * replicas / PERIOD_S + BACKGROUND_RPS_PER_REPLICA * replicas
    end = 20.0 + requests / per_s
    reqs: list[Request] = []
    append = reqs.append
    nxt = 1 << 40  # integer hashes of background chains (bursts use strings: no clash)
    size = BURST_PER_REPLICA * replicas
    k = 0
    while 20.0 + PERIOD_S * k < end:
        start = 20.0 + PERIOD_S * k + rng.uniform(-2.0, 2.0)
        prefix = tuple(f"b{k}p{j}" for j in range(PREFIX_BLOCKS))
        for i in range(size):
            t = round(start + SPREAD_S * i / size, 6)
            append(Request(f"b{k}-{i}", t, PREFIX_BLOCKS * BLOCK + BLOCK, 1, (*prefix, f"b{k}r{i}"), "burst"))
        k += 1
    rate = BACKGROUND_RPS_PER_REPLICA * replicas
    t = rng.expovariate(rate)
    g = 0
    while t < end:
        tokens = rng.randint(256, 4096)
        n = -(-tokens // BLOCK)
        append(Request(f"g{g}", round(t, 6), tokens, 16, range(nxt, nxt + n), "background"))  # type: ignore[arg-type]
        nxt += n
        g += 1
        t += rng.expovariate(rate)
    # chained by construction (a burst's prefix tuple then fresh ids; background: fresh ranges): no check needed
    return Trace(reqs, BLOCK, "generated", prefix_chained=True)


def one(replicas: int, requests: int, policy: str, profile: str | None) -> dict:
    from btbctl.engine.config import ClusterConfig
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.sim import simulate

    t0 = time.perf_counter()
    trace = scale_trace(replicas, requests)
    gen_s = time.perf_counter() - t0
    cluster = ClusterConfig(model="qwen3-8b", gpu="h100", gpus_per_replica=1, replicas=replicas)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    res = simulate(trace, policy, cluster, BtbConstants(), seed=42)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    s = res.summary()
    return {
        "replicas": replicas,
        "requests": len(trace),
        "generate_s": gen_s,
        "wall_s": wall,
        "requests_per_s": len(trace) / wall,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ttft_mean_s": s["ttft_s"]["mean"],
        "replications": s["replications"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="16,256", help="comma-separated fleet sizes (default 16,256)")
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests at the largest size")
    ap.add_argument("--policy", default="btb_plus")
    ap.add_argument("--per-replica", action="store_true", help="scale --requests with each fleet size")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    ap.add_argument("--profile", help="write a cProfile of the (single) run here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(one(args.child, args.requests, args.policy, args.profile)))
        return 0
    sizes = [int(x) for x in args.replicas.split(",")]
    rows = []
    for n in sizes:
        reqs = args.requests * n // max(sizes) if args.per_replica else args.requests
        cmd = [sys.executable, __file__, "--child", str(n), "--requests", str(reqs), "--policy", args.policy]
        if args.profile:
            cmd += ["--profile", f"{args.profile}.{n}"]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    for r in rows:
        r["ratio_vs_first"] = r["requests_per_s"] / rows[0]["requests_per_s"]
    if args.format == "json":
        print(json.dumps({"policy": args.policy, "rows": rows}, indent=2))
        return 0
    print(f"policy {args.policy}, realistic fidelity, qwen3-8b on 1 x H100 per replica")
    print(
        f"  {'replicas':>8}{'requests':>10}{'gen s':>7}{'sim s':>8}{'req/s':>8}{'RSS MiB':>9}{'ratio':>7}{'TTFT s':>8}"
    )
    for r in rows:
        print(
            f"  {r['replicas']:>8}{r['requests']:>10}{r['generate_s']:>7.1f}{r['wall_s']:>8.1f}"
            f"{r['requests_per_s']:>8.0f}{r['peak_rss_mib']:>9.0f}{r['ratio_vs_first']:>7.2f}{r['ttft_mean_s']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
