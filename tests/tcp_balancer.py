"""A small TCP balancer for the failover tests: several gateways behind one loopback address.

Each client connection goes to the next backend round-robin; when the connect to it fails (refused, reset, timed
out) the balancer tries the next backend, so nothing of a request is ever sent to a dead backend. Then it pipes
bytes both ways until either side closes. Each connection is recorded (:class:`Link`): which backend served it,
when it opened and closed (on the injected clock), and a label read from its first bytes (the value of a header,
so a test can tell which backend each of its requests went to).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Link:
    """One client connection.

    Attributes:
        label: the value of the ``label_header`` in the connection's first bytes, "" when absent.
        backend: index into the balancer's backends of the one that accepted it; -1 when none did.
        opened_s: when the client connected (clock seconds).
        connected_s: when the backend accepted it (clock seconds), None when none did.
        closed_s: when the piping ended (clock seconds), None while open.
        refused: indices of the backends whose connect failed first, in order.
    """

    label: str
    backend: int
    opened_s: float
    connected_s: float | None = None
    closed_s: float | None = None
    refused: tuple[int, ...] = ()


class TcpBalancer:
    """Round-robin TCP balancer on ``127.0.0.1:<free port>`` run by its own event loop in a thread.

    Args:
        backends: ``(host, port)`` of each backend, tried in this order round-robin.
        label_header: header whose value labels a connection (case-insensitive), e.g. ``x-test-id``.
        clock: seconds for the link times (monotonic by default).
        connect_timeout_s: how long a backend connect may take before the next one is tried.

    Use as a context manager; :attr:`port` is the listening port once entered.
    """

    def __init__(
        self,
        backends: list[tuple[str, int]],
        label_header: str = "x-test-id",
        clock: Callable[[], float] = time.monotonic,
        connect_timeout_s: float = 2.0,
    ) -> None:
        if not backends:
            raise ValueError("TcpBalancer needs at least one backend")
        self.backends = list(backends)
        self.clock = clock
        self.connect_timeout_s = connect_timeout_s
        self.links: list[Link] = []
        self._label_re = re.compile(rb"\r\n" + re.escape(label_header.encode()) + rb":\s*([^\r\n]*)", re.I)
        self._next = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-balancer", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    def __enter__(self) -> TcpBalancer:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def _close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(_close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def snapshot(self) -> list[Link]:
        """A copy of the links recorded so far."""
        with self._lock:
            return [Link(**vars(link)) for link in self.links]

    async def _serve(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        link = Link(label="", backend=-1, opened_s=self.clock())
        with self._lock:
            self.links.append(link)
            start = self._next
            self._next = (self._next + 1) % len(self.backends)
        refused: list[int] = []
        b_reader = b_writer = None
        for k in range(len(self.backends)):
            i = (start + k) % len(self.backends)
            try:
                b_reader, b_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.backends[i]), self.connect_timeout_s
                )
            except (OSError, asyncio.TimeoutError):
                refused.append(i)
                continue
            with self._lock:
                link.backend, link.connected_s = i, self.clock()
            break
        with self._lock:
            link.refused = tuple(refused)
        if b_reader is None or b_writer is None:
            c_writer.close()
            with self._lock:
                link.closed_s = self.clock()
            return
        first = True

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, label: bool) -> None:
            nonlocal first
            try:
                while data := await src.read(65536):
                    if label and first:
                        first = False
                        if m := self._label_re.search(data):
                            with self._lock:
                                link.label = m.group(1).decode(errors="replace").strip()
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.close()  # one side ended: end the other, so a dead backend reads as a closed connection

        try:
            await asyncio.gather(pipe(c_reader, b_writer, True), pipe(b_reader, c_writer, False))
        finally:
            with self._lock:
                link.closed_s = self.clock()
