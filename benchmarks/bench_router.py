"""BTB gateway vs SGLang's router (smg) in front of the same emulated workers (not a test; never gates CI).

Needs the ``smg`` executable, which this script never installs:

    pip install smg==1.13.0            # or: pip install '.[bench]'
    python benchmarks/bench_router.py [--smg PATH] [--format json]

Two parts, each on fresh emulated workers (4 x Llama-3.3-70B on 4 x H100, the default fleet) so no cache carries
over from one router to the next:

1. **Burst TTFT.** One compressed Bursted burst (``--burst-size`` requests sharing a ``--prefix-blocks`` x 256-token
   prefix plus a unique 256-token suffix, arriving evenly over ``--spread-s`` seconds; repeated for every value of
   ``--prefix-blocks``) is replayed with ``btbctl bench``'s client against: ``smg launch --policy cache_aware``
   (its defaults), the btbctl gateway with ``btb`` and with ``btb_plus`` (``prefix_blocks`` set to the burst's
   prefix) and the btbctl gateway with ``cache_aware`` (``--routers`` picks a subset). Reports mean/p50/p95 TTFT,
   the requests each worker served, the first answer's time, each copy's start and finish (from the source
   workers' ``/btb/copies``, seconds after the replay started), and the ratios ``btb p95 / smg p95`` and
   ``btb_plus p95 / smg p95`` (goal: at most 0.5). ``--repeat N`` runs every round N times; the ratios are then
   per run and their median.
   What to expect from the rules (not a measured claim): every request of the burst needs the prefix, which
   exists nowhere before the first request's cold prefill ends, so no router's p95 can drop below about that
   prefill plus the suffixes queued behind it. ``btb`` (the published rule) routes a hot request only to replicas
   holding all Y blocks; while the copies are in flight that is the source alone, so every request arriving
   during the source's prefill queues there (with a prefix whose prefill outlasts the burst, all of them: ``btb``
   then equals ``cache_aware``). ``btb_plus`` sends them to the copy targets, where they wait for the copy and
   then compute only their suffix, in parallel. The emulated workers move scaled-down blocks over loopback TCP
   without pacing them to the NIC's bandwidth, so copies take less time than on the pretended hardware (a
   64-block Llama-3.3-70B prefix is about 27 ms at 200 GB/s).
2. **Gateway overhead.** Workers started with ``--zero-delay`` (they answer at once), short unique prompts
   (``--overhead-tokens``), ``max_new_tokens`` 1, no streaming. A closed loop of ``--overhead-requests`` requests
   is sent (a) round-robin straight to the workers (no router), (b) through smg, (c) through the btbctl gateway
   (``btb``): at concurrency 1 the p50 and p99 latencies give the *added p50/p99* of each router over direct
   (goals for btbctl: p50 < 0.3 ms, p99 < 2 ms); at ``--overhead-concurrency`` the requests per second give the
   throughput at saturation (goal: btbctl >= 1.2 x smg). ``--overhead-runs`` (default 3) repeats the whole part,
   each run on fresh workers; every run gives its own ``btbctl / smg`` throughput ratio.

   **Same core budget.** Both routers get the same CPU set, ``--router-cpus`` (default: the last CPU this script
   may run on), and the workers and the client get the rest: each router process is started with that CPU
   affinity (inherited by all its threads), the workers and this script with the other CPUs. smg has no
   thread-count option of its own (``smg launch --help``); its Tokio runtime sizes itself to the CPUs it may use,
   and ``TOKIO_WORKER_THREADS`` is set to that count as well, so it runs as many worker threads as it has cores.
   The btbctl gateway is one event loop (one thread, plus a hashing pool for big prompts only). With fewer than
   two CPUs, or ``--router-cpus none``, nothing is pinned. Each router's CPU time per request over the throughput
   loop (user + system, all its threads, from ``/proc``) is reported too: on a machine shared with other work the
   throughput moves with everyone else's load, the CPU cost per request much less.

Client, workers and routers share this machine's cores, so absolute numbers depend on it; ratios measured in the
same run are the result. ``--skip-smg`` runs the btbctl parts alone; ``--skip-overhead`` skips part 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from btbctl.engine.compiled import core_build
from btbctl.engine.errors import BtbctlError
from btbctl.engine.httpclient import client_session, urlopen
from btbctl.engine.launcher.bench import BenchOptions, block_text, replay
from btbctl.engine.launcher.cluster import WorkerSpec, emulated_argv
from btbctl.engine.launcher.fleet import free_port
from btbctl.engine.launcher.local import Started, spawn, stop_group, wait_ready
from btbctl.engine.stats import summarize
from btbctl.engine.trace.generate import BurstedParams, generate_bursted

#: smg release the comparison was written against (REFERENCE.md s4).
SMG_VERSION = "1.13.0"
WORKERS = 4
#: Routers of the burst part, in the order they run.
ROUTERS = ("smg cache_aware", "btbctl btb", "btbctl btb_plus", "btbctl cache_aware")


class Fleet:
    """Emulated workers and one router, all stopped on exit (the other live benchmarks build on it)."""

    def __init__(self, logdir: Path, name: str = "") -> None:
        self.logdir = logdir / name if name else logdir
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Started] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                stop_group(p.pid, grace_s=8.0, popen=p.popen)

    def spawn_workers(self, argvs: list[list[str]]) -> list[str]:
        """Start one worker per command line (``worker-<i>``), wait until all are ready; their URLs."""
        started = []
        for i, argv in enumerate(argvs):
            p = spawn(f"worker-{i}", argv, self.logdir / f"worker-{i}.log")
            self.procs.append(p)
            started.append(p)
        for p in started:
            wait_ready(p, 60.0)
        return [p.url for p in started]

    def workers(self, zero_delay: bool) -> list[str]:
        spec = WorkerSpec(zero_delay=zero_delay)
        return self.spawn_workers([emulated_argv(spec, 0, 0) for _ in range(WORKERS)])

    def btbctl_gateway(
        self, urls: Sequence[str], policy: str, prefix_blocks: int | None, *extra: str, log_level: str = "warning"
    ) -> str:
        """``btbctl gateway`` on free ports in front of ``urls`` (``extra``: more of its flags); its URL."""
        argv = [sys.executable, "-m", "btbctl", "gateway", "--port", "0", "--control-port", "0"]
        argv += ["--policy", policy, "--log-level", log_level, *extra]
        if prefix_blocks is not None:
            argv += ["--prefix-blocks", str(prefix_blocks)]
        for u in urls:
            argv += ["--worker", u]
        p = spawn("gateway", argv, self.logdir / "gateway.log")
        self.procs.append(p)
        wait_ready(p, 60.0)
        return p.url

    def smg(self, exe: str, urls: list[str], policy: str = "cache_aware", threads: int | None = None) -> str:
        """``smg launch --policy POLICY`` (its defaults otherwise) with its metrics listener on a free loopback port
        (smg's default, 0.0.0.0:29000, fails when another smg runs on this machine); ready once it admitted the
        workers. Returns its URL."""
        port, metrics_port = free_port(), free_port()
        argv = [exe, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
        argv += ["--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
        argv += ["--log-level", "warn"]
        env = {"TOKIO_WORKER_THREADS": str(threads)} if threads else None
        p = spawn("smg", argv, self.logdir / "smg.log", env=env)
        self.procs.append(p)
        url = f"http://127.0.0.1:{port}"
        wait_ready(p, 60.0, health_url=url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # /health answers before the workers are admitted
            try:
                with urlopen(url + "/readiness", timeout=2) as r:
                    body = json.loads(r.read())
                if body.get("healthy_workers") == len(urls):
                    return url
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise BtbctlError(f"smg did not admit all {len(urls)} workers within 30 s (log {self.logdir / 'smg.log'})")


# ---------------------------------------------------------------------------------------------------------------
# part 1: burst TTFT


def burst_trace(n: int, prefix_blocks: int, spread_s: float, seed: int):
    return generate_bursted(
        BurstedParams(
            bursts=1,
            burst_size=n,
            first_burst_s=0.0,
            jitter_s=0.0,
            spread_s=spread_s,
            prefix_tokens=prefix_blocks * 256,
            suffix_tokens=256,
            output_tokens=1,
            decoys=0,
        ),
        seed=seed,
    )


def burst_round(router: str, args, logdir: Path, prefix_blocks: int) -> dict:
    trace = burst_trace(args.burst_size, prefix_blocks, args.spread_s, args.seed)
    with Fleet(logdir, f"burst-{prefix_blocks}-{router}") as fleet:
        urls = fleet.workers(zero_delay=False)
        if router == "smg cache_aware":
            target = fleet.smg(args.smg, urls)
        else:
            target = fleet.btbctl_gateway(urls, router.split()[-1], prefix_blocks)
        unix0 = time.time()
        report = replay(trace, BenchOptions(target))
        rep = report.as_dict()
        counts = [worker_counters(u) for u in urls]
        copies = copy_timeline(urls, unix0)
    ok = [r for r in report.results if r.ttft_s is not None]
    return {
        "router": router,
        "prefix_blocks": prefix_blocks,
        "requests": rep["requests"],
        "errors": rep["errors"],
        "ttft_s": rep["ttft_s"],
        "workers_used": sum(1 for c in counts if c["requests"] > 0),
        "served_per_worker": [c["requests"] for c in counts],
        "prefill_tokens_computed": sum(c["prompt_tokens"] - c["cached_tokens"] for c in counts),
        "first_answer_s": min((r.sent_s + r.ttft_s for r in ok), default=None),
        "copies": copies,
    }


def copy_timeline(urls: list[str], unix0: float) -> list[dict]:
    """The copies the workers sent (source records of ``GET /btb/copies``): ``{"source", "target" (worker
    index or the transfer address), "state", "blocks", "started_s", "finished_s"}`` with times in seconds after
    ``unix0`` (the replay's start, Unix seconds), oldest first. Plain SGLang workers (404) contribute nothing."""
    addrs = {}
    for i, u in enumerate(urls):
        try:
            with urlopen(u + "/btb/info", timeout=10) as r:
                addrs[json.loads(r.read()).get("transfer_addr")] = i
        except (OSError, ValueError):
            pass
    out = []
    for i, u in enumerate(urls):
        try:
            with urlopen(u + "/btb/copies", timeout=10) as r:
                recs = json.loads(r.read()).get("copies", [])
        except (OSError, ValueError):
            continue
        for c in recs:
            if c.get("role") != "source":
                continue
            fin = c.get("finished_s")
            out.append(
                {
                    "source": i,
                    "target": addrs.get(c.get("peer"), c.get("peer")),
                    "state": c.get("state"),
                    "blocks": c.get("blocks"),
                    "started_s": round(c["started_s"] - unix0, 3),
                    "finished_s": None if fin is None else round(fin - unix0, 3),
                }
            )
    out.sort(key=lambda c: c["started_s"])
    return out


def worker_counters(url: str) -> dict:
    """``{"requests", "prompt_tokens", "cached_tokens"}`` a worker reports on ``/metrics`` (SGLang's
    ``sglang:num_requests``, ``sglang:prompt_tokens`` and ``sglang:cached_tokens`` counters, summed over labels)."""
    with urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"requests": 0.0, "prompt_tokens": 0.0, "cached_tokens": 0.0}
    names = {
        "sglang:num_requests_total": "requests",
        "sglang:prompt_tokens_total": "prompt_tokens",
        "sglang:cached_tokens_total": "cached_tokens",
    }
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(line.rsplit(" ", 1)[1])
    return {k: int(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------------------------
# part 2: overhead


async def closed_loop(urls: list[str], n: int, concurrency: int, tokens: int, tag: str) -> dict:
    """``n`` non-streaming ``/generate`` requests, ``concurrency`` at a time, spread round-robin over ``urls``;
    latencies in seconds and requests per second."""
    import aiohttp

    prompts = [block_text(f"{tag}:{i}", tokens) for i in range(n)]
    lat: list[float] = []
    errors = 0
    nxt = 0
    conn = aiohttp.TCPConnector(limit=0)
    async with client_session(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(i: int) -> None:
            nonlocal errors
            body = {"text": prompts[i], "sampling_params": {"max_new_tokens": 1}}
            t = time.perf_counter()
            try:
                async with s.post(urls[i % len(urls)] + "/generate", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        errors += 1
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1
                return
            lat.append(time.perf_counter() - t)

        async def runner() -> None:
            nonlocal nxt
            while nxt < n:
                i = nxt
                nxt += 1
                await one(i)

        # warm the connection pools
        await asyncio.gather(*(one(i) for i in range(min(concurrency, n))))
        lat.clear()
        errors = 0
        nxt = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(runner() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    s_ = summarize(lat)
    return {
        "requests": n,
        "errors": errors,
        "concurrency": concurrency,
        "requests_per_s": len(lat) / wall,
        "p50_s": s_["p50"],
        "p95_s": s_["p95"],
        "p99_s": s_["p99"],
    }


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Processes started inside the block (and this process meanwhile) run on ``cpus`` only; None: no change."""
    if not cpus:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def cpu_split(spec: str) -> tuple[set[int] | None, set[int] | None]:
    """``(router CPUs, everyone else's CPUs)`` from ``--router-cpus`` (``auto``: the last allowed CPU; ``none``;
    or a comma-separated list); ``(None, None)`` when nothing is pinned."""
    if not hasattr(os, "sched_getaffinity") or spec == "none":
        return None, None
    allowed = sorted(os.sched_getaffinity(0))
    router = {allowed[-1]} if spec == "auto" else {int(x) for x in spec.split(",") if x.strip()}
    rest = set(allowed) - router
    if len(allowed) < 2 or not rest or not router <= set(allowed):
        return None, None
    return router, rest


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far; None without ``/proc``."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def overhead(args, logdir: Path) -> list[dict]:
    router_cpus, rest_cpus = cpu_split(args.router_cpus)
    rows = []
    for run in range(args.overhead_runs):
        with pinned(rest_cpus), Fleet(logdir, f"overhead-{run}") as fleet:
            urls = fleet.workers(zero_delay=True)
            targets: list[tuple[str, list[str], int | None]] = [("direct", urls, None)]
            with pinned(router_cpus):
                if not args.skip_smg:
                    threads = len(router_cpus) if router_cpus else None
                    url = fleet.smg(args.smg, urls, threads=threads)
                    targets.append(("smg cache_aware", [url], fleet.procs[-1].pid))
                url = fleet.btbctl_gateway(urls, "btb", 256)
                targets.append(("btbctl btb", [url], fleet.procs[-1].pid))
            run_rows = []
            for name, tgt, pid in targets:
                lat = asyncio.run(
                    closed_loop(tgt, args.overhead_latency_requests, 1, args.overhead_tokens, f"{name}-l{run}")
                )
                cpu0 = process_cpu_s(pid)
                thr = asyncio.run(
                    closed_loop(
                        tgt, args.overhead_requests, args.overhead_concurrency, args.overhead_tokens, f"{name}-t{run}"
                    )
                )
                cpu1 = process_cpu_s(pid)
                # the warm-up requests of closed_loop count too (one per connection)
                n_sent = args.overhead_requests + min(args.overhead_concurrency, args.overhead_requests)
                run_rows.append(
                    {
                        "target": name,
                        "run": run,
                        "router_cpus": sorted(router_cpus) if router_cpus and name != "direct" else None,
                        "p50_s_at_c1": lat["p50_s"],
                        "p95_s_at_c1": lat["p95_s"],
                        "p99_s_at_c1": lat["p99_s"],
                        "requests_per_s": thr["requests_per_s"],
                        "router_cpu_us_per_request": None
                        if cpu0 is None or cpu1 is None
                        else (cpu1 - cpu0) / n_sent * 1e6,
                        "concurrency": thr["concurrency"],
                        "errors": lat["errors"] + thr["errors"],
                    }
                )
        direct = run_rows[0]
        for r in run_rows:
            r["added_p50_ms"] = (r["p50_s_at_c1"] - direct["p50_s_at_c1"]) * 1000
            r["added_p99_ms"] = (r["p99_s_at_c1"] - direct["p99_s_at_c1"]) * 1000
        rows += run_rows
    return rows


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smg", default=shutil.which("smg"), help="smg executable (default: smg on PATH)")
    ap.add_argument("--skip-smg", action="store_true", help="measure the btbctl gateway only")
    ap.add_argument("--skip-overhead", action="store_true", help="run the burst part only")
    ap.add_argument(
        "--routers",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(ROUTERS),
        help="comma-separated subset of: " + ", ".join(ROUTERS),
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs of every burst round (default 1)")
    ap.add_argument("--burst-size", type=int, default=80)
    ap.add_argument(
        "--prefix-blocks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[8, 64],
        help="comma-separated prefix lengths in 256-token blocks (default 8,64)",
    )
    ap.add_argument("--spread-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--overhead-requests", type=int, default=3000)
    ap.add_argument("--overhead-latency-requests", type=int, default=500)
    ap.add_argument("--overhead-concurrency", type=int, default=64)
    ap.add_argument("--overhead-tokens", type=int, default=256)
    ap.add_argument("--overhead-runs", type=int, default=3, help="runs of the overhead part, fresh workers each")
    ap.add_argument(
        "--router-cpus",
        default="auto",
        help="CPUs of each router in the overhead part: auto (the last allowed CPU), none, or a list like 1 or 2,3",
    )
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args()
    if not args.skip_smg and not args.smg:
        sys.stderr.write(f"smg not found: pip install smg=={SMG_VERSION} (or pass --smg PATH, or --skip-smg)\n")
        return 2
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown or args.repeat < 1 or args.overhead_runs < 1:
        sys.stderr.write(
            f"bench_router: unknown router(s) {unknown}; valid: {', '.join(ROUTERS)}; "
            "--repeat and --overhead-runs must be >= 1\n"
        )
        return 2
    routers = [r for r in args.routers if not (args.skip_smg and r.startswith("smg"))]
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        logdir = Path(tmp)
        try:
            burst = []
            for run in range(args.repeat):
                for pb in args.prefix_blocks:
                    for r in routers:
                        row = burst_round(r, args, logdir, pb)
                        row["run"] = run
                        burst.append(row)
            over = [] if args.skip_overhead else overhead(args, logdir)
        except BtbctlError as e:
            sys.stderr.write(f"bench_router: error: {e}\n")
            return 2
    ratios: dict = {}
    for pb in args.prefix_blocks:
        for num, den in (
            ("btbctl btb", "smg cache_aware"),
            ("btbctl btb_plus", "smg cache_aware"),
            ("btbctl btb", "btbctl cache_aware"),
            ("btbctl btb_plus", "btbctl cache_aware"),
        ):
            per_run = []
            for run in range(args.repeat):
                by = {r["router"]: r for r in burst if r["prefix_blocks"] == pb and r["run"] == run}
                if num in by and den in by and by[den]["ttft_s"]["p95"]:
                    per_run.append(by[num]["ttft_s"]["p95"] / by[den]["ttft_s"]["p95"])
            if per_run:
                den_name = den.replace("btbctl ", "btbctl_").replace("smg ", "smg_")
                name = f"{num.split()[-1]}_p95_over_{den_name}_p95@{pb}"
                ratios[name] = statistics.median(per_run)
                if args.repeat > 1:
                    ratios[name + "_runs"] = per_run
    thr_runs = []
    for run in sorted({r["run"] for r in over}):
        ov = {r["target"]: r for r in over if r["run"] == run}
        if "smg cache_aware" in ov and "btbctl btb" in ov:
            thr_runs.append(ov["btbctl btb"]["requests_per_s"] / ov["smg cache_aware"]["requests_per_s"])
    if thr_runs:
        ratios["btbctl_over_smg_throughput"] = statistics.median(thr_runs)
        ratios["btbctl_over_smg_throughput_runs"] = thr_runs
    result = {
        "smg_version": SMG_VERSION if not args.skip_smg else None,
        "routing_core": core_build(),  # the btbctl the gateway runs: this interpreter's, started with -m
        "burst": burst,
        "overhead": over,
        "ratios": ratios,
    }
    if args.format == "json":
        print(json.dumps(result, indent=2))
        return 0
    print(f"btbctl routing core: {core_build()}")
    print(f"burst: {args.burst_size} requests over {args.spread_s:g} s, 4 emulated Llama-3.3-70B workers (4xH100)")
    print(
        f"{'router':22} {'run':>3} {'prefix':>7} {'mean ms':>8} {'p50 ms':>8} {'p95 ms':>8} {'served':>14} "
        f"{'prefilled':>9} {'1st ms':>7} {'err':>4}  copies (source>target start-finish ms)"
    )
    for r in burst:
        t = r["ttft_s"]
        served = "/".join(str(x) for x in r["served_per_worker"])
        first = r["first_answer_s"] * 1000 if r["first_answer_s"] is not None else float("nan")
        copies = " ".join(
            f"{c['source']}>{c['target']} {c['started_s'] * 1000:.0f}-"
            f"{'?' if c['finished_s'] is None else round(c['finished_s'] * 1000)}"
            f"{'' if c['state'] == 'done' else ' ' + str(c['state'])}"
            for c in r["copies"]
        )
        print(
            f"{r['router']:22} {r['run']:>3} {r['prefix_blocks'] * 256:>7} {t['mean'] * 1000:>8.1f} "
            f"{t['p50'] * 1000:>8.1f} {t['p95'] * 1000:>8.1f} {served:>14} {r['prefill_tokens_computed']:>9} "
            f"{first:>7.0f} {r['errors']:>4}  {copies}"
        )
    print(
        "(served: requests per worker; prefilled: prompt tokens the workers computed, i.e. not served from their "
        "prefix cache; 1st: the first answer's time after the replay started)"
    )
    if over:
        cpus = next((r["router_cpus"] for r in over if r["router_cpus"]), None)
        print(
            f"\noverhead: zero-delay workers, {args.overhead_tokens}-token prompts, routers on CPUs "
            + (",".join(map(str, cpus)) + " (workers and client on the others)" if cpus else "not pinned")
        )
        print(
            f"{'target':22} {'run':>3} {'p50 ms @1':>10} {'p99 ms @1':>10} {'added p50':>10} {'added p99':>10} "
            f"{'req/s @' + str(args.overhead_concurrency):>12} {'CPU us/req':>10} {'err':>4}"
        )
        for r in over:
            cpu = r["router_cpu_us_per_request"]
            print(
                f"{r['target']:22} {r['run']:>3} {r['p50_s_at_c1'] * 1000:>10.2f} {r['p99_s_at_c1'] * 1000:>10.2f} "
                f"{r['added_p50_ms']:>10.2f} {r['added_p99_ms']:>10.2f} {r['requests_per_s']:>12.0f} "
                f"{'-' if cpu is None else format(cpu, '.0f'):>10} {r['errors']:>4}"
            )
    print()
    for k, v in ratios.items():
        if isinstance(v, list):
            print(f"{k}: " + ", ".join(f"{x:.2f}" for x in v))
        else:
            many = args.overhead_runs > 1 if k.startswith("btbctl_over_smg") else args.repeat > 1
            print(f"{k}: {v:.2f}" + (" (median of runs)" if many else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
