"""The data plane's HTTP/1.1 client to the workers: pooled keep-alive connections, one request at a time each.

A request forwarded to a worker is one ``POST`` of a body the gateway already holds, answered by a JSON body or an
SSE stream; nothing else of a general HTTP client is needed on that path (no redirects, cookies, proxies,
compression or retries: a failure is the data plane's to retry elsewhere). This client does only that, over
asyncio protocols with the ``httptools`` (llhttp) parser, at about a quarter of aiohttp's client CPU per request
(``benchmarks/bench_router.py``'s gateway overhead part); everything else the gateway asks of a worker (health,
tokenization, copies) keeps the shared aiohttp session.

* :meth:`UpstreamPool.post` returns a future of the answer's head (:class:`UpstreamResponse`); cancelling it
  aborts the connection (its answer can never be read by the next request).
* A connection goes back to the pool only after its answer was read whole and the worker keeps it alive; the
  most recently used one is reused first, and one idle for more than ``keepalive_timeout_s`` is closed (below
  uvicorn's default of 5 s, so the gateway, not the worker, closes an idle connection). A request sent on a
  reused connection that the worker closes before any byte of the answer (it closed it idle as the request left)
  is sent once more, on a new connection: a worker closing idle connections is not a failed worker.
* ``limit``: connections open at once over all workers; a request beyond it waits for one to come back or close.
* Failures are :class:`UpstreamError` (a :class:`ConnectionError`), :class:`asyncio.TimeoutError`, or the
  :class:`OSError` of the connect (its ``errno`` kept: ``EMFILE`` is the gateway's own exhaustion).
* A streamed answer is read while the client takes it: beyond :data:`_HIGH_WATER_BYTES` buffered the socket stops
  being read until the data plane takes the buffer (:meth:`UpstreamResponse.readany`; ``read`` wants it whole).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from urllib.parse import urlsplit

import httptools

from btbctl.engine.logfmt import log_event

log = logging.getLogger(__name__)

#: Longest answer head accepted from a worker, bytes (status line and headers, informational answers included; a
#: product bound, SGLang's answers carry a few hundred); beyond it the connection is dropped and the attempt fails.
MAX_HEAD_BYTES = 65536
#: Why a request fails once the pool is closed (the gateway stops).
_CLOSED = "the gateway's upstream pool is closed"
#: Buffered bytes of an answer past which the worker's socket stops being read (until the buffer is taken).
_HIGH_WATER_BYTES = 1 << 18


class UpstreamError(ConnectionError):
    """A worker's connection broke, or its answer was not valid HTTP/1.1."""


