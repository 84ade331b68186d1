"""TCP transport in one process against a recording sink: the happy path, integrity checks, a sender that dies
mid-copy, protocol bounds, addresses and fault plans."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.hashing import block_payload, chain_hashes
from btbctl.engine.replication import TRANSPORTS, make_transport
from btbctl.engine.replication.auth import CopyAuth, new_token
from btbctl.engine.replication.tcp import FaultPlan, TcpReceiver, TcpTransport
from btbctl.engine.replication.transport import CopyRefused, TransferError, parse_address
from btbctl.engine.replication.wire import AsyncFrames
from btbctl.sglang_l3.frames import FRAME_HEAD, KIND_JSON, json_frame

BLOCK = 256


class Sink:
    def __init__(self, block_bytes: int = BLOCK, max_blocks: int = 10_000, refuse: str | None = None) -> None:
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.refuse = refuse
        self.begun: list[str] = []
        self.committed: dict[str, list[bytes]] = {}
        self.failed: dict[str, str] = {}
        self.progressed: list[int] = []

    def begin(self, copy_id, chain, peer):
        self.begun.append(copy_id)
        if self.refuse:
            raise CopyRefused(self.refuse)

    def check_block(self, index, block_hash, data):
        if data != block_payload(block_hash, self.block_bytes):
            raise CopyRefused(f"block {index}: content does not match its hash", index)

    def progress(self, copy_id, blocks_verified, bytes_received):
        self.progressed.append(blocks_verified)

    def commit(self, copy_id, chain, blocks):
        self.committed[copy_id] = blocks

    def fail(self, copy_id, error):
        self.failed[copy_id] = error


def _chain(n: int, seed: int = 1) -> list[str]:
    return chain_hashes([(seed * 31 + i) % 50000 for i in range(n * 16)], 16)


def _blocks(chain, nbytes=BLOCK):
    return [(h, block_payload(h, nbytes)) for h in chain]


class Target(str):
    """A receiver's ``host:port`` that can authorize copies at it (as the gateway's ``/btb/expect`` does)."""

    rx: TcpReceiver

    def authorize(self, copy_id: str, chain: list[str]) -> str:
        token = new_token()
        self.rx.expectations.expect(copy_id, chain, token)
        return token


@contextlib.asynccontextmanager
async def receiving(sink, idle_timeout_s: float = 2.0, **kw):
    """A TCP receiver for ``sink`` on a loopback port the OS picks; yields its ``host:port`` (a :class:`Target`)."""
    rx = TcpReceiver(sink, "127.0.0.1", 0, idle_timeout_s=idle_timeout_s, **kw)
    port = await rx.start()
    addr = Target(f"127.0.0.1:{port}")
    addr.rx = rx
    try:
        yield addr
    finally:
        await rx.close()


async def _send(addr: Target, copy_id, chain, blocks, progress=lambda s, t: None, transport=None, **kw):
    """An authorized copy: the target expects it, the sender holds its token."""
    token = addr.authorize(copy_id, chain)
    await (transport or TcpTransport()).send(addr, copy_id, chain, blocks, progress, token=token, **kw)


async def handshake(addr: str, auth: CopyAuth) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
    """A raw connection through the handshake with ``auth``; returns the streams and the target's last answer."""
    host, port = parse_address(addr)
    r, w = await asyncio.open_connection(host, port)
    frames = AsyncFrames(r.readexactly, w.write)
    frames.send_json(auth.hello())
    await w.drain()
    ch = await frames.recv_json()
    if ch["op"] != "challenge":
        return r, w, ch
    frames.send_json(auth.challenge(ch))
    await w.drain()
    return r, w, await frames.recv_json()


async def test_copy_arrives_verified_and_committed():
    sink = Sink()
    chain = _chain(20)
    progress = []

    async with receiving(sink) as addr:
        await _send(addr, "c1", chain, _blocks(chain), lambda s, t: progress.append((s, t)))
    assert sink.committed["c1"] == [b for _, b in _blocks(chain)]
    assert progress[-1] == (20 * BLOCK, 20 * BLOCK) and len(progress) == 20
    assert sink.progressed[-1] == 20 and not sink.failed


async def test_async_block_source_works():
    sink = Sink()
    chain = _chain(3)

    async def agen():
        for pair in _blocks(chain):
            yield pair

    async with receiving(sink) as addr:
        await _send(addr, "c-async", chain, agen())
    assert len(sink.committed["c-async"]) == 3


@pytest.mark.parametrize(
    "fault,needle", [("corrupt_wire=4", "digest mismatch"), ("corrupt_content=4", "content does not match")]
)
async def test_corrupted_block_is_detected_and_nothing_commits(fault, needle):
    sink = Sink()
    chain = _chain(10)

    async with receiving(sink) as addr:
        with pytest.raises(TransferError) as ei:
            await _send(addr, "bad", chain, _blocks(chain), transport=TcpTransport(fault=FaultPlan.parse(fault)))
    err = ei.value
    assert needle in str(err) and "block 4" in str(err)
    assert err.block == 4
    assert "bad" not in sink.committed
    assert needle in sink.failed["bad"]


async def test_sender_dying_mid_copy_leaves_nothing_warm():
    sink = Sink()
    chain = _chain(30)

    async with receiving(sink) as addr:
        with pytest.raises(TransferError, match="after 7 of 30"):
            await _send(addr, "dies", chain, _blocks(chain), transport=TcpTransport(fault=FaultPlan(close_after=7)))
        for _ in range(100):  # the receiver notices the reset
            if "dies" in sink.failed:
                break
            await asyncio.sleep(0.01)
    assert "dies" not in sink.committed
    assert "connection lost after 7 of 30 blocks" in sink.failed["dies"]


