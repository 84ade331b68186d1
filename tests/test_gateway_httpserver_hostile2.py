"""The data plane's HTTP/1.1 server (btbctl.engine.gateway.httpserver) against hostile clients, second round: the
mends of the first (the parser re-fed after an ``Upgrade`` header, percent-decoded paths, the head-size accounting,
the drain wait before the next answer) and what the first round did not try (trailers, duplicated singleton headers,
an HTTP/2 preface, HEAD on a streamed route, a stream nobody reads, in the gateway too).

Each test is an attack that holds (the defects this round found are mended; each test failed before its mend).
Timeouts are configured small; waits are bounded, nothing asserts a wall time.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from btbctl.engine.gateway.httpserver import (
    MAX_REQUEST_HEAD_BYTES,
    HttpRequest,
    Response,
    StreamResponse,
    json_response,
)
from gateway_fakes import GatewayEnv, metric_value, until
from test_gateway_httpserver import MAX_BODY, closed, post, read_head
from test_gateway_httpserver_hostile import ANSWER_WAIT_S, GET_HELLO, HostileApp, answer_within, read_all, settled


class Hostile2App(HostileApp):
    """:class:`HostileApp` plus ``POST /seen`` (reads the body, then answers the ``X-Name`` header it sees) and
    ``GET /v1/models`` (a route of two segments, as the gateway's), ``GET /gstream`` (a streamed GET answer)."""

    def routes(self) -> dict:
        return {
            **super().routes(),
            ("POST", "/seen"): self.seen,
            ("GET", "/v1/models"): self.models,
            ("GET", "/gstream"): self.gstream,
        }

    async def seen(self, request: HttpRequest) -> Response:
        await request.read()
        return json_response({"seen": request.headers.get("X-Name", "")})

    async def models(self, request: HttpRequest) -> Response:
        return json_response({"data": []})

    async def gstream(self, request: HttpRequest) -> StreamResponse:
        out = StreamResponse(200, {"Content-Type": "text/plain"})
        await out.prepare(request)
        await out.write(b"streamed")
        await out.write_eof()
        return out


UPGRADE = "Connection: Upgrade\r\nUpgrade: h2c\r\n"
GET_UPGRADE = f"GET /hello HTTP/1.1\r\nHost: x\r\n{UPGRADE}\r\n".encode()


async def until_gone(app: HostileApp, polls: int = 300) -> bool:
    """Whether the server's connections all close within ``polls`` polls 10 ms apart."""
    for _ in range(polls):
        if not app.server.conns:
            return True
        await asyncio.sleep(0.01)
    return not app.server.conns


# -- the parser re-fed after an Upgrade header ------------------------------------------------------------------


async def test_thousands_of_upgrade_requests_in_one_read_are_all_answered(caplog):
    n = 3000  # 200 KB: one or a few reads
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(GET_UPGRADE * n)
        answered = 0
        try:
            for _ in range(n):
                assert (await answer_within(r))[0] == 200
                answered += 1
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        w.transport.abort()
        assert "Fatal error" not in caplog.text and "RecursionError" not in caplog.text
        assert answered == n


async def test_an_upgrade_request_with_a_padded_content_length_keeps_its_body():
    smuggled = b"GET /hello HTTP/1.1\r\nX-Name: smuggled\r\n\r\n"
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\n" + UPGRADE.encode() + b"Content-Length: %d \r\n\r\n" % len(smuggled)
        )
        w.write(smuggled)
        status, _, body = await answer_within(r)
        assert (status, body) == (200, smuggled)
        assert app.answered == [("/echo", 200)]  # no /hello was served from the body
        w.close()


async def test_a_padded_content_length_without_upgrade_is_read_as_a_body():
    """The same request as above without the Upgrade header: its body is a body."""
    smuggled = b"GET /hello HTTP/1.1\r\nX-Name: smuggled\r\n\r\n"
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d \r\n\r\n" % len(smuggled) + smuggled)
        assert (await answer_within(r))[2] == smuggled
        w.write(GET_HELLO)
        assert (await answer_within(r))[2] == b'{"hello": ""}'
        assert app.answered == [("/echo", 200), ("/hello", 200)]
        w.close()


async def test_a_padded_content_length_over_the_limit_is_not_invited_with_100_continue():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d \r\nExpect: 100-continue\r\n\r\n" % (2 * MAX_BODY)
        )
        status, headers = await read_head(r)
        assert status == 413 and headers.get("connection") == "close", (status, headers)
        w.close()


UPGRADE_BODIES = {
    "content-length": post("/echo", b"GET /hello HTTP/1.1\r\n\r\n", UPGRADE),
    "chunked": b"POST /echo HTTP/1.1\r\nHost: x\r\n" + UPGRADE.encode() + b"Transfer-Encoding: chunked\r\n\r\n"
    b"17\r\nGET /hello HTTP/1.1\r\n\r\n\r\n0\r\nX-Trailer: 1\r\n\r\n",
}


