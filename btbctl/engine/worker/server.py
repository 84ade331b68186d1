"""Running an emulated worker process: bind HTTP and transfer ports, print the ready line, stop on a signal."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import TextIO

from aiohttp import web

from btbctl.engine.errors import BtbctlError
from btbctl.engine.worker.config import WorkerConfig
from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.http import build_app


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
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform without signals
            pass
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, shutdown_timeout=2.0)
        try:
            await site.start()
            await worker.start()
        except OSError as e:
            raise BtbctlError(f"cannot listen on {cfg.host}: {e.strerror or e}") from None
        port = cfg.port
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            port = server.sockets[0].getsockname()[1]
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
        await runner.cleanup()


def serve(cfg: WorkerConfig) -> None:
    """Blocking entry point of ``btbctl worker``."""
    asyncio.run(serve_async(cfg))
