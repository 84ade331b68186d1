"""The control API's event bus: coalescing publish/subscribe behind ``GET /control/events``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from pydantic import BaseModel

from btbctl.engine.aiotasks import cancel_and_wait

log = logging.getLogger(__name__)

#: The event types, in the order the control API documents them.
EVENT_KINDS = ("fleet", "prefixes", "transfers", "ttft", "constants")


class EventBus:
    """Coalescing publish/subscribe for the control API's event stream.

    Producers call :meth:`mark` with an event type (``fleet``, ``prefixes``, ``transfers``, ``ttft``,
    ``constants``); a ticker every :attr:`interval_s` (0.1 s: at most 10 events per second per type) builds one
    snapshot per marked type with the registered builder and hands it to every subscriber. Nothing is built while
    nobody listens. A subscriber that falls behind loses its oldest events (queues hold :attr:`queue_size`).
    At most :attr:`max_subscribers` listen at once (the control API answers 503 beyond; each one costs a
    connection and a snapshot per event).
    """

    def __init__(self, interval_s: float = 0.1, queue_size: int = 256, max_subscribers: int = 32) -> None:
        self.interval_s = interval_s
        self.max_subscribers = max_subscribers
        self.queue_size = queue_size
        self.builders: dict[str, Callable[[], BaseModel]] = {}
        self._dirty: set[str] = set()
        self._subs: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self.published = 0

    def register(self, kind: str, builder: Callable[[], BaseModel]) -> None:
        """Build events of type ``kind`` with ``builder`` (an answer model of the control-API schema)."""
        self.builders[kind] = builder

    def mark(self, kind: str) -> None:
        """Something behind events of type ``kind`` changed: build one at the next tick (if anyone listens)."""
        if self._subs:
            self._dirty.add(kind)

    def subscribe(self) -> asyncio.Queue:
        """A queue of ``(kind, json text)``; every registered type is marked so a new listener gets a full
        picture on the next tick."""
        q: asyncio.Queue = asyncio.Queue(maxsize=self.queue_size)
        self._subs.add(q)
        self._dirty.update(self.builders)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subs.discard(q)

    def close(self) -> None:
        """End every subscription: each queue receives ``(None, None)``, the end-of-stream marker."""
        for q in list(self._subs):
            while q.full():
                q.get_nowait()
            q.put_nowait((None, None))
        self._subs.clear()

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def flush(self) -> None:
        """Build and deliver the marked types now."""
        if not self._dirty or not self._subs:
            self._dirty.clear()
            return
        kinds = sorted(self._dirty)
        self._dirty.clear()
        for kind in kinds:
            builder = self.builders.get(kind)
            if builder is None:
                continue
            try:
                text = json.dumps(builder().model_dump(mode="json"), separators=(",", ":"))
            except Exception:  # a snapshot bug must not kill the stream (nor the other types)
                log.exception("building the %s event failed", kind)
                continue
            for q in list(self._subs):
                if q.full():
                    try:
                        q.get_nowait()
                    except asyncio.QueueEmpty:  # pragma: no cover
                        pass
                q.put_nowait((kind, text))
            self.published += 1

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.flush()
