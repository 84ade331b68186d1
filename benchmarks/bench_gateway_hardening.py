"""The gateway under an operator's worst day: the four figures of the hardening work (not a test; never gates CI).

Each scenario runs a real gateway in a child process (under the descriptor limit given) in front of emulated
workers (``python -m btbctl worker`` subprocesses, ``--zero-delay`` unless said otherwise), with this process as
the clients, and prints one line of figures:

* ``burst``: ``--streams`` concurrent streams (2,000) against a gateway under ``ulimit -n`` ``--nofile`` (1,024):
  how many got 200, how many 503 with ``Retry-After``, how many failed otherwise (errors, unanswered), and whether
  a worker was marked unhealthy.
* ``idle``: ``--idle`` connections (20,000; capped below this process's own descriptor limit) that send half a
  request head and then nothing, then 36 legitimate requests (clients that honour ``Retry-After``): how many were
  served, and the longest wait.
* ``body``: a ``--body-mib`` (31 MiB) body at page size 1, then the largest accepted one (just under
  ``max_body_bytes``): ``/health`` latency while each is handled, against the baseline before (max and ratio).
* ``frozen``: a worker ``SIGSTOP``ped for ``--freeze-s`` seconds (135 in the field report) while ``--requests``
  (100) requests are sent round robin: how many were answered, by the frozen worker or rerouted, answered twice,
  and the longest wait.

Run (about a minute with the defaults below; ``--freeze-s 135`` reproduces the field report's freeze)::

    python benchmarks/bench_gateway_hardening.py
    python benchmarks/bench_gateway_hardening.py --only frozen --freeze-s 135
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

TEXT = "a shared system prompt, long enough to fill a few blocks. " * 4


def child(nofile: int, config: str) -> None:
    """``--child``: a gateway under ``RLIMIT_NOFILE`` = ``nofile`` (soft and hard), logging to stderr."""
    import logging

    from btbctl.engine.gateway import GatewayConfig
    from btbctl.engine.gateway.server import run_gateway

    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
    run_gateway(
        GatewayConfig(**json.loads(config)),
        on_ready=lambda gw: print(f"ready {gw.data_url} {gw.control_url}", flush=True),
    )


def _log(path: Path):
    return open(path, "wb")


class Fleet:
    """Emulated workers and a child gateway, torn down on exit."""

    def __init__(self, tmp: Path, n_workers: int, nofile: int, page_size: int, worker_args=(), **gw_cfg) -> None:
        self.tmp, self.n, self.nofile, self.page = tmp, n_workers, nofile, page_size
        self.worker_args = list(worker_args)
        self.gw_cfg = gw_cfg
        self.workers: list = []
        self.urls: list[str] = []
        self.gw = None
        self.data_url = self.control_url = ""

    async def __aenter__(self) -> Fleet:
        tok = self.tmp / "worker.token"
        tok.write_text("wtok\n")
        for i in range(self.n):
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "btbctl", "worker", "--model-path", "llama-3.3-70b", "--port", "0",
                "--transfer-port", "0", "--page-size", str(self.page), "--btb-token-file", str(tok),
                *self.worker_args,
                stdout=asyncio.subprocess.PIPE, stderr=_log(self.tmp / f"w{i}.log"),
            )  # fmt: skip
            line = (await asyncio.wait_for(p.stdout.readline(), 60)).decode()
            assert line.startswith("ready "), line
            self.workers.append(p)
            self.urls.append(line.split()[1])
        cfg = {"workers": self.urls, "port": 0, "control_port": 0, "token": "t", "page_size": self.page, **self.gw_cfg}
        self.gw = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--child", str(self.nofile), json.dumps(cfg),
            stdout=asyncio.subprocess.PIPE, stderr=_log(self.tmp / "gateway.log"),
        )  # fmt: skip
        line = (await asyncio.wait_for(self.gw.stdout.readline(), 60)).decode()
        assert line.startswith("ready "), (line, (self.tmp / "gateway.log").read_text()[-2000:])
        _, self.data_url, self.control_url = line.split()
        return self

    async def __aexit__(self, *exc) -> None:
        self.keep_log()
        for p in [self.gw, *self.workers]:
            if p is not None and p.returncode is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        for p in [self.gw, *self.workers]:
            if p is not None:
                try:
                    await asyncio.wait_for(p.wait(), 10)
                except asyncio.TimeoutError:
                    p.kill()

    async def unhealthy(self, http: aiohttp.ClientSession) -> int:
        async with http.get(self.control_url + "/control/fleet") as r:
            return sum(1 for w in (await r.json())["workers"] if not w["healthy"])

    def keep_log(self) -> None:
        """``BENCH_KEEP_LOG=path``: keep a copy of the gateway's log there."""
        if os.environ.get("BENCH_KEEP_LOG"):
            Path(os.environ["BENCH_KEEP_LOG"]).write_bytes((self.tmp / "gateway.log").read_bytes())

    def log_lines(self) -> int:
        return sum(1 for _ in open(self.tmp / "gateway.log", "rb"))


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


