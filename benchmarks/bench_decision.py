"""Cost of one routing decision of the gateway: burst detector plus policy ``route()`` for a 64k-token prompt on
16 workers (not a test; never gates CI).

    python benchmarks/bench_decision.py [--decisions 10000] [--rounds 3] [--clock cpu] [--format json]

The decision is the gateway's own :meth:`~btbctl.engine.gateway.lifecycle.RequestLifecycle.pick` on a real
:class:`~btbctl.engine.gateway.server.Gateway` (never started: no sockets) whose 16 workers are marked healthy,
BTB-capable and copy-capable, with their fleet state (:class:`~btbctl.engine.gateway.state.FleetState`, the
policies' view) filled in: every prompt's 256-block chain held by two workers, 0-7 requests in flight on each.
The decisions run inside an event loop, as in the gateway, and the replicator really accepts the policies' copy
plans (a :class:`~btbctl.engine.gateway.state.Transfer` recorded, a task created); the one stub is that task's
body, the copy job itself (network calls, off the decision path), which does nothing here, so the copies stay in
flight for the whole run, as during a burst. Each decision routes one request of a burst: ``--prompts`` prompts of
256 blocks of 256 tokens (65,536 tokens; the published ``prefix_blocks`` is 256, so the whole prompt is the
detector's prefix) in turn, so the detector sees each prefix arriving over and over and the prefixes turn hot. Each
request carries a chain of its own (:func:`fresh`: new string objects, as the gateway's hashing makes per request),
so the decision pays what it pays live: the hashes of its blocks computed in its lookups, and no comparison of two
chains finding the same objects.

The routing core's build (compiled or plain Python, README "Compiled core") is printed with the figures. Reported
per policy (``btb``, ``btb_plus``, ``cache_aware``, and ``round_robin`` as the floor of the same call
path): p50/p99/mean of ``pick()`` in microseconds over ``--decisions`` decisions (the median over ``--rounds``
interleaved rounds, each on a fresh gateway, with every round's p99 to show the spread), and the ratio to the
round-robin p50. Separately, the cost of turning the prompt into its chain (xxh3 over the 256 KB of packed tokens:
:func:`btbctl.engine.gateway.prompt.chain_from_packed`), which the gateway pays once per request before the
decision (for a body over ``offload_bytes``, 256 KB by default, in its hashing thread), and the sum of both.

``--live`` runs each round as a gateway serves the burst (the figure the gateway pays): every decision's request
is started on its worker through the lifecycle (``start``, ``sent``), gets its first byte once the worker's FIFO
prefill queue reaches it and has computed the blocks it lacks there (:data:`LIVE_PREFILL_S_PER_BLOCK`), finishes
:data:`LIVE_DECODE_S` later, and the copies the policy ordered land :data:`LIVE_COPY_S` after they were ordered; the
arrivals come every ``1 / --rate`` seconds of a clock the benchmark moves (no sleeps). Without it the workers'
state stays as set up (no request ever starts), which flatters anything a decision keeps between decisions.

``--clock cpu`` times each decision with this thread's CPU clock instead of the wall clock: on a shared machine
the wall-clock p99 is mostly the scheduler handing the core to someone else mid-decision (a few ms), which the
CPU clock leaves out (it adds its own read, about a microsecond, to every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import statistics
import sys
import time

from btbctl.engine.compiled import core_build
from btbctl.engine.copies import CopyOutcome, CopyState
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.gateway.prompt import chain_from_packed
from btbctl.engine.gateway.server import GC_THRESHOLDS, Gateway
from btbctl.engine.hashing import pack_tokens
from btbctl.engine.trace.model import Request

WORKERS = 16
BLOCKS = 256
PAGE = 256
POLICIES = ("round_robin", "btb", "btb_plus", "cache_aware")
#: ``--live``: seconds a worker spends per block it computes (a 256-block prompt computed whole: 1.28 s, the order
#: of a 64k-token prefill on an H100 x 4; a warm one: next to nothing), seconds of decode after the first byte, and
#: seconds from a copy's order to its landing (load generators, not measurements).
LIVE_PREFILL_S_PER_BLOCK = 0.005
LIVE_DECODE_S = 0.5
LIVE_COPY_S = 0.2


class MovedClock:
    """The gateway's clock in ``--live`` mode: seconds the benchmark sets."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prompts(n: int) -> list[bytes]:
    """``n`` distinct 64k-token prompts, packed uint32 (what the data plane hashes)."""
    return [pack_tokens([(p * 7919 + i * 31) % 50000 for i in range(BLOCKS * PAGE)]) for p in range(n)]


def fresh(chain: tuple[str, ...]) -> tuple[str, ...]:
    """An equal chain of new string objects (their hashes not computed yet), as a request's own hashing gives."""
    return tuple([(h + "-")[:-1] for h in chain])


