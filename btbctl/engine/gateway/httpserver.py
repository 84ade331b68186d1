"""The data plane's HTTP/1.1 server: asyncio protocols with the ``httptools`` (llhttp) parser, under a
:class:`~btbctl.engine.netguard.ConnectionGuard`.

The data listener takes a few routes (prompt ``POST`` requests, ``/health``, ``/metrics``, ``/v1/models``) from
clients that keep their connections alive; nothing else of a general web framework is needed on that path (no
cookies, forms, websockets, compression, static files). This server does only that at well under half of
aiohttp's server CPU per request (``benchmarks/bench_router.py``); the control API, the agent and the emulated
worker keep aiohttp.

* **Requests**: one at a time per connection, in the order they arrived (pipelined ones wait their turn; once
  :data:`MAX_PIPELINED` wait, the socket stops being read: the parser takes a whole read, so one read of tiny
  requests may queue more), and the next one's turn comes once the client took the answer before it (the transport's
  write buffer under its high-water mark). A handler starts once the request head is
  complete; :meth:`HttpRequest.read` waits for the body (``Content-Length`` or chunked), sending ``100 Continue``
  first when the client asked for it. A body over ``max_body_bytes`` is not kept: :meth:`HttpRequest.read` raises
  :class:`HttpError` 413 once that much came. The rest of a body the handler did not read is dropped as it arrives
  (the connection serves on; it closes instead when the client waits for a ``100 Continue`` it never got). A
  pipelined request's body is read ahead up to 64 KiB; the rest waits in the socket for its turn. A client's end
  of stream closes the connection (as aiohttp's server does). A request with an ``Upgrade`` header stays HTTP/1.1
  (no protocol is switched: its body and the requests after it are read as such; ``CONNECT`` closes). A target in
  absolute form (``http://host/path``) is routed by its path, and a path is percent-decoded (an encoded slash
  stays encoded). A repeated ``Host``, ``Authorization``, ``Content-Type``, ``Expect`` or app-named header (the
  data plane's declared-burst header) is a 400. Trailers of a
  chunked body are read and dropped (never taken for headers); they and the chunk framing are bounded as a head is.
* **Answers**: a :class:`Response` (whole body), or a :class:`StreamResponse` (chunked transfer encoding; its
  :meth:`~StreamResponse.write` waits while the client's socket buffer is over the transport's high-water mark, so
  a slow client slows the reading of what it is sent; one that takes nothing for :data:`STALLED_IDLE_TIMEOUTS`
  idle timeouts is cut off). Any object with ``status``, ``body`` and ``headers`` is
  written like a :class:`Response` (the connection guard's 503 and the host guard's 403 are aiohttp's). ``HEAD``
  is answered as ``GET`` without the body (a stream's chunks too).
* **Errors**: an unknown path raises :class:`HttpError` 404, a known path with another method 405, inside the
  middlewares (so they are answered in the app's error shape); a request that is not HTTP/1.x or whose head is over
  :data:`MAX_REQUEST_HEAD_BYTES` gets a JSON 400 (431; 405 for a method the parser does not know) and the
  connection closes; no middleware runs for it (as for aiohttp's own 400 answers). A malformed body fails its
  :meth:`HttpRequest.read` with 400 and the connection closes after the answer. A handler that fails before its
  answer started is answered 500; after (a stream), the connection is cut, never a second head.
* **Connections**: the guard sees each connection open and close and runs its middleware first (cap, per-peer cap,
  head timeout of a fresh connection, 503 over the cap); a connection with no complete request head within
  ``idle_timeout_s`` of its last answer (once all of it was handed to the socket) is closed. A client that leaves
  does not cancel its handler (as aiohttp's default): the handler sees ``request.transport.is_closing()`` and a
  :exc:`ConnectionResetError` from any write.
* **Stop** (:meth:`HttpServer.cleanup`): no new connection; idle ones close at once, busy ones after their current
  answer; handlers still running after ``shutdown_timeout_s`` are cancelled and their connections aborted.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote_to_bytes

import httptools

from btbctl.engine.errors import api_error_body
from btbctl.engine.netguard import ConnectionGuard

log = logging.getLogger(__name__)

#: Longest request head accepted (request line and headers), bytes: aiohttp's server bounds a line at 8190 bytes
#: and 128 headers; clients of the data plane send a few hundred bytes.
MAX_REQUEST_HEAD_BYTES = 65536
#: Idle timeouts a client may take nothing of an answer before it is cut off (a product choice: long against a
#: reader's pauses, which an idle connection's timeout would cut, and short against a client that never reads
#: holding a worker's stream, a handler and a place under the connection cap: 80 s at the gateway's default 10 s).
STALLED_IDLE_TIMEOUTS = 8
#: Requests parsed ahead of the one being answered on a connection (pipelining) before its socket stops being read.
MAX_PIPELINED = 8
#: Body bytes of a request parsed ahead (pipelined) before the socket stops being read until its turn comes.
_AHEAD_BODY_BYTES = 65536

#: What a handler answers: a :class:`Response`, a :class:`StreamResponse`, or any object with ``status``,
#: ``body`` and ``headers`` (written as a :class:`Response`).
Answer = Any
Handler = Callable[["HttpRequest"], Awaitable[Answer]]
#: ``middleware(request, handler)``: aiohttp's middleware signature (the guards' middlewares are shared).
Middleware = Callable[["HttpRequest", Handler], Awaitable[Answer]]


class HttpError(Exception):
    """An HTTP error the app answers in its error shape: ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Headers(dict):
    """A request's headers: names in lower case, the last value of a repeated one; looked up in any case."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())


class Response:
    """A whole answer: ``status``, ``body`` (bytes) and ``headers`` (``content_type`` sets ``Content-Type``)."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = dict(headers) if headers else {}
        if content_type is not None:
            self.headers["Content-Type"] = content_type


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    """``data`` as a JSON answer."""
    return Response(status, json.dumps(data).encode(), headers, "application/json")


