"""Copy authorization in one process over real loopback sockets: expectations (expiry on an injected clock, single
use), the proof, the copy deadline measured on an injected clock, the cap on connections in the handshake, the
structured log lines, and the RDMA control channel carrying the same proof."""

from __future__ import annotations

import asyncio
import logging

import pytest

from btbctl.engine.agent import peer
from btbctl.engine.replication.auth import AuthError, CopyAuth, Expectations, mac, new_token, parse_hello
from btbctl.engine.replication.rdma import RdmaTransport
from btbctl.engine.replication.tcp import TcpTransport
from btbctl.engine.replication.transport import TransferError
from btbctl.engine.replication.wire import AsyncFrames, ClientHandshake
from btbctl.sglang_l3.frames import page_frame_head
from test_replication_rdma import FakeDevice, _pairs
from test_replication_tcp import BLOCK, Sink, _blocks, _chain, _send, handshake, receiving


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def _until(pred, what: str) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_expectations_expire_on_the_clock_and_are_used_once():
    clock = Clock()
    ex = Expectations(clock)
    chain = _chain(3)
    tok = new_token()
    ex.expect("c1", chain, tok, ttl_s=10)
    with pytest.raises(AuthError, match="already expected"):
        ex.expect("c1", chain, new_token())
    auth = CopyAuth(tok, "c1", chain, BLOCK)
    hello = parse_hello(auth.hello())
    exp = ex.lookup(hello, BLOCK)
    ex.verify(exp, hello, "ab" * 16, auth.proof("ab" * 16))
    with pytest.raises(AuthError, match="authentication failed"):
        ex.verify(exp, hello, "cd" * 16, auth.proof("ab" * 16))  # a proof for another challenge
    with pytest.raises(AuthError, match="authentication failed"):  # a token for another chain
        ex.verify(exp, hello, "ab" * 16, CopyAuth(tok, "c1", _chain(3, 2), BLOCK).proof("ab" * 16))
    ex.claim(exp)
    with pytest.raises(AuthError, match="already arriving"):
        ex.lookup(hello, BLOCK)
    ex.expect("c2", chain, new_token(), ttl_s=10)
    clock.t += 11
    with pytest.raises(AuthError, match="expired"):
        ex.lookup(parse_hello(CopyAuth(new_token(), "c2", chain, BLOCK).hello()), BLOCK)
    with pytest.raises(AuthError, match="not expected"):
        ex.lookup(parse_hello(CopyAuth(new_token(), "c3", chain, BLOCK).hello()), BLOCK)
    with pytest.raises(AuthError, match="already expected"):  # a used id cannot be expected again (replay)
        ex.expect("c1", chain, new_token())
    for bad in ({"token": "short"}, {"ttl_s": 0}, {"ttl_s": 1e9}):
        with pytest.raises(AuthError):
            ex.expect("c9", chain, bad.get("token", new_token()), bad.get("ttl_s", 5))


def test_the_agents_handshake_uses_the_same_mac_primitive():
    key, n_s = b"s" * 32, "ab" * 16
    hs = ClientHandshake(peer.AUTH_LABEL, peer.PROTOCOL_VERSION)
    want = mac(key, b"btbctl-agent-auth-v2", b"client", n_s.encode(), hs.nonce.encode(), b"src", b"dst")
    assert hs.proof(n_s, key, ("src", "dst")) == want


async def test_wrong_token_unexpected_copy_and_duplicate_are_refused_and_logged(caplog):
    caplog.set_level(logging.INFO, logger="btbctl.replication")
    sink = Sink()
    chain = _chain(4)
    async with receiving(sink) as addr:
        addr.authorize("real", chain)
        with pytest.raises(TransferError, match="authentication failed"):
            await TcpTransport().send(addr, "real", chain, _blocks(chain), lambda s, t: None, token=new_token())
        with pytest.raises(TransferError, match="not expected"):
            await TcpTransport().send(addr, "nobody", chain, _blocks(chain), lambda s, t: None, token=new_token())
        with pytest.raises(TransferError, match="no token"):
            await TcpTransport().send(addr, "real", chain, _blocks(chain), lambda s, t: None)
        assert not sink.begun  # nothing reserved for any of them
        await _send(addr, "ok-1", chain, _blocks(chain))
        with pytest.raises(TransferError, match="already arriving or was received"):
            r, w, ans = await handshake(addr, CopyAuth(new_token(), "ok-1", chain, BLOCK))
            raise TransferError(ans["error"])
        w.close()
    assert sink.begun == ["ok-1"] and not sink.failed and list(sink.committed) == ["ok-1"]
    lines = [r.getMessage() for r in caplog.records]
    refused = [x for x in lines if x.startswith("event=transfer_refused")]
    assert any("copy real: authentication failed" in x and "peer=127.0.0.1:" in x for x in refused), refused
    assert any("nobody is not expected" in x for x in refused)
    assert any(x.startswith("event=transfer_authorized copy_id=ok-1 peer=127.0.0.1:") for x in lines)
    assert any(x.startswith("event=transfer_done copy_id=ok-1") for x in lines)


