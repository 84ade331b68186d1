"""The data plane's HTTP/1.1 client to the workers (btbctl.engine.gateway.upstream) against hostile and broken
workers and racy callers, over real sockets: stray bytes after an answer, connections lost at every phase (as they
open, idle, as a request leaves on them), heads that never end, bodies cut by a reset, giant error bodies, the pool
closed during traffic; no answer reaches another request, the ``limit`` never leaks, and a failure is told by its
first cause."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest
from aiohttp import web

from btbctl.engine.gateway.dataplane import DataPlane
from btbctl.engine.gateway.upstream import MAX_HEAD_BYTES, UpstreamError
from gateway_fakes import FakeWorker, GatewayEnv, until
from test_gateway_upstream import OK, Server, pool


async def test_a_stray_partial_answer_after_the_answer_never_reaches_the_next_request():
    """A worker that sends a second answer for one request, its head split across segments: the connection that
    holds its first part is never reused (else the next request would get the rest as its own answer)."""

    async def twice(writer):
        writer.write(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")
        await writer.drain()

    async def rest(writer):
        writer.write(b"\r\nstale")
        await writer.drain()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")

    def answer(conn_no: int, req_no: int):
        if conn_no == 1:
            return twice if req_no == 0 else rest
        return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"

    async with Server(answer) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.read() == b"fresh"
        resp.release()
        await p.close()


@pytest.mark.timeout(10)  # broken, the loop spins: only pytest-timeout ends it
async def test_at_the_limit_an_idle_connection_the_worker_closed_is_not_taken_for_a_free_slot():
    """With ``limit`` connections busy, an idle one the worker closed meanwhile is no connection to close for a
    new request: the request waits (before, the loop spun on it for ever)."""
    close_it = asyncio.Event()

    async def ok_then_close(writer):
        writer.write(OK)
        await writer.drain()
        await close_it.wait()
        writer.close()

    async with Server(lambda c, n: ok_then_close) as a, Server(lambda c, n: None) as b:
        p = pool(limit=1, total_timeout_s=0.1)
        resp = await p.post(a.base, "/generate", b"{}")
        await resp.read()
        resp.release()
        assert p.idle_connections(a.base) == 1
        close_it.set()  # the worker closes its side of the idle connection
        await until(lambda: p.open_connections == 0)
        busy = p.post(b.base, "/generate", b"{}")  # takes the one connection; b never answers
        await b.got_request.wait()
        waiting = p.post(b.base + "/", "/generate", b"{}")  # another target: waits for a slot
        with pytest.raises(asyncio.TimeoutError):
            await busy
        with pytest.raises(asyncio.TimeoutError):  # the slot freed by the timeout: sent, then timed out itself
            await waiting
        assert len(b.requests) == 2 and p.open_connections == 0
        await p.close()


async def test_a_request_sent_while_the_pool_closes_fails_and_leaves_no_connection_open():
    async with Server(lambda c, n: OK) as srv:
        p = pool()
        head = p.post(srv.base, "/generate", b"{}")  # its connection not opened yet
        await p.close()
        with pytest.raises(UpstreamError, match="closed"):
            await head
        assert p.open_connections == 0 and srv.requests == []


async def test_a_connection_lost_as_it_opens_fails_its_request_and_frees_its_slot(monkeypatch):
    """The worker resets a connection right as it opens, and the pool learns of it before its connect resumes
    (on Python 3.11 ``wait_for`` runs the connect in a task of its own: one more loop turn)."""
    loop = asyncio.get_running_loop()
    connect = loop.create_connection

    async def connect_then_reset(*a, **kw):
        transport, protocol = await connect(*a, **kw)
        transport.abort()
        await asyncio.sleep(0)  # connection_lost runs before the pool sees the connection
        return transport, protocol

    async with Server(lambda c, n: OK) as srv:
        p = pool(limit=1)
        monkeypatch.setattr(loop, "create_connection", connect_then_reset)
        with pytest.raises(UpstreamError, match="as it opened"):
            await asyncio.wait_for(p.post(srv.base, "/generate", b"{}"), 1.0)  # broken: no answer ever
        assert p.open_connections == 0
        monkeypatch.undo()
        resp = await asyncio.wait_for(p.post(srv.base, "/generate", b"{}"), 1.0)  # its slot is free
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        await p.close()


async def test_one_endless_header_line_is_cut_off_like_an_endless_head():
    """One header value that never ends (the parser keeps a header line whole until it ends): the head is cut off
    past MAX_HEAD_BYTES received, not when the line ends."""

    async def endless(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nX-Junk: ")
        for _ in range(64 * MAX_HEAD_BYTES // 4096):  # ends (broken pool: a head the total timeout fails)
            writer.write(b"j" * 4096)
            await writer.drain()

    async with Server(lambda c, n: endless) as srv:
        p = pool(total_timeout_s=2.0)
        with pytest.raises(UpstreamError, match="head over"):
            await p.post(srv.base, "/generate", b"{}")
        assert p.open_connections == 0
        await p.close()


async def test_a_body_delimited_by_the_close_ends_only_at_the_worker_s_clean_close():
    """A stream without length or chunks ends at the connection's end, but not at a reset (the worker died) nor
    when the gateway's pool closes under it: the data plane must see a broken stream, not a whole one."""

    async def reset(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        linger = struct.pack("ii", 1, 0)  # close with a reset
        writer.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        writer.transport.abort()

    async def hang(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: 1\n\n")
        await writer.drain()
        await asyncio.Event().wait()  # the rest never comes

    async with Server(lambda c, n: reset if c == 1 else hang) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.readany() == b"data: 1\n\n"
        with pytest.raises(UpstreamError, match="before the answer's end"):
            await resp.readany()
        resp.release()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.readany() == b"data: 1\n\n"
        await p.close()
        with pytest.raises(UpstreamError, match="before the answer's end"):
            await resp.readany()
        resp.release()


async def test_a_request_given_up_as_its_answer_head_arrives_closes_that_answer():
    """The data plane's wait for a first byte is cancelled (its handler ends) just as the head came: the answer it
    will never read is closed, not left holding a connection against the limit."""
    async with Server(lambda c, n: OK) as srv:
        p = pool(limit=1)
        dp = DataPlane(gw=None, life=None)
        head = p.post(srv.base, "/generate", b"{}")
        await asyncio.wait((head,))  # the head is in, the waiter not woken yet
        waiting = asyncio.create_task(dp._until_first_byte(head, 0, asyncio.get_running_loop().time() + 5.0))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert p.open_connections == 0
        resp = await asyncio.wait_for(p.post(srv.base, "/generate", b"{}"), 1.0)  # its slot is free
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        await p.close()


class CloseOnCue:
    """A worker in a thread (blocking sockets): answers each request on its first connection with OK, closes that
    connection when ``close`` is set (signalling ``closed``), then answers on later connections as usual."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.close, self.closed = threading.Event(), threading.Event()
        self.requests = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _answer(self, c: socket.socket, until_cue: bool) -> None:
        c.settimeout(0.05)
        buf = b""
        while True:
            if until_cue and self.close.is_set():
                c.close()
                self.closed.set()
                return
            try:
                data = c.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                c.close()
                return
            buf += data
            if b"\r\n\r\n{}" in buf:  # one whole request of the tests' body
                buf = b""
                self.requests += 1
                c.sendall(OK)

    def _run(self) -> None:
        first = True
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(c, first), daemon=True).start()
            first = False

    def stop(self) -> None:
        self.sock.close()


async def test_a_request_sent_on_an_idle_connection_the_worker_just_closed_goes_on_a_new_one():
    """The worker closes an idle keep-alive connection as the gateway sends on it (the close not seen yet): the
    request is sent again on a new connection, not failed (which would mark a healthy worker down)."""
    srv = CloseOnCue()
    try:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        srv.close.set()
        assert srv.closed.wait(2.0)  # blocks the loop: the pool cannot have seen the close yet
        resp = await asyncio.wait_for(p.post(srv.base, "/generate", b"{}"), 2.0)
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        assert srv.requests == 2
        await p.close()
    finally:
        srv.stop()


async def test_an_answer_s_failure_is_told_by_its_first_cause_not_by_the_close_that_follows():
    """The total timeout passing while nobody reads, or a broken chunk, is what the reader is told: not the
    connection's close that follows (the data plane tells a slow worker from a refusing one by it)."""

    async def half(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")

    async def bad_chunk(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\nxx\r\n")

    async with Server(lambda c, n: half if c == 1 else bad_chunk) as srv:
        p = pool(total_timeout_s=0.05)
        resp = await p.post(srv.base, "/generate", b"{}")
        await until(lambda: resp._conn.closed)
        await asyncio.sleep(0)  # and its close came
        assert await resp.readany() == b"half"
        with pytest.raises(asyncio.TimeoutError):
            await resp.readany()
        resp.release()
        p.total_timeout_s = None
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.readany() == b"hello"
        with pytest.raises(UpstreamError, match="invalid HTTP"):
            await resp.readany()
        resp.release()
        await p.close()


async def test_a_worker_s_endless_error_body_is_not_read_whole(monkeypatch):
    """A 5xx answer's body is read only as far as the attempt's reason needs (its first bytes), not whole: a worker
    answering 500 with a giant body is cut off, the request goes on to fail cleanly."""
    size = 64 << 20
    outcome: list[str] = []

    async def generate(self, request):
        await request.read()
        resp = web.StreamResponse(status=500, headers={"Content-Type": "text/plain", "Content-Length": str(size)})
        await resp.prepare(request)
        try:
            for _ in range(size // 65536):
                await resp.write(b"e" * 65536)
        except ConnectionError:
            outcome.append("cut off")
            raise
        outcome.append("sent whole")
        return resp

    monkeypatch.setattr(FakeWorker, "generate", generate)
    async with GatewayEnv(1) as env:
        status, body = await env.post("/generate", {"text": "hello there"})
        assert status == 502 and "HTTP 500: eeee" in body["error"]["attempts"][0]
        await until(lambda: outcome)
        assert outcome == ["cut off"]
