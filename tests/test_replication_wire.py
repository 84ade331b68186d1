"""The one copy wire (:mod:`btbctl.engine.replication.wire` on the frames of :mod:`btbctl.sglang_l3.frames`): frames
round-trip on both channel kinds, oversized frames are refused before their body is read, a proof that is wrong,
reflected, replayed or bound to something else is refused, a page whose digest does not match is refused, and the
local protocol to SGLang's backend speaks the same frames."""

from __future__ import annotations

import asyncio
import socket

import pytest

from btbctl.engine.replication.wire import (
    AsyncFrames,
    ChannelError,
    ClientHandshake,
    DigestMismatch,
    FrameConn,
    HandshakeError,
    ServerHandshake,
    check_page,
    page_digest,
)
from btbctl.sglang_l3 import wire as local_wire
from btbctl.sglang_l3.frames import (
    FRAME_HEAD,
    KIND_JSON,
    KIND_PAGE,
    MAX_PREAUTH_BYTES,
    PAGE_HEAD,
    FrameError,
    json_frame,
    page_frame_head,
)

LABEL = b"btbctl-test-auth-v1"
KEY = b"k" * 32


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = FrameConn(a, 5.0), FrameConn(b, 5.0)
    yield ca, cb
    ca.close()
    cb.close()


def test_json_and_page_frames_round_trip_on_a_socket(pair):
    tx, rx = pair
    tx.send_json({"op": "offer", "names": ["a", "b"], "n": 2})
    page = memoryview(bytes(range(256)) * 4)
    tx.send_page(7, page, page_digest(page))
    assert rx.recv_json() == {"op": "offer", "names": ["a", "b"], "n": 2}
    kind, n = rx.recv_head()
    assert kind == KIND_PAGE and n == PAGE_HEAD.size + len(page)
    index, digest = rx.recv_page_head()
    buf = bytearray(n - PAGE_HEAD.size)
    rx.recv_into(memoryview(buf))
    assert index == 7 and bytes(buf) == bytes(page) and digest == page_digest(buf)
    check_page(index, "p7", buf, digest)  # intact: no error
    offer = json_frame({"op": "offer", "names": ["a", "b"], "n": 2})
    assert rx.received == len(offer) + FRAME_HEAD.size + PAGE_HEAD.size + len(page)


async def test_frames_round_trip_on_asyncio_streams_in_the_same_bytes():
    got: list[bytes] = []
    frames = AsyncFrames(None, got.append)  # type: ignore[arg-type]
    frames.send_json({"op": "done", "bytes": 3})
    frames.send_page(2, b"xyz", page_digest(b"xyz"))
    wire = b"".join(got)
    assert wire == json_frame({"op": "done", "bytes": 3}) + page_frame_head(2, 3, page_digest(b"xyz")) + b"xyz"
    reader = asyncio.StreamReader()
    reader.feed_data(wire)
    reader.feed_eof()
    rx = AsyncFrames(reader.readexactly, got.append)
    assert await rx.recv_json() == {"op": "done", "bytes": 3}
    assert await rx.recv_head() == (KIND_PAGE, PAGE_HEAD.size + 3)
    assert await rx.recv_page_head() == (2, page_digest(b"xyz"))


def test_an_oversized_frame_is_refused_before_its_body_is_read(pair):
    tx, rx = pair
    tx.sock.sendall(FRAME_HEAD.pack(KIND_JSON, MAX_PREAUTH_BYTES + 1))  # the header only: no body follows
    with pytest.raises(ChannelError, match=f"exceeds {MAX_PREAUTH_BYTES}"):
        rx.recv_json(MAX_PREAUTH_BYTES)  # would block on the body if it read it
    tx.send_page(0, memoryview(b"x"), page_digest(b"x"))
    with pytest.raises(ChannelError, match="expected a control frame"):
        rx.recv_json()


async def test_an_oversized_or_foreign_frame_is_refused_on_streams_too():
    for data, needle in (
        (FRAME_HEAD.pack(KIND_JSON, MAX_PREAUTH_BYTES + 1), "exceeds"),
        (b"GET / HTTP/1.1\r\n\r\n", "expected a control frame"),
        (FRAME_HEAD.pack(KIND_JSON, 9) + b"[1, 2, 3]", "JSON object"),
    ):
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        with pytest.raises(FrameError, match=needle):
            await AsyncFrames(reader.readexactly, lambda b: None).recv_json(MAX_PREAUTH_BYTES)


