"""Slow ``/health`` on every worker, generation unaffected (not a test; never gates CI).

Four emulated workers (``btbctl worker``, Llama-3.3-70B on 4 x H100 each), each behind a loopback proxy in this
process that passes every route through and, once the replay starts, answers ``/health`` only after ``--delay-s``
(3 s by default: beyond the gateway's default ``health_timeout_s`` of 2 s). A fresh ``btbctl gateway`` (default
health settings: every 1 s, 2 s timeout, down after 2 failed rounds) per policy starts while ``/health`` is still
fast, then 200 unrelated 256-token prompts arrive evenly over 10 s with 16 output tokens each (streamed). Prints the
answers per HTTP status per policy::

    python benchmarks/bench_slow_health.py
    python benchmarks/bench_slow_health.py --policies round_robin,btb_plus --format json

``tests/test_gateway_health_busy.py`` states the expectation as a test (a short delay, short probe intervals).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

from btbctl.engine.launcher.bench import BenchOptions, replay_async
from btbctl.engine.launcher.cluster import WorkerSpec, emulated_argv
from btbctl.engine.trace.model import Request, Trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_router import Fleet

POLICIES = ("round_robin", "least_load", "cache_aware", "btb", "btb_plus")
WORKERS = 4
BT = 256


class SlowHealthProxy:
    """A loopback proxy in front of one worker: every request passed through as is (streams chunk by chunk);
    ``GET /health`` answered after ``delay_s`` while ``slow`` is set."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.slow = False
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> SlowHealthProxy:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None)
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._forward(request)
        except (ConnectionResetError, RuntimeError):  # the gateway gave up on the answer (its timeout), or the end
            return web.Response(status=499)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/health" and self.slow:
            await asyncio.sleep(self.delay_s)
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=body or None, headers=headers
        ) as up:
            out = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def trace(n: int, spread_s: float, out: int) -> Trace:
    """``n`` unrelated one-block prompts arriving evenly over ``spread_s`` seconds, ``out`` output tokens each."""
    reqs = [Request(f"s{i}", spread_s * i / n, BT, out, (f"s{i}",)) for i in range(n)]
    return Trace(reqs, BT, "generated")


async def _one(fleet: Fleet, policy: str, delay_s: float, n: int, spread_s: float) -> dict:
    urls = fleet.spawn_workers([emulated_argv(WorkerSpec(), 0, 0) for _ in range(WORKERS)])
    proxies = [await SlowHealthProxy(u, delay_s).start() for u in urls]
    try:
        # the gateway is a child process: its own event loop, as in production
        gw = await asyncio.to_thread(fleet.btbctl_gateway, [p.url for p in proxies], policy, None)
        for p in proxies:
            p.slow = True
        opts = BenchOptions(target=gw, timeout_s=120.0)
        report = (await replay_async(trace(n, spread_s, 16), opts)).as_dict()
    finally:
        for p in proxies:
            await p.stop()
    by = dict(report["errors_by_status"])
    return {"2xx": report["ok"], **{k: by[k] for k in sorted(by)}, "ttft_p50_s": report["ttft_s"]["p50"]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    ap.add_argument("--delay-s", type=float, default=3.0, help="seconds /health takes (default 3)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--spread-s", type=float, default=10.0, help="seconds over which the requests arrive")
    ap.add_argument("--format", choices=("human", "json"), default="human")
    args = ap.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="btb-slow-health-") as tmp:
        for pol in [p.strip() for p in args.policies.split(",") if p.strip()]:
            with Fleet(Path(tmp), pol) as fleet:
                results[pol] = asyncio.run(_one(fleet, pol, args.delay_s, args.requests, args.spread_s))
            if args.format == "human":
                print(pol, " ".join(f"{k}={v}" for k, v in results[pol].items()), flush=True)
    if args.format == "json":
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