async def test_receiver_refusal_and_incompatible_block_size():
    chain = _chain(2)

    async with receiving(Sink(refuse="full")) as addr:
        with pytest.raises(TransferError, match="refused: full"):
            await _send(addr, "r1", chain, _blocks(chain))
    sink = Sink(block_bytes=512)
    async with receiving(sink) as addr:
        with pytest.raises(TransferError, match="block size"):
            await _send(addr, "r2", chain, _blocks(chain, 256))
    assert not sink.begun  # refused at the hello, before the sink heard of it


async def test_chain_longer_than_the_sink_allows_is_refused():
    chain = _chain(5)

    async with receiving(Sink(max_blocks=4)) as addr:
        with pytest.raises(TransferError, match="exceeds this receiver's limit of 4"):
            await _send(addr, "long", chain, _blocks(chain))


async def test_garbage_and_oversized_headers_get_error_replies():
    async def raw(addr, payload: bytes) -> dict:
        host, port = parse_address(addr)
        r, w = await asyncio.open_connection(host, port)
        w.write(payload)
        await w.drain()
        rep = await asyncio.wait_for(AsyncFrames(r.readexactly, w.write).recv_json(), 5)
        w.close()
        return rep

    def hello(**kw) -> bytes:
        return json_frame({"op": "hello", "v": 3, "copy_id": "x", "blocks": 1, "block_bytes": BLOCK, **kw})

    sink = Sink()
    async with receiving(sink) as addr:
        a = await raw(addr, b"GET / HTTP/1.1\r\n\r\n")
        b = await raw(addr, FRAME_HEAD.pack(KIND_JSON, 1 << 30))
        c = await raw(addr, hello(v=9, nonce="ab" * 16))
        d = await raw(addr, FRAME_HEAD.pack(KIND_JSON, 9) + b"[1, 2, 3]")
        e = await raw(addr, hello(nonce="not-hex"))
        f = await raw(addr, hello(v=2, nonce="ab" * 16))  # the previous wire version
    assert "control frame" in a["error"] and "exceeds 4096" in b["error"] and "version 9" in c["error"]
    assert "JSON object" in d["error"] and "hex" in e["error"] and "version 2" in f["error"]
    assert all(x["op"] == "refuse" for x in (a, b, c, d, e, f)) and not sink.begun


async def test_silent_sender_times_out_and_is_discarded():
    sink = Sink()
    chain = _chain(3)

    async with receiving(sink, idle_timeout_s=0.5) as addr:
        r, w, ans = await handshake(addr, CopyAuth(addr.authorize("quiet", chain), "quiet", chain, BLOCK))
        assert ans["op"] == "auth_ok"
        for _ in range(400):
            if "quiet" in sink.failed:
                break
            await asyncio.sleep(0.01)
        w.close()
    assert "went quiet after 0 of 3" in sink.failed["quiet"]


async def test_unreachable_target_raises_transfer_error():
    with pytest.raises(TransferError, match="cannot connect"):
        await TcpTransport(connect_timeout_s=2).send(
            "127.0.0.1:1", "x", ["ab"], [("ab", b"x" * 64)], lambda s, t: None, token=new_token()
        )


async def test_cancelling_a_copy_while_it_waits_for_the_targets_reason_cancels_it():
    """When the copy breaks (here: the block source fails) the sender waits briefly for the target to say why;
    cancelling the copy during that wait must cancel it, not end it as a TransferError."""
    chain = _chain(3)
    pairs = _blocks(chain)
    broke = asyncio.Event()

    def source():
        yield pairs[0]
        broke.set()
        raise ValueError("the source lost its KV cache")

    async with receiving(Sink(), idle_timeout_s=10.0) as addr:  # a target that accepts, then stays silent
        copy = asyncio.ensure_future(_send(addr, "c-cancel", chain, source()))
        await asyncio.wait_for(broke.wait(), 5)
        await asyncio.sleep(0.1)  # the sender now waits (up to 0.5 s) for the target's reason
        copy.cancel()
        with pytest.raises(asyncio.CancelledError):
            await copy


def test_parse_address():
    assert parse_address("127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert parse_address("[::1]:9") == ("::1", 9)
    assert parse_address("worker-3.example:41000") == ("worker-3.example", 41000)
    for bad in (
        "",
        "127.0.0.1",
        "127.0.0.1:0",
        "127.0.0.1:70000",
        "a b:1",
        "$(reboot):1",
        "[zz]:1",
        "http://x:1",
        "host:1;ls",
    ):
        with pytest.raises(TransferError):
            parse_address(bad)


def test_fault_plan_parse():
    assert FaultPlan.parse("corrupt_wire=3,delay_s=0.5") == FaultPlan(corrupt_wire=3, delay_s=0.5)
    assert FaultPlan.parse("") == FaultPlan()
    for bad in ("explode=1", "close_after=x", "delay_s"):
        with pytest.raises(ValueError, match=r"^bad fault item"):
            FaultPlan.parse(bad)


def test_registry():
    assert set(TRANSPORTS) == {"tcp", "rdma"}
    assert make_transport("tcp").name == "tcp"
    with pytest.raises(ConfigError):
        make_transport("carrier-pigeon")
    with pytest.raises(BtbctlError, match=r"^RDMA unavailable: "):
        make_transport("rdma")
