"""Streaming answers: server-sent events (``data: <json>\\n\\n``, ending with ``data: [DONE]``), the pace at which a
request's tokens are reported, and the merge of several choices' streams into one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from btbctl.engine.worker.model import LiveRequest


async def merge(gens: list) -> Any:
    """Yield ``(index, item)`` from several async generators as items come."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g) -> None:
        try:
            async for x in g:
                await q.put((i, x))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    left = len(tasks)
    try:
        while left:
            i, x = await q.get()
            if x is None:
                left -= 1
                continue
            yield i, x
    finally:
        for t in tasks:
            t.cancel()


async def progress(lr: LiveRequest, clock: Callable[[], float]):
    """Yield ``(tokens_out, finished)`` as tokens come out: the first at the first token, the rest spread at the
    estimated decode pace (``clock``: the model's wall clock, seconds), whatever remains when the model says the
    request finished."""
    n = lr.max_new_tokens
    await lr.first
    if n <= 1:
        await lr.done
        yield n, True
        return
    yield 1, False
    i = 1
    while i < n - 1 and not lr.done.done():
        delay = lr.first_wall + i * lr.itl_wall_s - clock()
        if delay > 0:
            try:
                await asyncio.wait_for(asyncio.shield(lr.done), delay)
            except asyncio.TimeoutError:
                pass
            if lr.done.done():
                break
        i += 1
        yield i, False
    await lr.done
    yield n, True


async def sse_start(request: web.Request) -> web.StreamResponse:
    """Open a 200 ``text/event-stream`` answer to ``request``."""
    resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def sse_send(resp: web.StreamResponse, obj) -> None:
    """Send one event: ``obj`` as compact JSON, or a string (``"[DONE]"``) as it is."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    await resp.write(f"data: {data}\n\n".encode())


__all__ = ["merge", "progress", "sse_send", "sse_start"]
