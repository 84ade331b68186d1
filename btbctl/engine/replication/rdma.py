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


def plan_writes(n_blocks: int, block_bytes: int, staging_bytes: int = DEFAULT_STAGING_BYTES,
                max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES) -> list[WriteOp]:
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

    def open_region(self, copy_id: str, chain: list[str], block_bytes: int) -> RemoteRegion:
        """Ask the target to register a region for the copy (control message); it may refuse (raise)."""

    def post_write(self, wr_id: int, local: LocalRegion, local_offset: int, length: int, remote_addr: int,
                   rkey: int) -> None:
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

    def __init__(self, device: DeviceLayer | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 max_msg_bytes: int = DEFAULT_MAX_MSG_BYTES, poll_budget: int = 1_000_000) -> None:
        if device is None:
            reason = probe()
            if reason is None:
                reason = ("RDMA devices are present but this build has no pyverbs device layer; "
                          "use the tcp transport")
            raise BtbctlError(f"RDMA unavailable: {reason}")
        self.device = device
        self.staging_bytes = staging_bytes
        self.max_msg_bytes = max_msg_bytes
        self.poll_budget = poll_budget

    async def send(self, target: str, copy_id: str, chain: list[str], blocks: Blocks,
                   on_progress: Callable[[int, int], None], *, block_bytes: int | None = None,
                   on_accept: Callable[[], None] | None = None) -> None:
        """See :meth:`Transport.send`. Raises :class:`TransferError`. The blocks are gathered first (a source
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
        try:
            conn = self.device.connect(host, port)
        except (OSError, BtbctlError) as e:
            raise TransferError(f"copy {copy_id}: cannot connect to {target} over RDMA: {e}") from None
        try:
            try:
                remote = conn.open_region(copy_id, list(chain), block_bytes)
            except (OSError, BtbctlError) as e:
                raise TransferError(f"copy {copy_id}: {target} refused: {e}") from None
            if on_accept is not None:
                on_accept()
            if remote.length < total:
                raise TransferError(f"copy {copy_id}: target region of {remote.length} bytes is smaller than the "
                                    f"copy ({total} bytes)")
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
                    chunk = b"".join(data[op.first:op.first + op.count])
                    staging.buf[op.local_offset:op.local_offset + op.length] = chunk
                    wr_id += 1
                    conn.post_write(wr_id, staging, op.local_offset, op.length, remote.addr + op.remote_offset,
                                    remote.rkey)
                    outstanding[wr_id] = op
                polls = 0
                while outstanding:
                    for wid, ok in conn.poll(len(outstanding)):
                        op = outstanding.pop(wid, None)
                        if op is None:
                            continue
                        if not ok:
                            raise TransferError(f"copy {copy_id}: RDMA write of blocks {op.first}.."
                                                f"{op.first + op.count - 1} failed", op.first)
                        sent += op.length
                        on_progress(sent, total)
                    polls += 1
                    if outstanding and polls >= self.poll_budget:
                        raise TransferError(f"copy {copy_id}: {len(outstanding)} RDMA writes never completed")
            reply = conn.commit(copy_id, [xxhash.xxh3_64_intdigest(b) for b in data])
            if not isinstance(reply, dict) or reply.get("ok") is not True:
                err = reply.get("error") if isinstance(reply, dict) else "malformed reply"
                blk = reply.get("block") if isinstance(reply, dict) else None
                raise TransferError(f"copy {copy_id}: {target} rejected the copy: {err}",
                                    blk if isinstance(blk, int) else None)
        finally:
            conn.close()


__all__ = ["DEFAULT_MAX_MSG_BYTES", "DEFAULT_STAGING_BYTES", "Connection", "DeviceLayer", "LocalRegion",
           "RdmaTransport", "RemoteRegion", "WriteOp", "plan_writes", "probe"]
