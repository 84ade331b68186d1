"""RDMA transport logic against a fake device layer: write planning, registration, completions, commit checks;
and the clear error where no RDMA stack exists."""

from __future__ import annotations

from itertools import pairwise

import pytest
import xxhash

from btbctl.engine.errors import BtbctlError
from btbctl.engine.hashing import block_payload, chain_hashes
from btbctl.engine.replication.rdma import RdmaTransport, RemoteRegion, plan_writes, probe
from btbctl.engine.replication.transport import TransferError

TOKEN = "ab" * 32


class _Mr:
    def __init__(self, n: int, lkey: int) -> None:
        self.buf = bytearray(n)
        self.lkey = lkey


class FakeConn:
    """A target in memory: a remote region, completions queued per post, a commit that checks digests and
    content."""

    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev
        self.region = bytearray()
        self.cq: list[tuple[int, bool]] = []
        self.chain: list[str] = []
        self.block_bytes = 0
        self.closed = False

    def reg_mr(self, length):
        self.dev.registered.append(length)
        return _Mr(length, 7)

    def open_region(self, copy_id, chain, block_bytes, auth):
        if self.dev.refuse:
            raise BtbctlError(self.dev.refuse)
        self.dev.auth.run(auth)  # the control channel's handshake, before anything is registered
        self.chain, self.block_bytes = chain, block_bytes
        self.region = bytearray(len(chain) * block_bytes)
        return RemoteRegion(addr=0x1000, rkey=99, length=len(self.region))

    def post_write(self, wr_id, local, local_offset, length, remote_addr, rkey):
        assert rkey == 99 and length <= self.dev.max_msg
        off = remote_addr - 0x1000
        data = bytes(local.buf[local_offset : local_offset + length])
        if self.dev.flip_write == len(self.dev.writes):
            data = bytes([data[0] ^ 1]) + data[1:]
        self.region[off : off + length] = data
        self.dev.writes.append((off, length))
        self.cq.append((wr_id, wr_id != self.dev.fail_wr))

    def poll(self, n):
        out, self.cq = self.cq[:n], self.cq[n:]
        return out

    def commit(self, copy_id, digests):
        bb = self.block_bytes
        for k, h in enumerate(self.chain):
            data = bytes(self.region[k * bb : (k + 1) * bb])
            if xxhash.xxh3_64_intdigest(data) != digests[k]:
                return {"ok": False, "error": f"block {k}: digest mismatch", "block": k}
            if data != block_payload(h, bb):
                return {"ok": False, "error": f"block {k}: content", "block": k}
        self.dev.committed = True
        return {"ok": True}

    def close(self):
        self.closed = True


class _AcceptAny:
    """A control channel that runs the sender's side of the handshake and checks only that it is well formed."""

    def run(self, auth):
        assert len(auth.proof("ab" * 16)) == 64 and auth.hello()["blocks"] >= 1


class FakeDevice:
    name = "fake"

    def __init__(self, max_msg=1 << 20, refuse=None, fail_wr=None, flip_write=None, auth=None):
        self.max_msg = max_msg
        self.refuse = refuse
        self.fail_wr = fail_wr
        self.flip_write = flip_write
        self.auth = auth or _AcceptAny()
        self.writes: list = []
        self.registered: list = []
        self.committed = False
        self.conn: FakeConn | None = None

    def connect(self, host, port):
        self.conn = FakeConn(self)
        return self.conn


def _pairs(n, nbytes=1000):
    chain = chain_hashes(list(range(n * 8)), 8)
    return chain, [(h, block_payload(h, nbytes)) for h in chain]


def test_plan_writes_coalesces_whole_blocks_within_staging_rounds():
    ops = plan_writes(10, 1000, staging_bytes=4000, max_msg_bytes=2500)
    # 4 blocks per round, 2 blocks per message
    assert [(o.round, o.first, o.count) for o in ops] == [(0, 0, 2), (0, 2, 2), (1, 4, 2), (1, 6, 2), (2, 8, 2)]
    assert all(o.remote_offset == o.first * 1000 and o.length == o.count * 1000 for o in ops)
    assert [o.local_offset for o in ops] == [0, 2000, 0, 2000, 0]
    covered = sorted((o.first, o.first + o.count) for o in ops)
    assert covered[0][0] == 0 and covered[-1][1] == 10
    assert all(a[1] == b[0] for a, b in pairwise(covered))
    big = plan_writes(3, 5000, staging_bytes=1000, max_msg_bytes=1000)  # a block larger than both limits
    assert [(o.round, o.first, o.count, o.length) for o in big] == [(0, 0, 1, 5000), (1, 1, 1, 5000), (2, 2, 1, 5000)]
    assert plan_writes(0, 10) == []
    with pytest.raises(ValueError, match="sizes must be positive"):
        plan_writes(1, 0)


async def test_rdma_send_moves_and_verifies_blocks():
    dev = FakeDevice(max_msg=3000)
    chain, pairs = _pairs(9)
    prog = []
    t = RdmaTransport(device=dev, staging_bytes=4000, max_msg_bytes=3000)
    await t.send("10.0.0.2:4791", "c1", chain, pairs, lambda s, tot: prog.append((s, tot)), token=TOKEN)
    assert dev.committed and dev.conn.closed
    assert bytes(dev.conn.region) == b"".join(b for _, b in pairs)
    assert dev.registered == [4000]  # one staging registration, reused every round
    assert prog[-1] == (9000, 9000)


async def test_rdma_failed_completion_and_corruption_are_reported():
    chain, pairs = _pairs(6)
    dev = FakeDevice(fail_wr=2)
    with pytest.raises(TransferError, match="RDMA write of blocks"):
        await RdmaTransport(device=dev, max_msg_bytes=2000).send(
            "h:1", "c", chain, pairs, lambda s, t: None, token=TOKEN
        )
    assert not dev.committed and dev.conn.closed
    dev = FakeDevice(flip_write=1)
    with pytest.raises(TransferError, match="digest mismatch") as ei:
        await RdmaTransport(device=dev, max_msg_bytes=2000).send(
            "h:1", "c", chain, pairs, lambda s, t: None, token=TOKEN
        )
    assert ei.value.block == 2 and not dev.committed
    dev = FakeDevice(refuse="no room")
    with pytest.raises(TransferError, match="refused: no room"):
        await RdmaTransport(device=dev).send("h:1", "c", chain, pairs, lambda s, t: None, token=TOKEN)


def test_rdma_unavailable_is_a_clear_error_here():
    reason = probe()
    if reason is None:
        pytest.skip("this host has an RDMA device")
    with pytest.raises(BtbctlError) as ei:
        RdmaTransport()
    assert str(ei.value).startswith("RDMA unavailable: ")