@pytest.mark.parametrize("raw", UPGRADE_BODIES.values(), ids=UPGRADE_BODIES.keys())
async def test_upgrade_requests_in_a_row_have_their_bodies_read_exactly(raw):
    """Two Upgrade requests with bodies that look like requests, then a plain one, in one write: three answers."""
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(raw + raw + GET_HELLO)
        assert (await answer_within(r))[2] == b"GET /hello HTTP/1.1\r\n\r\n"
        assert (await answer_within(r))[2] == b"GET /hello HTTP/1.1\r\n\r\n"
        assert (await answer_within(r))[2] == b'{"hello": ""}'
        assert app.answered == [("/echo", 200), ("/echo", 200), ("/hello", 200)]
        w.close()


async def test_an_upgrade_request_split_across_reads_keeps_its_framing():
    """The head in one read, its body byte by byte after: nothing of the body becomes a request."""
    body = b"GET /hello HTTP/1.1\r\n\r\n"
    async with HostileApp() as app:
        r, w = await app.connect()
        raw = post("/echo", body, UPGRADE)
        w.write(raw[: -len(body)])
        await w.drain()
        for i in range(len(body)):
            w.write(body[i : i + 1])
            await w.drain()
            await asyncio.sleep(0)
        assert (await answer_within(r))[2] == body
        assert app.answered == [("/echo", 200)]
        w.close()


async def test_an_http2_preface_is_refused_and_closed():
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        status, headers, body = await answer_within(r)
        assert status == 400 and headers["connection"] == "close", body
        assert await closed(r) and app.answered == []
        w.close()


DUPLICATED = {
    "Host": b"GET /hello HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n",
    "Transfer-Encoding": b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
}


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(DUPLICATED["Host"], id="Host"),
        pytest.param(DUPLICATED["Transfer-Encoding"], id="Transfer-Encoding"),
    ],
)
async def test_a_duplicated_singleton_header_is_refused(raw):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(raw)
        status, _, body = await answer_within(r)
        assert status == 400, body
        assert app.answered == []
        w.close()


# -- trailers -----------------------------------------------------------------------------------------------------


async def test_a_trailer_does_not_overwrite_a_request_header():
    async with Hostile2App() as app:
        r, w = await app.connect()
        w.write(
            b"POST /seen HTTP/1.1\r\nHost: x\r\nX-Name: head\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n0\r\nX-Name: trailer\r\n\r\n"
        )
        status, _, body = await answer_within(r)
        assert (status, json.loads(body)) == (200, {"seen": "head"})
        w.close()


