#!/usr/bin/env python3
"""Prove BTB's ``l3`` path on a running fleet of real SGLang workers (or emulated ones): compute a prefix on one
worker, replicate it to another through the node agents, and check that the other worker's warm-up loaded the whole
prefix from L3 (``meta_info.cached_tokens_details.storage``); time each step.

Run it against a fleet that ``btbctl up`` started in replication mode ``l3`` with at least two workers (two GPUs are
enough; see examples/cluster-sglang-l3.toml)::

    btbctl up -d -c examples/cluster-sglang-l3.toml
    python scripts/sglang-l3-proof.py --prefix-tokens 16384
    btbctl down

Steps, each timed:

1. **Compute.** ``POST /generate`` through the gateway with ``--prefix-tokens`` random token ids plus a short tail
   (``input_ids``, ``max_new_tokens`` 1): one worker (the source) computes the prefix, and its HiCache writes the
   pages through to its node's agent. One request does not make the prefix hot, so nothing is copied yet.
2. **Replicate.** ``btbctl replicate --prefix ID -n 1``: the gateway waits until the source's agent holds the pages,
   copies them to the target's agent (none when both workers share a node), then warms the target up.
3. **Proof.** The copy counts only if the warm-up's ``cached_tokens_details.storage`` covers the prefix (whole pages):
   the script reads it back from ``GET /control/replications/{prefix}`` and asserts it.
4. **Reuse.** The same prompt sent straight to the target: its ``cached_tokens`` must cover the prefix too, and its
   time to answer is printed next to the source's cold compute.

Prints one line per step (``--format json``: one JSON object) and exits 0 when the proof holds, 1 when it does not,
2 when the fleet cannot be used (not running, not ``l3``, fewer than two workers). It needs nothing but the
Python standard library and ``btbctl`` on the path of this interpreter (``-m btbctl``).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import urllib.error
import urllib.request

from btbctl.engine.httpclient import urlopen
from btbctl.sglang_l3.keys import page_keys

#: Header the gateway names the answering worker in (``btbctl.engine.launcher.bench.WORKER_HEADER``).
WORKER_HEADER = "X-BTB-Worker"


class Unusable(Exception):
    """The fleet cannot run the proof (exit status 2)."""


def _btbctl(*args: str, timeout: float = 600.0) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "btbctl", *args, "--format", "json"], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        raise Unusable(f"btbctl {args[0]} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout)


def _http(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method="GET" if body is None else "POST", headers={"Content-Type": "application/json"}
    )
    with urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read()), dict(resp.headers)


def _generate(base: str, ids: list[int]) -> tuple[float, dict, str | None]:
    """``(seconds, meta_info, answering worker)`` of one ``/generate`` of ``ids`` (one new token)."""
    t0 = time.perf_counter()
    ans, headers = _http(
        base.rstrip("/") + "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_cached_tokens_details": True,
        },
    )
    worker = next((v for k, v in headers.items() if k.lower() == WORKER_HEADER.lower()), None)
    return time.perf_counter() - t0, ans.get("meta_info") or {}, worker


def prove(run_dir: str | None, prefix_tokens: int, seed: int = 0, vocab: int = 32000) -> dict:
    """Run the four steps against the fleet of ``run_dir`` (None: btbctl's default); returns the result object
    (``ok``: whether the proof held). Raises :class:`Unusable`."""
    rd = ["--run-dir", run_dir] if run_dir else []
    st = _btbctl("status", *rd)
    if st.get("replication") != "l3":
        raise Unusable(f"the fleet's replication mode is {st.get('replication')!r}, not l3")
    healthy = [w for w in st["workers"] if w.get("healthy")]
    if len(healthy) < 2:
        raise Unusable(f"{len(healthy)} healthy worker(s); the proof needs two")
    control = st["control_url"].rstrip("/")
    if not 3 < vocab:
        raise Unusable(f"--vocab {vocab} leaves no token ids to draw")
    rng = random.Random(seed)
    # ids 3.. (past the usual pad/bos/eos) below the model's vocabulary: a real server fails on an id beyond it
    ids = [rng.randrange(3, vocab) for _ in range(prefix_tokens + 16)]

    # 1. compute the prefix on one worker
    compute_s, meta, source = _generate(st["gateway_url"], ids)
    # the gateway tracks this prompt's prefixes under its own page keys: find ours by key, never by recency (other
    # traffic may have arrived meanwhile)
    fleet, _ = _http(control + "/control/fleet")
    chain = set(page_keys(ids, int(fleet["page_size"])))
    prefixes, _ = _http(control + "/control/prefixes")
    ours = [p for p in prefixes["prefixes"] if p["id"] in chain]
    mine = max(ours, key=lambda p: p["prefix_blocks"], default=None)
    if mine is None:
        raise Unusable(
            "the gateway tracks no prefix of the compute request's prompt (prefix shorter than btb.prefix_blocks?)"
        )
    # 2. replicate it to one more worker
    t0 = time.perf_counter()
    rep = _btbctl("replicate", *rd, "--prefix", mine["id"], "-n", "1")
    replicate_s = time.perf_counter() - t0
    # 3. the proof, as the gateway recorded it
    record, _ = _http(control + f"/control/replications/{mine['id']}")
    copies = [t for t in record.get("copies", []) if t.get("mode") == "l3"]
    done = [t for t in copies if t["state"] == "done"]
    copy = done[-1] if done else (copies[-1] if copies else None)
    covered = copy.get("covered_tokens") if copy else None
    storage = copy.get("proof_storage_tokens") if copy else None
    proved = bool(done) and storage is not None and covered is not None and storage >= covered
    # 4. the target reuses it
    reuse = None
    if copy is not None and copy["state"] == "done":
        reuse_s, reuse_meta, _ = _generate(copy["target"], ids)
        reuse = {"seconds": reuse_s, "cached_tokens": reuse_meta.get("cached_tokens")}
        proved = proved and (reuse["cached_tokens"] or 0) >= covered
    return {
        "ok": proved,
        "prefix": mine["id"],
        "prefix_tokens": mine.get("prefix_tokens"),
        "prompt_tokens": len(ids),
        "source": source or (copy or {}).get("source"),
        "target": (copy or {}).get("target"),
        "compute_s": compute_s,
        "compute_cached_tokens": meta.get("cached_tokens"),
        "replicate_status": rep.get("status"),
        "replicate_s": replicate_s,
        "copy_state": (copy or {}).get("state"),
        "copy_error": (copy or {}).get("error"),
        "copy_bytes": (copy or {}).get("bytes_total"),
        "copy_transfer_s": (copy or {}).get("transfer_s"),
        "copy_duration_s": (copy or {}).get("duration_s"),
        "covered_tokens": covered,
        "proof": (copy or {}).get("proof"),
        "proof_storage_tokens": storage,
        "reuse": reuse,
    }


def _human(r: dict) -> str:
    reuse = r["reuse"] or {}
    lines = [
        (
            f"1. compute   a {r['prompt_tokens']}-token prompt on {r['source']}: {r['compute_s']:.3f} s; the gateway "
            f"tracks its first {r['prefix_tokens']} tokens as the prefix (its deepest tracked one; btb.prefix_blocks "
            "is the shortest)"
        ),
        (
            f"2. replicate to {r['target']}: copy {r['copy_state']} in {r['copy_duration_s'] or 0:.3f} s (source wait, "
            f"{r['copy_bytes'] or 0} bytes between agents in {r['copy_transfer_s'] or 0:.3f} s, warm-up"
            f"{'; ' + r['copy_error'] if r['copy_error'] else ''}); `btbctl replicate` answered "
            f"{r['replicate_status']} after {r['replicate_s']:.3f} s"
        ),
        f"3. proof     storage {r['proof_storage_tokens']} of {r['covered_tokens']} tokens ({r['proof']})",
        f"4. reuse     {reuse.get('cached_tokens')} cached tokens on the target, {reuse.get('seconds', 0):.3f} s",
        "PROVED" if r["ok"] else "NOT PROVED",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--run-dir", help="run directory of the fleet (default: btbctl's)")
    ap.add_argument("--prefix-tokens", type=int, default=16384, help="prefix length, tokens (default 16384)")
    ap.add_argument("--seed", type=int, default=int(time.time()), help="seed of the random token ids")
    ap.add_argument(
        "--vocab",
        type=int,
        default=32000,
        help="token ids are drawn below this; at most the served model's vocabulary size (default 32000)",
    )
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    try:
        r = prove(args.run_dir, args.prefix_tokens, args.seed, args.vocab)
    except (Unusable, urllib.error.URLError, OSError) as e:
        print(f"sglang-l3-proof: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2) if args.format == "json" else _human(r))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
