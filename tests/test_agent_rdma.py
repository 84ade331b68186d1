"""RDMA into the agent's arena, against a fake device layer: registration in slices below 4 GiB, WRITE planning
that never crosses a slice, completions, and verification before commit."""

from __future__ import annotations

import os

import pytest

from btbctl.engine.replication.rdma import (
    MAX_REGION_BYTES,
    ArenaSlice,
    arena_slices,
    plan_arena_writes,
    register_arena,
    verify_arena_pages,
    write_arena_pages,
)
from btbctl.engine.replication.transport import TransferError


class FakeDevice:
    """Source and target arenas in one process: addresses are (arena, offset) packed into ints."""

    def __init__(self, fail_wr: int | None = None, lose_wr: int | None = None) -> None:
        self.bufs: dict[int, memoryview] = {}
        self.cq: list[tuple[int, bool]] = []
        self.fail_wr, self.lose_wr = fail_wr, lose_wr
        self.writes: list[tuple[int, int]] = []
        self._next = 1

    def reg_slice(self, buf: memoryview):
        key = self._next
        self._next += 1
        self.bufs[key] = buf
        assert len(buf) <= MAX_REGION_BYTES
        return key << 40, key, key

    def post_write(self, wr_id, lkey, local_addr, length, remote_addr, rkey):
        src, soff = self.bufs[local_addr >> 40], local_addr & ((1 << 40) - 1)
        dst, doff = self.bufs[remote_addr >> 40], remote_addr & ((1 << 40) - 1)
        assert lkey == local_addr >> 40 and rkey == remote_addr >> 40
        assert soff + length <= len(src) and doff + length <= len(dst)  # never crosses a registered slice
        dst[doff : doff + length] = src[soff : soff + length]
        self.writes.append((wr_id, length))
        if wr_id != self.lose_wr:
            self.cq.append((wr_id, wr_id != self.fail_wr))

    def poll(self, n):
        out, self.cq = self.cq[:n], self.cq[n:]
        return out


def test_arena_slices_stay_below_4_gib():
    sl = arena_slices(10 << 30)
    assert all(n <= MAX_REGION_BYTES < (1 << 32) for _, n in sl)
    assert sl[0] == (0, MAX_REGION_BYTES) and sum(n for _, n in sl) == 10 << 30
    assert arena_slices(100, 40) == [(0, 40), (40, 40), (80, 20)]
    with pytest.raises(ValueError, match=r"."):
        arena_slices(0)


def test_writes_split_at_slice_boundaries_and_message_size():
    src = [ArenaSlice(0, 100), ArenaSlice(100, 100)]
    dst = [ArenaSlice(0, 64), ArenaSlice(64, 64), ArenaSlice(128, 72)]
    w = plan_arena_writes([(90, 60, 30), (0, 150, 40)], src, dst, max_msg_bytes=16)
    # page 0: src 90..120 crosses src slice 1 at 100, dst 60..90 crosses dst slice 1 at 64
    assert [(x.page, x.src_slice, x.src_off, x.dst_slice, x.dst_off, x.length) for x in w[:3]] == [
        (0, 0, 90, 0, 60, 4),
        (0, 0, 94, 1, 0, 6),
        (0, 1, 0, 1, 6, 16),
    ]
    assert sum(x.length for x in w if x.page == 0) == 30 and sum(x.length for x in w if x.page == 1) == 40
    assert all(x.length <= 16 for x in w)
    with pytest.raises(ValueError, match="outside"):
        plan_arena_writes([(0, 190, 20)], src, dst)


def _arenas(n_pages: int, page: int, region: int):
    src = memoryview(bytearray(os.urandom(n_pages * page)))
    dst = memoryview(bytearray(n_pages * page + 3 * page))
    return src, dst


def test_arena_copy_moves_verifies_and_reports_each_page():
    page, n = 3000, 7
    src, dst = _arenas(n, page, 4096)
    dev = FakeDevice()
    s_sl, s_lk = register_arena(dev, src, max_region_bytes=4096)
    d_sl, _ = register_arena(dev, dst, max_region_bytes=5000)
    assert len(s_sl) == 6 and len(d_sl) == 6
    pages = [(k * page, (n - 1 - k) * page + 100, page) for k in range(n)]  # scattered target extents
    done = []
    write_arena_pages(
        dev, plan_arena_writes(pages, s_sl, d_sl, 1024), s_sl, s_lk, d_sl, max_outstanding=4, on_page=done.append
    )
    assert sorted(done) == list(range(n))
    import xxhash

    digests = [xxhash.xxh3_64_intdigest(src[o : o + page]) for o, _, _ in pages]
    assert verify_arena_pages(dst, [(d, sz) for _, d, sz in pages], digests) is None
    dst[pages[3][1] + 5] ^= 1
    assert verify_arena_pages(dst, [(d, sz) for _, d, sz in pages], digests) == 3  # the target refuses to commit


def test_failed_or_lost_completions_end_the_copy():
    page, n = 2048, 4
    src, dst = _arenas(n, page, 4096)
    for dev, msg in ((FakeDevice(fail_wr=3), "RDMA write of page"), (FakeDevice(lose_wr=2), "never completed")):
        s_sl, s_lk = register_arena(dev, src)
        d_sl, _ = register_arena(dev, dst)
        plan = plan_arena_writes([(k * page, k * page, page) for k in range(n)], s_sl, d_sl, 1024)
        with pytest.raises(TransferError, match=msg):
            write_arena_pages(dev, plan, s_sl, s_lk, d_sl, poll_budget=1000)