async def burst(args, tmp: Path) -> None:
    async with Fleet(tmp, 2, args.nofile, 16, ["--zero-delay"]) as fleet, session() as http:
        counts = {"200": 0, "503+Retry-After": 0, "other": 0, "error": 0}
        errors: dict[str, int] = {}

        async def one(i: int) -> None:
            body = {"text": f"{i} {TEXT}", "stream": True, "sampling_params": {"max_new_tokens": 8}}
            try:
                async with http.post(fleet.data_url + "/generate", json=body, timeout=aiohttp.ClientTimeout(120)) as r:
                    data = await r.read()
                    if r.status == 200 and data.rstrip().endswith(b"data: [DONE]"):
                        counts["200"] += 1
                    elif r.status == 503 and "Retry-After" in r.headers:
                        counts["503+Retry-After"] += 1
                    else:
                        counts["other"] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                counts["error"] += 1
                errors[str(e)[:60]] = errors.get(str(e)[:60], 0) + 1

        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(args.streams)))
        wall = time.perf_counter() - t
        print(
            f"burst: {args.streams} streams under nofile {args.nofile}: {counts}; answered "
            f"{counts['200'] + counts['503+Retry-After']}/{args.streams} in {wall:.1f} s; workers marked unhealthy: "
            f"{await fleet.unhealthy(http)}; gateway log lines: {fleet.log_lines()}; client errors: {errors}"
        )


async def idle(args, tmp: Path) -> None:
    own = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n = min(args.idle, own - 300)
    async with Fleet(tmp, 2, args.nofile, 16, ["--zero-delay"]) as fleet:
        host, port = fleet.data_url.rsplit("/", 1)[1].rsplit(":", 1)
        writers: list = []
        sem = asyncio.Semaphore(512)

        async def open_one() -> None:
            async with sem:
                try:
                    _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
                except (OSError, asyncio.TimeoutError):
                    return
                w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                writers.append(w)

        await asyncio.gather(*(open_one() for _ in range(n)))
        await asyncio.sleep(1.0)
        async with session() as http:

            async def legit(i: int) -> tuple[bool, float]:
                t = time.perf_counter()
                for _ in range(30):
                    try:
                        async with http.post(
                            fleet.data_url + "/generate",
                            json={"text": f"{i} {TEXT}", "sampling_params": {"max_new_tokens": 4}},
                            timeout=aiohttp.ClientTimeout(60),
                        ) as r:
                            if r.status == 200:
                                return True, time.perf_counter() - t
                            if r.status != 503 or "Retry-After" not in r.headers:
                                return False, time.perf_counter() - t
                            wait = int(r.headers["Retry-After"])
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        return False, time.perf_counter() - t
                    await asyncio.sleep(wait)
                return False, time.perf_counter() - t

            res = await asyncio.gather(*(legit(i) for i in range(36)))
            print(
                f"idle: {len(writers)} half-sent connections opened (of {n} tried; gateway nofile {args.nofile}): "
                f"legitimate served {sum(ok for ok, _ in res)}/36, longest wait {max(w for _, w in res):.1f} s; "
                f"gateway log lines: {fleet.log_lines()}"
            )
        for w in writers:
            w.close()


