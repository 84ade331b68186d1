"""The emulated worker's prefix copies: the records ``/btb/copies`` reports (:class:`CopyBook`), the sending side
(:class:`CopySender`: a push trails the model's prefill block by block) and the receiving side (:class:`CopySink`,
which the transfer receiver delivers into and which tells the model the blocks are arriving).

A record's ``state`` is a :class:`~btbctl.engine.copies.CopyState` value: ``running`` until the outcome, then
``done`` (a source only after the target acknowledged that every block arrived, verified and was committed) or
``failed`` with an ``error``. Bytes are bytes of the scaled block store; times are Unix seconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from btbctl.engine.aiotasks import cancel_all
from btbctl.engine.copies import CopyState
from btbctl.engine.logfmt import log_event
from btbctl.engine.replication.auth import DEFAULT_EXPECT_TTL_S, AuthError, Expectations, Expected
from btbctl.engine.replication.transport import CopyRefused, TransferError, Transport, check_copy_id
from btbctl.engine.sim.replica import IncomingCopy
from btbctl.engine.worker.model import BlocksLost, ModelDriver, NoRoom
from btbctl.engine.worker.store import BlockStore

log = logging.getLogger("btbctl.worker")

#: Copy records kept for ``/btb/copies`` (oldest finished ones dropped first).
MAX_COPY_RECORDS = 1024
#: Copies this worker sends at once; more pushes get 429 (bounds tasks and sockets).
MAX_OUTBOUND_COPIES = 64
#: Longest a sender waits for its source to compute the next block of a copy, seconds. Below the receiver's
#: idle timeout (30 s, :class:`~btbctl.engine.replication.tcp.TcpReceiver`), which drops a copy that goes quiet;
#: a 8192-token prefill chunk of any preset takes far less.
SOURCE_BLOCK_WAIT_S = 25.0
#: Largest copy this worker receives, bytes of its block store (a copy is held in memory until it verifies;
#: 1 GiB is 800k blocks of Llama-3.3-70B at the default scale, far beyond its KV capacity).
MAX_INBOUND_COPY_BYTES = 1 << 30


@dataclass
class CopyRecord:
    """One copy as seen by this worker. ``started_s``/``finished_s`` are Unix times (seconds); bytes are bytes of
    the scaled block store. ``blocks_available`` (source side): leading blocks the source has computed and
    released to the sender so far (less than ``blocks`` while the copy trails the source's prefill)."""

    copy_id: str
    role: str  # "source" | "target"
    state: CopyState  # running | done | failed
    bytes_sent: int
    bytes_total: int
    blocks_verified: int
    error: str | None
    started_s: float
    finished_s: float | None
    peer: str
    blocks: int
    chain: tuple = ()
    blocks_available: int = 0

    @property
    def in_flight(self) -> bool:
        return not self.state.final

    def as_dict(self) -> dict:
        """The JSON shape of ``/btb/copies`` (without the chain)."""
        d = asdict(self)
        d.pop("chain")
        d["state"] = self.state.value
        return d


def running_record(copy_id: str, role: str, peer: str, chain: Sequence[str], block_bytes: int) -> CopyRecord:
    """The record of a copy of ``chain`` that starts now, as ``role`` (``source``/``target``) with ``peer``."""
    return CopyRecord(
        copy_id=copy_id,
        role=role,
        state=CopyState.RUNNING,
        bytes_sent=0,
        bytes_total=len(chain) * block_bytes,
        blocks_verified=0,
        error=None,
        started_s=time.time(),
        finished_s=None,
        peer=peer,
        blocks=len(chain),
        chain=tuple(chain),
    )


class CopyBook:
    """The worker's copy records, keyed by ``(copy_id, role)`` in start order, and a version that changes with
    any of them (long polls of ``/btb/copies/{id}`` wait on it)."""

    def __init__(self) -> None:
        self.records: OrderedDict[tuple[str, str], CopyRecord] = OrderedDict()
        self.version = 0
        self._changed = asyncio.Event()

    def get(self, copy_id: str, role: str) -> CopyRecord | None:
        return self.records.get((copy_id, role))

    def newest_first(self) -> list[CopyRecord]:
        return list(reversed(self.records.values()))

    def changed(self) -> None:
        """A copy record changed: bump the version and wake the long polls."""
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self, timeout_s: float) -> None:
        """Wait until some copy record changes, at most ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def record(self, rec: CopyRecord) -> CopyRecord:
        """Keep ``rec`` (replacing a record of the same id and role); forget the oldest finished records beyond
        :data:`MAX_COPY_RECORDS`."""
        key = (rec.copy_id, rec.role)
        records = self.records
        records.pop(key, None)
        records[key] = rec
        if len(records) > MAX_COPY_RECORDS:
            for k, old in list(records.items()):
                if len(records) <= MAX_COPY_RECORDS:
                    break
                if not old.in_flight:
                    del records[k]
        return rec

    def any_in_flight(self) -> bool:
        return any(r.in_flight for r in self.records.values())

    def outbound_in_flight(self) -> int:
        return sum(1 for r in self.records.values() if r.role == "source" and r.in_flight)

    def inbound_pending(self, chain: Sequence[str]) -> int:
        """Longest leading part of ``chain`` covered by a copy arriving now."""
        best = 0
        for rec in self.records.values():
            if rec.role == "target" and rec.in_flight:
                n = 0
                for a, b in zip(chain, rec.chain, strict=False):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
        return best


class CopySender:
    """The sending side: pushes of a chain to another worker's transfer port, in background tasks.

    Args:
        book: where the records go.
        model: the worker's model (blocks are sent as it commits them; sent blocks stay pinned meanwhile).
        store: the block store (the bytes sent).
        transport: the sender transport.
        block_bytes: bytes per block of the store.
    """

    def __init__(
        self, book: CopyBook, model: ModelDriver, store: BlockStore, transport: Transport, block_bytes: int
    ) -> None:
        self.book = book
        self.model = model
        self.store = store
        self.transport = transport
        self.block_bytes = block_bytes
        self.tasks: set[asyncio.Task] = set()

    def start_push(
        self, chain: list[str], target: str, copy_id: str, token: str | None = None
    ) -> tuple[CopyRecord, asyncio.Future]:
        """Start sending ``chain`` to ``target`` in the background, authorized by ``token`` (the gateway minted it
        and told the target to expect the copy; without one the copy fails at once). The chain must be resident
        here or planned (being computed, or a request queued here will compute it): blocks are sent as the model
        commits them.
        Returns the record and a future resolved when the target accepted the copy or the copy ended."""
        rec = self.book.record(running_record(copy_id, "source", target, chain, self.block_bytes))
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        task = loop.create_task(self._push(rec, chain, target, accepted, token))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.book.changed()
        return rec, accepted

    async def stop(self) -> None:
        """Cancel every push (their copies fail)."""
        await cancel_all(self.tasks)

    async def _push(
        self, rec: CopyRecord, chain: list[str], target: str, accepted: asyncio.Future, token: str | None
    ) -> None:
        book = self.book

        def progress(sent: int, total: int) -> None:
            rec.bytes_sent = sent
            book.changed()

        def accept() -> None:
            if not accepted.done():
                accepted.set_result(True)

        blocks = SourceBlocks(self, rec, chain)
        try:
            await self.transport.send(
                target,
                rec.copy_id,
                chain,
                blocks,
                progress,
                block_bytes=self.block_bytes,
                on_accept=accept,
                token=token,
            )
            rec.blocks_verified = rec.blocks
            rec.state = CopyState.DONE
        except TransferError as e:
            rec.state, rec.error = CopyState.FAILED, str(e)
        except asyncio.CancelledError:
            rec.state, rec.error = CopyState.FAILED, "worker shutting down"
            raise
        except Exception as e:  # a bug: report it on the record rather than lose it
            log.exception("copy %s failed", rec.copy_id)
            rec.state, rec.error = CopyState.FAILED, f"internal error: {type(e).__name__}"
        finally:
            blocks.release()
            rec.finished_s = time.time()
            if not accepted.done():
                accepted.set_result(False)
            book.changed()


class SourceBlocks:
    """The blocks of an outgoing copy, yielded as the source's model commits them (async iterator of
    ``(hash, bytes)``). Blocks handed out are pinned until :meth:`release`, so they cannot be evicted while the
    copy is in flight. Raises :class:`TransferError` when a block is evicted or no longer computed here, or is not
    computed within :data:`SOURCE_BLOCK_WAIT_S`."""

    def __init__(self, sender: CopySender, rec: CopyRecord, chain: list[str]) -> None:
        self.sender = sender
        self.rec = rec
        self.chain = tuple(chain)
        self.k = 0
        self.pinned = 0

    def __aiter__(self) -> SourceBlocks:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        k = self.k
        if k >= len(self.chain):
            raise StopAsyncIteration
        s = self.sender
        if k >= self.pinned:
            model = s.model
            try:
                have = await model.wait_blocks(self.chain, k + 1, SOURCE_BLOCK_WAIT_S)
            except BlocksLost as e:
                raise TransferError(f"source lost the prefix at block {k}: {e}", k) from None
            model.pin(self.chain, self.pinned, have)
            self.pinned = have
            self.rec.blocks_available = have
            s.book.changed()
        self.k = k + 1
        h = self.chain[k]
        return h, s.store.get(h)

    def release(self) -> None:
        """Unpin the blocks handed out (idempotent)."""
        n, self.pinned = self.pinned, 0
        self.sender.model.unpin(self.chain, n)


class CopySink:
    """The receiving side, a :class:`~btbctl.engine.replication.transport.CopySink`: records the copy, tells the
    model its blocks are arriving (requests needing them wait), and makes them resident once all verified.

    It also keeps the copies this worker expects (:attr:`expected`, filled by ``POST /btb/expect`` through
    :meth:`expect`): the transfer receiver accepts only those, from a sender that proves it knows the copy's token,
    and only then calls :meth:`begin` (see :mod:`btbctl.engine.replication.auth`).

    Args:
        book: where the records go.
        model: the worker's model.
        store: the block store (the verified bytes are kept there).
        page_size: tokens per block.
    """

    def __init__(self, book: CopyBook, model: ModelDriver, store: BlockStore, page_size: int) -> None:
        self.book = book
        self.model = model
        self.store = store
        self.page_size = page_size
        self.block_bytes = store.block_bytes
        self.max_blocks = max(1, min(model.capacity_tokens // page_size, MAX_INBOUND_COPY_BYTES // store.block_bytes))
        self.incoming: dict[str, IncomingCopy] = {}  # copy id -> the model's reservation for it
        self.expected = Expectations()

    def expect(self, copy_id: object, chain: Sequence[str], token: object, ttl_s: object = None) -> Expected:
        """Authorize one inbound copy of ``chain`` (``POST /btb/expect``). Raises
        :class:`~btbctl.engine.replication.auth.AuthError` (its ``status`` is the HTTP answer) for a malformed
        field, a copy that could never fit, an id already expected or received here, or too many expected."""
        try:
            cid = check_copy_id(copy_id)  # type: ignore[arg-type]
        except TransferError as e:
            raise AuthError(str(e)) from None
        if len(chain) > self.max_blocks:
            raise AuthError(f"chain of {len(chain)} blocks exceeds this worker's limit of {self.max_blocks}")
        old = self.book.get(cid, "target")
        if old is not None and old.in_flight:
            raise AuthError(f"copy {cid} is already arriving", 409)
        ttl = DEFAULT_EXPECT_TTL_S if ttl_s is None else ttl_s
        exp = self.expected.expect(cid, chain, token, ttl)  # type: ignore[arg-type]
        log_event(log, "copy_expected", copy_id=cid, blocks=len(chain), ttl_s=ttl)
        return exp

    def begin(self, copy_id: str, chain: Sequence[str], peer: str) -> None:
        old = self.book.get(copy_id, "target")
        if old is not None and old.in_flight:
            # never touches the copy already arriving under this id
            raise CopyRefused(f"copy {copy_id} is already arriving")
        n = len(chain)
        self.book.record(running_record(copy_id, "target", peer, chain, self.block_bytes))
        self.book.changed()
        reason = None
        if n * self.page_size > self.model.capacity_tokens:
            reason = f"{n} blocks do not fit in this worker's KV cache"
        else:
            try:
                # from now on the model counts the blocks as arriving: requests needing them wait for this copy
                self.incoming[copy_id] = self.model.begin_copy(chain)
            except NoRoom as e:
                reason = str(e)
        if reason is not None:
            self.fail(copy_id, reason)  # this copy's own record; the receiver does not call fail for a refusal
            raise CopyRefused(reason)

    def check_block(self, index: int, block_hash: str, data: bytes) -> None:
        if data != self.store.expected(block_hash):
            raise CopyRefused(f"block {index} ({block_hash}): content does not match its hash", index)

    def progress(self, copy_id: str, blocks_verified: int, bytes_received: int) -> None:
        rec = self.book.get(copy_id, "target")
        if rec is not None:
            rec.blocks_verified, rec.bytes_sent = blocks_verified, bytes_received
            self.book.changed()

    def commit(self, copy_id: str, chain: Sequence[str], blocks: list[bytes]) -> None:
        inc = self.incoming.pop(copy_id, None)
        ok = self.model.end_copy(inc, True) if inc is not None else self.model.insert(chain)
        if not ok:
            raise CopyRefused(f"no room in the KV cache for {len(chain)} blocks (in use by running requests)")
        self.store.put_many(chain, blocks)
        rec = self.book.get(copy_id, "target")
        if rec is not None:
            rec.state, rec.finished_s = CopyState.DONE, time.time()
        self.book.changed()

    def fail(self, copy_id: str, error: str) -> None:
        inc = self.incoming.pop(copy_id, None)
        if inc is not None:
            self.model.end_copy(inc, False)  # nothing becomes warm; waiting requests compute the blocks
        rec = self.book.get(copy_id, "target")
        if rec is not None and rec.in_flight:
            rec.state, rec.error, rec.finished_s = CopyState.FAILED, error, time.time()
        self.book.changed()


__all__ = [
    "CopyBook",
    "CopyRecord",
    "CopySender",
    "CopySink",
    "MAX_COPY_RECORDS",
    "MAX_INBOUND_COPY_BYTES",
    "MAX_OUTBOUND_COPIES",
    "SOURCE_BLOCK_WAIT_S",
    "SourceBlocks",
]
