"""The data plane's HTTP/1.1 server (btbctl.engine.gateway.httpserver) over real sockets: pipelining, bodies
(Content-Length, chunked, over the limit, 100-continue), HEAD and unknown routes, the guard's timeouts and cap,
streams (back-pressure, a client that leaves), bad HTTP and the stop.

Timeouts are configured small; waits are bounded, nothing asserts a wall time.
"""

from __future__ import annotations

import asyncio
import json
import logging

from btbctl.engine.gateway.dataplane import error_middleware
from btbctl.engine.gateway.httpserver import HttpApp, HttpRequest, HttpServer, Response, StreamResponse, json_response
from btbctl.engine.netguard import ConnectionGuard, RateLimiter, listen_http

#: Bodies over this are refused (413) by the test server.
MAX_BODY = 4096


class _Metrics:
    """What the error middleware counts refusals in."""

    def __init__(self) -> None:
        self.rejected: list[int] = []

    def reject(self, status: int, reason: str | None = None) -> None:
        self.rejected.append(status)


class App:
    """A served test app: ``POST /echo`` answers its body, ``GET /hello`` a JSON, ``POST /stream`` streams
    ``chunks`` chunks of ``chunk_bytes`` (counting those written), ``POST /wait`` waits for ``release``."""

    def __init__(self, **guard_kw) -> None:
        self.guard_kw = {"max_connections": 16, "header_timeout_s": 0.3, "idle_timeout_s": 0.3, **guard_kw}
        self.metrics = _Metrics()
        self.busy = 0
        self.max_busy = 0
        self.answered: list[tuple[str, int]] = []
        self.chunks = 4
        self.chunk_bytes = 16
        self.written = 0
        self.stream_error: BaseException | None = None
        self.stream_done = asyncio.Event()
        self.release = asyncio.Event()
        self.waiting = asyncio.Event()
        self.cancelled = False

    def routes(self) -> dict:
        """``{(method, path): handler}`` served (a subclass adds its own)."""
        return {
            ("POST", "/echo"): self.echo,
            ("GET", "/hello"): self.hello,
            ("POST", "/stream"): self.stream,
            ("POST", "/wait"): self.wait,
        }

    async def __aenter__(self) -> App:
        on_answer = lambda r, status: self.answered.append((r.path, status))
        app = HttpApp(self.routes(), [error_middleware(self.metrics)], on_answer)
        self.server = HttpServer(app, max_body_bytes=MAX_BODY)
        self.guard = ConnectionGuard("test", retry_after_s=1, limiter=RateLimiter(), **self.guard_kw)
        self.runner, self.port = await listen_http(self.server, "127.0.0.1", 0, self.guard, shutdown_timeout=0.3)
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        await self.runner.cleanup()
        self.guard.close()

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def echo(self, request: HttpRequest) -> Response:
        self.busy += 1
        self.max_busy = max(self.max_busy, self.busy)
        try:
            body = await request.read()
            await asyncio.sleep(0.01)  # a pipelined request arrives meanwhile
            return Response(200, body, {"X-Seen-Length": str(len(body))}, "application/octet-stream")
        finally:
            self.busy -= 1

    async def hello(self, request: HttpRequest) -> Response:
        return json_response({"hello": request.headers.get("X-Name", "")})

    async def stream(self, request: HttpRequest) -> StreamResponse:
        await request.read()
        out = StreamResponse(200, {"Content-Type": "text/event-stream"})
        try:
            await out.prepare(request)
            for _ in range(self.chunks):
                await out.write(b"x" * self.chunk_bytes)
                self.written += 1
            await out.write_eof()
        except ConnectionResetError as e:
            self.stream_error = e
        finally:
            self.stream_done.set()
        return out

    async def wait(self, request: HttpRequest) -> Response:
        await request.read()
        self.waiting.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return json_response({"waited": True})


