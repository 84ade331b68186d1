"""Running an emulated worker process: bind HTTP and transfer ports, print the ready line, stop on a signal."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import TextIO

from aiohttp import web

from btbctl.engine.errors import BtbctlError
from btbctl.engine.netguard import ConnectionGuard, RateLimiter, listen_http
from btbctl.engine.worker.config import WorkerConfig
from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.http import build_app

#: Open connections at most on the emulated worker's HTTP port; a connection without a complete request head for
#: ``HTTP_HEADER_TIMEOUT_S`` is closed, an idle keep-alive one after ``HTTP_IDLE_TIMEOUT_S`` (seconds).
HTTP_MAX_CONNECTIONS = 1024
HTTP_HEADER_TIMEOUT_S = 10.0
HTTP_IDLE_TIMEOUT_S = 60.0


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def serve_async(cfg: WorkerConfig, out: TextIO | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set or SIGTERM/SIGINT arrives; then stop gracefully (inbound copies are discarded,
    outbound copies fail, open connections get up to 2 s).

    Prints ``ready http://HOST:PORT transfer HOST:TPORT`` on ``out`` (default stdout) once both ports listen.

    Raises:
        BtbctlError: a port is taken or the address cannot be bound.
    """
    out = out or sys.stdout
    stop = stop or asyncio.Event()
    worker = Worker(cfg)
    app = build_app(worker)
    guard = ConnectionGuard(
        "worker_http",
        max_connections=HTTP_MAX_CONNECTIONS,
        header_timeout_s=HTTP_HEADER_TIMEOUT_S,
        idle_timeout_s=HTTP_IDLE_TIMEOUT_S,
        retry_after_s=1,
        limiter=RateLimiter(),
    )
    runner: web.AppRunner | None = None
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform without signals
            pass
    try:
        try:
            runner, port = await listen_http(app, cfg.host, cfg.port, guard, shutdown_timeout=2.0, handle_signals=False)
            await worker.start()
        except OSError as e:
            raise BtbctlError(f"cannot listen on {cfg.host}: {e.strerror or e}") from None
        worker.http_port = port
        worker.ready = True
        out.write(f"ready http://{_fmt_host(cfg.host)}:{port} transfer {worker.transfer_addr}\n")
        out.flush()
        await stop.wait()
    finally:
        worker.ready = False
        for sig in installed:
            loop.remove_signal_handler(sig)
        await worker.stop()
        if runner is not None:
            await runner.cleanup()
        guard.close()


def log_to(stream: TextIO) -> None:
    """Write the worker's log lines (``btbctl.worker``: request lines, refusals) at INFO and above on ``stream``
    as logfmt (:class:`~btbctl.engine.logfmt.LogfmtFormatter`); other loggers are left as they are."""
    import logging

    from btbctl.engine.logfmt import LogfmtFormatter

    logger = logging.getLogger("btbctl.worker")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogfmtFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def serve(cfg: WorkerConfig) -> None:
    """Blocking entry point of ``btbctl worker``: its log lines go to stdout, after the ready line (``btbctl up``
    writes both to ``logs/worker-N.log``, size-capped)."""
    log_to(sys.stdout)
    asyncio.run(serve_async(cfg))
