"""Small asyncio helpers shared by the gateway, the emulated worker and the transports."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it ended; its cancellation is not propagated."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task of ``tasks`` (a snapshot is taken first), then wait for each, ignoring how it ended."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t
