"""The control API's event bus: coalescing publish/subscribe behind ``GET /control/events``."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable

from pydantic import BaseModel

from btbctl.engine.aiotasks import cancel_and_wait

log = logging.getLogger(__name__)

#: The event types, in the order the control API documents them.
EVENT_KINDS = ("fleet", "prefixes", "transfers", "ttft", "constants")
#: Seconds between two events of a type that changes with the clock alone (:meth:`EventBus.age`): a dashboard sees
#: arrivals leave the detector's window within a second, at one event a second per type.
AGE_EVERY_S = 1.0


class EventBus:
    """Coalescing publish/subscribe for the control API's event stream.

    Producers call :meth:`mark` with an event type (``fleet``, ``prefixes``, ``transfers``, ``ttft``,
    ``constants``); a ticker every :attr:`interval_s` (0.1 s: at most 10 events per second per type) builds one
    snapshot per marked type with the registered builder and hands it to every subscriber. Nothing is built while
    nobody listens. Types whose content changes with the clock alone (heat decaying, TTFT samples leaving a window)
    are also marked every :data:`AGE_EVERY_S` while they change (:meth:`age`, :meth:`tick`). A subscriber that falls
    behind loses its oldest events (queues hold :attr:`queue_size`).
    At most :attr:`max_subscribers` listen at once (the control API answers 503 beyond; each one costs a
    connection and a snapshot per event).
    """

    def __init__(
        self,
        interval_s: float = 0.1,
        queue_size: int = 256,
        max_subscribers: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_subscribers = max_subscribers
        self.queue_size = queue_size
        self.clock = clock
        self.builders: dict[str, Callable[[], BaseModel]] = {}
        self._aging: dict[str, _Aging] = {}
        self._dirty: set[str] = set()
        self._subs: set[asyncio.Queue] = set()
        self._task: asyncio.Task | None = None
        self.published = 0

    def register(self, kind: str, builder: Callable[[], BaseModel]) -> None:
        """Build events of type ``kind`` with ``builder`` (an answer model of the control-API schema)."""
        self.builders[kind] = builder

    def age(self, kind: str, busy: Callable[[float], bool], every_s: float = AGE_EVERY_S) -> None:
        """Events of type ``kind`` change with the clock alone (arrivals leaving a window): every ``every_s``
        seconds of :attr:`clock` while ``busy(now_s)`` holds, and once more when it stops holding, mark ``kind``
        (see :meth:`tick`)."""
        self._aging[kind] = _Aging(busy, every_s)

    def tick(self) -> None:
        """Mark the aging types that are due (:meth:`age`); nothing is asked while nobody listens."""
        if not self._subs or not self._aging:
            return
        now = self.clock()
        for kind, a in self._aging.items():
            if now - a.marked_s < a.every_s:
                continue
            try:
                busy = a.busy(now)
            except Exception:  # a bug in a predicate must not stop the stream
                log.exception("the aging check of %s events failed", kind)
                continue
            if busy or a.was_busy:
                self._dirty.add(kind)
                a.marked_s = now
            a.was_busy = busy

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
            self.tick()
            self.flush()


class _Aging:
    """An aging event type's predicate, period and state (:meth:`EventBus.age`)."""

    __slots__ = ("busy", "every_s", "marked_s", "was_busy")

    def __init__(self, busy: Callable[[float], bool], every_s: float) -> None:
        self.busy = busy
        self.every_s = every_s
        self.marked_s = -math.inf
        self.was_busy = False
