"""The data plane's HTTP/1.1 client to the workers (btbctl.engine.gateway.upstream) against a real socket server
that answers as told: keep-alive reuse, abandoned and broken answers, streams, back-pressure, limits, bad HTTP."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from btbctl.engine.gateway.upstream import UpstreamError, UpstreamPool

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok":true}'


class Server:
    """A loopback server: each request's head and body are recorded, and ``answer(conn_no, req_no)`` returns the
    bytes to send (None: send nothing; a callable gets the writer to misbehave with)."""

    def __init__(self, answer) -> None:
        self.answer = answer
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection number, head, body)
        self.closed: list[int] = []  # connection numbers the client closed
        self.got_request = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.base = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn_no = self.connections
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((conn_no, head, body))
                self.got_request.set()
                out = self.answer(conn_no, n)
                n += 1
                if callable(out):
                    await out(writer)
                elif out is not None:
                    writer.write(out)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.append(conn_no)
        finally:
            writer.close()


async def answer(p: UpstreamPool, base: str) -> bytes:
    """One request through ``p``: its whole answer (its connection back to the pool)."""
    resp = await p.post(base, "/generate", b"{}")
    out = await resp.read()
    resp.release()
    return out


def pool(**kw) -> UpstreamPool:
    return UpstreamPool(**{"limit": 8, "keepalive_timeout_s": 4.0, "connect_timeout_s": 2.0, **kw})


async def test_a_connection_is_reused_once_its_answer_was_read_and_the_request_is_sent_as_given():
    async with Server(lambda c, n: OK) as srv:
        p = pool()
        for i in range(3):
            resp = await p.post(srv.base, "/generate", b'{"text":"%d"}' % i)
            assert (resp.status, resp.header("Content-Type"), await resp.read()) == (
                200,
                "application/json",
                b'{"ok":true}',
            )
            resp.release()
        assert srv.connections == 1 and [r[0] for r in srv.requests] == [1, 1, 1]
        conn, head, body = srv.requests[2]
        assert head.startswith(b"POST /generate HTTP/1.1\r\n")
        assert f"Host: {srv.base.removeprefix('http://')}".encode() in head
        assert b"Content-Type: application/json" in head and body == b'{"text":"2"}'
        assert (p.open_connections, p.idle_connections(srv.base)) == (1, 1)
        await p.close()


async def test_an_abandoned_request_closes_its_connection_so_its_answer_never_reaches_the_next_one():
    release = asyncio.Event()

    async def late(writer):
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale")

    async with Server(lambda c, n: late if c == 1 else OK) as srv:
        p = pool()
        head = p.post(srv.base, "/generate", b"{}")
        await srv.got_request.wait()
        head.cancel()
        release.set()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert await resp.read() == b'{"ok":true}'  # the second connection's answer, not the stale one
        resp.release()
        assert srv.connections == 2
        await p.close()


async def test_an_answer_not_read_whole_is_never_reused():
    async with Server(lambda c, n: OK) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        resp.close()
        await answer(p, srv.base)
        assert srv.connections == 2
        await p.close()


async def test_a_connection_that_breaks_before_or_during_the_answer_is_an_upstream_error():
    async def cut(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nhalf")
        await writer.drain()
        writer.transport.abort()

    async def nothing(writer):
        writer.transport.abort()

    async with Server(lambda c, n: cut if c == 1 else nothing) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        with pytest.raises(UpstreamError, match="before the answer's end"):
            await resp.read()
        resp.release()
        with pytest.raises(UpstreamError, match="before the answer"):
            await p.post(srv.base, "/generate", b"{}")
        assert p.open_connections == 0
        await p.close()


async def test_a_chunked_stream_arrives_in_order_and_its_end_frees_the_connection():
    async def stream(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            data = b"data: %d\n\n" % i
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(b"0\r\n\r\n")

    async with Server(lambda c, n: stream if n == 0 else OK) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert resp.header("content-type") == "text/event-stream"
        got = b""
        while chunk := await resp.readany():
            got += chunk
        assert got == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and resp.at_eof()
        resp.release()
        await answer(p, srv.base)
        assert srv.connections == 1
        await p.close()


async def test_a_fast_stream_stops_being_read_until_the_reader_catches_up():
    size = 4 << 20

    async def big(writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        writer.write(b"x" * size)
        await writer.drain()

    async with Server(lambda c, n: big) as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        conn = resp._conn
        for _ in range(200):  # until the buffer passes its high-water mark
            if conn.paused:
                break
            await asyncio.sleep(0.01)
        assert conn.paused
        got = len(await resp.readany())
        assert not conn.paused  # drained: read again
        got += len(await resp.read())
        assert got == size
        resp.release()
        await p.close()


async def test_with_a_limit_of_one_a_second_request_waits_for_the_first_connection_and_reuses_it():
    async with Server(lambda c, n: OK) as srv:
        p = pool(limit=1)
        first = await p.post(srv.base, "/generate", b"{}")
        second = p.post(srv.base, "/generate", b"{}")
        await asyncio.sleep(0.05)
        assert not second.done() and p.open_connections == 1
        await first.read()
        first.release()
        resp = await second
        await resp.read()
        resp.release()
        assert srv.connections == 1 and len(srv.requests) == 2
        await p.close()


async def test_an_idle_connection_past_the_keepalive_timeout_is_closed_not_reused():
    async with Server(lambda c, n: OK) as srv:
        p = pool(keepalive_timeout_s=4.0)
        await answer(p, srv.base)
        p._targets[srv.base].idle[0].idle_since -= 5.0  # idle for 5 s by the pool's clock
        await answer(p, srv.base)
        assert srv.connections == 2 and p.open_connections == 1
        await p.close()


async def test_connection_close_and_a_body_delimited_by_the_close_are_read_whole_and_not_reused():
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end"

    async def until_close(writer):
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with Server(lambda c, n: until_close) as srv:
        p = pool()
        for _ in range(2):
            resp = await p.post(srv.base, "/generate", b"{}")
            assert await resp.read() == b"until the end"
            resp.release()
        assert srv.connections == 2
        await p.close()


async def test_an_informational_answer_is_skipped_and_bad_http_is_an_upstream_error():
    async with Server(lambda c, n: b"HTTP/1.1 100 Continue\r\n\r\n" + OK if c == 1 else b"SMTP ready\r\n\r\n") as srv:
        p = pool()
        resp = await p.post(srv.base, "/generate", b"{}")
        assert resp.status == 200 and await resp.read() == b'{"ok":true}'
        resp.close()
        with pytest.raises(UpstreamError, match="invalid HTTP"):
            await p.post(srv.base, "/generate", b"{}")
        await p.close()


async def test_the_total_timeout_and_a_refused_connect_are_told_apart():
    async with Server(lambda c, n: None) as srv:
        p = pool(total_timeout_s=0.05)
        with pytest.raises(asyncio.TimeoutError):
            await p.post(srv.base, "/generate", b"{}")
        await p.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = pool()
    with pytest.raises(ConnectionRefusedError) as e:
        await p.post(f"http://127.0.0.1:{port}", "/generate", b"{}")
    assert e.value.errno == errno.ECONNREFUSED and not isinstance(e.value, UpstreamError)
    with pytest.raises(ValueError, match="not an http"):
        p.post("ftp://x", "/generate", b"{}")
    await p.close()
    with pytest.raises(UpstreamError, match="closed"):
        await p.post("http://127.0.0.1:1", "/generate", b"{}")


async def test_an_endless_answer_head_is_cut_off():
    async def endless(writer):
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(2000):
            writer.write(b"X-Junk-%d: %s\r\n" % (i, b"j" * 100))
            await writer.drain()

    async with Server(lambda c, n: endless) as srv:
        p = pool()
        with pytest.raises(UpstreamError, match="head over"):
            await p.post(srv.base, "/generate", b"{}")
        assert p.open_connections == 0
        await p.close()
