"""TCP transport: the source worker streams a prefix's KV blocks straight to the target worker's transfer port.

Wire format (version 1; all integers big-endian; one copy per connection)::

    sender -> target   preamble   4s magic b"BTBK" | u16 version (1) | u16 flags (0) | u32 header_len
                       header     header_len bytes of UTF-8 JSON:
                                  {"copy_id": str, "chain": [hash, ...], "block_bytes": int}
    target -> sender   reply      one JSON line: {"ok": true} (go ahead) or {"ok": false, "error": str, "block": null}
    sender -> target   n frames   u32 index | u8 hash_len | hash (ASCII) | u32 length | u64 xxh3_64(bytes) | bytes
    target -> sender   reply      one JSON line: {"ok": true, "blocks_verified": n, "bytes": total}
                                  or {"ok": false, "error": str, "block": k | null}

The target checks every frame as it arrives: the index is the next one, the hash is ``chain[index]``, the length is
its own block size, the xxh3_64 digest of the bytes matches (wire integrity), and then the sink's content check
(the emulated worker compares the bytes with ``hashing.block_payload(hash, length)``). The first failure is
answered with an error reply naming the block, and the connection is closed. Only after all ``n`` blocks
verified does the target commit the chain (it becomes cached) and answer ``ok``. If the connection drops or goes
quiet for ``idle_timeout_s`` before that, the partial copy is discarded: nothing becomes warm. The target may also
send an error reply at any time (the sender watches for it while streaming).

Bounds (against memory abuse): header at most :data:`MAX_HEADER_BYTES`; chain at most :data:`MAX_CHAIN_BLOCKS`
blocks and at most the sink's ``max_blocks``; hashes 1..64 hex digits; block size must equal the sink's; reply
lines at most :data:`MAX_REPLY_BYTES`; at most ``max_connections`` copies received at once.

Fault injection (tests only): :class:`FaultPlan`, given to :class:`TcpTransport` or read from the environment
variable :data:`FAULT_ENV` (``BTBCTL_REPLICATION_FAULT``) by the worker, a comma-separated list of
``corrupt_wire=K`` (flip one byte of block K *after* its digest is computed: the digest check catches it),
``corrupt_content=K`` (flip one byte *before* the digest: only the content check can catch it),
``close_after=K`` (close the connection abruptly after K blocks, as a dying source would) and ``delay_s=X``
(sleep X seconds after each block, to make a copy slow enough to interrupt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from btbctl.engine.aiotasks import cancel_all
from btbctl.engine.replication.transport import (
    Blocks,
    CopyRefused,
    CopySink,
    TransferError,
    check_copy_id,
    parse_address,
)

MAGIC = b"BTBK"
VERSION = 1
_PREAMBLE = struct.Struct(">4sHHI")
_FRAME_HEAD = struct.Struct(">IB")
_FRAME_TAIL = struct.Struct(">IQ")
#: Largest header accepted, bytes (a 65,536-block chain of 16-hex-digit hashes is about 1.3 MB of JSON).
MAX_HEADER_BYTES = 8 << 20
#: Most blocks in one copy: 65,536 pages of 256 tokens = 16.7M tokens, beyond any model's context.
MAX_CHAIN_BLOCKS = 1 << 16
#: Largest block accepted on the wire, bytes (Llama-3.3-70B at 256 tokens per page and full size is 80 MiB; the
#: emulated worker's blocks are scaled down far below this).
MAX_BLOCK_BYTES = 128 << 20
#: Longest reply line, bytes.
MAX_REPLY_BYTES = 64 << 10
#: Environment variable the worker reads a :class:`FaultPlan` from (tests only).
FAULT_ENV = "BTBCTL_REPLICATION_FAULT"

_HASH = re.compile(r"^[0-9a-f]{1,64}\Z")


@dataclass(frozen=True)
class FaultPlan:
    """Faults a sender injects (tests only; see the module docstring). ``None`` fields inject nothing."""

    corrupt_wire: int | None = None
    corrupt_content: int | None = None
    close_after: int | None = None
    delay_s: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse ``"corrupt_wire=3,delay_s=0.01"``. Raises ValueError naming the bad item."""
        kw: dict = {}
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, val = item.partition("=")
            if not sep or key not in ("corrupt_wire", "corrupt_content", "close_after", "delay_s"):
                raise ValueError(
                    f"bad fault item {item!r}; valid: corrupt_wire=K, corrupt_content=K, close_after=K, delay_s=X"
                )
            try:
                kw[key] = float(val) if key == "delay_s" else int(val)
            except ValueError:
                raise ValueError(f"bad fault item {item!r}: {val!r} is not a number") from None
        return cls(**kw)

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan in :data:`FAULT_ENV`, or None when unset/empty."""
        spec = os.environ.get(FAULT_ENV, "").strip()
        return cls.parse(spec) if spec else None


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


async def _iterate(blocks: Blocks):
    if hasattr(blocks, "__aiter__"):
        async for item in blocks:  # type: ignore[union-attr]
            yield item
    else:
        for item in blocks:  # type: ignore[union-attr]
            yield item


def _reply(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _parse_reply(line: bytes, target: str) -> dict:
    try:
        obj = json.loads(line)
    except ValueError:
        raise TransferError(f"copy to {target}: malformed reply from target") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("ok"), bool):
        raise TransferError(f"copy to {target}: malformed reply from target")
    return obj


class TcpTransport:
    """Sender side of the TCP transport (:class:`~btbctl.engine.replication.transport.Transport`).

    Args:
        connect_timeout_s: seconds to wait for the TCP connect and the target's first reply.
        io_timeout_s: seconds any single write or the final acknowledgement may take.
        fault: a :class:`FaultPlan` (tests only).
    """

    name = "tcp"

    def __init__(
        self, connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0, fault: FaultPlan | None = None
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.io_timeout_s = io_timeout_s
        self.fault = fault

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
    ) -> None:
        """See :meth:`Transport.send`. Raises :class:`TransferError`.

        With ``block_bytes`` given, the connection is opened and the header sent before the first block is
        available, so the target knows the copy is coming while the source still computes it; each block is sent
        as soon as ``blocks`` yields it (an async iterator may wait for the source's compute). While waiting for
        a block the sender watches for the target's early error reply. The target drops a copy that goes quiet
        for its ``idle_timeout_s``."""
        host, port = parse_address(target)
        check_copy_id(copy_id)
        n = len(chain)
        if not 1 <= n <= MAX_CHAIN_BLOCKS:
            raise TransferError(f"copy {copy_id}: chain must have 1..{MAX_CHAIN_BLOCKS} blocks, got {n}")
        it = _iterate(blocks).__aiter__()
        first: tuple[str, bytes] | None = None
        if block_bytes is None:
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                raise TransferError(f"copy {copy_id}: no blocks to send") from None
            block_bytes = len(first[1])
        if not 1 <= block_bytes <= MAX_BLOCK_BYTES:
            raise TransferError(f"copy {copy_id}: block size {block_bytes} outside 1..{MAX_BLOCK_BYTES} bytes")
        total = n * block_bytes
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise TransferError(f"copy {copy_id}: cannot connect to {target}: {e or 'timed out'}") from None
        sent_blocks = 0
        final: asyncio.Task | None = None
        try:
            header = json.dumps(
                {"copy_id": copy_id, "chain": list(chain), "block_bytes": block_bytes}, separators=(",", ":")
            ).encode()
            writer.write(_PREAMBLE.pack(MAGIC, VERSION, 0, len(header)) + header)
            await asyncio.wait_for(writer.drain(), self.io_timeout_s)
            line = await asyncio.wait_for(reader.readline(), self.connect_timeout_s + self.io_timeout_s)
            if not line:
                raise TransferError(f"copy {copy_id}: {target} closed the connection before accepting")
            rep = _parse_reply(line, target)
            if not rep["ok"]:
                raise TransferError(f"copy {copy_id}: {target} refused: {rep.get('error')}")
            final = asyncio.ensure_future(reader.readline())
            if on_accept is not None:
                on_accept()
            item: tuple[str, bytes] | None = first
            fault = self.fault
            for k in range(n):
                if item is None:
                    nxt = asyncio.ensure_future(it.__anext__())
                    if not nxt.done():
                        await asyncio.wait((nxt, final), return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():  # the target answered (an error) or closed while the source computes
                        nxt.cancel()
                        with contextlib.suppress(BaseException):
                            await nxt
                        break
                    try:
                        item = nxt.result()
                    except StopAsyncIteration:
                        raise TransferError(f"copy {copy_id}: only {k} of {n} blocks supplied") from None
                h, data = item
                item = None
                if h != chain[k] or len(data) != block_bytes:
                    raise TransferError(f"copy {copy_id}: block {k} does not match the chain or block size", k)
                if final.done():
                    break  # the target answered early: an error
                if fault and fault.close_after is not None and k >= fault.close_after:
                    writer.transport.abort()
                    raise TransferError(
                        f"copy {copy_id}: fault injection closed the connection after {k} of {n} blocks"
                    )
                if fault and fault.corrupt_content == k:
                    data = _flip(data)
                digest = xxhash.xxh3_64_intdigest(data)
                if fault and fault.corrupt_wire == k:
                    data = _flip(data)
                hb = h.encode("ascii")
                writer.write(_FRAME_HEAD.pack(k, len(hb)) + hb + _FRAME_TAIL.pack(len(data), digest))
                writer.write(data)
                await asyncio.wait_for(writer.drain(), self.io_timeout_s)
                sent_blocks = k + 1
                on_progress(sent_blocks * block_bytes, total)
                if fault and fault.delay_s > 0:
                    await asyncio.sleep(fault.delay_s)
            line = await asyncio.wait_for(final, self.io_timeout_s)
            if not line:
                raise TransferError(
                    f"copy {copy_id}: connection to {target} lost after {sent_blocks} of {n} "
                    "blocks (no acknowledgement)"
                )
            rep = _parse_reply(line, target)
            if not rep["ok"]:
                blk = rep.get("block")
                raise TransferError(
                    f"copy {copy_id}: {target} rejected the copy: {rep.get('error')}",
                    blk if isinstance(blk, int) else None,
                )
            if sent_blocks != n:
                raise TransferError(f"copy {copy_id}: {target} acknowledged after {sent_blocks} of {n} blocks")
        except asyncio.TimeoutError:
            raise TransferError(
                f"copy {copy_id}: timed out talking to {target} after {sent_blocks} of {n} blocks"
            ) from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            # the target may have said why before closing
            reason = await _early_reason(final)
            if reason:
                raise TransferError(f"copy {copy_id}: {target} rejected the copy: {reason}") from None
            raise TransferError(
                f"copy {copy_id}: connection to {target} lost after {sent_blocks} of {n} blocks: {type(e).__name__}"
            ) from None
        finally:
            if final is not None and not final.done():
                final.cancel()
                with contextlib.suppress(BaseException):
                    await final
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)


async def _early_reason(final: asyncio.Task | None) -> str | None:
    if final is None:
        return None
    try:
        line = await asyncio.wait_for(asyncio.shield(final), 0.5)
        obj = json.loads(line) if line else None
    except asyncio.CancelledError:
        if final.cancelled():
            return None
        raise  # the copy itself is being cancelled: never turn that into a "connection lost"
    except Exception:  # noqa: BLE001 - the connection is already lost; any failure reading the reason means none
        return None
    if isinstance(obj, dict) and obj.get("ok") is False:
        return str(obj.get("error"))
    return None


class _Reject(Exception):
    def __init__(self, message: str, block: int | None = None) -> None:
        self.block = block
        super().__init__(message)


class TcpReceiver:
    """Receiver side: listens on a TCP port and delivers verified copies into a :class:`CopySink`.

    Args:
        sink: where copies go.
        host, port: address to bind (port 0 = ephemeral; read :attr:`port` after :meth:`start`).
        idle_timeout_s: a connection that sends nothing for this long is dropped (its copy discarded).
        max_connections: copies received at once; more are refused with an error reply.
    """

    def __init__(
        self,
        sink: CopySink,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = 30.0,
        max_connections: int = 16,
    ) -> None:
        self.sink = sink
        self.host = host
        self.port = port
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._active = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Bind and listen; returns the bound port. Raises OSError when the address is taken."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_REPLY_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and abort copies in progress (each is reported to the sink as failed)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await cancel_all(self._tasks)

    async def _read(self, reader: asyncio.StreamReader, n: int) -> bytes:
        return await asyncio.wait_for(reader.readexactly(n), self.idle_timeout_s)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        peer = writer.get_extra_info("peername")
        peer_s = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        copy_id: str | None = None
        begun = False
        received = 0
        n = 0
        try:
            if self._active >= self.max_connections:
                writer.write(_reply({"ok": False, "error": "too many copies in progress", "block": None}))
                await writer.drain()
                return
            self._active += 1
            try:
                copy_id, chain, block_bytes = await self._read_header(reader)
                n = len(chain)
                begun = True
                self.sink.begin(copy_id, chain, peer_s)
                writer.write(_reply({"ok": True}))
                await writer.drain()
                blocks: list[bytes] = []
                for k in range(n):
                    blocks.append(await self._read_block(reader, k, chain[k], block_bytes))
                    received += block_bytes
                    self.sink.progress(copy_id, k + 1, received)
                self.sink.commit(copy_id, chain, blocks)
                writer.write(_reply({"ok": True, "blocks_verified": n, "bytes": received}))
                await writer.drain()
            finally:
                self._active -= 1
        except (_Reject, CopyRefused) as e:
            if begun and copy_id is not None:
                self.sink.fail(copy_id, str(e))
            with contextlib.suppress(Exception):
                writer.write(_reply({"ok": False, "error": str(e), "block": e.block}))
                await asyncio.wait_for(writer.drain(), 2.0)
        except asyncio.TimeoutError:
            if begun and copy_id is not None:
                blocks_in = _blocks_in(received, self.sink.block_bytes)
                self.sink.fail(copy_id, f"sender went quiet after {blocks_in} of {n} blocks; partial copy discarded")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if begun and copy_id is not None:
                blocks_in = _blocks_in(received, self.sink.block_bytes)
                self.sink.fail(copy_id, f"connection lost after {blocks_in} of {n} blocks; partial copy discarded")
        except asyncio.CancelledError:
            if begun and copy_id is not None:
                self.sink.fail(copy_id, "receiver shut down; partial copy discarded")
            raise
        finally:
            writer.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            if task is not None:
                self._tasks.discard(task)

    async def _read_header(self, reader: asyncio.StreamReader) -> tuple[str, list[str], int]:
        magic, version, _flags, hlen = _PREAMBLE.unpack(await self._read(reader, _PREAMBLE.size))
        if magic != MAGIC:
            raise _Reject("not a btbctl block transfer (bad magic)")
        if version != VERSION:
            raise _Reject(f"unsupported protocol version {version}; this receiver speaks {VERSION}")
        if not 2 <= hlen <= MAX_HEADER_BYTES:
            raise _Reject(f"header of {hlen} bytes outside 2..{MAX_HEADER_BYTES}")
        try:
            hdr = json.loads(await self._read(reader, hlen))
        except ValueError:
            raise _Reject("malformed header JSON") from None
        if not isinstance(hdr, dict):
            raise _Reject("header must be a JSON object")
        copy_id, chain, block_bytes = hdr.get("copy_id"), hdr.get("chain"), hdr.get("block_bytes")
        try:
            check_copy_id(copy_id)
        except TransferError as e:
            raise _Reject(str(e)) from None
        if not isinstance(chain, list) or not chain:
            raise _Reject("header.chain must be a non-empty list of block hashes")
        limit = min(MAX_CHAIN_BLOCKS, self.sink.max_blocks)
        if len(chain) > limit:
            raise _Reject(f"chain of {len(chain)} blocks exceeds this receiver's limit of {limit}")
        if not all(isinstance(h, str) and _HASH.match(h) for h in chain):
            raise _Reject("header.chain entries must be 1..64 lowercase hex digits")
        if not isinstance(block_bytes, int) or block_bytes != self.sink.block_bytes:
            raise _Reject(
                f"block size {block_bytes!r} differs from this receiver's {self.sink.block_bytes} bytes "
                "(model, page size and kv-bytes-scale must match)"
            )
        return copy_id, chain, block_bytes

    async def _read_block(self, reader: asyncio.StreamReader, k: int, expect_hash: str, block_bytes: int) -> bytes:
        index, hlen = _FRAME_HEAD.unpack(await self._read(reader, _FRAME_HEAD.size))
        if index != k:
            raise _Reject(f"block {k}: frame carries index {index}", k)
        h = (await self._read(reader, hlen)).decode("ascii", errors="replace")
        if h != expect_hash:
            raise _Reject(f"block {k}: hash {h!r} is not chain[{k}] {expect_hash!r}", k)
        length, digest = _FRAME_TAIL.unpack(await self._read(reader, _FRAME_TAIL.size))
        if length != block_bytes:
            raise _Reject(f"block {k}: length {length} differs from the block size {block_bytes}", k)
        data = await self._read(reader, length)
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise _Reject(f"block {k} ({h}): xxh3_64 digest mismatch (corrupted in transit)", k)
        try:
            self.sink.check_block(k, h, data)
        except CopyRefused as e:
            raise _Reject(str(e), k if e.block is None else e.block) from None
        return data


def _blocks_in(received: int, block_bytes: int) -> int:
    return received // block_bytes if block_bytes > 0 else 0


__all__ = [
    "FAULT_ENV",
    "FaultPlan",
    "MAX_BLOCK_BYTES",
    "MAX_CHAIN_BLOCKS",
    "MAX_HEADER_BYTES",
    "TcpReceiver",
    "TcpTransport",
]
