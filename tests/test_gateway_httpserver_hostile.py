"""The data plane's HTTP/1.1 server (btbctl.engine.gateway.httpserver) against hostile, broken and racy clients over
real sockets: smuggling attempts (conflicting framing, bad chunks), heads and bodies past the limits, pipelining
that never reads its answers, upgrade requests, odd request targets, a handler failing mid-stream.

Each ``xfail(strict=True)`` test is a defect that stands (its reason says which, and what aiohttp's server did);
the others are attacks that hold. Timeouts are configured small; waits are bounded, nothing asserts a wall time.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket

import pytest

from btbctl.engine.gateway.httpserver import (
    MAX_PIPELINED,
    MAX_REQUEST_HEAD_BYTES,
    HttpRequest,
    Response,
    StreamResponse,
)
from gateway_fakes import GatewayEnv, metric_value, until
from test_gateway_httpserver import App, closed, post, read_answer, read_head

#: Body of ``GET /big``: an answer far larger than its request (as ``/metrics`` is).
BIG_BYTES = 16384
#: Longest a test waits for an answer that should come at once, seconds.
ANSWER_WAIT_S = 2.0


class HostileApp(App):
    """:class:`App` plus ``GET /big`` (an answer of ``big_bytes``, 16 KiB unless set), ``POST /boom`` (a stream
    that fails after its first chunk) and ``GET /unwritable`` (an answer whose head cannot be encoded)."""

    def routes(self) -> dict:
        return {
            **super().routes(),
            ("GET", "/big"): self.big,
            ("POST", "/boom"): self.boom,
            ("GET", "/unwritable"): self.unwritable,
        }

    big_bytes = BIG_BYTES

    async def big(self, request: HttpRequest) -> Response:
        return Response(200, b"z" * self.big_bytes, content_type="application/octet-stream")

    async def boom(self, request: HttpRequest) -> StreamResponse:
        await request.read()
        out = StreamResponse(200, {"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(b"data: 1\n\n")
        raise ValueError("a bug after the answer started")

    async def unwritable(self, request: HttpRequest) -> Response:
        return Response(200, b"{}", {"X-Label": "\u20ac"})  # not latin-1: its head cannot be written

    def conn(self):
        """The one open server connection."""
        (conn,) = self.server.conns
        return conn


async def answer_within(r: asyncio.StreamReader, timeout_s: float = ANSWER_WAIT_S):
    """:func:`read_answer` within ``timeout_s`` (an answer that should come at once)."""
    return await asyncio.wait_for(read_answer(r), timeout_s)


async def read_all(r: asyncio.StreamReader, timeout_s: float = ANSWER_WAIT_S) -> bytes:
    """Everything until the server closes (or ``timeout_s`` passes)."""
    out = b""
    try:
        while data := await asyncio.wait_for(r.read(65536), timeout_s):
            out += data
    except (asyncio.TimeoutError, ConnectionResetError):
        pass
    return out


async def settled(value, polls: int = 5, timeout_s: float = 5.0) -> None:
    """Wait until ``value()`` stops changing for ``polls`` polls 20 ms apart (at most ``timeout_s``)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    last, same = value(), 0
    while same < polls and loop.time() < end:
        await asyncio.sleep(0.02)
        now = value()
        same = same + 1 if now == last else 0
        last = now


GET_HELLO = b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n"

# -- smuggling and malformed heads: held ------------------------------------------------------------------------

REFUSED = {
    "content-length and chunked": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "two equal content-lengths": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    "two content-lengths": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "chunked, identity": b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, identity\r\n\r\n"
    b"3\r\nabc\r\n0\r\n\r\n",
    "identity and content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n"
    b"Content-Length: 3\r\n\r\nabc",
    "negative content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "signed content-length": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc",
    "content-length overflow": b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n",
    "obs-fold": b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: a\r\n b\r\n\r\n",
    "NUL in a value": b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: a\x00b\r\n\r\n",
    "CR in a value": b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: a\rb\r\n\r\n",
    "space before the colon": b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name : a\r\n\r\n",
    "bare LF": b"GET /hello HTTP/1.1\nHost: x\n\n",
    "lower-case method": b"get /hello HTTP/1.1\r\nHost: x\r\n\r\n",
    "non-UTF-8 path": b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP/1.2": b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /hello HTTP/1.2\r\nHost: x\r\n\r\n",
}