class StreamResponse:
    """An answer sent as it comes, in chunked transfer encoding: :meth:`prepare` sends the head, :meth:`write` a
    chunk (waiting while the client's socket buffer is full), :meth:`write_eof` the end.

    Raises (each method): ConnectionResetError once the client's connection is closed.
    """

    __slots__ = ("_conn", "_eof", "_head_only", "headers", "status")

    def __init__(self, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers = dict(headers) if headers else {}
        self._conn: _Connection | None = None
        self._eof = False
        self._head_only = False  # the answer to a HEAD request: its head only

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: HttpRequest) -> None:
        conn = request._conn
        conn.check_open()
        self._conn = conn
        self._head_only = request.method == "HEAD"
        conn.send_body(conn.head(request, self.status, self.headers, None))

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or self._eof:
            raise RuntimeError("write before prepare or after write_eof")
        if not data or self._head_only:
            return
        conn.check_open()
        conn.send_body(b"%x\r\n%b\r\n" % (len(data), data) if conn.chunked else data)
        await conn.drain()

    async def write_eof(self) -> None:
        conn = self._conn
        if conn is None or self._eof:
            return
        self._eof = True
        conn.check_open()
        if conn.chunked and not self._head_only:
            conn.send_body(b"0\r\n\r\n")
        await conn.drain()


