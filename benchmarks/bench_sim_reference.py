"""Simulator speed against the reference simulator (Infer-Sim with the BTB harness) on the held-out window shape.

Not a test; never gates CI. One generated Bursted window (default shape, seed 42: 8 bursts of 500 requests with a
65,536-token prefix, 120 decoys; 4,120 requests) on the ``70b_h100x4`` setup (4 replicas of Llama-3.3-70B on
4 x H100 each), routed by cache_aware, least_load and btb (the harness's ``early_rdma``). Each round runs, in
fresh subprocesses and interleaved so all see the same machine load: the reference, btbctl's ``infersim``
fidelity and btbctl's ``realistic`` fidelity. The best wall time per (simulator, policy) is kept and the speed
ratios to the reference are printed (above 1: btbctl is faster). Trace construction is outside the timing.

    python benchmarks/bench_sim_reference.py --infersim-root DIR --harness-root DIR [--rounds R] [--format json]

``--infersim-root``: a checkout of github.com/jwlaboratory/inference-sim (``config.py``, ``simulate.py``, ...).
``--harness-root``: a checkout of github.com/jwlaboratory/bite-the-bullet (``2-bite-the-bullet/bite_the_bullet.py``
and ``sim_path.py``). The reference's requests are built from the generated window the way the harness's
``load_windows`` builds them from Bursted-ART rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

POLICIES = {"cache_aware": "cache_aware", "least_load": "least_load", "btb": "early_rdma"}
SETUP = "70b_h100x4"


def _window():
    from btbctl.engine.trace.generate import BurstedParams, generate_bursted

    return generate_bursted(BurstedParams(), seed=42)


def run_reference(policy: str, infersim_root: Path, harness_root: Path) -> dict:
    """One reference run in this process; returns wall seconds and its mean TTFT."""
    import random

    os.environ["INFERENCE_SIM_ROOT"] = str(infersim_root)
    sys.path.insert(0, str(harness_root / "2-bite-the-bullet"))
    import bite_the_bullet as btb  # type: ignore[import-not-found]

    btb.register()
    cfg = btb.setup_cfg("70b", "H100", 4, 4)
    trace = _window()
    block = btb.BLOCK
    reqs = []
    for i, r in enumerate(trace.requests):
        blocks = [str(x) for x in r.block_hashes]
        extra = math.ceil((r.input_tokens + r.output_tokens) / block) - len(blocks)
        reqs.append(
            btb.Request(
                id=i,
                arrival=r.arrival_s,
                group="w",
                prefix_tokens=min(len(blocks) * block, r.input_tokens),
                input_tokens=r.input_tokens,
                output_tokens=r.output_tokens,
                blocks=blocks,
                cache_blocks=blocks + [f"w:{i}#o{j}" for j in range(max(0, extra))],
            )
        )
    random.seed(btb.SEED)
    t0 = time.perf_counter()
    ev = btb.run(POLICIES[policy], reqs, cfg)["events"]
    wall = time.perf_counter() - t0
    ttfts = [e["start"] - e["arrival"] + e["reuse"] + e["prefill"] for e in ev]
    return {"wall_s": wall, "requests": len(reqs), "ttft_mean_s": sum(ttfts) / len(ttfts)}


def run_btbctl(policy: str, fidelity: str) -> dict:
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.setups import setup_cluster
    from btbctl.engine.sim import simulate

    trace = _window()
    cluster = setup_cluster(SETUP)
    t0 = time.perf_counter()
    res = simulate(trace, policy, cluster, BtbConstants(), seed=42, fidelity=fidelity)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "requests": len(trace), "ttft_mean_s": res.summary()["ttft_s"]["mean"]}


def _child(args) -> int:
    if args.child == "reference":
        out = run_reference(args.policy, args.infersim_root, args.harness_root)
    else:
        out = run_btbctl(args.policy, args.child)
    print(json.dumps(out))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--infersim-root", type=Path, required=True)
    ap.add_argument("--harness-root", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--fidelities", default="infersim,realistic")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    ap.add_argument("--child", choices=("reference", "infersim", "realistic"), help=argparse.SUPPRESS)
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    policies = args.policies.split(",")
    sims = ["reference", *args.fidelities.split(",")]
    best: dict[tuple[str, str], dict] = {}
    for _ in range(args.rounds):
        for pol in policies:
            for sim in sims:
                cmd = [sys.executable, __file__, "--child", sim, "--policy", pol]
                cmd += ["--infersim-root", str(args.infersim_root), "--harness-root", str(args.harness_root)]
                res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
                key = (sim, pol)
                if key not in best or res["wall_s"] < best[key]["wall_s"]:
                    best[key] = res
    rows = []
    for pol in policies:
        ref = best[("reference", pol)]
        for sim in sims:
            b = best[(sim, pol)]
            rows.append(
                {
                    "simulator": sim,
                    "policy": pol,
                    "wall_s": b["wall_s"],
                    "requests_per_s": b["requests"] / b["wall_s"],
                    "ratio_vs_reference": ref["wall_s"] / b["wall_s"],
                    "ttft_mean_s": b["ttft_mean_s"],
                }
            )
    if args.format == "json":
        print(json.dumps({"setup": SETUP, "rounds": args.rounds, "rows": rows}, indent=2))
        return 0
    n = best[("reference", policies[0])]["requests"]
    print(f"Bursted window ({n} requests), {SETUP}, best of {args.rounds} interleaved rounds")
    print(f"  {'policy':<13}{'simulator':<11}{'wall s':>8}{'req/s':>9}{'vs ref':>8}{'TTFT mean s':>13}")
    for r in rows:
        print(
            f"  {r['policy']:<13}{r['simulator']:<11}{r['wall_s']:>8.2f}{r['requests_per_s']:>9.0f}"
            f"{r['ratio_vs_reference']:>8.2f}{r['ttft_mean_s']:>13.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