async def test_an_authorized_copy_that_trickles_is_cut_at_its_deadline(caplog):
    """Fragments keep the idle timer alive; the deadline (measured on the injected clock) still cuts the copy."""
    caplog.set_level(logging.INFO, logger="btbctl.replication")
    clock = Clock()
    sink = Sink()
    chain = _chain(2)
    async with receiving(
        sink, idle_timeout_s=30.0, clock=clock, deadline_base_s=10.0, deadline_per_block_s=0.0
    ) as addr:
        r, w, ans = await handshake(addr, CopyAuth(addr.authorize("slow", chain), "slow", chain, BLOCK))
        assert ans["op"] == "auth_ok" and sink.begun == ["slow"]
        head = page_frame_head(0, BLOCK, 0)
        for byte in head[:4]:  # fragments, each well within the idle timeout
            w.write(bytes([byte]))
            await w.drain()
            await asyncio.sleep(0.01)
        assert not sink.failed
        clock.t += 10.5  # past the deadline: the next fragment finds it
        w.write(head[4:5])
        await w.drain()
        await _until(lambda: "slow" in sink.failed, "copy cut at its deadline")
        reply = await asyncio.wait_for(AsyncFrames(r.readexactly, w.write).recv_json(), 5)
        w.close()
    assert "deadline passed after 0 of 2 blocks" in sink.failed["slow"] and "slow" not in sink.committed
    assert reply["op"] == "refuse" and "deadline passed" in reply["error"]
    assert any(
        x.getMessage().startswith("event=transfer_timed_out copy_id=slow peer=127.0.0.1:") for x in caplog.records
    )


async def test_handshake_deadline_and_the_cap_on_unauthenticated_connections(caplog):
    caplog.set_level(logging.INFO, logger="btbctl.replication")
    clock = Clock()
    sink = Sink()
    chain = _chain(3)
    async with receiving(sink, clock=clock, max_unauthenticated=4, auth_timeout_s=5.0) as addr:
        host, port = addr.rsplit(":", 1)
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(10)]
        # a real copy gets through although 10 sockets sit in the handshake (the oldest are pushed out)
        await _send(addr, "real", chain, _blocks(chain))
        assert list(sink.committed) == ["real"]
        pushed_out = [x for x in caplog.records if "the oldest is dropped" in x.getMessage()]
        assert len(pushed_out) >= 7
        # a peer that starts the handshake and then trickles is cut at the handshake deadline
        r, w = idle[-1]
        w.write(b"BT")
        await w.drain()
        await asyncio.sleep(0.05)
        clock.t += 6
        w.write(b"B")
        await w.drain()
        await _until(lambda: r.at_eof(), "handshake deadline")
        for _, w2 in idle:
            w2.close()
    assert any(
        x.getMessage().startswith("event=transfer_timed_out") and "no handshake within the deadline" in x.getMessage()
        for x in caplog.records
    )
    assert sink.begun == ["real"]


class AuthTarget:
    """The target side of the RDMA control channel's handshake, as a real receiver would run it."""

    def __init__(self, expectations: Expectations, block_bytes: int) -> None:
        self.ex = expectations
        self.block_bytes = block_bytes

    def run(self, auth: CopyAuth) -> None:
        hello = parse_hello(auth.hello())
        exp = self.ex.lookup(hello, self.block_bytes)
        nonce = "ef" * 16
        self.ex.verify(exp, hello, nonce, auth.proof(nonce))
        self.ex.claim(exp)
        assert auth.target_ok(nonce, self.ex.answer(exp, hello, nonce))


async def test_rdma_control_channel_carries_the_same_authorization():
    chain, pairs = _pairs(4)
    ex = Expectations()
    dev = FakeDevice(auth=AuthTarget(ex, 1000))
    token = new_token()
    ex.expect("r1", chain, token)
    with pytest.raises(TransferError, match="authentication failed"):
        await RdmaTransport(device=dev).send("10.0.0.2:4791", "r1", chain, pairs, lambda s, t: None, token=new_token())
    assert not dev.committed and dev.conn.region == bytearray()  # nothing registered for a wrong proof
    with pytest.raises(TransferError, match="no token"):
        await RdmaTransport(device=dev).send("10.0.0.2:4791", "r1", chain, pairs, lambda s, t: None)
    await RdmaTransport(device=dev).send("10.0.0.2:4791", "r1", chain, pairs, lambda s, t: None, token=token)
    assert dev.committed
