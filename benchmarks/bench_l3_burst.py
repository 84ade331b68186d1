"""BTB's copy modes against cache-aware routing on one burst (not a test; never gates CI).

For each replication mode (``l3``: node agents and warm-up proofs, the path of stock SGLang fleets; ``push``: the
emulated workers' own copies) and each run: a fresh fleet of 4 emulated Llama-3.3-70B workers on 4 x H100 (TP 4,
page size 256) with ``[btb] prefix_blocks = 64, threshold = 2, window_s = 1.0, warm_replicas = 4`` and the gateway's
default policy, started with ``btbctl up -d``; one burst (``btbctl trace gen --bursts 1 --burst-size 200
--prefix-tokens 16384 --suffix-tokens 256 --output-tokens 4 --spread-s 4 --decoys 0``) replayed with ``btbctl bench``;
then ``btbctl tune policy=cache_aware`` and a fresh burst of the same shape (another seed) on the same fleet. Reported
per mode, as the median over ``--runs`` runs: TTFT p50 / p95 / mean of both policies and their ratios (default /
cache_aware, in the same run), the requests each worker served under the default policy, and the copies: their
outcome and the time from the copy's start (the detector's fire) to a usable replica (``usable_s``; push: every
block verified at the target; l3: the target's warm-up proved the prefix from L3).

    python benchmarks/bench_l3_burst.py                   # both modes, 3 runs each
    python benchmarks/bench_l3_burst.py --modes l3 --runs 1 --format json

Workers, gateway, agents and the client share this machine's cores, so absolute times depend on it; the ratios
are taken within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CLUSTER = """
[gateway]
port = 0
control_port = 0

[btb]
prefix_blocks = 64
threshold = 2
window_s = 1.0
warm_replicas = 4

[replication]
mode = "{mode}"
arena_mib = 256

[[workers]]
name = "w"
count = 4
model = "llama-3.3-70b"
gpu = "h100"
tp_size = 4
page_size = 256
ready_timeout_s = 60.0
"""


def _btbctl(*args: str, timeout: float = 600.0) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
    proc = subprocess.run(
        [sys.executable, "-m", "btbctl", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    if proc.returncode != 0:
        raise SystemExit(f"btbctl {' '.join(args[:2])} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return proc.stdout


def _trace(path: Path, seed: int) -> Path:
    _btbctl(
        "trace", "gen", "-o", str(path), "--bursts", "1", "--burst-size", "200", "--prefix-tokens", "16384",
        "--suffix-tokens", "256", "--output-tokens", "4", "--spread-s", "4", "--decoys", "0",
        "--first-burst-s", "0", "--jitter-s", "0", "--seed", str(seed),
    )  # fmt: skip
    return path


def one_run(mode: str, run: int, tmp: Path) -> dict:
    """One fresh fleet in ``mode``: the default policy's burst, then cache_aware's on a fresh prefix."""
    cfg = tmp / f"cluster-{mode}.toml"
    cfg.write_text(CLUSTER.format(mode=mode))
    rd = tmp / f"run-{mode}-{run}"
    _btbctl("up", "-d", "-c", str(cfg), "--run-dir", str(rd), timeout=300)
    try:
        out = {}
        for policy, seed in (("default", 100 + 2 * run), ("cache_aware", 101 + 2 * run)):
            if policy != "default":
                _btbctl("tune", "--run-dir", str(rd), f"policy={policy}")
            trace = _trace(tmp / f"trace-{mode}-{run}-{policy}.jsonl", seed)
            rep = json.loads(_btbctl("bench", "--run-dir", str(rd), "--trace", str(trace), "--format", "json"))
            out[policy] = rep
        return out
    finally:
        _btbctl("down", "--run-dir", str(rd), timeout=120)


def summarize(mode: str, runs: list[dict]) -> dict:
    def med(f) -> float:
        return statistics.median(f(r) for r in runs)

    def ttft(r: dict, policy: str, k: str) -> float:
        return r[policy]["ttft_s"][k]

    copies = [c for r in runs for c in (r["default"]["copies"] or [])]
    usable = [c["usable_s"] for c in copies if c.get("usable_s") is not None]
    return {
        "mode": mode,
        "runs": len(runs),
        "default": {k: med(lambda r, k=k: ttft(r, "default", k)) for k in ("p50", "p95", "mean")},
        "cache_aware": {k: med(lambda r, k=k: ttft(r, "cache_aware", k)) for k in ("p50", "p95", "mean")},
        "ratio_p95": med(lambda r: ttft(r, "default", "p95") / ttft(r, "cache_aware", "p95")),
        "ratio_mean": med(lambda r: ttft(r, "default", "mean") / ttft(r, "cache_aware", "mean")),
        "errors": sum(r[p]["errors"] for r in runs for p in ("default", "cache_aware")),
        "workers_serving": [len(r["default"]["by_worker"]) for r in runs],
        "requests_per_worker": [sorted(r["default"]["by_worker"].values(), reverse=True) for r in runs],
        "copies": [
            {
                "outcome": c.get("outcome") or c["state"],
                "usable_s": c.get("usable_s"),
                "phases_s": c.get("phases_s"),
                "proof_storage_tokens": c.get("proof_storage_tokens"),
                "covered_tokens": c.get("covered_tokens"),
            }
            for c in copies
        ],
        "usable_s_median": statistics.median(usable) if usable else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="l3,push", help="comma-separated replication modes (default: l3,push)")
    ap.add_argument("--runs", type=int, default=3, help="fresh fleets per mode (default 3; medians are reported)")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    out = []
    with tempfile.TemporaryDirectory(prefix="btb-l3-bench-") as d:
        for mode in args.modes.split(","):
            runs = [one_run(mode, i, Path(d)) for i in range(args.runs)]
            out.append(summarize(mode, runs))
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    for s in out:
        d, ca = s["default"], s["cache_aware"]
        print(
            f"{s['mode']:5} default p50/p95/mean {d['p50']:.3f}/{d['p95']:.3f}/{d['mean']:.3f} s; cache_aware "
            f"{ca['p50']:.3f}/{ca['p95']:.3f}/{ca['mean']:.3f} s; p95 x{s['ratio_p95']:.2f}, "
            f"mean x{s['ratio_mean']:.2f}; errors {s['errors']}; requests per worker {s['requests_per_worker']}"
        )
        outcomes = sorted({c["outcome"] for c in s["copies"]})
        print(
            f"      copies {len(s['copies'])} ({', '.join(outcomes)}), usable after {s['usable_s_median']} s (median)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