def _run(bind_c=("a", "b"), bind_s=("a", "b"), key_c=KEY, key_s=KEY):
    """One handshake in memory; returns the client and server objects after it (raises what it raises)."""
    client, server = ClientHandshake(LABEL, 1), ServerHandshake(LABEL, 1)
    server.read_hello(client.hello(agent="a"))
    auth = client.answer(server.challenge(agent="b"), key_c, bind_c)
    client.confirm(server.verify(auth, key_s, bind_s))
    return client, server


def test_the_handshake_authenticates_both_sides_with_fresh_nonces():
    c1, s1 = _run()
    c2, s2 = _run()
    assert len({c1.nonce, s1.nonce, c2.nonce, s2.nonce}) == 4  # 128 fresh random bits each, per connection


@pytest.mark.parametrize(
    "kw,needle",
    [
        ({"key_c": b"x" * 32}, "authentication failed"),  # a client without the key
        ({"bind_c": ("a", "c")}, "authentication failed"),  # a proof for another copy / other agents
    ],
)
def test_a_wrong_client_proof_is_refused(kw, needle):
    with pytest.raises(HandshakeError, match=needle):
        _run(**kw)


def test_a_server_without_the_key_is_not_believed():
    client, server = ClientHandshake(LABEL, 1), ServerHandshake(LABEL, 1)
    server.read_hello(client.hello())
    auth = client.answer(server.challenge(), KEY, ("a",))
    assert server.client_ok(auth["mac"], KEY, ("a",))
    with pytest.raises(HandshakeError, match="server failed authentication"):
        client.confirm({"op": "auth_ok", "mac": server.proof(b"y" * 32, ("a",))})
    with pytest.raises(HandshakeError, match="server failed authentication"):  # the client's own proof reflected
        client.confirm({"op": "auth_ok", "mac": auth["mac"]})
    with pytest.raises(HandshakeError, match="server failed authentication"):
        client.confirm({"op": "auth_ok", "mac": "é" * 64})  # not even ASCII: refused, not an exception


def test_a_recorded_proof_does_not_answer_another_challenge():
    client, server = ClientHandshake(LABEL, 1), ServerHandshake(LABEL, 1)
    server.read_hello(client.hello())
    recorded = client.answer(server.challenge(), KEY, ("a",))
    # the same client hello replayed to a new connection: the server's nonce is new, the old proof does not fit
    again = ServerHandshake(LABEL, 1)
    again.read_hello(client.hello())
    again.challenge()
    with pytest.raises(HandshakeError, match="authentication failed"):
        again.verify(recorded, KEY, ("a",))


def test_malformed_handshake_frames_are_refused():
    server = ServerHandshake(LABEL, 2)
    with pytest.raises(HandshakeError, match="version 1"):
        server.read_hello(ClientHandshake(LABEL, 1).hello())
    with pytest.raises(HandshakeError, match="nonce"):
        server.read_hello({"op": "hello", "v": 2, "nonce": "not-hex"})
    with pytest.raises(HandshakeError, match="not a hello"):
        server.read_hello({"op": "auth", "v": 2})
    client = ClientHandshake(LABEL, 2)
    with pytest.raises(HandshakeError, match="refused: no such copy"):
        client.answer({"op": "refuse", "error": "no such copy"}, KEY, ())
    with pytest.raises(HandshakeError, match="nonce"):
        client.answer({"op": "challenge", "nonce": "ab"}, KEY, ())


def test_a_page_whose_digest_does_not_match_is_refused():
    data = bytearray(b"\x01" * 4096)
    digest = page_digest(data)
    data[2048] ^= 0xFF  # one flipped byte in transit
    with pytest.raises(DigestMismatch, match=r"block 3 \(h3\): xxh3_64 digest mismatch") as ei:
        check_page(3, "h3", data, digest, "block")
    assert ei.value.index == 3 and ei.value.digest == page_digest(data) != digest


def test_the_local_protocol_speaks_the_shared_frames():
    a, b = socket.socketpair()
    with a, b:
        req = {"op": "exists", "ns": "0" * 16, "keys": ["k1"]}
        assert local_wire.encode(req) == json_frame(req)
        a.sendall(local_wire.encode(req))
        assert local_wire.recv_frame(b) == req
        a.sendall(page_frame_head(0, 1, 0) + b"x")  # a page frame has no place on the local socket
        with pytest.raises(local_wire.WireError, match="expected a control frame"):
            local_wire.recv_frame(b)
    a, b = socket.socketpair()  # a refused frame ends its connection: a new one
    with a, b:
        a.sendall(FRAME_HEAD.pack(KIND_JSON, local_wire.MAX_FRAME_BYTES + 1))
        with pytest.raises(local_wire.WireError, match="exceeds"):
            local_wire.recv_frame(b)
