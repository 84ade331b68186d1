"""Emulated workers (``python -m btbctl worker``) as subprocesses on loopback, for tests that need real ones."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path


async def start_worker(log: Path, *flags: str, model: str = "llama-3.3-70b") -> tuple[asyncio.subprocess.Process, str]:
    """Start one on free ports (``flags``: more of its flags; stderr to ``log``); ``(process, URL)`` once it
    printed its ready line (within 60 s)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "btbctl",
        "worker",
        "--model-path",
        model,
        "--port",
        "0",
        "--transfer-port",
        "0",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=open(log, "wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    assert line.startswith("ready "), line
    return proc, line.split()[1]


async def start_workers(tmp_path: Path, n: int, *flags: str) -> tuple[list, list[str]]:
    """``n`` of them at once (logs ``w<i>.log`` in ``tmp_path``): their processes and URLs."""
    started = await asyncio.gather(*(start_worker(tmp_path / f"w{i}.log", *flags) for i in range(n)))
    return [p for p, _ in started], [u for _, u in started]


async def stop_workers(procs) -> None:
    """SIGTERM each, SIGKILL what is still there after 10 s."""
    for p in procs:
        if p.returncode is None:
            p.terminate()
    for p in procs:
        try:
            await asyncio.wait_for(p.wait(), 10)
        except asyncio.TimeoutError:
            p.kill()
            await p.wait()