def percentiles(ns: list[int]) -> dict:
    us = sorted(x / 1000 for x in ns)
    return {
        "p50_us": us[len(us) // 2],
        "p99_us": us[min(len(us) - 1, int(len(us) * 0.99))],
        "mean_us": statistics.fmean(us),
    }


def median_round(runs: list[dict]) -> dict:
    """One row from ``runs`` of the same policy: the median of each percentile over the rounds, plus every round's
    p99 (``p99_us_rounds``) to show the spread."""
    out = dict(runs[0])
    for k in ("p50_us", "p99_us", "mean_us"):
        out[k] = statistics.median(r[k] for r in runs)
    out["p99_us_rounds"] = [round(r["p99_us"], 1) for r in runs]
    return out


def gateway(policy: str, seed: int, clock: MovedClock | None = None) -> tuple[Gateway, list[int]]:
    urls = [f"http://127.0.0.1:{20000 + i}" for i in range(WORKERS)]
    cfg = GatewayConfig(workers=urls, policy=policy, page_size=PAGE, seed=seed, token="x")
    gw = Gateway(cfg, clock)
    for w in gw.state.workers:
        w.healthy = True
        w.health_error = None
        w.btb = True
        w.info = {"page_size": PAGE, "transfer_addr": f"127.0.0.1:{30000 + w.index}", "capacity_tokens": 1 << 22}
        w.capacity_blocks = (1 << 22) // PAGE
    gw._settle_page_size()
    gw._install_policy(gw.policy, None)
    jobs = [0]

    async def job(t, source_confirmed=False) -> None:  # the copy itself: not part of the decision
        jobs[0] += 1

    gw.replicator._job = job  # type: ignore[method-assign]
    return gw, jobs


async def bench_policy(
    policy: str,
    chains: list[tuple],
    decisions: int,
    seed: int,
    clock_ns=time.perf_counter_ns,
    live_rate: float | None = None,
) -> dict:
    moved = MovedClock() if live_rate else None
    gw, jobs = gateway(policy, seed, moved)
    ws = gw.state.workers
    for k, chain in enumerate(chains):  # each prompt held by two workers, as after earlier requests
        ws[(2 * k) % WORKERS].hold(chain)
        ws[(2 * k + 1) % WORKERS].hold(chain)
    if moved is None:
        for w in ws:
            w.inflight = (w.index * 5) % 8
    clock = gw.clock
    life = gw.lifecycle
    choose = life.pick
    times: list[int] = []
    picked = [0] * WORKERS
    warm = min(1000, decisions // 10)
    events: list[tuple[float, int, str, object]] = []  # --live: (time, order, what, attempt or copy)
    busy_until = [0.0] * WORKERS  # --live: when each worker's FIFO prefill queue is through
    landing: set[str] = set()  # --live: copies whose landing is scheduled
    for i in range(decisions + warm):
        if moved is not None:
            moved.now = i / live_rate
            live_events(gw, events, moved)
        req = Request(
            request_id=str(i),
            arrival_s=clock(),
            input_tokens=BLOCKS * PAGE,
            output_tokens=1,
            block_hashes=fresh(chains[i % len(chains)]),
        )
        t = clock_ns()
        pick = choose(req, ())
        dt = clock_ns() - t
        if i >= warm:
            times.append(dt)
            if pick is not None:
                picked[pick[0]] += 1
        if moved is not None and pick is not None:
            live_start(gw, req, pick, events, busy_until, landing, i)
    out = {"policy": policy, "decisions": decisions, **percentiles(times)}
    await asyncio.sleep(0)  # let the copy jobs' (empty) tasks run
    out["copies_started"] = len(gw.state.transfers.all())
    out["detector_fires"] = gw.detector.stats()["fires"]
    out["workers_picked"] = sum(1 for c in picked if c)
    out["requests_served"] = sum(w.served for w in ws)  # --live: answered before the last decision (else 0)
    return out


def live_start(
    gw: Gateway,
    req: Request,
    pick: tuple[int, int],
    events: list,
    busy_until: list[float],
    landing: set[str],
    order: int,
) -> None:
    """``--live``: start ``req`` on the picked worker as the data plane does, schedule its first byte and its end,
    and the landing of the copies ordered for it (``landing``: the ids of the copies whose landing is scheduled)."""
    life, now = gw.lifecycle, gw.clock()
    idx, pace = pick
    a = life.start(req, idx, pace, True)
    life.sent(a)
    computes = len(req.block_hashes) - a.worker.held_blocks(req.block_hashes)
    first = max(now, busy_until[idx]) + LIVE_PREFILL_S_PER_BLOCK * computes
    busy_until[idx] = first
    heapq.heappush(events, (first, 2 * order, "first_byte", a))
    heapq.heappush(events, (first + LIVE_DECODE_S, 2 * order + 1, "end", a))
    for t in gw.state.transfers.all():
        if t.active and t.copy_id not in landing:
            landing.add(t.copy_id)
            heapq.heappush(events, (now + LIVE_COPY_S, 2 * order, "copy_done", t))


def live_events(gw: Gateway, events: list, moved: MovedClock) -> None:
    """``--live``: what happened up to ``moved.now`` (first bytes, ends, copies landing), in time order."""
    life, now = gw.lifecycle, moved.now
    while events and events[0][0] <= now:
        at, _, what, obj = heapq.heappop(events)
        moved.now = at
        if what == "first_byte":
            life.first_byte(obj, at)  # type: ignore[arg-type]
        elif what == "end":
            life.answered(obj, "200")  # type: ignore[arg-type]
            life.end(obj)  # type: ignore[arg-type]
        elif obj.active:  # type: ignore[attr-defined]
            gw.replicator._finish(obj, CopyState.DONE, "copy_done", outcome=CopyOutcome.DONE)  # type: ignore[arg-type]
    moved.now = now


def bench_hashing(data: list[bytes], n: int, clock_ns=time.perf_counter_ns) -> dict:
    times = []
    for i in range(n):
        d = data[i % len(data)]
        t = clock_ns()
        chain_from_packed(d, PAGE)
        times.append(clock_ns() - t)
    return {"what": "chain_from_packed, 64k tokens", "runs": n, **percentiles(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decisions", type=int, default=10000)
    ap.add_argument("--prompts", type=int, default=8, help="distinct 64k-token prompts of the burst (default 8)")
    ap.add_argument("--hash-runs", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; percentiles are their medians")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="time decisions by (default wall)")
    ap.add_argument("--live", action="store_true", help="start every request and land every copy (see above)")
    ap.add_argument("--rate", type=float, default=50.0, help="--live: arrivals per second (default 50)")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args()
    data = prompts(args.prompts)
    # as the gateway process runs (server.run_gateway): start-up out of the collector's way, its young generation
    # collected less often
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    chains = [chain_from_packed(d, PAGE) for d in data]
    clock_ns = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    rounds: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in range(args.rounds):  # interleaved: every policy sees the same spells of machine load
        for p in POLICIES:
            live = args.rate if args.live else None
            rounds[p].append(asyncio.run(bench_policy(p, chains, args.decisions, args.seed, clock_ns, live)))
    rows = [median_round(rounds[p]) for p in POLICIES]
    floor = rows[0]["p50_us"]
    for r in rows:
        r["p50_over_round_robin"] = r["p50_us"] / floor if floor else None
    hashing = bench_hashing(data, args.hash_runs, clock_ns)
    for r in rows:
        r["with_hashing_p50_us"] = r["p50_us"] + hashing["p50_us"]
        r["with_hashing_p99_us"] = r["p99_us"] + hashing["p99_us"]
    if args.format == "json":
        out = {"workers": WORKERS, "prompt_tokens": BLOCKS * PAGE, "clock": args.clock, "live": args.live}
        out["routing_core"] = core_build()
        out["decisions"] = rows
        print(json.dumps({**out, "hashing": hashing}))
        return 0
    print(
        f"decision = RequestLifecycle.pick() (detector + policy route), {WORKERS} workers, "
        f"{BLOCKS * PAGE}-token prompts "
        f"({BLOCKS} blocks of {PAGE}), {args.prompts} prompts in turn, {args.decisions} decisions, {args.clock} clock, "
        f"{f'live at {args.rate:g}/s' if args.live else 'static fleet'}, "
        f"median of {args.rounds} interleaved rounds, routing core {core_build()}"
    )
    print(
        f"{'policy':12} {'p50 us':>8} {'p99 us':>8} {'mean us':>8} {'p50/rr':>7} {'copies':>6} {'fires':>6} "
        f"{'+hash p50':>10} {'+hash p99':>10}  p99 per round"
    )
    for r in rows:
        print(
            f"{r['policy']:12} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f} {r['mean_us']:>8.1f} "
            f"{r['p50_over_round_robin']:>7.2f} {r['copies_started']:>6} {r['detector_fires']:>6} "
            f"{r['with_hashing_p50_us']:>10.1f} {r['with_hashing_p99_us']:>10.1f}  {r['p99_us_rounds']}"
        )
    print(
        f"hashing the prompt (chain_from_packed, {BLOCKS * PAGE} tokens): p50 {hashing['p50_us']:.1f} us, "
        f"p99 {hashing['p99_us']:.1f} us (paid once per request before the decision; '+hash' columns add the "
        "percentiles, an upper bound of the sum's)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