async def test_an_endless_trailer_line_is_refused_not_buffered():
    async with Hostile2App() as app:
        r, w = await app.connect()
        w.write(b"POST /seen HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: ")
        try:
            for _ in range(64):  # 4 MB of one trailer value, 64 times the head limit
                w.write(b"t" * 65536)
                await asyncio.wait_for(w.drain(), ANSWER_WAIT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass  # refused and closed: what follows is not read
        got = await read_all(r, 0.5)
        refused = got.startswith(b"HTTP/1.1 4") or await until_gone(app, 100)
        w.transport.abort()
        assert refused, got[:100]


async def test_trailers_past_the_head_limit_fail_the_read():
    """Trailers count against the head limit: a body whose trailers never end is refused, not buffered."""
    async with Hostile2App() as app:
        r, w = await app.connect()
        w.write(b"POST /seen HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n")
        for i in range(80):  # 80 KB of trailer fields
            w.write(b"X-T%d: %b\r\n" % (i, b"t" * 1000))
        status, headers, _ = await answer_within(r)
        assert status == 400 and headers["connection"] == "close"
        assert await closed(r)
        w.close()


# -- percent-decoded paths ------------------------------------------------------------------------------------------


NOT_A_ROUTE = {
    # an encoded slash stays encoded: /v1%2Fmodels is not /v1/models
    "encoded slash": (Hostile2App, b"/v1%2Fmodels", (404,)),
    # an absolute-form target's authority ends at its "?": the query is never the path
    "absolute-form query": (HostileApp, b"http://x?/hello", (400, 404)),
}


@pytest.mark.parametrize("app_type,target,statuses", NOT_A_ROUTE.values(), ids=NOT_A_ROUTE.keys())
async def test_a_target_that_only_looks_like_a_route_is_not_routed(app_type, target, statuses):
    async with app_type() as app:
        r, w = await app.connect()
        w.write(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = await answer_within(r)
        assert status in statuses, body
        w.close()


ODD_PATHS = {
    "encoded dot-dot": (b"/x/%2E%2E/hello", 404),
    "encoded slash and dot-dot": (b"/x%2F..%2Fhello", 404),
    "double encoding": (b"/hel%256Co", 404),
    "encoded CR LF": (b"/hello%0D%0AX-Name:%20a", 404),
    "encoded NUL": (b"/hello%00", 404),
    "encoded non-UTF-8": (b"/%FF%FE", 404),
    "a lone percent": (b"/hello%", 404),
    "a bad escape": (b"/hel%zzlo", 404),
    "encoded letters": (b"/%68%65%6C%6C%6F", 200),
}


@pytest.mark.parametrize("path,status", ODD_PATHS.values(), ids=ODD_PATHS.keys())
async def test_percent_decoded_paths_route_only_as_their_plain_form(path, status, caplog):
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n" + GET_HELLO)
        got, headers, body = await answer_within(r)
        assert got == status, body
        assert "\r" not in "".join(headers) and b"\r\n" not in body  # nothing decoded reached the answer's framing
        assert (await answer_within(r))[0] == 200  # the connection serves on
        assert "unhandled error" not in caplog.text
        w.close()


async def test_head_on_a_streamed_get_route_sends_no_body():
    async with Hostile2App() as app:
        r, w = await app.connect()
        w.write(b"HEAD /gstream HTTP/1.1\r\nHost: x\r\n\r\n" + GET_HELLO)
        status, _ = await read_head(r)
        assert status == 200
        line = await asyncio.wait_for(r.readuntil(b"\r\n"), ANSWER_WAIT_S)
        assert line.startswith(b"HTTP/1.1 200 "), line  # the next answer's status line, not the HEAD's body
        w.close()


async def test_a_long_head_starting_after_a_whole_request_in_its_read_is_still_431():
    """The head limit counts a read that completed a request only by what the callbacks saw (an unfinished header
    value is not seen): the next read, inside the head, counts whole, so the head is bounded all the same."""
    async with HostileApp() as app:
        r, w = await app.connect()
        w.write(GET_HELLO + b"GET /hello HTTP/1.1\r\nX-Long: " + b"a" * 200_000)
        try:
            for _ in range(8):
                w.write(b"a" * 100_000)
                await asyncio.wait_for(w.drain(), ANSWER_WAIT_S)
        except (ConnectionError, asyncio.TimeoutError):
            pass
        got = await read_all(r)  # may be lost to the reset that closing on unread bytes causes
        assert got == b"" or (got.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 431 " in got), got[-200:]
        assert await until_gone(app) and app.answered == [("/hello", 200)]
        w.transport.abort()


async def test_a_head_under_the_limit_split_inside_a_header_line_is_served():
    async with HostileApp() as app:
        r, w = await app.connect()
        lines = b"".join(b"X-H%d: %b\r\n" % (i, b"v" * 7800) for i in range(8))  # each line under 8190 bytes
        head = b"GET /hello HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n"
        assert len(head) < MAX_REQUEST_HEAD_BYTES
        cut = len(head) - 4000  # inside the last header line
        w.write(head[:cut])
        for _ in range(200):  # until the server has read (and counted) the first part
            if app.server.conns and app.conn().head_bytes >= cut:
                break
            await asyncio.sleep(0.01)
        assert app.conn().head_bytes >= cut
        w.write(head[cut:])
        status, _, body = await answer_within(r)
        assert status == 200, body
        w.close()


# -- clients that never read their answer -------------------------------------------------------------------------


async def test_a_connection_waiting_for_a_never_read_answer_is_evicted_at_the_cap():
    """A whole answer the client never reads keeps its connection (the drain wait: no idle timer yet), but its
    handler is done: at the cap the guard closes it for a new client."""
    async with Hostile2App(max_connections=1, idle_timeout_s=5.0) as app:
        app.big_bytes = 8 << 20
        r, w = await app.connect()
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        conn = None
        for _ in range(300):
            conns = list(app.server.conns)
            if conns and conns[0].drain_waiter is not None:
                conn = conns[0]
                break
            await asyncio.sleep(0.01)
        assert conn is not None  # held in the drain wait
        r2, w2 = await app.connect()
        w2.write(GET_HELLO)
        status, _, body = await answer_within(r2, 5.0)
        assert status == 200, body
        assert conn.closed
        w.transport.abort()
        w2.close()


async def test_a_stream_nobody_reads_does_not_hold_the_connection_cap_forever():
    async with Hostile2App(max_connections=1) as app:
        app.chunks, app.chunk_bytes = 1000, 1 << 20  # 1 GB, far beyond the socket buffers
        r, w = await app.connect()
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        w.write(post("/stream", b""))
        await settled(lambda: app.written)
        assert 0 < app.written < app.chunks  # stuck in the drain wait
        gone = await until_gone(app, polls=int(10 * app.guard.idle_timeout_s / 0.01))  # 10 idle timeouts
        r2, w2 = await app.connect()
        w2.write(GET_HELLO)
        status, _, _ = await answer_within(r2, 5.0)
        w.transport.abort()
        w2.close()
        assert gone and status == 200


async def test_a_gateway_stream_nobody_reads_does_not_stay_in_flight_forever():
    async with GatewayEnv(1, header_timeout_s=0.3, idle_timeout_s=0.3, worker_kw={"chunks": 400_000}) as env:
        port = int(env.url.rsplit(":", 1)[1])
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"text": "hello there", "stream": True}).encode()
        w.write(
            b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (port, len(body), body)
        )
        await until(lambda: env.fleet[0].requests)
        loop = asyncio.get_running_loop()
        end = loop.time() + 60 * 0.3  # the stall cut-off (8 idle timeouts) and room for a busy machine
        for _ in range(1000):
            inflight = metric_value(await env.metrics(), "btb_inflight_requests")
            if inflight == 0 or loop.time() > end:
                break
            await asyncio.sleep(0.05)
        w.transport.abort()
        assert inflight == 0