class HttpRequest:
    """One request as the handlers see it.

    Attributes:
        method: ``GET``, ``POST``, ... as sent.
        path: the target's path (without the query).
        headers: :class:`Headers`.
        content_length: the ``Content-Length`` (None when absent, e.g. a chunked body).
        remote: the peer's address.
        transport: the connection's transport (``is_closing()`` once the client left).
        protocol: the connection (the key of the connection guard).
    """

    __slots__ = (
        "_body",
        "_complete",
        "_conn",
        "_continue",
        "_drop",
        "_error",
        "_size",
        "_too_large",
        "_waiter",
        "content_length",
        "headers",
        "keep_alive",
        "method",
        "path",
        "protocol",
        "remote",
        "status",
        "transport",
        "version",
    )

    def __init__(self, conn: _Connection, method: str, path: str, headers: Headers, version: str) -> None:
        self._conn = conn
        self.protocol = conn
        self.transport = conn.transport
        self.remote = conn.remote
        self.method = method
        self.path = path
        self.headers = headers
        self.version = version
        cl = headers.get("content-length")
        cl = None if cl is None else cl.strip(" \t")  # the parser accepts (and checked) padding around the digits
        self.content_length = int(cl) if cl is not None and cl.isdigit() else None
        self.keep_alive = True
        self.status: int | None = None  # the answer's, once its head is sent
        self._body: list[bytes] = []
        self._size = 0
        self._complete = False
        self._too_large = False
        self._drop = False
        self._error: HttpError | None = None  # the body turned out malformed (then the connection closes)
        self._continue = headers.get("expect", "").lower() == "100-continue"
        self._waiter: asyncio.Future[None] | None = None

    @property
    def gone(self) -> bool:
        """Whether the client closed the connection (nobody takes an answer any more)."""
        return self._conn.closed or self.transport.is_closing()

    def at_eof(self) -> bool:
        """Whether the whole body has arrived (a small one usually comes with the head)."""
        return self._complete

    async def read(self) -> bytes:
        """The whole body.

        Raises:
            HttpError: 413, the body is over the server's ``max_body_bytes`` (as soon as that many bytes came; the
                rest is dropped as it arrives).
            ConnectionResetError: the client left before the body's end.
        """
        limit = self._conn.server.max_body_bytes
        if not self._complete and self._continue and self.content_length is not None and self.content_length > limit:
            self._too_large = True  # refused before the client is invited to send it: it may send it anyway
            self.keep_alive = False
        if not self._complete and not self._too_large:
            if self._continue:
                self._continue = False
                self._conn.send_continue()
            while not self._complete and not self._too_large and self._error is None:
                if self._conn.closed:
                    raise ConnectionResetError("the client closed the connection before the request body's end")
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
        if self._error is not None:
            raise self._error
        if self._too_large:
            size = self._size if self.content_length is None else max(self._size, self.content_length)
            raise HttpError(413, f"Maximum request body size {limit} exceeded, actual body size {size}")
        body = self._body
        return body[0] if len(body) == 1 else b"".join(body)

    # -- fed by the connection ----------------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._size += len(data)
        if self._drop:
            return
        if self._size > self._conn.server.max_body_bytes:
            if not self._too_large:
                self._too_large = True
                self._body = []
                self._wake()
            return
        self._body.append(data)


#: Reason phrases of the status codes (HTTP/1.1 wants one; the client ignores it).
_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
#: Status lines of the common answers, built once.
_STATUS_LINES = {s: b"HTTP/1.1 %d %s\r\n" % (s, _REASONS[s].encode()) for s in (200, 400, 404, 413, 429, 502, 503)}