async def body(args, tmp: Path) -> None:
    from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES

    async with Fleet(tmp, 1, args.nofile, 1, ["--zero-delay"]) as fleet, session() as http:

        async def health() -> float:
            t = time.perf_counter()
            async with http.get(fleet.data_url + "/health") as r:
                await r.read()
            return time.perf_counter() - t

        base = max([await health() for _ in range(20)])
        for label, size in (("over the limit", args.body_mib << 20), ("largest accepted", MAX_REQUEST_BODY_BYTES - 64)):
            payload = json.dumps({"text": "y" * (size - 60), "sampling_params": {"max_new_tokens": 1}}).encode()
            t = time.perf_counter()
            task = asyncio.create_task(
                http.post(fleet.data_url + "/generate", data=payload, headers={"Content-Type": "application/json"})
            )
            lat = []
            while not task.done():
                lat.append(await health())
            r = await task
            status = r.status
            r.release()
            wall = time.perf_counter() - t
            print(
                f"body: {len(payload) / 2**20:.1f} MiB at page size 1 ({label}): HTTP {status} in {wall:.2f} s; "
                f"/health max {max(lat) * 1000:.1f} ms over {len(lat)} probes (baseline max {base * 1000:.1f} ms, "
                f"ratio {max(lat) / base:.0f}x)"
            )


async def frozen(args, tmp: Path) -> None:
    async with Fleet(tmp, 2, args.nofile, 16, ["--zero-delay"], policy="round_robin") as fleet, session() as http:
        frozen_url = fleet.urls[0]
        fleet.workers[0].send_signal(signal.SIGSTOP)
        t_freeze = time.perf_counter()
        answers: dict[int, list] = {}

        async def one(i: int) -> None:
            t = time.perf_counter()
            b = {"text": f"{i} {TEXT}", "stream": i % 2 == 0, "sampling_params": {"max_new_tokens": 4}}
            try:
                async with http.post(fleet.data_url + "/generate", json=b, timeout=aiohttp.ClientTimeout(600)) as r:
                    await r.read()
                    answers.setdefault(i, []).append((r.status, r.headers.get("X-BTB-Worker"), time.perf_counter() - t))
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                answers.setdefault(i, []).append((repr(e), None, time.perf_counter() - t))

        async def thaw() -> None:
            await asyncio.sleep(args.freeze_s)
            fleet.workers[0].send_signal(signal.SIGCONT)

        thawing = asyncio.create_task(thaw())
        await asyncio.gather(*(one(i) for i in range(args.requests)))
        done_at = time.perf_counter() - t_freeze
        ok = [a for a in answers.values() if a[0][0] == 200]
        print(
            f"frozen: worker frozen {args.freeze_s:g} s, {args.requests} requests: answered {len(ok)}/{args.requests}, "
            f"by the frozen worker {sum(1 for a in ok if a[0][1] == frozen_url)}, rerouted or on the other "
            f"{sum(1 for a in ok if a[0][1] != frozen_url)}, answered twice "
            f"{sum(1 for a in answers.values() if len(a) > 1)}, longest wait "
            f"{max(a[0][2] for a in answers.values()):.1f} s (all answered {done_at:.1f} s into the freeze)"
        )
        await thawing


async def main(args) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    runs = {"burst": burst, "idle": idle, "body": body, "frozen": frozen}
    for name in args.only.split(",") if args.only else runs:
        with tempfile.TemporaryDirectory() as d:
            await runs[name](args, Path(d))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nofile", type=int, default=1024, help="the gateway's descriptor limit (default 1024)")
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--idle", type=int, default=20000)
    ap.add_argument("--body-mib", type=int, default=31)
    ap.add_argument("--freeze-s", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--only", default="", help="comma-separated: burst,idle,body,frozen")
    asyncio.run(main(ap.parse_args()))
