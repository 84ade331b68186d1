"""RDMA transport: one-sided RDMA WRITEs of a prefix's blocks into a region the target registered.

Availability: ``pyverbs`` (rdma-core's Python bindings; on Debian the ``python3-pyverbs`` package, REFERENCE.md
s7) is imported only when an :class:`RdmaTransport` is built without an explicit device layer. Where the module is
missing or no RDMA device exists, the constructor raises ``BtbctlError("RDMA unavailable: <reason>")``.

What is implemented here, and tested against a fake device layer, is the device-independent part:

* :func:`plan_writes`: which WRITE work requests move the chain. Consecutive blocks are coalesced into messages
  of at most ``max_msg_bytes`` (transfers need messages of at least 256 KiB to approach line rate, REFERENCE.md
  s6), and each message fits in one slot of the registered staging buffer.
* :meth:`RdmaTransport.send`: registers one staging region, fills it round by round, posts the planned writes
  into the target's region, waits for their completions, then sends a commit message carrying every block's
  xxh3_64 digest; the target verifies the region against the digests (and the content) and commits, exactly
  like the TCP receiver does. Any failed completion or refused commit raises :class:`TransferError`.

The device layer (:class:`DeviceLayer`, :class:`Connection`) is the seam where the verbs calls go: memory
registration, queue-pair connection and region exchange, ``post_send`` of ``IBV_WR_RDMA_WRITE`` and completion
polling. A pyverbs-backed layer of that seam, and the matching receiver in the worker, are not part of this build:
on a host that has RDMA devices the constructor says so instead of pretending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from btbctl.engine.errors import BtbctlError
from btbctl.engine.replication.auth import AuthError, CopyAuth
from btbctl.engine.replication.transport import Blocks, TransferError, check_copy_id, parse_address

#: Default largest single WRITE message, bytes (1 MiB: well above the 256 KiB needed to approach line rate).
DEFAULT_MAX_MSG_BYTES = 1 << 20
#: Default size of the registered staging buffer, bytes (64 MiB: amortises one registration over many messages).
DEFAULT_STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class WriteOp:
    """One RDMA WRITE: blocks ``first .. first + count - 1`` of the chain, ``length`` bytes taken from
    ``local_offset`` in the staging region and written at ``remote_offset`` in the target's region. ``round`` is
    the staging round (the staging buffer is refilled between rounds)."""

    round: int
    first: int
    count: int
    local_offset: int
    remote_offset: int
    length: int


def plan_writes(
    n_blocks: int,
    block_bytes: int,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
) -> list[WriteOp]:
    """Plan the WRITEs that move ``n_blocks`` blocks of ``block_bytes`` each.

    Messages carry whole blocks: ``max(1, max_msg_bytes // block_bytes)`` blocks each (a block larger than
    ``max_msg_bytes`` travels alone). A round holds as many whole blocks as fit in ``staging_bytes`` (at least one).
    Remote offsets are ``block index x block_bytes`` (the target's region is the chain laid out in order).

    Raises:
        ValueError: non-positive sizes or a negative block count.
    """
    if n_blocks < 0 or block_bytes < 1 or staging_bytes < 1 or max_msg_bytes < 1:
        raise ValueError("plan_writes: sizes must be positive and n_blocks >= 0")
    per_msg = max(1, max_msg_bytes // block_bytes)
    per_round = max(1, staging_bytes // block_bytes)
    ops: list[WriteOp] = []
    rnd = 0
    for round_first in range(0, n_blocks, per_round):
        round_n = min(per_round, n_blocks - round_first)
        for off in range(0, round_n, per_msg):
            cnt = min(per_msg, round_n - off)
            first = round_first + off
            ops.append(WriteOp(rnd, first, cnt, off * block_bytes, first * block_bytes, cnt * block_bytes))
        rnd += 1
    return ops


@dataclass(frozen=True)
class RemoteRegion:
    """The target's registered region for one copy: ``addr`` and ``rkey`` as verbs use them, ``length`` bytes."""

    addr: int
    rkey: int
    length: int


class LocalRegion(Protocol):
    """A registered local buffer: ``buf`` is writable (bytearray or memoryview), ``lkey`` its local key."""

    buf: bytearray
    lkey: int


class Connection(Protocol):
    """One connected queue pair to a target plus its control channel."""

    def reg_mr(self, length: int) -> LocalRegion:
        """Register ``length`` bytes of local memory for RDMA."""

    def open_region(self, copy_id: str, chain: list[str], block_bytes: int, auth: CopyAuth) -> RemoteRegion:
        """Ask the target to register a region for the copy (control messages); it may refuse (raise).

        The control channel carries the same authorization as the TCP wire (:mod:`btbctl.engine.replication.auth`):
        it sends ``auth.hello()``, answers the target's nonce with ``auth.proof(nonce)`` and believes the target
        only if ``auth.target_ok(nonce, its_mac)``; the target registers nothing before the proof verified
        (:class:`~btbctl.engine.replication.auth.Expectations`). The token itself never goes on the wire."""

    def post_write(
        self, wr_id: int, local: LocalRegion, local_offset: int, length: int, remote_addr: int, rkey: int
    ) -> None:
        """Post one signalled RDMA WRITE."""

    def poll(self, max_entries: int) -> list[tuple[int, bool]]:
        """Completed work requests as ``(wr_id, success)``; may return fewer than asked (never blocks long)."""

    def commit(self, copy_id: str, digests: list[int]) -> dict:
        """Control message: all writes done; the target verifies and commits. Returns ``{"ok": bool, "error"}``."""

    def close(self) -> None:
        """Release the queue pair and registrations."""


class DeviceLayer(Protocol):
    """Opens connections to targets (``host``, ``port`` of the target's RDMA control endpoint)."""

    name: str

    def connect(self, host: str, port: int) -> Connection:
        """Connect a queue pair to the target; raise OSError or BtbctlError when that fails."""


def probe() -> str | None:
    """None when pyverbs imports and lists at least one RDMA device, else the reason it does not (one line)."""
    try:
        import pyverbs.device as device  # optional, heavy, host-specific: imported where needed
    except ImportError as e:
        return f"pyverbs is not importable ({e}); install rdma-core's python3-pyverbs"
    try:
        devs = device.get_device_list()
    except Exception as e:  # noqa: BLE001 - pyverbs raises PyverbsRDMAError('Failed to get devices list') without devices
        return f"{type(e).__name__}: {e}"
    if not devs:
        return "no RDMA devices found"
    return None


class RdmaTransport:
    """Sender side over RDMA (:class:`~btbctl.engine.replication.transport.Transport`).

    Args:
        device: the device layer; None probes pyverbs (see the module docstring).
        staging_bytes: size of the registered staging buffer, bytes.
        max_msg_bytes: largest single WRITE, bytes.
        poll_budget: completion polls per outstanding round before the copy is declared stuck.

    Raises:
        BtbctlError: ``RDMA unavailable: <reason>`` when ``device`` is None and no usable RDMA stack exists.
    """

    name = "rdma"

    def __init__(
        self,
        device: DeviceLayer | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
        poll_budget: int = 1_000_000,
    ) -> None:
        if device is None:
            reason = probe()
            if reason is None:
                reason = "RDMA devices are present but this build has no pyverbs device layer; use the tcp transport"
            raise BtbctlError(f"RDMA unavailable: {reason}")
        self.device = device
        self.staging_bytes = staging_bytes
        self.max_msg_bytes = max_msg_bytes
        self.poll_budget = poll_budget

    async def send(
        self,
        target: str,
        copy_id: str,
        chain: list[str],
        blocks: Blocks,
        on_progress: Callable[[int, int], None],
        *,
        block_bytes: int | None = None,
        on_accept: Callable[[], None] | None = None,
        token: str | None = None,
    ) -> None:
        """See :meth:`Transport.send`. Raises :class:`TransferError`. ``token`` authorizes the copy at the target
        (as over TCP; no copy without one). The blocks are gathered first (a source
        still computing the prefix delays the whole copy); ``on_accept`` is called once the target opened its
        region; ``block_bytes``, when given, must match the blocks."""
        host, port = parse_address(target)
        check_copy_id(copy_id)
        data: list[bytes] = []
        if hasattr(blocks, "__aiter__"):
            pairs = [p async for p in blocks]  # type: ignore[union-attr]
        else:
            pairs = list(blocks)  # type: ignore[arg-type]
        if len(pairs) != len(chain) or not chain:
            raise TransferError(f"copy {copy_id}: {len(pairs)} blocks supplied for a chain of {len(chain)}")
        for k, (h, b) in enumerate(pairs):
            if h != chain[k]:
                raise TransferError(f"copy {copy_id}: block {k} does not match the chain", k)
            data.append(b)
        if block_bytes is not None and len(data[0]) != block_bytes:
            raise TransferError(f"copy {copy_id}: blocks of {len(data[0])} bytes, {block_bytes} announced")
        block_bytes = len(data[0])
        if block_bytes < 1 or any(len(b) != block_bytes for b in data):
            raise TransferError(f"copy {copy_id}: blocks must all have the same non-zero size")
        total = block_bytes * len(data)
        auth = CopyAuth.for_copy(token, copy_id, chain, block_bytes)
        try:
            conn = self.device.connect(host, port)
        except (OSError, BtbctlError) as e:
            raise TransferError(f"copy {copy_id}: cannot connect to {target} over RDMA: {e}") from None
        try:
            try:
                remote = conn.open_region(copy_id, list(chain), block_bytes, auth)
            except (OSError, BtbctlError, AuthError) as e:
                raise TransferError(f"copy {copy_id}: {target} refused: {e}") from None
            if on_accept is not None:
                on_accept()
            if remote.length < total:
                raise TransferError(
                    f"copy {copy_id}: target region of {remote.length} bytes is smaller than the copy ({total} bytes)"
                )
            ops = plan_writes(len(data), block_bytes, self.staging_bytes, self.max_msg_bytes)
            per_round = max(1, self.staging_bytes // block_bytes)  # as plan_writes
            staging = conn.reg_mr(min(total, per_round * block_bytes))
            sent = 0
            rnd_ops: dict[int, list[WriteOp]] = {}
            for op in ops:
                rnd_ops.setdefault(op.round, []).append(op)
            wr_id = 0
            for rnd in sorted(rnd_ops):
                outstanding: dict[int, WriteOp] = {}
                for op in rnd_ops[rnd]:
                    chunk = b"".join(data[op.first : op.first + op.count])
                    staging.buf[op.local_offset : op.local_offset + op.length] = chunk
                    wr_id += 1
                    conn.post_write(
                        wr_id, staging, op.local_offset, op.length, remote.addr + op.remote_offset, remote.rkey
                    )
                    outstanding[wr_id] = op
                polls = 0
                while outstanding:
                    for wid, ok in conn.poll(len(outstanding)):
                        op = outstanding.pop(wid, None)
                        if op is None:
                            continue
                        if not ok:
                            raise TransferError(
                                f"copy {copy_id}: RDMA write of blocks {op.first}..{op.first + op.count - 1} failed",
                                op.first,
                            )
                        sent += op.length
                        on_progress(sent, total)
                    polls += 1
                    if outstanding and polls >= self.poll_budget:
                        raise TransferError(f"copy {copy_id}: {len(outstanding)} RDMA writes never completed")
            reply = conn.commit(copy_id, [xxhash.xxh3_64_intdigest(b) for b in data])
            if not isinstance(reply, dict) or reply.get("ok") is not True:
                err = reply.get("error") if isinstance(reply, dict) else "malformed reply"
                blk = reply.get("block") if isinstance(reply, dict) else None
                raise TransferError(
                    f"copy {copy_id}: {target} rejected the copy: {err}", blk if isinstance(blk, int) else None
                )
        finally:
            conn.close()


__all__ = [
    "DEFAULT_MAX_MSG_BYTES",
    "DEFAULT_STAGING_BYTES",
    "Connection",
    "DeviceLayer",
    "LocalRegion",
    "RdmaTransport",
    "RemoteRegion",
    "WriteOp",
    "plan_writes",
    "probe",
]


# -- the agent's arena as an RDMA target ------------------------------------------------------------------------------
#
# Between ``btbctl agent`` processes a copy goes straight from the source's arena into the target's arena: the target
# registers its arena in slices (:func:`arena_slices`), sends the slices' ``(addr, rkey, length)`` and the arena
# offset reserved for every needed page over the authenticated control channel (with its queue-pair details), the
# source posts one-sided WRITEs planned by :func:`plan_arena_writes` from its own registered arena, waits for their
# completions, and sends a completion message carrying every page's xxh3_64; the target verifies each page in its
# arena and commits only then (:func:`verify_arena_pages`), exactly as over TCP.

#: Largest memory region registered at once, bytes: just below 4 GiB (many HCAs and drivers take at most 2^32 - 1
#: bytes per registration; ``ibv_reg_mr`` lengths are ``size_t`` but ConnectX firmware limits vary).
MAX_REGION_BYTES = (1 << 32) - (1 << 12)


@dataclass(frozen=True)
class ArenaSlice:
    """One registered slice of an arena: ``offset`` and ``length`` in the arena, ``addr``/``rkey`` as verbs use
    them (``addr`` is the slice's virtual address)."""

    offset: int
    length: int
    addr: int = 0
    rkey: int = 0


@dataclass(frozen=True)
class ArenaWrite:
    """One WRITE: ``length`` bytes of page ``page`` from source slice ``src_slice`` at ``src_off`` (within it) to
    target slice ``dst_slice`` at ``dst_off``."""

    page: int
    src_slice: int
    src_off: int
    dst_slice: int
    dst_off: int
    length: int


def arena_slices(arena_bytes: int, max_region_bytes: int = MAX_REGION_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` of the registration slices covering an arena of ``arena_bytes``, each at most
    ``max_region_bytes``. Raises ValueError for non-positive sizes."""
    if arena_bytes < 1 or max_region_bytes < 1:
        raise ValueError("arena_slices: sizes must be positive")
    return [(off, min(max_region_bytes, arena_bytes - off)) for off in range(0, arena_bytes, max_region_bytes)]


def _locate(slices: list[ArenaSlice], offset: int) -> int:
    lo, hi = 0, len(slices) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if slices[mid].offset <= offset:
            lo = mid
        else:
            hi = mid - 1
    s = slices[lo]
    if not s.offset <= offset < s.offset + s.length:
        raise ValueError(f"offset {offset} is outside the registered slices")
    return lo


def plan_arena_writes(
    pages: list[tuple[int, int, int]],
    src_slices: list[ArenaSlice],
    dst_slices: list[ArenaSlice],
    max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES,
) -> list[ArenaWrite]:
    """Plan the WRITEs of ``pages`` (each ``(source offset, target offset, bytes)`` in the two arenas).

    A WRITE never crosses a slice boundary on either side (each side's memory region is one slice) and carries at
    most ``max_msg_bytes``; a page is split where needed, in order.

    Raises:
        ValueError: a page outside the slices, or non-positive sizes.
    """
    if max_msg_bytes < 1:
        raise ValueError("max_msg_bytes must be positive")
    out: list[ArenaWrite] = []
    for k, (src, dst, size) in enumerate(pages):
        if size < 1:
            raise ValueError(f"page {k}: size must be positive")
        done = 0
        while done < size:
            si, di = _locate(src_slices, src + done), _locate(dst_slices, dst + done)
            s, d = src_slices[si], dst_slices[di]
            n = min(size - done, max_msg_bytes, s.offset + s.length - (src + done), d.offset + d.length - (dst + done))
            out.append(ArenaWrite(k, si, src + done - s.offset, di, dst + done - d.offset, n))
            done += n
    return out


class ArenaDevice(Protocol):
    """The verbs calls an arena copy needs (pyverbs on a host with RDMA; a fake in tests)."""

    def reg_slice(self, buf: memoryview) -> tuple[int, int, int]:
        """Register ``buf`` for local reads and remote writes; returns ``(addr, lkey, rkey)``."""

    def post_write(self, wr_id: int, lkey: int, local_addr: int, length: int, remote_addr: int, rkey: int) -> None:
        """Post one signalled RDMA WRITE on the connected queue pair."""

    def poll(self, max_entries: int) -> list[tuple[int, bool]]:
        """Completed work requests as ``(wr_id, success)``."""


def register_arena(
    device: ArenaDevice, view: memoryview, max_region_bytes: int = MAX_REGION_BYTES
) -> tuple[list[ArenaSlice], list[int]]:
    """Register an arena in slices; returns the slices (with ``addr``/``rkey``) and their lkeys."""
    slices, lkeys = [], []
    for off, length in arena_slices(len(view), max_region_bytes):
        addr, lkey, rkey = device.reg_slice(view[off : off + length])
        slices.append(ArenaSlice(off, length, addr, rkey))
        lkeys.append(lkey)
    return slices, lkeys


def write_arena_pages(
    device: ArenaDevice,
    writes: list[ArenaWrite],
    src_slices: list[ArenaSlice],
    lkeys: list[int],
    dst_slices: list[ArenaSlice],
    max_outstanding: int = 64,
    poll_budget: int = 1_000_000,
    on_page: Callable[[int], None] | None = None,
) -> None:
    """Post ``writes`` (at most ``max_outstanding`` in flight) and wait for every completion; ``on_page(k)`` when the
    last WRITE of page ``k`` completed.

    Raises:
        TransferError: a failed completion (naming the page) or completions that never come.
    """
    remaining: dict[int, int] = {}
    for w in writes:
        remaining[w.page] = remaining.get(w.page, 0) + 1
    outstanding: dict[int, ArenaWrite] = {}
    it = iter(enumerate(writes, 1))
    polls = 0
    exhausted = False
    while True:
        while not exhausted and len(outstanding) < max_outstanding:
            nxt = next(it, None)
            if nxt is None:
                exhausted = True
                break
            wr_id, w = nxt
            s, d = src_slices[w.src_slice], dst_slices[w.dst_slice]
            device.post_write(wr_id, lkeys[w.src_slice], s.addr + w.src_off, w.length, d.addr + w.dst_off, d.rkey)
            outstanding[wr_id] = w
        if not outstanding:
            return
        for wr_id, ok in device.poll(len(outstanding)):
            w = outstanding.pop(wr_id, None)
            if w is None:
                continue
            if not ok:
                raise TransferError(f"RDMA write of page {w.page} failed", w.page)
            remaining[w.page] -= 1
            if remaining[w.page] == 0 and on_page is not None:
                on_page(w.page)
        polls += 1
        if polls >= poll_budget:
            raise TransferError(f"{len(outstanding)} RDMA writes never completed")


def verify_arena_pages(view: memoryview, pages: list[tuple[int, int]], digests: list[int]) -> int | None:
    """Check each page ``(offset, bytes)`` of the target's arena against the sender's xxh3_64; returns the index of
    the first mismatch, or None when all match."""
    if len(digests) != len(pages):
        return 0
    for k, ((off, size), want) in enumerate(zip(pages, digests, strict=True)):
        if xxhash.xxh3_64_intdigest(view[off : off + size]) != want:
            return k
    return None


__all__ += [
    "ArenaDevice",
    "ArenaSlice",
    "ArenaWrite",
    "MAX_REGION_BYTES",
    "arena_slices",
    "plan_arena_writes",
    "register_arena",
    "verify_arena_pages",
    "write_arena_pages",
]