class UpstreamResponse:
    """A worker's answer: its head at once, its body as it arrives.

    Attributes:
        status: the HTTP status code.
        headers: the answer's headers, names in lower case (the last value of a repeated one).
    """

    __slots__ = ("_chunks", "_conn", "_eof", "_exc", "_size", "_waiter", "_whole", "headers", "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn: _Connection | None = conn
        self.status = status
        self.headers = headers
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._whole = False  # read() wants the whole body: no back-pressure

    def header(self, name: str, default: str | None = None) -> str | None:
        """The value of header ``name`` (any case), or ``default``."""
        return self.headers.get(name.lower(), default)

    def at_eof(self) -> bool:
        """Whether the whole body has arrived (a small answer usually comes with its head)."""
        return self._eof

    def body(self) -> bytes:
        """The body buffered so far, taken out of the buffer."""
        out = b"".join(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks.clear()
        self._size = 0
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        return out

    async def readany(self) -> bytes:
        """The next bytes of the body (all that is buffered), waiting for some; ``b""`` at its end.

        Raises:
            UpstreamError: the connection broke before the body's end.
            asyncio.TimeoutError: the pool's total timeout passed.
        """
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            await self._more()
        return self.body()

    async def read(self) -> bytes:
        """The rest of the body, whole (raises as :meth:`readany`); the socket is read on, whatever is buffered."""
        self._whole = True
        conn = self._conn
        if conn is not None and conn.paused:
            conn.resume()
        while not self._eof:
            if self._exc is not None:
                raise self._exc
            await self._more()
        if self._exc is not None:
            raise self._exc
        return self.body()

    async def _more(self) -> None:
        """Wait until the connection feeds, ends or fails the answer."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read whole and the worker
        keeps it alive, else it is closed."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.done_with(self)

    def close(self) -> None:
        """Abandon the answer: its connection is closed (the worker stops streaming it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.abort()

    # -- fed by the connection ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER_BYTES and not self._whole and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _end(self) -> None:
        self._eof = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._eof and self._exc is None:  # the first cause (the close that follows it says less)
            self._exc = exc
        self._wake()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one worker, carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, target: _Target) -> None:
        self.pool = pool
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.head: asyncio.Future[UpstreamResponse] | None = None
        self.resp: UpstreamResponse | None = None
        self.headers: dict[str, str] = {}
        self.head_bytes = 0
        self.complete = False
        self.keep_alive = False
        self.closed = False
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.idle_since = 0.0
        self.data = b""  # the request on the way (head and body), kept until its answer's first byte
        self.requests = 0  # requests sent on this connection

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.head is None:  # bytes on an idle connection: not an answer to anything of ours
            self.abort()
            return
        self.data = b""  # the worker answers: the request is never sent again
        heading = self.resp is None
        if heading:  # counted as they come: the parser keeps a header line whole however long it grows
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            cause = e.__context__ if isinstance(e.__context__, UpstreamError) else None
            exc = cause or UpstreamError(f"invalid HTTP answer: {e}")
            if self.resp is not None and not self.complete:
                self.resp._fail(exc)
            self._broken(exc)
            self.abort()
            return
        if heading and self.resp is None and self.head_bytes > MAX_HEAD_BYTES:
            self._broken(UpstreamError(f"answer head over {MAX_HEAD_BYTES} bytes"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        ours = self.closed  # aborted by the pool or the answer's reader, not ended by the worker
        self.closed = True
        self.pool._lost(self)
        resp = self.resp
        if resp is not None and not self.complete:
            if exc is None and not ours and self._until_close():  # a body delimited by the worker's clean close
                self.complete = True
                resp._end()
            else:
                resp._fail(UpstreamError(f"connection closed before the answer's end ({exc or 'EOF'})"))
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        head = self.head
        if not ours and self.data and self.requests > 1 and head is not None and not head.done():
            # closed by the worker as it idled, before this request reached it: once more, on a new connection
            log_event(log, "upstream_resend", logging.INFO, worker=self.target.host_header.decode(), error=exc)
            self.pool._open_new(self.target, self.data, head)
            self.data = b""
            return
        self._broken(UpstreamError(f"connection closed before the answer ({exc or 'EOF'})"))

    # -- httptools callbacks ------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # bytes past the answer's end (a second answer to one request): never any request's
            raise UpstreamError("bytes after the answer's end")  # out of feed_data: the connection goes

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() < 200:  # an informational answer (1xx): the real one follows
            self.headers = {}
            return
        resp = self.resp = UpstreamResponse(self, self.parser.get_status_code(), self.headers)
        head = self.head
        if head is not None and not head.done():
            head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        if self.resp is None:  # the end of a 1xx answer
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful inside the parser's callbacks
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.resp._end()

    # -- used by the pool and the answer --------------------------------------------------------------------------

    def send(self, data: bytes, head: asyncio.Future[UpstreamResponse], total_s: float | None) -> None:
        """Write one request (head and body in ``data``); its answer's head resolves ``head``."""
        self.head = head
        self.data = data
        self.requests += 1
        self.resp = None
        self.headers = {}
        self.head_bytes = 0
        self.complete = self.keep_alive = False
        head.add_done_callback(self._head_done)
        if total_s is not None:
            self.timer = asyncio.get_running_loop().call_later(total_s, self._timed_out, total_s)
        assert self.transport is not None
        self.transport.write(data)

    def _head_done(self, head: asyncio.Future[UpstreamResponse]) -> None:
        if head.cancelled():  # the caller gave up before the head: the answer must never reach another request
            self.abort()

    def _timed_out(self, total_s: float) -> None:
        self.timer = None
        exc = asyncio.TimeoutError(f"no whole answer within {total_s:g} s")
        if self.resp is not None:
            self.resp._fail(exc)
        self._broken(exc)
        self.abort()

    def _broken(self, exc: BaseException) -> None:
        head = self.head
        if head is not None and not head.done():
            head.set_exception(exc)

    def _until_close(self) -> bool:
        h = self.headers
        return "content-length" not in h and "chunked" not in h.get("transfer-encoding", "").lower()

    def done_with(self, resp: UpstreamResponse) -> None:
        if self.complete and self.keep_alive and not self.closed and self.resp is resp:
            self.data = b""
            if self.paused:
                self.resume()
            self.head = None
            self.resp = None
            self.pool._idle(self)
        else:
            self.abort()

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.abort()
            self.pool._lost(self)


class _Target:
    """Where one base URL's requests go: address, TLS, the request head's fixed part."""

    __slots__ = ("heads", "host", "idle", "port", "ssl", "server_hostname", "host_header")

    def __init__(self, base: str) -> None:
        u = urlsplit(base)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base!r}")
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if u.scheme == "https" else None
        self.server_hostname = u.hostname if self.ssl else None
        self.host_header = u.netloc.rpartition("@")[2].encode("latin-1")
        self.heads: dict[tuple[str, str], bytes] = {}
        self.idle: deque[_Connection] = deque()

    def head(self, path: str, content_type: str) -> bytes:
        key = (path, content_type)
        h = self.heads.get(key)
        if h is None:
            h = self.heads[key] = b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: %s\r\nContent-Length: " % (
                path.encode("latin-1"),
                self.host_header,
                content_type.encode("latin-1"),
            )
        return h


class UpstreamPool:
    """Keep-alive connections to the workers (see the module docstring).

    Args:
        limit: connections open at once, over all workers (at least 1).
        keepalive_timeout_s: an idle connection is closed after this long.
        connect_timeout_s: longest a new connection may take.
        total_timeout_s: longest a whole request may take (head and body); None: no limit.
    """

    def __init__(
        self,
        limit: int,
        keepalive_timeout_s: float,
        connect_timeout_s: float,
        total_timeout_s: float | None = None,
    ) -> None:
        self.limit = max(1, limit)
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.total_timeout_s = total_timeout_s
        self._targets: dict[str, _Target] = {}
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._slots: deque[asyncio.Future[None]] = deque()
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections open now (busy and idle)."""
        return len(self._open)

    def idle_connections(self, base: str | None = None) -> int:
        """Idle connections, to ``base`` or to every worker."""
        if base is not None:
            t = self._targets.get(base)
            return len(t.idle) if t else 0
        return sum(len(t.idle) for t in self._targets.values())

    def post(
        self, base: str, path: str, body: bytes, content_type: str = "application/json"
    ) -> asyncio.Future[UpstreamResponse]:
        """Send ``body`` to ``base + path``; a future of the answer's head (cancel it to abandon the request).

        Raises:
            ValueError: ``base`` is not an http(s) URL.
        """
        loop = asyncio.get_running_loop()
        head: asyncio.Future[UpstreamResponse] = loop.create_future()
        if self._closed:
            head.set_exception(UpstreamError(_CLOSED))
            return head
        t = self._targets.get(base)
        if t is None:
            t = self._targets[base] = _Target(base)
        data = b"%s%d\r\n\r\n%s" % (t.head(path, content_type), len(body), body)
        conn = self._take_idle(t, loop.time())
        if conn is not None:
            conn.send(data, head, self.total_timeout_s)
        else:
            self._open_new(t, data, head)
        return head

    async def close(self) -> None:
        """Close every connection; pending and later requests fail with :class:`UpstreamError`."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._open):
            conn.abort()
        while self._slots:
            f = self._slots.popleft()
            if not f.done():
                f.set_exception(UpstreamError(_CLOSED))

    # -- internals ------------------------------------------------------------------------------------------------

    def _open_new(self, t: _Target, data: bytes, head: asyncio.Future[UpstreamResponse]) -> None:
        """Send ``data`` to ``t`` on a new connection, within the limit (cancelling ``head`` abandons it)."""
        task = asyncio.get_running_loop().create_task(self._open_and_send(t, data, head))
        head.add_done_callback(lambda h: task.cancel() if h.cancelled() else None)

    def _take_idle(self, t: _Target, now: float) -> _Connection | None:
        idle = t.idle
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if conn.closed:
                continue
            if now - conn.idle_since > self.keepalive_timeout_s:  # and every one left of it is older still
                conn.abort()
                while idle:
                    idle.pop().abort()
                return None
            return conn
        return None

    async def _open_and_send(self, t: _Target, data: bytes, head: asyncio.Future[UpstreamResponse]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while len(self._open) + self._connecting >= self.limit:
                if not self._close_oldest_idle():
                    slot: asyncio.Future[None] = loop.create_future()
                    self._slots.append(slot)
                    await slot
                    if head.done():  # abandoned meanwhile: the freed connection is the next waiter's
                        self._next_slot()
                        return
                    idle = self._take_idle(t, loop.time())
                    if idle is not None:
                        idle.send(data, head, self.total_timeout_s)
                        return
            if self._closed:  # closed while this request waited or before its task began
                raise UpstreamError(_CLOSED)
            self._connecting += 1
            try:
                _, conn = await asyncio.wait_for(
                    loop.create_connection(
                        lambda: _Connection(self, t),
                        t.host,
                        t.port,
                        ssl=t.ssl,
                        server_hostname=t.server_hostname,
                    ),
                    self.connect_timeout_s,
                )
            finally:
                self._connecting -= 1
        except asyncio.CancelledError:
            self._next_slot()
            raise
        except Exception as e:  # noqa: BLE001 - handed to the caller through the future
            self._next_slot()
            if not head.done():
                head.set_exception(e)
            return
        if conn.closed or self._closed:  # lost as it opened (the loss found no slot to free), or the pool closed
            conn.abort()
            self._next_slot()
            if not head.done():
                head.set_exception(UpstreamError(_CLOSED if self._closed else "connection closed as it opened"))
            return
        self._open.add(conn)
        if head.done():  # abandoned while connecting: the connection is the pool's for the next request
            self._idle_conn(conn, loop.time())
            return
        conn.send(data, head, self.total_timeout_s)

    def _close_oldest_idle(self) -> bool:
        """Close the idle connection unused the longest; False when none is open."""
        oldest: _Connection | None = None
        for t in self._targets.values():
            idle = t.idle
            while idle and idle[0].closed:  # the worker closed it while idle: no slot to free there
                idle.popleft()
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        oldest.abort()
        return True

    def _idle(self, conn: _Connection) -> None:
        self._idle_conn(conn, asyncio.get_running_loop().time())
        self._next_slot()  # a request waiting for a connection takes this one, or closes it for its own worker

    def _idle_conn(self, conn: _Connection, now: float) -> None:
        conn.idle_since = now
        conn.target.idle.append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_timeout_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        self._sweep = None
        now = asyncio.get_running_loop().time()
        left = False
        for t in self._targets.values():
            idle = t.idle
            while idle and (idle[0].closed or now - idle[0].idle_since > self.keepalive_timeout_s):
                idle.popleft().abort()
            left = left or bool(idle)
        if left and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_timeout_s, self._sweep_idle)

    def _lost(self, conn: _Connection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self._next_slot()

    def _next_slot(self) -> None:
        while self._slots:
            f = self._slots.popleft()
            if not f.done():
                f.set_result(None)
                return


__all__ = ["UpstreamError", "UpstreamPool", "UpstreamResponse"]
