"""Server-side CPU per request of the data listener's HTTP layer alone (not a test; never gates CI).

A closed loop of ``--requests`` keep-alive POSTs (``--concurrency`` connections, a ~1 KB JSON body, a small JSON
answer) from this process against a server process running one of:

* ``app``: an aiohttp ``web.Application`` with two pass-through middlewares (the data plane before
  :mod:`btbctl.engine.gateway.httpserver`);
* ``lowlevel``: aiohttp's low-level ``web.Server``;
* ``proto``: a minimal asyncio protocol with the ``httptools`` parser (the floor: no guard, no routing);
* ``ours``: :mod:`btbctl.engine.gateway.httpserver` under a connection guard, with the host guard and the data
  plane's error middleware (what the gateway runs, less the data plane itself).

Reports each server's CPU microseconds per request (user + system from ``/proc/<pid>/stat``, after a warm-up of
500 requests) and its requests per second. On a shared machine the CPU per request moves much less than the rate.

    python benchmarks/bench_data_server.py [--servers app,lowlevel,proto,ours] [--requests 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

#: The request body (about 1 KB, a prompt of the shape the data plane takes) and the answer.
BODY = json.dumps({"text": "x" * 950, "sampling_params": {"max_new_tokens": 1}}).encode()
ANSWER = json.dumps({"text": "ok", "meta_info": {"id": "1"}}).encode()
SERVERS = ("app", "lowlevel", "proto", "ours")
_WARMUP_REQUESTS = 500


async def _serve(kind: str, port: int) -> None:
    if kind == "app":
        from aiohttp import web

        @web.middleware
        async def passthrough(request, handler):
            return await handler(request)

        async def handle(request):
            await request.read()
            return web.Response(body=ANSWER, content_type="application/json")

        app = web.Application(middlewares=[passthrough, passthrough])
        app.router.add_post("/generate", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
    elif kind == "lowlevel":
        from aiohttp import web

        async def handle(request):
            await request.read()
            return web.Response(body=ANSWER, content_type="application/json")

        await asyncio.get_running_loop().create_server(web.Server(handle, access_log=None), "127.0.0.1", port)
    elif kind == "proto":
        import httptools

        class Minimal(asyncio.Protocol):
            def connection_made(self, transport):
                self.transport = transport
                self.parser = httptools.HttpRequestParser(self)
                self.body: list[bytes] = []

            def data_received(self, data):
                self.parser.feed_data(data)

            def on_body(self, body):
                self.body.append(body)

            def on_message_complete(self):
                self.body = []
                self.task = asyncio.ensure_future(self.answer())  # a task per request, as a real server has

            async def answer(self):
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                self.transport.write(head % len(ANSWER) + ANSWER)

        await asyncio.get_running_loop().create_server(Minimal, "127.0.0.1", port)
    else:
        from btbctl.engine.gateway.dataplane import error_middleware
        from btbctl.engine.gateway.guard import host_guard
        from btbctl.engine.gateway.httpserver import HttpApp, HttpServer, Response
        from btbctl.engine.netguard import ConnectionGuard, RateLimiter, listen_http

        class NoMetrics:
            def reject(self, status, reason=None):
                pass

        async def handle(request):
            await request.read()
            return Response(200, ANSWER, content_type="application/json")

        middlewares = [host_guard("data", "127.0.0.1", RateLimiter()), error_middleware(NoMetrics())]
        server = HttpServer(HttpApp({("POST", "/generate"): handle}, middlewares), max_body_bytes=1 << 20)
        guard = ConnectionGuard(
            "data",
            max_connections=1024,
            header_timeout_s=10.0,
            idle_timeout_s=10.0,
            retry_after_s=1,
            limiter=RateLimiter(),
        )
        await listen_http(server, "127.0.0.1", port, guard)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _client(port: int, requests: int, concurrency: int) -> None:
    """``requests`` POSTs over ``concurrency`` keep-alive connections, each waiting for its answer."""
    req = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    req += b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
    left = [requests]

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while left[0] > 0:
            left[0] -= 1
            w.write(req)
            head = await r.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await r.readexactly(length)
        w.close()

    await asyncio.gather(*(one() for _ in range(concurrency)))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve, args.port))
        return
    kinds = args.servers.split(",")
    bad = [k for k in kinds if k not in SERVERS]
    if bad or args.requests < 1 or args.concurrency < 1:
        sys.exit(f"bench_data_server: --servers of {', '.join(SERVERS)}, --requests and --concurrency >= 1")
    for kind in kinds:
        port = _free_port()
        cmd = [sys.executable, __file__, "--serve", kind, "--port", str(port)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                sys.exit(f"bench_data_server: the {kind} server did not start")
            asyncio.run(_client(port, _WARMUP_REQUESTS, args.concurrency))
            cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
            asyncio.run(_client(port, args.requests, args.concurrency))
            cpu_s, wall_s = _cpu_s(proc.pid) - cpu0, time.monotonic() - t0
        finally:
            proc.kill()
            proc.wait()
        us = 1e6 * cpu_s / args.requests
        print(f"{kind:9s} {us:6.1f} us CPU per request, {args.requests / wall_s:7.0f} requests/s", flush=True)


if __name__ == "__main__":
    main()