async def read_answer(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer from ``r``: status, headers (names in lower case) and body (Content-Length or chunked; none for
    a HEAD, which the caller reads with :func:`read_head`)."""
    status, headers = await read_head(r)
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            body += (await r.readexactly(size + 2))[:-2]
            if size == 0:
                return status, headers, body
    return status, headers, await r.readexactly(int(headers.get("content-length", "0")))


async def read_head(r: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def closed(r: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (EOF or reset) within a bounded wait."""
    try:
        return await asyncio.wait_for(r.read(), 5) == b""
    except ConnectionResetError:
        return True


async def test_pipelined_requests_are_answered_one_at_a_time_in_order():
    async with App() as app:
        r, w = await app.connect()
        w.write(post("/echo", b"one") + b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: two\r\n\r\n" + post("/echo", b"3"))
        answers = [await read_answer(r) for _ in range(3)]
        assert [a[2] for a in answers] == [b"one", b'{"hello": "two"}', b"3"]
        assert app.max_busy == 1
        assert [p for p, _ in app.answered] == ["/echo", "/hello", "/echo"]
        w.close()


async def test_a_chunked_body_is_read_whole():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(0.05)
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        status, headers, body = await read_answer(r)
        assert (status, body, headers["x-seen-length"]) == (200, b"hello world", "11")
        w.close()


async def test_a_body_over_the_limit_is_413_in_the_error_shape_and_the_connection_serves_on():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            w.write(b"800\r\n" + b"y" * 2048 + b"\r\n")
        status, _, body = await read_answer(r)  # refused before the body's end
        w.write(b"800\r\n" + b"y" * 2048 + b"\r\n0\r\n\r\n")  # the rest is dropped
        err = json.loads(body)["error"]
        assert status == 413 and "Maximum request body size 4096 exceeded" in err["message"], body
        assert err["type"] == "invalid_request_error" and app.metrics.rejected == [413]
        w.write(post("/echo", b"after"))
        assert (await read_answer(r))[2] == b"after"
        w.close()


async def test_an_unread_body_is_dropped_and_the_connection_serves_on():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
        assert (await read_answer(r))[0] == 200
        w.write(b"67890" + post("/echo", b"next"))
        assert (await read_answer(r))[2] == b"next"
        w.close()


async def test_expect_100_continue_is_answered_when_the_body_is_read():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        w.write(b"body")
        assert (await read_answer(r))[2] == b"body"
        w.close()


async def test_head_unknown_path_and_wrong_method():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers = await read_head(r)
        assert status == 200 and int(headers["content-length"]) > 0  # the GET's length, no body
        w.write(b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_answer(r)
        assert status == 404 and json.loads(body)["error"] == {
            "message": "Not Found: GET /nope",
            "type": "not_found",
            "param": None,
            "code": 404,
        }
        w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_answer(r)
        assert status == 405 and json.loads(body)["error"]["message"] == "Method Not Allowed: GET /echo"
        assert app.metrics.rejected == [404, 405]
        w.close()


async def test_http_1_0_and_connection_close_close_after_the_answer():
    async with App() as app:
        for head in (b"GET /hello HTTP/1.0\r\n\r\n", b"GET /hello HTTP/1.1\r\nConnection: close\r\n\r\n"):
            r, w = await app.connect()
            w.write(head)
            status, headers, _ = await read_answer(r)
            assert status == 200 and headers["connection"] == "close"
            assert await closed(r)
            w.close()


async def test_a_slow_head_is_closed_and_counted():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        assert await closed(r)
        assert app.guard.closed["header_timeout"] == 1 and not app.guard.conns
        w.close()


async def test_an_idle_keep_alive_connection_is_closed():
    async with App() as app:
        r, w = await app.connect()
        w.write(post("/echo", b"once"))
        assert (await read_answer(r))[2] == b"once"
        assert await closed(r)
        assert not app.guard.conns
        w.close()


async def test_a_malformed_request_gets_400_and_the_connection_closes():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        status, headers, body = await read_answer(r)
        assert status == 400 and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert await closed(r)
        w.close()


async def test_a_head_over_the_limit_is_431():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.1\r\nX-Big: " + b"a" * 70000)
        status, _, _ = await read_answer(r)
        assert status == 431
        assert await closed(r)
        w.close()


async def test_a_stream_is_chunked_and_whole():
    async with App() as app:
        r, w = await app.connect()
        w.write(post("/stream", b""))
        status, headers, body = await read_answer(r)
        assert status == 200 and headers["transfer-encoding"] == "chunked" and body == b"x" * 64
        w.write(post("/echo", b"after"))  # the connection is still good
        assert (await read_answer(r))[2] == b"after"
        w.close()


async def test_a_slow_client_holds_the_stream_back():
    async with App() as app:
        app.chunks, app.chunk_bytes = 1024, 65536  # 64 MiB in all, far beyond the socket buffers
        r, w = await app.connect()
        w.write(post("/stream", b""))
        await read_head(r)
        seen = -1
        for _ in range(100):  # until the writer stops: it waits for the client
            await asyncio.sleep(0.05)
            if app.written == seen:
                break
            seen = app.written
        assert seen == app.written and 0 < app.written < app.chunks // 2, app.written
        got = 0
        while True:
            data = await asyncio.wait_for(r.read(1 << 20), 5)
            if not data or data.endswith(b"0\r\n\r\n"):
                break
            got += len(data)
        await asyncio.wait_for(app.stream_done.wait(), 5)
        assert app.written == app.chunks and app.stream_error is None
        w.close()


async def test_a_client_that_leaves_mid_stream_is_seen_by_the_handler():
    async with App() as app:
        app.chunks, app.chunk_bytes = 1 << 20, 65536
        r, w = await app.connect()
        w.write(post("/stream", b""))
        await read_head(r)
        await r.read(65536)
        w.transport.abort()
        await asyncio.wait_for(app.stream_done.wait(), 5)
        assert isinstance(app.stream_error, ConnectionResetError) and app.written < app.chunks
        assert not app.guard.conns and not app.server.conns


async def test_the_cap_answers_503_with_retry_after():
    async with App(max_connections=1) as app:
        r1, w1 = await app.connect()
        w1.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), 5)  # the first connection is serving: it cannot be evicted
        r2, w2 = await app.connect()
        w2.write(post("/echo", b"refused"))
        status, headers, body = await read_answer(r2)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert json.loads(body)["error"]["type"] == "overloaded"
        assert await closed(r2) and app.guard.closed["over_cap"] == 1
        app.release.set()
        assert (await read_answer(r1))[0] == 200
        w1.close()
        w2.close()


async def test_stop_closes_idle_connections_and_cancels_handlers_past_the_timeout():
    async with App() as app:
        r1, w1 = await app.connect()
        w1.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), 5)
        r2, w2 = await app.connect()
        w2.write(post("/echo", b"x"))
        await read_answer(r2)
        await app.runner.cleanup()  # waits 0.3 s for the handler, then cancels it
        assert app.cancelled
        assert await closed(r1) and await closed(r2)
        assert not app.server.conns
        w1.close()
        w2.close()