class _Clock:
    """The ``Date`` header's value, rebuilt at most once a second."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.at = 0
        self.value = b""

    def date(self) -> bytes:
        now = int(time.time())
        if now != self.at:
            self.at = now
            self.value = formatdate(now, usegmt=True).encode()
        return self.value


_DATE = _Clock()


class _Connection(asyncio.Protocol):
    """One client connection: parses its requests, answers them one at a time in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.closing = False  # no request after the ones being answered: close then
        self.reading_paused = False
        self.writing_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.queue: deque[HttpRequest] = deque()  # complete heads waiting for their turn
        self.current: HttpRequest | None = None  # the request being answered
        self.task: asyncio.Task | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.idle_since: float | None = None  # loop time of the last answer, while no request head came since
        self.parsing: HttpRequest | None = None  # the request whose head or body is arriving
        self.url = b""
        self.headers = Headers()
        self.in_head = False
        self.head_bytes = 0  # of the head being parsed: its URL and whole header lines, and reads wholly inside it
        self.read_counted = 0  # head bytes the callbacks counted during the current read
        self.raw_pending = 0  # head bytes counted raw for the header line being read (recounted whole at its end)
        self.trailer_bytes = 0  # of the trailers of a chunked body
        self.framing_bytes = 0  # of a body's reads that were not body (chunk framing, trailers)
        self.chunks = 0  # chunks of the body being read
        self.body_in_read = 0  # body bytes of the current read
        self.done_in_read = 0  # requests whose end the current read held
        self.upgraded: HttpRequest | None = None  # a request with an Upgrade header, its body not parsed yet
        self.chunked = False  # the answer being sent uses chunked transfer encoding
        self.bad: tuple[int, str] | None = None  # a request that could not be parsed: answered, then close
        self.resumed: HttpRequest | None = None  # the request whose body the next parsed head frames

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.server.made(self)

    def data_received(self, data: bytes) -> None:
        if self.closing or self.bad is not None:
            return  # nothing after a request answered with a close is read
        # A read that ends inside a head and holds nothing else (it started inside the head, or between requests
        # with no request completed before the head began) counts whole: its part the callbacks did not see is a
        # header line being read, which the parser keeps whole however long it grows. (A read that also completed
        # requests before the head began counts only what the callbacks saw: at most one read more.)
        while True:
            whole = self.in_head or self.parsing is None
            in_body = self.parsing if not self.in_head else None  # a body (chunked: and trailers) being read
            self.read_counted = 0
            self.done_in_read = 0
            self.body_in_read = 0
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as e:
                rest = self._not_upgraded(data, e.args[0] if e.args else len(data))
                if rest is None:
                    return
                data = rest  # the upgrade request's body and what follows, for the new parser (a loop, not a
                continue  # call per request: thousands of them may come in one read)
            except httptools.HttpParserError as e:  # a callback's _Refused comes as its context
                if isinstance(e.__context__, _Refused):
                    self._malformed(e.__context__.status, e.__context__)
                    return
                self._parse_error(e)
                return
            break
        if in_body is not None and self.parsing is in_body and not self.done_in_read:
            # what of a read wholly inside a body is not body: chunk framing and trailers (a trailer line the parser
            # keeps whole however long it grows), bounded as a head is, plus a few bytes per chunk
            self.framing_bytes += max(0, len(data) - self.body_in_read)
            if self.framing_bytes > MAX_REQUEST_HEAD_BYTES + _CHUNK_FRAMING_BYTES * self.chunks:
                self._malformed(400, _Refused(400, f"chunk framing or trailers over {MAX_REQUEST_HEAD_BYTES} bytes"))
                return
        if self.in_head and whole and not self.done_in_read:
            extra = max(0, len(data) - self.read_counted)
            self.head_bytes += extra
            self.raw_pending += extra
            if self.head_bytes > MAX_REQUEST_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_REQUEST_HEAD_BYTES} bytes")

    def _parse_error(self, e: httptools.HttpParserError) -> None:
        """The parser failed: 405 for a method no route takes (aiohttp's router said 405 too), else
        :meth:`_malformed`."""
        if isinstance(e, httptools.HttpParserInvalidMethodError):
            self._refuse(405, "Method Not Allowed: a method no route takes")
        else:
            self._malformed(431 if self.head_bytes > MAX_REQUEST_HEAD_BYTES else 400, e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.closing = True
        self.server.lost(self)
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        for req in (self.current, self.parsing, *self.queue):
            if req is not None:
                req._wake()
        self.queue.clear()
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("the client closed the connection"))

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks ------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = Headers()
        self.in_head = True
        self.head_bytes = self.raw_pending = self.trailer_bytes = self.framing_bytes = self.chunks = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:  # a trailer (after a chunked body): counted, never taken for a header of the head
            self.trailer_bytes += len(name) + len(value) + 4
            if self.trailer_bytes > MAX_REQUEST_HEAD_BYTES:
                raise _Refused(400, f"trailers over {MAX_REQUEST_HEAD_BYTES} bytes")
            return
        self.head_bytes -= self.raw_pending  # that part of this line was counted raw: now it counts whole
        self.raw_pending = 0
        self._count_head(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        if key in self.server.singletons and key in self.headers:
            raise _Refused(400, f"a repeated {key} header")
        self.headers[key] = value.decode("latin-1")

    def _count_head(self, n: int) -> None:
        """``n`` more bytes of the head being parsed; past :data:`MAX_REQUEST_HEAD_BYTES` the parse stops (431)."""
        self.head_bytes += n
        self.read_counted += n
        if self.head_bytes > MAX_REQUEST_HEAD_BYTES:
            raise _Refused(431, f"request head over {MAX_REQUEST_HEAD_BYTES} bytes")  # stops the parser

    def _malformed(self, status: int, e: Exception) -> None:
        """The parser failed: a head over the limit (431) or not HTTP/1.x (400). A request whose body it was
        reading fails its :meth:`HttpRequest.read` with 400 (answered in the app's error shape, then the
        connection closes); otherwise the connection answers ``status`` after the requests before it and closes."""
        if isinstance(e, _Refused):
            message = e.message
        else:
            message = f"request head over {MAX_REQUEST_HEAD_BYTES} bytes" if status == 431 else f"malformed HTTP: {e}"
        req = self.parsing
        if req is not None:  # its head was complete: the body is malformed
            self.parsing = None
            self.bad = (status, message)  # nothing after it is read
            req.keep_alive = False
            req._error = HttpError(400, f"malformed request body: {e}")
            req._wake()
            return
        self._refuse(status, message)

    def _not_upgraded(self, data: bytes, offset: int) -> bytes | None:
        """The parser stopped after the head of a request with an ``Upgrade`` header, taking what follows for
        another protocol. No protocol is switched here: the request stays HTTP/1.1, so a new parser is to read its
        body (the framing of its head) and the requests after it: returns what to feed it (a framing head, then
        ``data`` from ``offset``), None for a tunnel (``CONNECT``: the connection closes after its answer)."""
        req = self.upgraded
        self.upgraded = None
        if req is None or req.method == "CONNECT":
            self.closing = True  # a tunnel: what follows is not HTTP/1.1
            return None
        framing = "Transfer-Encoding: chunked" if "transfer-encoding" in req.headers else None
        if framing is None:
            framing = f"Content-Length: {req.content_length or 0}"
        self.parser = httptools.HttpRequestParser(self)
        self.resumed = req
        return f"POST / HTTP/1.1\r\n{framing}\r\n\r\n".encode() + data[offset:]

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.idle_since = None
        p = self.parser
        resumed = self.resumed
        if resumed is not None:  # the framing head of an Upgrade request's body (_not_upgraded): its body follows
            self.resumed = None
            self.parsing = resumed
            return
        req = HttpRequest(self, p.get_method().decode("latin-1"), _path(self.url), self.headers, p.get_http_version())
        req.keep_alive = p.should_keep_alive()
        if p.should_upgrade():
            self.upgraded = req
        self.parsing = req
        if self.current is None:
            self._start(req)
        else:
            self.queue.append(req)
            if len(self.queue) >= MAX_PIPELINED:
                self._pause()

    def _pause(self) -> None:
        if not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_body(self, body: bytes) -> None:
        self.body_in_read += len(body)
        req = self.parsing
        if req is not None:
            req._feed(body)
            if req is not self.current and req._size > _AHEAD_BODY_BYTES:
                self._pause()  # a pipelined request's body waits in the socket until its turn

    def on_message_complete(self) -> None:
        req = self.parsing
        self.parsing = None
        self.done_in_read += 1
        if req is not None and req is not self.upgraded:  # an Upgrade request's body comes after (_not_upgraded)
            req._complete = True
            req._wake()

    # -- answering ----------------------------------------------------------------------------------------------

    def _start(self, req: HttpRequest) -> None:
        self.current = req
        self.task = asyncio.get_running_loop().create_task(self._serve(req))

    async def _serve(self, req: HttpRequest) -> None:
        server = self.server
        try:
            ans = await server.app.handle(req)
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception:
            ans = None  # the client left: nobody to answer
            if not self.closed:
                log.exception("unhandled error on %s %s", req.method, req.path)
                if req.status is not None:  # its answer had started: cut it (a second head would be its body)
                    self.abort()
                else:
                    ans = _internal_error()
        if self.closed:
            if ans is not None and not (isinstance(ans, StreamResponse) and ans.prepared):
                server.answered(req, ans.status)  # counted and logged as any answer, though nobody takes it
        elif ans is not None:
            try:
                if isinstance(ans, StreamResponse):
                    if not ans.prepared:
                        await ans.prepare(req)
                    await ans.write_eof()
                else:
                    self._answer(req, ans)
                await self.drain()  # the next pipelined answer waits until the client takes this one
            except ConnectionError:
                pass
            except Exception:  # an answer that cannot be written (a header outside latin-1)
                log.exception("cannot write the answer to %s %s", req.method, req.path)
                if req.status is None and not self.closed:  # nothing of it went out: a 500 instead
                    self._answer(req, _internal_error())
                else:
                    self.abort()
        self._next(req)

    def _answer(self, req: HttpRequest, ans: Answer) -> None:
        """Write a whole answer (a :class:`Response` or anything with ``status``, ``body`` and ``headers``)."""
        body = ans.body if isinstance(ans, Response) else _body_of(ans)
        head = self.head(req, ans.status, ans.headers, len(body))
        self.transport.write(head if req.method == "HEAD" else head + body)  # type: ignore[union-attr]

    def _next(self, req: HttpRequest) -> None:
        """``req``'s answer is out: the next request's turn, or the idle wait, or the close."""
        self.current = None
        self.task = None
        server = self.server
        if server.access_log is not None:
            server.access_log.info(
                '%s "%s %s HTTP/%s" %s', req.remote, req.method, req.path, req.version, req.status or "-"
            )
        if self.closed:
            return
        if not req._complete:
            if req._continue:  # the client waits for a 100 Continue that never came: it may never send the body
                req.keep_alive = False
            req._drop = True  # the rest of an unread body is parsed and dropped (the idle timeout bounds it)
        if not req.keep_alive:
            self.closing = True
        if self.queue and not self.closing:
            nxt = self.queue.popleft()
            self._start(nxt)
            if self.reading_paused and len(self.queue) < MAX_PIPELINED and (self.parsing in (None, nxt)):
                self.reading_paused = False
                self.transport.resume_reading()  # type: ignore[union-attr]
        elif self.closing or server.stopping:
            self.closing = True
            self.transport.close()  # type: ignore[union-attr]
        elif self.bad is not None:
            self._refuse(*self.bad)
        else:
            loop = asyncio.get_running_loop()
            self.idle_since = loop.time()
            if self.idle is None:
                self.idle = loop.call_at(self.idle_since + server.guard.idle_timeout_s, self._idle_due)

    def _idle_due(self) -> None:
        """The idle timer: armed once and moved on while requests keep coming (not one timer per answer)."""
        self.idle = None
        since = self.idle_since
        if since is None or self.closed:
            return  # a request head came: the timer is armed again after its answer
        loop = asyncio.get_running_loop()
        if self.transport is not None and self.transport.get_write_buffer_size():
            self.idle_since = since = loop.time()  # the last answer is still going out: idle from when it is
        due = since + self.server.guard.idle_timeout_s
        if loop.time() >= due:
            self.abort()
        else:
            self.idle = loop.call_at(due, self._idle_due)

    def _refuse(self, status: int, message: str) -> None:
        """A request that is not HTTP/1.x (or whose head is too long): answered once the ones before it are, then
        the connection closes."""
        if self.bad is None:
            self.bad = (status, message)
        if self.current is not None or self.closed:
            return
        self.closing = True
        body = json.dumps(api_error_body(status, message, "invalid_request_error")).encode()
        head = b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
        self.transport.write(head % (status, _REASONS[status].encode(), len(body)) + body)  # type: ignore[union-attr]
        self.transport.close()  # type: ignore[union-attr]

    # -- used by the answers ------------------------------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")

    def send_continue(self) -> None:
        if not self.closed:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    def head(self, req: HttpRequest, status: int, headers: Mapping[str, str], length: int | None) -> bytes:
        """The answer's head (the answer counts as sent from here); ``length`` None: a chunked body follows (or, to
        an HTTP/1.0 client, a body up to the connection's close). A ``Connection: close`` among ``headers``
        closes the connection after the answer, and so does a body the client holds back for a ``100 Continue`` it
        was not sent (it may still send it).

        Raises:
            UnicodeEncodeError: a header outside latin-1 (nothing counts as sent then).
        """
        fields = "".join([f"{k}: {v}\r\n" for k, v in headers.items() if k != "Connection"]).encode("latin-1")
        req.status = status
        self.server.answered(req, status)
        keep = (
            req.keep_alive
            and not self.server.stopping
            and headers.get("Connection") != "close"
            and not (req._continue and not req._complete)
        )
        if length is not None:
            framing = b"Content-Length: %d\r\n" % length
            self.chunked = False
        elif req.version == "1.0":
            framing = b""
            keep = self.chunked = False
        else:
            framing = b"Transfer-Encoding: chunked\r\n"
            self.chunked = True
        if not keep:
            req.keep_alive = False
            framing += b"Connection: close\r\n"
        elif req.version == "1.0":
            framing += b"Connection: keep-alive\r\n"  # an HTTP/1.0 client closes unless told
        line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, "Unknown").encode())
        return b"%b%b%bDate: %b\r\n\r\n" % (line, fields, framing, _DATE.date())

    def send_body(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    async def drain(self) -> None:
        """Wait while the transport's write buffer is over its high-water mark, at most
        :data:`STALLED_IDLE_TIMEOUTS` of the guard's ``idle_timeout_s`` (a client that takes nothing of an answer for
        that long is cut off: its handler, the worker's stream and the connection's place under the cap go).

        Raises:
            ConnectionResetError: the connection closed meanwhile, or was cut off.
        """
        if not self.writing_paused:
            return
        self.check_open()
        self.drain_waiter = waiter = asyncio.get_running_loop().create_future()
        wait_s = self.server.guard.idle_timeout_s * STALLED_IDLE_TIMEOUTS
        try:
            await asyncio.wait_for(waiter, wait_s)
        except asyncio.TimeoutError:  # the client takes nothing: its connection (and the handler's slot) goes
            self.abort()
            raise ConnectionResetError(f"the client took nothing of the answer for {wait_s:g} s") from None
        finally:
            self.drain_waiter = None

    def abort(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.abort()


def _internal_error() -> Response:
    """The 500 answer to a request whose handler failed (or whose answer could not be written)."""
    return json_response(api_error_body(500, "internal gateway error", "internal_error"), 500)


class _Refused(Exception):
    """Raised from a parser callback to stop the parse: answered ``status`` (a head past
    :data:`MAX_REQUEST_HEAD_BYTES`: 431; trailers past it or a repeated singleton header: 400), then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


#: Bytes of chunk framing (size line, extensions, line ends) allowed per chunk beyond the head-sized allowance.
_CHUNK_FRAMING_BYTES = 64
#: Headers a request may carry once (RFC 9110 5.3: a repeat of a field defined as one value is an error; aiohttp's
#: server refused these repeated too); ``Content-Length`` and ``Transfer-Encoding`` the parser checks itself.
_SINGLETONS = frozenset({"host", "authorization", "content-type", "expect"})


def _path(url: bytes) -> str:
    """The path of a request target: origin form (``/p?q``), or absolute form (``http://host/p``, RFC 9112 3.2.2),
    percent-decoded (UTF-8; bytes that are not stay as surrogate escapes, matching no route)."""
    if url[:1] != b"/" and b"://" in url[:16]:
        url = url.split(b"://", 1)[1]
        ends = [i for i in (url.find(b"/"), url.find(b"?"), url.find(b"#")) if i >= 0]
        end = min(ends) if ends else len(url)  # the authority ends at the first of them
        url = url[end:] if url[end : end + 1] == b"/" else b"/"
    path = url.split(b"?", 1)[0]
    if b"%" in path:  # an encoded slash stays encoded: it is part of a segment, never a separator
        path = b"%2F".join(unquote_to_bytes(p) for p in path.replace(b"%2f", b"%2F").split(b"%2F"))
    return path.decode("utf-8", "surrogateescape")


def _body_of(ans: Any) -> bytes:
    """The body of an answer that is not a :class:`Response` (aiohttp's ``web.Response`` of the guards: bytes)."""
    body = ans.body
    return b"" if body is None else bytes(body)


class HttpApp:
    """Routes and middlewares of a listener.

    Args:
        routes: ``{(method, path): handler}``; a ``GET`` route answers ``HEAD`` too.
        middlewares: ``middleware(request, handler)``, the first outermost; they run for unknown routes too (whose
            handler raises :class:`HttpError` 404 or 405).
        on_answer: called with each request and its answer's status as the answer head is sent.
    """

    def __init__(
        self,
        routes: Mapping[tuple[str, str], Handler],
        middlewares: Sequence[Middleware] = (),
        on_answer: Callable[[HttpRequest, int], None] | None = None,
    ) -> None:
        self.routes = dict(routes)
        self.middlewares = list(middlewares)
        self.on_answer = on_answer
        self._build()

    def first(self, middleware: Middleware) -> None:
        """Put ``middleware`` before the others (the connection guard's)."""
        self.middlewares.insert(0, middleware)
        self._build()

    def _build(self) -> None:
        """The handlers through the middlewares, once (not per request)."""
        self._paths = {path for _, path in self.routes}
        self._chains: dict[tuple[str, str], Handler] = {}
        for (method, path), handler in self.routes.items():
            self._chains[(method, path)] = self._wrap(handler)
            if method == "GET":
                self._chains.setdefault(("HEAD", path), self._chains[(method, path)])
        self._missing = self._wrap(_not_found)
        self._refused = self._wrap(_not_allowed)

    def _wrap(self, handler: Handler) -> Handler:
        for mw in reversed(self.middlewares):
            handler = _bind(mw, handler)
        return handler

    def handle(self, request: HttpRequest) -> Awaitable[Answer]:
        """The answer to ``request`` (through the middlewares)."""
        handler = self._chains.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        return (self._refused if request.path in self._paths else self._missing)(request)


async def _not_found(request: HttpRequest) -> Answer:
    raise HttpError(404, f"Not Found: {request.method} {request.path}")


async def _not_allowed(request: HttpRequest) -> Answer:
    raise HttpError(405, f"Method Not Allowed: {request.method} {request.path}")


def _bind(mw: Middleware, inner: Handler) -> Handler:
    def handler(request: HttpRequest) -> Awaitable[Answer]:
        return mw(request, inner)

    return handler


class HttpServer:
    """A listener serving ``app`` under ``guard`` (see the module docstring); open it with :meth:`listen`.

    Args:
        app: the routes and middlewares.
        max_body_bytes: longest request body kept (beyond: 413 at :meth:`HttpRequest.read`).
        singletons: more headers a request may carry once (the app's own), beyond :data:`_SINGLETONS`.
    """

    def __init__(self, app: HttpApp, *, max_body_bytes: int, singletons: Sequence[str] = ()) -> None:
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must be >= 0, not {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.singletons = _SINGLETONS | {h.lower() for h in singletons}
        self.access_log: logging.Logger | None = None
        self.shutdown_timeout_s = 1.0
        self.guard: ConnectionGuard = None  # type: ignore[assignment]  # set by listen
        self.conns: set[_Connection] = set()
        self.stopping = False
        self._server: asyncio.Server | None = None

    async def listen(
        self,
        host: str,
        port: int,
        guard: ConnectionGuard,
        *,
        backlog: int = 1024,
        access_log: logging.Logger | None = None,
        shutdown_timeout_s: float = 1.0,
    ) -> tuple[HttpServer, int]:
        """Listen on ``host:port`` under ``guard`` (its middleware goes first; normally through
        :func:`~btbctl.engine.netguard.listen_http`). ``access_log``: a logger for one line per answered request;
        ``shutdown_timeout_s``: how long :meth:`cleanup` waits for running handlers. Returns ``(self, bound
        port)``; the caller awaits :meth:`cleanup` and closes the guard.

        Raises:
            OSError: the address cannot be bound.
        """
        self.guard = guard
        self.access_log = access_log
        self.shutdown_timeout_s = shutdown_timeout_s
        self.app.first(guard.middleware)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True
        )
        guard.start_sweeps()
        sock = self._server.sockets[-1]
        return self, int(sock.getsockname()[1])

    # -- connections ----------------------------------------------------------------------------------------------

    def made(self, conn: _Connection) -> None:
        self.conns.add(conn)
        if self.stopping:
            conn.abort()
            return
        self.guard.connection_made(conn, conn.transport)

    def lost(self, conn: _Connection) -> None:
        self.conns.discard(conn)
        self.guard.connection_lost(conn)

    def answered(self, req: HttpRequest, status: int) -> None:
        hook = self.app.on_answer
        if hook is not None:
            hook(req, status)

    async def cleanup(self) -> None:
        """Stop: see the module docstring. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.conns):
            if conn.current is None:
                conn.closing = True
                if conn.transport is not None:
                    conn.transport.close()
        tasks = [c.task for c in self.conns if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.shutdown_timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        for conn in list(self.conns):
            if conn.transport is not None and not conn.transport.is_closing():
                conn.abort()  # a connection closing after its last answer is left to send it
        if self._server is not None:
            await self._server.wait_closed()
