"""Routing under the cases people report against LLM routers (not a test; never gates CI).

Each case comes from a public bug report against SGLang's router, smg or vLLM's router; ``tests/test_routing_cases.py``
states the expectation of each as a test. This script measures them at full size and prints, per case and policy,
the requests each worker (or replica) served and TTFT p50 / p95 (seconds)::

    python benchmarks/bench_routing_cases.py                 # every case
    python benchmarks/bench_routing_cases.py --cases 4,5     # the simulated ones only (a few seconds)
    python benchmarks/bench_routing_cases.py --format json

Live cases start fresh emulated workers (Llama-3.3-70B on 4 x H100 each, ``btbctl worker``) and a fresh
``btbctl gateway`` for every policy, so no cache or routing state carries over, and replay with ``btbctl bench``'s
client; the worker that answered is read from the gateway's ``X-BTB-Worker`` header. Client, workers and gateway
share this machine's cores, so absolute times depend on it.

1. **Stock SGLang workers** (live): 4 workers without the ``/btb`` routes (the emulated worker with those routes
   answering 404, as a stock SGLang server does), so every copy is refused. 300 requests over 3 s sharing a
   16-block (4,096-token) prefix plus a unique 256-token suffix, 1 output token; BTB constants Y = 16, X = 2,
   Z = 1 s, M = 4.
2. **Ties** (live): (a) 20 sequential unrelated 256-token prompts on an idle fleet of 4 (zero-delay workers),
   (b) 400 sequential 64-token prompts (zero-delay), (c) 600 unique 512-token prompts at 30 req/s with 1-token
   answers (``--case2-scale`` compresses (c): workers and replay run that many times faster).
3. **Cold start** (live): 8 workers, 480 concurrent requests sharing a 15-block prefix plus one unique block, on a
   gateway that has just started, and on one that saw one unrelated request 2 s earlier.
4. **Published constants** (simulated, realistic profile): 300 requests over 3 s sharing a 65,536-token prefix plus a
   unique 256-token suffix, 1 output token, on 4 replicas of the default fleet; constants 2 / 256 / 1.0 / 4.
7. **Conversations** (live): 4 workers; 32 conversations sharing one 2,048-token system prompt, each 4-8 turns
   (seeded) of a ~300-token user message through ``/v1/chat/completions`` with 32-token answers, every turn carrying
   the earlier turns and answers, sent one after another per conversation, the conversations interleaved (each
   starts at a random time in the first 2 s). Reported: follow-up turns served where the previous turn was
   (``home``), follow-ups that found their history cached (``cached_history``: the worker reported at least the
   previous turn's prompt, less one page, as cached tokens), the mean cached share of a follow-up's prompt, and the
   conversations each worker served first turns of, and the p50 / p95 of a whole turn (answers are 32 tokens).
5. **Moderate sharing, two replicas** (simulated): 600 Poisson arrivals at 3 req/s of 9,800-token prompts sharing
   2,560 tokens, 430 output tokens, on 2 replicas of Qwen3-8B on one H100, seeds 0-4; mean and p95 TTFT averaged
   over the seeds and relative to round robin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from btbctl.engine.launcher.bench import BenchOptions, replay_async
from btbctl.engine.launcher.cluster import WorkerSpec, emulated_argv
from btbctl.engine.stats import summarize
from btbctl.engine.trace.model import Request, Trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import Fleet as RouterFleet

POLICIES = ("round_robin", "least_load", "cache_aware", "cache_aware_spill", "btb", "btb_plus")
BT = 256


# -- traces --------------------------------------------------------------------------------------------------------


def shared_burst(n: int, spread_s: float, prefix_blocks: int, tag: str, suffix_blocks: int = 1, out: int = 1) -> Trace:
    """``n`` requests arriving evenly over ``spread_s`` seconds, each ``prefix_blocks`` shared blocks plus
    ``suffix_blocks`` of its own, ``out`` output tokens."""
    prefix = tuple(f"{tag}-p{k}" for k in range(prefix_blocks))
    reqs = [
        Request(
            f"{tag}{i}",
            spread_s * i / n,
            (prefix_blocks + suffix_blocks) * BT,
            out,
            prefix + tuple(f"{tag}-u{i}-{k}" for k in range(suffix_blocks)),
            kind="burst",
        )
        for i in range(n)
    ]
    return Trace(reqs, BT, "generated")


def unique_prompts(n: int, tokens: int, tag: str, rate: float | None = None, seed: int = 0) -> Trace:
    """``n`` unrelated prompts of ``tokens`` tokens, 1 output token; all at 0 (``rate`` None) or Poisson at
    ``rate`` per second."""
    r = random.Random(seed)
    t = 0.0
    reqs = []
    for i in range(n):
        if rate:
            t += r.expovariate(rate)
        chain = tuple(f"{tag}-{i}-{k}" for k in range(tokens // BT))
        reqs.append(Request(f"{tag}{i}", t, tokens, 1, chain))
    return Trace(reqs, BT, "generated")


# -- live fleets ---------------------------------------------------------------------------------------------------


def _stock_worker(argv: list[str]) -> None:
    """Run an emulated worker whose ``/btb`` routes answer 404, like a stock SGLang server (child process)."""
    from aiohttp import web

    from btbctl.commands.app import main
    from btbctl.engine.worker import server

    build = server.build_app

    @web.middleware
    async def no_btb(request, handler):
        if request.path.startswith("/btb"):
            raise web.HTTPNotFound()
        return await handler(request)

    def build_stock(worker):
        app = build(worker)
        app.middlewares.append(no_btb)
        return app

    server.build_app = build_stock
    main(["worker", *argv])


class Fleet(RouterFleet):
    """Emulated workers (stock ones too) and one gateway, all stopped on exit."""

    def workers(self, n: int, *, stock: bool = False, zero_delay: bool = False, time_scale: float = 1.0) -> list[str]:
        spec = WorkerSpec(zero_delay=zero_delay, time_scale=time_scale)
        argvs = []
        for _ in range(n):
            argv = emulated_argv(spec, 0, 0)
            if stock:  # same flags, through this script's worker entry point
                argv = [sys.executable, __file__, "_stock_worker", *argv[argv.index("worker") + 1 :]]
            argvs.append(argv)
        return self.spawn_workers(argvs)

    def gateway(self, urls: Sequence[str], policy: str, prefix_blocks: int | None = None) -> str:
        return self.btbctl_gateway(urls, policy, prefix_blocks)


def _figures(report: dict, urls: Sequence[str]) -> dict:
    by = report["by_worker"]
    counts = [by.get(u, 0) for u in urls]
    mean = sum(counts) / len(counts)
    return {
        "per_worker": counts,
        "busiest_over_mean": round(max(counts) / mean, 2) if mean else None,
        "p50_s": report["ttft_s"]["p50"],
        "p95_s": report["ttft_s"]["p95"],
        "errors": report["errors"],
    }


async def _replay(url: str, trace: Trace, *, concurrency: int | None = None, time_scale: float = 1.0) -> dict:
    opts = BenchOptions(target=url, concurrency=concurrency, time_scale=time_scale, timeout_s=120.0)
    return (await replay_async(trace, opts)).as_dict()


def live_case(name: str, policies: Sequence[str], logdir: Path, **kw) -> dict:
    out = {}
    for pol in policies:
        with Fleet(logdir / name / pol) as fleet:
            out[pol] = asyncio.run(_live_one(name, pol, fleet, **kw))
    return out


async def _live_one(name: str, pol: str, fleet: Fleet, case2_scale: float = 5.0) -> dict:
    if name == "case1":
        urls = fleet.workers(4, stock=True)
        gw = fleet.gateway(urls, pol, prefix_blocks=16)
        return _figures(await _replay(gw, shared_burst(300, 3.0, 16, "c1")), urls)
    if name == "case2":
        res = {}
        urls = fleet.workers(4, zero_delay=True)
        gw = fleet.gateway(urls, pol)
        res["a_20_sequential"] = _figures(await _replay(gw, unique_prompts(20, 256, "c2a"), concurrency=1), urls)
        res["b_400_sequential"] = _figures(await _replay(gw, unique_prompts(400, 64, "c2b"), concurrency=1), urls)
        urls = fleet.workers(4, time_scale=case2_scale)
        gw = fleet.gateway(urls, pol)
        trace = unique_prompts(600, 512, "c2c", rate=30.0, seed=1)
        res["c_600_at_30rps"] = _figures(await _replay(gw, trace, time_scale=case2_scale), urls)
        return res
    if name == "case3":
        res = {}
        for warm in (False, True):
            urls = fleet.workers(8)
            gw = fleet.gateway(urls, pol)
            if warm:
                await _replay(gw, unique_prompts(1, 512, "c3w"))
                await asyncio.sleep(2.0)
            key = "after_one_request" if warm else "fresh_gateway"
            res[key] = _figures(await _replay(gw, shared_burst(480, 0.0, 15, f"c3{warm}")), urls)
        return res
    if name == "case7":
        urls = fleet.workers(4)
        gw = fleet.gateway(urls, pol)
        return await conversations(gw, urls)
    raise ValueError(name)


@dataclass(frozen=True)
class Conversations:
    """Case 7's shape: conversations, system prompt and user message (tokens of the emulated worker's 4-byte
    pseudo-tokenizer), answer tokens, turns per conversation (inclusive range), window of first turns (s)."""

    n: int = 32
    system_tokens: int = 2048
    turn_tokens: int = 300
    answer_tokens: int = 32
    turns: tuple[int, int] = (4, 8)
    start_s: float = 2.0


async def conversations(
    url: str, urls: Sequence[str], shape: Conversations = Conversations(), seed: int = 7, page_tokens: int = BT
) -> dict:
    """Case 7 against the gateway at ``url`` (workers ``urls``): see the module's docstring. Every turn must be
    answered 200. ``page_tokens``: the workers' page size (a history ending mid-page is cached up to its last full
    page)."""
    import aiohttp

    rng = random.Random(seed)
    sys_bytes = shape.system_tokens * 4
    system = "".join(f"system rule {i:04d}: be brief. " for i in range(sys_bytes // 16))[:sys_bytes]
    plans = [(c, rng.randint(*shape.turns), rng.uniform(0.0, shape.start_s)) for c in range(shape.n)]
    turns: list[dict] = []

    async def one(http: aiohttp.ClientSession, conv: int, n_turns: int, start_s: float) -> None:
        await asyncio.sleep(start_s)
        messages = [{"role": "system", "content": system}]
        last_prompt = 0
        for t in range(n_turns):
            words = "".join(f"word{rng.randint(0, 99999):05d} " for _ in range(shape.turn_tokens * 4 // 10))
            messages.append(
                {"role": "user", "content": f"conversation {conv} turn {t}: {words}"[: shape.turn_tokens * 4]}
            )
            body = {"model": "m", "messages": messages, "max_tokens": shape.answer_tokens}
            t0 = time.perf_counter()
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, (r.status, await r.text())
                ans = await r.json()
                worker = r.headers.get("X-BTB-Worker")
            took = time.perf_counter() - t0
            usage = ans["usage"]
            turns.append(
                {
                    "conv": conv,
                    "turn": t,
                    "worker": worker,
                    "prompt": usage["prompt_tokens"],
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                    "history": last_prompt,
                    "latency_s": took,
                }
            )
            last_prompt = usage["prompt_tokens"]
            messages.append({"role": "assistant", "content": ans["choices"][0]["message"]["content"]})

    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(one(http, *p) for p in plans))
    by_conv: dict[int, list[dict]] = {}
    for row in sorted(turns, key=lambda r: (r["conv"], r["turn"])):
        by_conv.setdefault(row["conv"], []).append(row)
    follow = home = cached_hist = 0
    shares = []
    for rows in by_conv.values():
        for prev, cur in zip(rows, rows[1:], strict=False):
            follow += 1
            home += cur["worker"] == prev["worker"]
            cached_hist += cur["cached"] >= cur["history"] - page_tokens
            shares.append(cur["cached"] / cur["prompt"])
    firsts = [sum(1 for rows in by_conv.values() if rows[0]["worker"] == u) for u in urls]
    served = [sum(1 for r in turns if r["worker"] == u) for u in urls]
    lat = summarize(r["latency_s"] for r in turns)  # linear percentiles, as percentile() gives
    return {
        "follow_ups": follow,
        "home": round(home / follow, 3),
        "cached_history": round(cached_hist / follow, 3),
        "cached_share": round(sum(shares) / len(shares), 3),
        "first_turns_per_worker": firsts,
        "per_worker": served,
        "turn_p50_s": round(lat["p50"], 3),
        "turn_p95_s": round(lat["p95"], 3),
    }


# -- simulated cases -----------------------------------------------------------------------------------------------


def sim_case4(policies: Sequence[str]) -> dict:
    from btbctl.engine.config import ClusterConfig
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.sim import simulate

    trace = shared_burst(300, 3.0, 256, "c4")
    out = {}
    for pol in policies:
        res = simulate(trace, pol, ClusterConfig(replicas=4), BtbConstants(), seed=1)
        counts = [sum(1 for r in res.records if r.replica == k) for k in range(4)]
        s = res.summary()["ttft_s"]
        out[pol] = {"per_worker": counts, "p50_s": s["p50"], "p95_s": s["p95"], "mean_s": s["mean"]}
    return out


def case5_trace(seed: int, n: int = 600) -> Trace:
    """600 Poisson arrivals at 3 req/s: 9,800-token prompts sharing the first 2,560 (10 blocks), 430 output tokens."""
    r = random.Random(seed)
    shared = tuple(f"c5-s{k}" for k in range(10))
    t = 0.0
    reqs = []
    for i in range(n):
        t += r.expovariate(3.0)
        own = tuple(f"c5-{seed}-{i}-{k}" for k in range(9800 // BT - len(shared)))
        reqs.append(Request(f"c5-{i}", t, 9800, 430, shared + own))
    return Trace(reqs, BT, "generated")


def sim_case5(policies: Sequence[str], seeds: Sequence[int] = range(5)) -> dict:
    from btbctl.engine.config import ClusterConfig
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.sim import simulate

    cluster = ClusterConfig(replicas=2, model="qwen3-8b", gpu="h100", gpus_per_replica=1)
    sums: dict[str, list[float]] = {p: [0.0, 0.0, 0.0] for p in policies}
    for seed in seeds:
        trace = case5_trace(seed)
        for pol in policies:
            s = simulate(trace, pol, cluster, BtbConstants(), seed=seed).summary()["ttft_s"]
            sums[pol][0] += s["mean"] / len(seeds)
            sums[pol][1] += s["p50"] / len(seeds)
            sums[pol][2] += s["p95"] / len(seeds)
    base = sums.get("round_robin")
    out = {}
    for pol, (mean, p50, p95) in sums.items():
        row = {"mean_s": mean, "p50_s": p50, "p95_s": p95}
        if base:
            row["mean_vs_round_robin"] = round(mean / base[0] - 1, 4)
            row["p95_vs_round_robin"] = round(p95 / base[2] - 1, 4)
        out[pol] = row
    return out


# -- main ------------------------------------------------------------------------------------------------------------


def _rows(row: dict) -> list[tuple[str, dict]]:
    return list(row.items()) if all(isinstance(v, dict) for v in row.values()) else [("", row)]


def _print(results: dict, baseline: str = "round_robin") -> None:
    """One line per case, policy (and sub-case): requests per worker, TTFT, and p50 / p95 relative to ``baseline``
    in the same run (``x1.00`` = equal)."""
    for case, by_policy in results.items():
        print(case)
        base = dict(_rows(by_policy[baseline])) if baseline in by_policy else {}
        for pol, row in by_policy.items():
            for sub, r in _rows(row):
                head = f"  {pol:18s} {sub:18s}"
                parts = [f"per worker {r['per_worker']}"] if "per_worker" in r else []
                parts += [
                    f"{k} {r[k]}"
                    for k in (
                        "home",
                        "cached_history",
                        "cached_share",
                        "first_turns_per_worker",
                        "turn_p50_s",
                        "turn_p95_s",
                    )
                    if k in r
                ]
                if r.get("busiest_over_mean") is not None:
                    parts.append(f"busiest/mean {r['busiest_over_mean']}")
                parts += [f"{k} {r[k]:.3f}" for k in ("mean_s", "p50_s", "p95_s") if r.get(k) is not None]
                b = base.get(sub)
                for k in ("p50_s", "p95_s"):
                    if b and r.get(k) is not None and b.get(k):
                        parts.append(f"{k[:3]}/{baseline} x{r[k] / b[k]:.2f}")
                parts += [f"{k} {r[k]:+.1%}" for k in ("mean_vs_round_robin", "p95_vs_round_robin") if k in r]
                if r.get("errors"):
                    parts.append(f"errors {r['errors']}")
                print(head + "  ".join(parts))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1,2,3,4,5", help="comma-separated case numbers (default: all)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    ap.add_argument("--case2-scale", type=float, default=5.0, help="time scale of case 2(c) (default 5)")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="btb-cases-") as tmp:
        logdir = Path(tmp)
        for c in cases:
            if c in ("1", "2", "3", "7"):
                results[f"case{c}"] = live_case(f"case{c}", policies, logdir, case2_scale=args.case2_scale)
            elif c == "4":
                results["case4"] = sim_case4(policies)
            elif c == "5":
                results["case5"] = sim_case5(policies)
            else:
                ap.error(f"unknown case {c!r}")
            if args.format == "human":
                _print({f"case{c}": results[f"case{c}"]})
                sys.stdout.flush()
    if args.format == "json":
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_stock_worker":
        _stock_worker(sys.argv[2:])
    else:
        main()
