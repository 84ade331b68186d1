"""Small asyncio helpers shared by the gateway, the emulated worker and the transports."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel ``task`` (if any) and wait until it ended; its cancellation is not propagated."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait((task,))  # a cancel of the caller still reaches the caller (``await task`` would blur them)
    if not task.cancelled():
        task.result()  # re-raises what the task ended with


async def cancel_all(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task of ``tasks`` (a snapshot is taken first), then wait for each, ignoring how it ended."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    # gather, not a suppress around each await: a cancel of the caller itself must still reach the caller
    await asyncio.gather(*tasks, return_exceptions=True)


def every(interval_s: float, fn: Callable[[], Coroutine[Any, Any, Any]], *, at_once: bool) -> asyncio.Task:
    """A background task awaiting ``fn()`` every ``interval_s`` seconds (the first time at once with ``at_once``,
    else after one interval) until cancelled (:func:`cancel_and_wait`)."""

    async def loop() -> None:
        if not at_once:
            await asyncio.sleep(interval_s)
        while True:
            await fn()
            await asyncio.sleep(interval_s)

    return asyncio.get_running_loop().create_task(loop())


#: Set (to anything but ``""`` or ``0``) to run the gateway on asyncio's own event loop even when uvloop is
#: installed.
NO_UVLOOP_ENV = "BTBCTL_NO_UVLOOP"


def loop_factory(allow_uvloop: bool = True) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop factory of a long-running server: uvloop's (libuv; transports and callbacks in C, where the
    gateway's forwarding spends most of its time) when ``allow_uvloop``, unless ``BTBCTL_NO_UVLOOP`` is set or
    uvloop is not importable (or before Python 3.11, where ``asyncio.Runner`` takes no factory); None means
    asyncio's default loop."""
    if not allow_uvloop or os.environ.get(NO_UVLOOP_ENV, "") not in ("", "0") or sys.version_info < (3, 11):
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], allow_uvloop: bool = True) -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    factory = loop_factory(allow_uvloop)
    if factory is None or sys.version_info < (3, 11):
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
