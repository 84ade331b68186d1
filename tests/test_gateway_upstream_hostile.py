"""The data plane's HTTP/1.1 client to the workers (btbctl.engine.gateway.upstream) against hostile and broken
workers and racy callers, over real sockets: stale bytes after an answer, connections lost at every phase, heads
that never end, the pool closed during traffic; no answer reaches another request and the ``limit`` never leaks."""

from __future__ import annotations

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