async def test_a_client_that_leaves_before_its_body_ends_fails_the_read_quietly(caplog):
    async with App() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part")
        for _ in range(100):
            if app.busy:
                break
            await asyncio.sleep(0.01)
        w.transport.abort()
        for _ in range(100):
            if not app.busy:
                break
            await asyncio.sleep(0.01)
        assert app.busy == 0 and not app.answered and not app.server.conns
        assert "unhandled error" not in caplog.text


async def test_an_answer_whose_client_left_is_still_reported():
    async with App() as app:
        r, w = await app.connect()
        w.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), 5)
        w.transport.abort()
        for _ in range(100):
            if not app.server.conns:
                break
            await asyncio.sleep(0.01)
        app.release.set()
        for _ in range(100):
            if app.answered:
                break
            await asyncio.sleep(0.01)
        assert app.answered == [("/wait", 200)]


async def test_a_pipelined_body_waits_in_the_socket_for_its_turn():
    async with App() as app:
        r, w = await app.connect()
        w.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), 5)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(2048):  # 2 MiB: far more than is read ahead of its turn
            w.write(b"400\r\n" + b"z" * 1024 + b"\r\n")
        (conn,) = app.server.conns
        for _ in range(100):
            if conn.reading_paused:
                break
            await asyncio.sleep(0.01)
        assert conn.reading_paused and conn.queue[0]._size < 1 << 20  # the read ahead, at most one more read
        app.release.set()
        assert (await read_answer(r))[0] == 200
        w.write(b"0\r\n\r\n")
        status, _, body = await read_answer(r)
        assert status == 413  # its body is read again once its turn came (and is over the limit)
        w.close()


async def test_a_method_the_parser_does_not_know_is_405():
    async with App() as app:
        r, w = await app.connect()
        w.write(b"FROB /echo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await read_answer(r)
        assert status == 405 and "Method Not Allowed" in json.loads(body)["error"]["message"]
        assert await closed(r)
        w.close()


async def test_the_gateway_data_listener_logs_access_and_errors_and_answers_head(caplog):
    from gateway_fakes import GatewayEnv

    caplog.set_level(logging.INFO)
    async with GatewayEnv(1, access_log=True) as env:
        status, _ = await env.post("/generate", {"text": "hello"})
        assert status == 200
        async with env.http.head(env.url + "/health") as r:
            assert r.status == 200 and await r.read() == b""
        async with env.http.get(env.url + "/nope") as r:
            assert r.status == 404
    access = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert any('"POST /generate HTTP/1.1" 200' in m for m in access), access
    assert any('"GET /nope HTTP/1.1" 404' in m for m in access), access
    errors = [r.getMessage() for r in caplog.records if "request_error" in r.getMessage()]
    assert len(errors) == 1 and "status=404" in errors[0] and "path=/nope" in errors[0], errors