@pytest.mark.parametrize("raw", REFUSED.values(), ids=REFUSED.keys())
async def test_ambiguous_or_malformed_requests_are_refused_and_the_connection_closes(raw):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(raw)
        if raw.startswith(GET_HELLO):  # a good request first: answered, then the bad one
            assert (await answer_within(r))[0] == 200
        status, headers, body = await answer_within(r)
        # 400; a method the parser does not know (lower case: methods are case-sensitive) is 405
        assert status == (405 if raw.startswith(b"get ") else 400) and headers["connection"] == "close", body
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        assert await closed(r)
        assert app.answered in ([], [("/hello", 200)])  # the bad request reached no handler
        w.close()


ACCEPTED = {
    "chunk extension": (b"Transfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n0\r\n\r\n", b"abc"),
    "trailer": (b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n", b"abc"),
    "padded content-length": (b"Content-Length:  3 \r\n\r\nabc", b"abc"),
}


@pytest.mark.parametrize("rest,body", ACCEPTED.values(), ids=ACCEPTED.keys())
async def test_legal_framing_variants_are_read_exactly(rest, body):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n" + rest + post("/echo", b"next"))
        assert (await answer_within(r))[2] == body
        assert (await answer_within(r))[2] == b"next"  # nothing of the first was taken for a request
        w.close()


ODD_TARGETS = {
    "OPTIONS *": (b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "CONNECT": (b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "dot-dot": (b"GET /x/../hello HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "%00": (b"GET /hello%00 HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "fragment": (b"GET /hello#f HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    "query": (b"GET /hello?a=1&b HTTP/1.1\r\nHost: x\r\n\r\n", 200),
    "non-UTF-8 header value": (b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: \xff\xfe\r\n\r\n", 200),
}


@pytest.mark.parametrize("raw,status", ODD_TARGETS.values(), ids=ODD_TARGETS.keys())
async def test_odd_targets_and_bytes_are_answered_in_the_error_shape_not_500(raw, status, caplog):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(raw)
        got, _, body = await answer_within(r)
        assert got == status, body
        if status == 404:
            assert json.loads(body)["error"]["type"] == "not_found"
        assert "unhandled error" not in caplog.text
        w.close()


async def test_head_on_a_post_route_is_405_without_a_body():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"HEAD /echo HTTP/1.1\r\nHost: x\r\n\r\n" + GET_HELLO)
        status, headers = await read_head(r)
        assert status == 405 and int(headers["content-length"]) > 0
        assert (await answer_within(r))[2] == b'{"hello": ""}'  # no body came between the two
        w.close()


async def test_a_request_after_connection_close_is_not_answered():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" + GET_HELLO)
        assert (await read_all(r)).count(b"HTTP/1.1 200 OK") == 1
        assert app.answered == [("/hello", 200)]
        w.close()


async def test_a_url_of_megabytes_is_refused_and_not_buffered():
    """The 431 may be lost to the reset that closing on the unread rest of the URL causes; the connection closes."""
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /" + b"a" * (4 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await read_all(r)
        assert got == b"" or got.startswith(b"HTTP/1.1 431 "), got[:100]
        assert app.answered == []
        w.close()


# -- timeouts: held ---------------------------------------------------------------------------------------------


async def test_a_slow_head_on_a_kept_alive_connection_is_closed_by_the_idle_timeout():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(GET_HELLO)
        assert (await answer_within(r))[0] == 200
        w.write(b"GET /hello HTTP/1.1\r\nX-Slow: ")  # the guard's head timeout is over: only the idle one is left
        assert await closed(r)
        assert not app.server.conns and app.answered == [("/hello", 200)]
        w.close()


async def test_an_endless_unread_body_is_cut_off_by_the_idle_timeout():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
        assert (await answer_within(r))[0] == 200

        async def trickle() -> None:
            while not w.is_closing():
                w.write(b"x" * 1024)
                await asyncio.sleep(0.01)

        feeder = asyncio.create_task(trickle())
        try:
            assert await closed(r)  # the body keeps coming, dropped; the idle timeout ends it
        finally:
            w.close()
            feeder.cancel()


async def test_hundreds_of_idle_connections_are_closed_and_the_books_balance():
    async with HostileApp(max_connections=16) as app:
        idle = [await app.connect() for _ in range(200)]
        r, w = await app.connect()
        w.write(GET_HELLO)
        status, _, _ = await answer_within(r, 5.0)
        assert status in (200, 503)  # served or refused in the error shape, never left hanging
        assert all(await asyncio.gather(*(closed(ri) for ri, _ in idle)))
        w.close()
        for _, wi in idle:
            wi.close()
        await until(lambda: not app.server.conns and not app.guard.conns)
        assert app.guard.closed["header_timeout"] + app.guard.closed["evicted"] >= 200 - 16


# -- defects -----------------------------------------------------------------------------------------------------


async def test_requests_pipelined_ahead_of_an_upgrade_request_are_all_answered():
    async with HostileApp() as app:
        r, w = await app.connect()
        upgrade = b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nX-Name: 3\r\n\r\n"
        w.write(GET_HELLO + b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Name: 2\r\n\r\n" + upgrade)
        assert (await answer_within(r))[2] == b'{"hello": ""}'
        assert (await answer_within(r))[2] == b'{"hello": "2"}'  # broken: the connection closes here
        w.close()


async def test_a_post_with_an_upgrade_header_has_its_body_read():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(post("/echo", b"abc", "Connection: Upgrade\r\nUpgrade: h2c\r\n"))
        status, headers, body = await answer_within(r)
        assert (status, body) == (200, b"abc"), headers
        w.close()


BAD_BODIES = {
    "chunk-size overflow": b"FFFFFFFFFFFFFFFFF1\r\nabc\r\n0\r\n\r\n",
    "bare LF after a chunk size": b"3\nabc\n0\n\n",
    "not a chunk size": b"zz\r\nabc\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("chunks", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_a_malformed_chunked_body_fails_the_read_at_once(chunks):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks)
        status, headers, _ = await answer_within(r)
        assert status == 400 and headers.get("connection") == "close"
        assert await closed(r) and app.busy == 0
        w.close()


async def test_a_chunked_body_over_the_limit_is_refused_before_its_end():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):  # 8 KiB, twice the limit; the last chunk never comes
            w.write(b"800\r\n" + b"y" * 2048 + b"\r\n")
        status, _, body = await answer_within(r)
        assert status == 413 and "Maximum request body size" in json.loads(body)["error"]["message"]
        w.close()


async def test_a_client_that_never_reads_its_pipelined_answers_holds_the_server_back():
    async with HostileApp(idle_timeout_s=5.0) as app:
        r, w = await app.connect()
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 2000)  # 62 KB asking for 32 MB, never read
        await settled(lambda: len(app.answered))
        buffered = app.conn().transport.get_write_buffer_size()
        assert buffered < 1 << 20, (buffered, len(app.answered))
        w.transport.abort()


async def test_requests_parsed_ahead_stop_the_reading_of_the_socket():
    """The parser takes a whole read (as aiohttp's does): one 32 KB read of tiny pipelined requests queues them all,
    beyond MAX_PIPELINED; from there the socket is not read until the queue is short again, so what a client
    pipelines beyond one read waits in its socket."""
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), ANSWER_WAIT_S)
        w.write(GET_HELLO * 1000)  # 32 KB: one read
        conn = app.conn()
        await settled(lambda: len(conn.queue))
        queued = len(conn.queue)
        assert conn.reading_paused and MAX_PIPELINED <= queued <= 1000, queued
        w.write(GET_HELLO * 1000)  # more: not read
        await settled(lambda: len(conn.queue))
        assert len(conn.queue) == queued
        app.release.set()
        w.transport.abort()


async def test_a_handler_error_after_its_stream_started_cuts_the_stream():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(post("/boom", b""))
        status, headers = await read_head(r)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        rest = await read_all(r)
        assert b"HTTP/1.1" not in rest and not rest.endswith(b"0\r\n\r\n"), rest  # cut, not ended as whole
        assert app.answered == [("/boom", 200)]
        w.close()


async def test_an_absolute_form_target_is_routed_by_its_path():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET http://x/hello?a=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await answer_within(r))[:3:2] == (200, b'{"hello": ""}')
        w.close()


async def test_a_percent_encoded_path_is_routed_decoded():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /hel%6Co HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await answer_within(r))[0] == 200
        w.close()


async def test_an_http_1_0_keep_alive_answer_says_keep_alive():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = await answer_within(r)
        assert status == 200 and headers.get("connection", "").lower() == "keep-alive", headers
        w.close()


async def test_a_head_over_the_limit_is_431_even_when_its_end_comes_in_the_same_read():
    async with HostileApp() as app:
        r, w = await app.connect()
        first = MAX_REQUEST_HEAD_BYTES - 4096
        w.write(b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * first)
        conn = None
        for _ in range(200):  # until the server has read the first part
            if app.server.conns and next(iter(app.server.conns)).head_bytes >= first:
                conn = next(iter(app.server.conns))
                break
            await asyncio.sleep(0.01)
        assert conn is not None
        w.write(b"a" * 8192 + b"\r\n\r\n")  # one more small read ends the head, past the limit
        status, _, _ = await answer_within(r)
        assert status == 431
        w.close()


async def test_a_small_head_after_many_pipelined_requests_in_one_read_is_not_431():
    async with HostileApp(idle_timeout_s=5.0) as app:  # 275 KB of answers to read on a busy machine
        r, w = await app.connect()
        w.write(post("/wait", b""))
        await asyncio.wait_for(app.waiting.wait(), ANSWER_WAIT_S)
        w.write(GET_HELLO * MAX_PIPELINED)
        conn = app.conn()
        await settled(lambda: conn.reading_paused)
        assert conn.reading_paused  # what follows waits in the socket, then comes in one read
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        n = 2500
        w.write(GET_HELLO * n + b"GET /hel")  # 80 KB; the last head ends after the read
        app.release.set()
        assert (await answer_within(r))[0] == 200  # /wait
        for _ in range(MAX_PIPELINED + n):
            assert (await answer_within(r))[0] == 200
        w.write(b"lo HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await answer_within(r)
        assert status == 200, body
        w.close()


@pytest.mark.xfail(
    strict=True,
    reason="a client that half-closes (shutdown SHUT_WR) after its request never gets the answer: its end of "
    "stream closes the connection at once (aiohttp's server did the same; the docstring chose it)",
)
async def test_a_half_closed_client_still_gets_its_answer():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(post("/echo", b"then eof"))
        w.write_eof()
        assert (await answer_within(r))[2] == b"then eof"
        w.close()


async def test_an_answer_that_cannot_be_written_does_not_hang_the_connection():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /unwritable HTTP/1.1\r\nHost: x\r\n\r\n")
        got = await read_all(r, timeout_s=5.0)
        hung = got == b"" and bool(app.server.conns)
        w.transport.abort()
        for _ in range(300):  # the server sees the close
            if not app.server.conns:
                break
            await asyncio.sleep(0.01)
    del app
    gc.collect()  # the server's dead task goes now: not while pytest parses sources for the failure's report
    assert got.startswith(b"HTTP/1.1 500 ") and not hung, got


async def test_a_large_answer_read_slowly_is_not_cut_off_by_the_idle_timeout():
    async with HostileApp() as app:
        app.big_bytes = 32 << 20  # far beyond the socket buffers
        r, w = await app.connect()
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers = await read_head(r)
        assert status == 200
        for _ in range(int(4 * app.guard.idle_timeout_s / 0.02)):  # not reading, for several idle timeouts
            if not app.server.conns:
                break
            await asyncio.sleep(0.02)
        got = 0
        try:
            while data := await asyncio.wait_for(r.read(1 << 20), ANSWER_WAIT_S):
                got += len(data)
                if got >= app.big_bytes:
                    break
        except ConnectionResetError:
            pass
        assert got == int(headers["content-length"]), got
        w.close()


async def test_a_reset_in_the_middle_of_pipelined_answers_is_quiet(caplog):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * 64)
        await read_head(r)
        w.transport.abort()
        for _ in range(300):
            if not app.server.conns:
                break
            await asyncio.sleep(0.01)
        assert not app.server.conns and not app.guard.conns
        assert "unhandled error" not in caplog.text and "Traceback" not in caplog.text


# -- the gateway behind it: a client leaving while its request is at a worker (held) ----------------------------


async def _settled_metrics(env) -> str:
    """``/metrics`` once a request is counted and none is in flight (at most 3 s)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 3.0
    while True:
        m = await env.metrics()
        done = metric_value(m, "btb_requests_total") >= 1 and metric_value(m, "btb_inflight_requests") == 0
        if done or loop.time() > end:
            return m
        await asyncio.sleep(0.02)


async def test_a_body_over_the_gateway_s_limit_is_413_and_its_bytes_never_become_a_request():
    async with GatewayEnv(1, max_body_bytes=1024) as env:
        port = int(env.url.rsplit(":", 1)[1])
        host = b"Host: 127.0.0.1:%d\r\n" % port
        r, w = await asyncio.open_connection("127.0.0.1", port)
        smuggled = b"GET /health HTTP/1.1\r\n" + host + b"\r\n"
        body = smuggled * (4096 // len(smuggled))
        w.write(b"POST /generate HTTP/1.1\r\n" + host + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        w.write(b"GET /metrics HTTP/1.1\r\n" + host + b"\r\n")
        status, _, answer = await answer_within(r)
        assert status == 413 and json.loads(answer)["error"]["type"] == "invalid_request_error"
        status, headers, _ = await answer_within(r)
        assert status == 200 and headers["content-type"].startswith("text/plain")  # /metrics, not a /health
        w.close()


async def test_a_100_continue_request_over_the_limit_is_413_with_connection_close():
    async with GatewayEnv(1, max_body_bytes=1024) as env:
        port = int(env.url.rsplit(":", 1)[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 4096\r\n"
            b"Expect: 100-continue\r\n\r\n" % port
        )
        status, headers, _ = await answer_within(r)  # no 100 Continue first
        assert status == 413 and await closed(r)  # held: the body is not awaited
        assert headers.get("connection") == "close", headers
        w.close()


@pytest.mark.parametrize("when", ["before the first byte", "mid-stream", "not streamed"])
async def test_a_client_that_leaves_is_counted_client_gone_once_and_frees_its_worker(when):
    gate = asyncio.Event()
    key = "chunk_gate" if when == "mid-stream" else "first_byte_gate"
    async with GatewayEnv(1, worker_kw={key: gate}) as env:
        port = int(env.url.rsplit(":", 1)[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"text": "hello there", "stream": when != "not streamed"}).encode()
        w.write(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (port, len(body), body)
        )
        if when == "mid-stream":
            status, _ = await read_head(r)
            assert status == 200 and b"data:" in await asyncio.wait_for(r.read(65536), ANSWER_WAIT_S)
        else:
            await until(lambda: env.fleet[0].requests)
        w.transport.abort()
        gate.set()
        m = await _settled_metrics(env)
        assert metric_value(m, "btb_inflight_requests") == 0
        assert metric_value(m, "btb_requests_total", status="client_gone") == 1
        assert metric_value(m, "btb_requests_total") == 1, m
        status, answer = await env.post("/generate", {"text": "after"})  # the worker's slot is free
        assert status == 200, answer
