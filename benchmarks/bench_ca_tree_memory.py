"""Memory of the cache-aware prefix tree under many unique long prompts (not a test; never gates CI).

    python benchmarks/bench_ca_tree_memory.py [--prompts 20000] [--blocks 64] [--workers 8] [--inflight 64]
        [--policies cache_aware,btb,round_robin] [--format json]

Each policy runs in a fresh Python process: ``--prompts`` unique prompts of ``--blocks`` blocks (64 blocks of 256
tokens = 16k tokens; hashes are 16-character hex strings, as the gateway's xxh3 chains) are routed one after the
other through the policy object itself (``route()``, no gateway, no sockets) over a stub fleet view with
``--workers`` workers and ``--inflight`` requests in flight (the oldest finishes when a new one starts), one
arrival every ``--gap-s`` seconds of policy time. Unique prompts never match, so a cache-aware tree only grows.
``round_robin`` (no tree) is the floor: the prompts themselves and the interpreter. (``btb_plus`` needs the
gateway's cost view and keeps no tree.)

Reported per policy: the process's resident set (``VmRSS``) before the first prompt, after half of them and at
the end (MiB), and, for the policies with a cache-aware tree (``cache_aware``, ``btb``), the tree's nodes, its
(node, worker) entries and its own byte estimate at the end, plus the time per routed prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Hashable, Sequence


def rss_mib() -> float:
    """Resident set of this process, MiB (``/proc/self/status``; 0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class StubView:
    """Loads from the requests in flight; no replica holds or computes anything (unique prompts)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loads = [0] * n

    @property
    def n_replicas(self) -> int:
        return self.n

    def load(self, replica: int) -> int:
        return self.loads[replica]

    def cached_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return 0

    def pending_blocks(self, replica: int, chain: Sequence[Hashable]) -> int:
        return 0

    def copy_in_flight(self, replica: int, chain: Sequence[Hashable]) -> bool:
        return False

    def accepts_copies(self, replica: int) -> bool:
        return True


def run_one(policy: str, args: argparse.Namespace) -> dict:
    """Route the prompts through ``policy`` in this process and measure."""
    from btbctl.engine.policies import make_policy
    from btbctl.engine.trace.model import Request

    rng = random.Random(1)
    pol = make_policy(policy, args.workers, random.Random(2), block_tokens=256)
    view = StubView(args.workers)
    flight: deque[int] = deque()
    out: dict = {"policy": policy, "rss_start_mib": rss_mib()}
    half = args.prompts // 2
    t0 = time.perf_counter()
    for i in range(args.prompts):
        chain = tuple(f"{rng.getrandbits(64):016x}" for _ in range(args.blocks))
        req = Request(str(i), i * args.gap_s, args.blocks * 256, 16, chain)
        r = pol.route(req, view, i * args.gap_s).replica
        view.loads[r] += 1
        flight.append(r)
        if len(flight) > args.inflight:
            view.loads[flight.popleft()] -= 1
        if i + 1 == half:
            out["rss_half_mib"] = rss_mib()
    out["us_per_prompt"] = (time.perf_counter() - t0) / args.prompts * 1e6
    out["rss_end_mib"] = rss_mib()
    holder = pol if hasattr(pol, "tree") else getattr(pol, "fallback", None)
    tree = getattr(holder, "tree", None)
    if tree is not None:
        out["tree_nodes"] = len(tree)
        out["tree_entries"] = sum(tree.tenant_blocks(r) for r in range(args.workers))
        if hasattr(tree, "estimated_bytes"):
            out["tree_bytes_estimate_mib"] = tree.estimated_bytes() / 2**20
    return out


def measure(n_prompts: int, blocks: int) -> dict:
    """Bytes the tree retains per node (its first tenant's entry apart) and per (node, tenant) entry.

    ``tracemalloc`` over ``n_prompts`` unique prompts of ``blocks`` hashes inserted under tenant 0 (no bound
    reached, orders settled), then the same chains under tenant 1: the second step costs one entry per node, the
    first one node plus one entry. The hashes are made before tracing starts (in the gateway a request's chain is
    gone once it is answered and the tree alone keeps its hashes), so each one's size (``sys.getsizeof`` of a
    16-character hex string, rounded up to pymalloc's 8 bytes) is added to the node."""
    import gc
    import tracemalloc

    from btbctl.engine.policies.cache_aware import BlockPrefixTree

    rng = random.Random(3)
    chains = [tuple(f"{rng.getrandbits(64):016x}" for _ in range(blocks)) for _ in range(n_prompts)]
    key_bytes = -(-sys.getsizeof(chains[0][0]) // 8) * 8
    tree = BlockPrefixTree(2, 1 << 30, max_blocks=1 << 30, max_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for c in chains:
        tree.insert(c, 0)
    tree._settle_all()
    gc.collect()
    one = tracemalloc.get_traced_memory()[0] - base
    for c in chains:
        tree.insert(c, 1)
    tree._settle_all()
    gc.collect()
    two = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    n = len(tree)
    entry = (two - one) / n
    return {
        "nodes": n,
        "entry_bytes": round(entry),
        "node_bytes_without_entry": round(one / n - entry + key_bytes),
        "of_which_key_bytes": key_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--gap-s", type=float, default=0.01, help="seconds of policy time between arrivals")
    ap.add_argument("--policies", default="cache_aware,btb,round_robin")
    ap.add_argument("--format", choices=("text", "json"), default="text")
    ap.add_argument("--measure", action="store_true", help="measure the bytes per node and per entry instead")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(min(args.prompts, 4000), args.blocks), indent=2))
        return 0
    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return 0
    rows = []
    for name in args.policies.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", name]
        for key in ("prompts", "blocks", "workers", "inflight", "gap_s"):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        res = subprocess.run(cmd, check=True, capture_output=True, text=True)
        rows.append(json.loads(res.stdout))
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.prompts} unique prompts x {args.blocks} blocks, {args.workers} workers, {args.inflight} in flight")
    print(
        f"{'policy':<12} {'RSS start/half/end MiB':>24} {'half->end':>10} {'nodes':>9} {'entries':>9} "
        f"{'est MiB':>8} {'us/prompt':>10}"
    )
    for r in rows:
        rss = f"{r['rss_start_mib']:.0f}/{r['rss_half_mib']:.0f}/{r['rss_end_mib']:.0f}"
        est = r.get("tree_bytes_estimate_mib")
        print(
            f"{r['policy']:<12} {rss:>24} {r['rss_end_mib'] - r['rss_half_mib']:>+10.0f} "
            f"{r.get('tree_nodes', '-'):>9} {r.get('tree_entries', '-'):>9} "
            f"{'-' if est is None else f'{est:.0f}':>8} {r['us_per_prompt']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
