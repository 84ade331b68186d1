"""TCP transport: the source worker streams a prefix's KV blocks straight to the target worker's transfer port.

Wire: the frames and the handshake of :mod:`btbctl.engine.replication.wire` (one copy per connection). Only a copy
the gateway authorized is received: the sender proves it knows the copy's token (key of the handshake, see
:mod:`btbctl.engine.replication.auth`) before anything is reserved on the target::

    sender -> target   J {"op": "hello", "v": 3, "nonce": n_s, "copy_id": str, "blocks": n, "block_bytes": int}
    target -> sender   J {"op": "challenge", "nonce": n_t}                      or a refusal
    sender -> target   J {"op": "auth", "mac": HMAC(token, label | "client" | n_t | n_s | bind)}
    target -> sender   J {"op": "auth_ok", "mac": HMAC(token, label | "server" | n_s | n_t | bind)}   or a refusal
    sender -> target   n × P (u32 index | u64 xxh3_64(bytes) | bytes)
    target -> sender   J {"op": "done", "blocks_verified": n, "bytes": total}   or a refusal

with ``bind = copy_id | sha256(chain) | n | block_bytes`` and a refusal ``J {"op": "refuse", "error": str, "block":
k | null}``.

The target refuses at the challenge a copy it does not expect (the gateway's ``/btb/expect`` registers each copy's
id, chain and token), an expired one, one already arriving or received, or one of another block count or size; and
at the proof a wrong MAC (compared in constant time). A refused connection never touches another copy, not even one
with the same id. Only after the proof verified is the expectation claimed (once), room reserved and the blocks
counted as arriving (:meth:`CopySink.begin` with the *authorized* chain).

The target checks every frame as it arrives: a page frame, the index is the next one, the length is its own block
size, the xxh3_64 digest of the bytes matches (wire integrity), and then the sink's content check against the
authorized ``chain[index]`` (the emulated worker compares the bytes with ``hashing.block_payload(hash, length)``).
The first failure is answered with an error reply naming the block, and the connection is closed. Only after all
``n`` blocks verified does the target commit the chain (it becomes cached) and answer ``done``. The target may also
send an error reply at any time (the sender watches for it while streaming).

Bounds and deadlines (against a hostile or stuck peer): a connection must finish the handshake within
``auth_timeout_s`` of connecting, and at most ``max_unauthenticated`` connections may be in the handshake at once (a
new one pushes the oldest out, so idle sockets cannot lock real senders out; they never count against the copy
slots); at most ``max_connections`` authenticated copies at once, ``max_per_peer`` from one peer address; every copy
must finish within its deadline ``deadline_base_s + blocks x deadline_per_block_s + bytes / min_rate_bytes_per_s``
after authentication (data arriving in fragments does not extend it) and may go quiet for at most
``idle_timeout_s``; a copy cut off or broken off leaves nothing warm. Handshake frames at most
:data:`~btbctl.sglang_l3.frames.MAX_PREAUTH_BYTES`; chain at most
:data:`~btbctl.sglang_l3.frames.MAX_COPY_PAGES` blocks and the sink's ``max_blocks``. Every state change of
an inbound copy is one structured log line on the ``btbctl.replication`` logger
(``event=transfer_authorized|transfer_refused|transfer_timed_out|transfer_done|transfer_failed copy_id=...
peer=... reason=...``).

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
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from btbctl.engine.aiotasks import cancel_all
from btbctl.engine.logfmt import log_event
from btbctl.engine.replication import wire
from btbctl.engine.replication.auth import (
    COPY_AUTH_LABEL,
    COPY_AUTH_VERSION,
    AuthError,
    CopyAuth,
    Expectations,
    Expected,
    Hello,
    parse_hello,
)
from btbctl.engine.replication.transport import (
    Blocks,
    CopyFaults,
    CopyRefused,
    CopySink,
    TransferError,
    check_copy_id,
    parse_address,
)
from btbctl.engine.replication.wire import AsyncFrames, DigestMismatch, FrameError, HandshakeError, ServerHandshake
from btbctl.sglang_l3 import frames

log = logging.getLogger("btbctl.replication")
#: Seconds a connection has to authenticate (a handshake takes milliseconds on loopback and LAN).
DEFAULT_AUTH_TIMEOUT_S = 5.0
#: Connections in the handshake at once; a new one pushes the oldest out.
DEFAULT_MAX_UNAUTHENTICATED = 32
#: Authenticated copies received at once, and from one peer address.
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_MAX_PER_PEER = 8
#: A copy's deadline after authentication: base + blocks x per-block allowance + bytes / floor rate. The per-block
#: allowance covers a copy that trails its source's prefill (a 256-token page of a 70B model prefills in well under
#: a second on any preset GPU); the floor rate is far below kernel TCP (about 1 GB/s, REFERENCE.md s6).
DEFAULT_DEADLINE_BASE_S = 30.0
DEFAULT_DEADLINE_PER_BLOCK_S = 0.5
DEFAULT_MIN_RATE_BYTES_PER_S = 50e6
#: A copy silent this long is cut off, seconds (above the source's wait for its own prefill of one block,
#: ``SOURCE_BLOCK_WAIT_S`` of the worker).
DEFAULT_IDLE_TIMEOUT_S = 30.0
#: Environment variable the worker reads a :class:`FaultPlan` from (tests only).
FAULT_ENV = "BTBCTL_REPLICATION_FAULT"


@dataclass(frozen=True)
class FaultPlan(CopyFaults):
    """Faults a sender injects (tests only; see the module docstring): :class:`CopyFaults` and ``corrupt_content``."""

    ENV: ClassVar[str] = FAULT_ENV

    corrupt_content: int | None = None


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


def _refusal(error: str, block: int | None = None) -> dict:
    return {"op": wire.REFUSE, "error": error, "block": block}


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
        token: str | None = None,
    ) -> None:
        """See :meth:`Transport.send`. Raises :class:`TransferError`.

        ``token`` is the copy's token the gateway minted (it authorized the copy at the target with it); without
        one no copy is sent. It never goes on the wire: the sender answers the target's challenge with a MAC.

        With ``block_bytes`` given, the connection is opened and the header sent before the first block is
        available, so the target knows the copy is coming while the source still computes it; each block is sent
        as soon as ``blocks`` yields it (an async iterator may wait for the source's compute). While waiting for
        a block the sender watches for the target's early error reply. The target drops a copy that goes quiet
        for its ``idle_timeout_s``."""
        host, port = parse_address(target)
        check_copy_id(copy_id)
        n = len(chain)
        if not 1 <= n <= frames.MAX_COPY_PAGES:
            raise TransferError(f"copy {copy_id}: chain must have 1..{frames.MAX_COPY_PAGES} blocks, got {n}")
        it = _iterate(blocks).__aiter__()
        first: tuple[str, bytes] | None = None
        if block_bytes is None:
            try:
                first = await it.__anext__()
            except StopAsyncIteration:
                raise TransferError(f"copy {copy_id}: no blocks to send") from None
            block_bytes = len(first[1])
        if not 1 <= block_bytes <= frames.MAX_PAGE_BYTES:
            raise TransferError(f"copy {copy_id}: block size {block_bytes} outside 1..{frames.MAX_PAGE_BYTES} bytes")
        total = n * block_bytes
        auth = CopyAuth.for_copy(token, copy_id, chain, block_bytes)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as e:
            raise TransferError(f"copy {copy_id}: cannot connect to {target}: {e or 'timed out'}") from None
        sent_blocks = 0
        final: asyncio.Task | None = None
        chan = AsyncFrames(reader.readexactly, writer.write)
        try:
            chan.send_json(auth.hello())
            await asyncio.wait_for(writer.drain(), self.io_timeout_s)
            challenge = await self._answer(chan, copy_id, target)
            try:
                chan.send_json(auth.challenge(challenge))
            except HandshakeError:
                raise TransferError(f"copy {copy_id}: malformed challenge from {target}") from None
            await asyncio.wait_for(writer.drain(), self.io_timeout_s)
            acc = await self._answer(chan, copy_id, target)
            if acc.get("op") != wire.AUTH_OK or not auth.target_ok(challenge["nonce"], acc.get("mac")):
                raise TransferError(f"copy {copy_id}: {target} failed authentication (it does not know the token)")
            final = asyncio.ensure_future(chan.recv_json(frames.MAX_JSON_BYTES))
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
                        await asyncio.gather(nxt, return_exceptions=True)
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
                digest = wire.page_digest(data)
                if fault and fault.corrupt_wire == k:
                    data = _flip(data)
                chan.send_page(k, data, digest)
                await asyncio.wait_for(writer.drain(), self.io_timeout_s)
                sent_blocks = k + 1
                on_progress(sent_blocks * block_bytes, total)
                if fault and fault.delay_s > 0:
                    await asyncio.sleep(fault.delay_s)
            try:
                rep = await asyncio.wait_for(final, self.io_timeout_s)
            except asyncio.IncompleteReadError:
                raise TransferError(
                    f"copy {copy_id}: connection to {target} lost after {sent_blocks} of {n} "
                    "blocks (no acknowledgement)"
                ) from None
            if rep.get("op") != "done":
                blk = rep.get("block")
                raise TransferError(
                    f"copy {copy_id}: {target} rejected the copy: {rep.get('error', rep.get('op'))}",
                    blk if isinstance(blk, int) else None,
                )
            if sent_blocks != n:
                raise TransferError(f"copy {copy_id}: {target} acknowledged after {sent_blocks} of {n} blocks")
        except asyncio.TimeoutError:
            raise TransferError(
                f"copy {copy_id}: timed out talking to {target} after {sent_blocks} of {n} blocks"
            ) from None
        except (OSError, asyncio.IncompleteReadError, FrameError, ValueError) as e:
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
                await asyncio.gather(final, return_exceptions=True)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _answer(self, chan: AsyncFrames, copy_id: str, target: str) -> dict:
        """One handshake answer; raises :class:`TransferError` with the refusal."""
        try:
            wait_s = self.connect_timeout_s + self.io_timeout_s
            rep = await asyncio.wait_for(chan.recv_json(frames.MAX_PREAUTH_BYTES), wait_s)
        except asyncio.IncompleteReadError:
            raise TransferError(f"copy {copy_id}: {target} closed the connection before accepting") from None
        except FrameError as e:
            raise TransferError(f"copy to {target}: malformed reply from target ({e})") from None
        if rep.get("op") == wire.REFUSE:
            raise TransferError(f"copy {copy_id}: {target} refused: {rep.get('error')}")
        return rep


async def _early_reason(final: asyncio.Task | None) -> str | None:
    if final is None:
        return None
    try:
        obj = await asyncio.wait_for(asyncio.shield(final), 0.5)
    except asyncio.CancelledError:
        if final.cancelled():
            return None
        raise  # the copy itself is being cancelled: never turn that into a "connection lost"
    except Exception:  # noqa: BLE001 - the connection is already lost; any failure reading the reason means none
        return None
    if isinstance(obj, dict) and obj.get("op") == wire.REFUSE:
        return str(obj.get("error"))
    return None


class _Reject(Exception):
    def __init__(self, message: str, block: int | None = None) -> None:
        self.block = block
        super().__init__(message)


class _Deadline(Exception):
    pass


def _peer_of(writer: asyncio.StreamWriter) -> tuple[str, str]:
    peer = writer.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return host, (f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}")
    return "?", "?"


class TcpReceiver:
    """Receiver side: listens on a TCP port and delivers authorized, verified copies into a :class:`CopySink`.

    Args:
        sink: where copies go.
        host, port: address to bind (port 0 = ephemeral; read :attr:`port` after :meth:`start`).
        expectations: the copies this receiver accepts (the worker's ``/btb/expect`` fills it); default: an empty
            table of its own (:attr:`expectations`).
        idle_timeout_s: a copy that sends nothing for this long is dropped (its copy discarded).
        max_connections: authenticated copies received at once; more are refused with an error reply.
        max_per_peer: authenticated copies received at once from one peer address.
        max_unauthenticated: connections in the handshake at once (a new one pushes the oldest out).
        auth_timeout_s: seconds from connect to the end of the handshake.
        deadline_base_s, deadline_per_block_s, min_rate_bytes_per_s: a copy's deadline (module docstring).
        clock: monotonic seconds (injectable for tests; deadlines are measured on it).
    """

    def __init__(
        self,
        sink: CopySink,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        *,
        expectations: Expectations | None = None,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        auth_timeout_s: float = DEFAULT_AUTH_TIMEOUT_S,
        deadline_base_s: float = DEFAULT_DEADLINE_BASE_S,
        deadline_per_block_s: float = DEFAULT_DEADLINE_PER_BLOCK_S,
        min_rate_bytes_per_s: float = DEFAULT_MIN_RATE_BYTES_PER_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.host = host
        self.port = port
        self.expectations = expectations if expectations is not None else Expectations(clock)
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.max_unauthenticated = max_unauthenticated
        self.auth_timeout_s = auth_timeout_s
        self.deadline_base_s = deadline_base_s
        self.deadline_per_block_s = deadline_per_block_s
        self.min_rate_bytes_per_s = min_rate_bytes_per_s
        self.clock = clock
        self._active = 0
        self._per_peer: dict[str, int] = {}
        self._preauth: OrderedDict[asyncio.Task | None, asyncio.StreamWriter] = OrderedDict()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        """Bind and listen; returns the bound port. Raises OSError when the address is taken."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop listening and abort copies in progress (each is reported to the sink as failed)."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await cancel_all(self._tasks)

    def deadline_s(self, blocks: int, block_bytes: int) -> float:
        """Seconds a copy of ``blocks`` blocks of ``block_bytes`` may take after authentication."""
        return (
            self.deadline_base_s
            + blocks * self.deadline_per_block_s
            + blocks * block_bytes / max(1.0, self.min_rate_bytes_per_s)
        )

    async def _read(self, reader: asyncio.StreamReader, n: int, deadline: float) -> bytes:
        """``n`` bytes, each arriving within ``idle_timeout_s`` of the last, all before ``deadline`` (clock
        seconds; checked as every fragment arrives). Raises :class:`_Deadline`, TimeoutError (idle) or
        IncompleteReadError."""
        buf = bytearray()
        while len(buf) < n:
            left = deadline - self.clock()
            if left <= 0:
                raise _Deadline
            chunk = await asyncio.wait_for(reader.read(n - len(buf)), min(self.idle_timeout_s, left))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buf), n)
            buf += chunk
        if self.clock() > deadline:
            raise _Deadline
        return bytes(buf)

    def _event(self, event: str, **fields: object) -> None:
        log_event(
            log,
            event,
            logging.WARNING if event in ("transfer_refused", "transfer_timed_out") else logging.INFO,
            **fields,
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        host, peer_s = _peer_of(writer)
        copy_id: str | None = None
        begun = False
        counted = False
        received = 0
        n = 0
        phase = "handshake"
        try:
            exp, hello, nonce = await self._authenticate(reader, writer, task, peer_s)
            copy_id, n = exp.copy_id, len(exp.chain)
            chain = list(exp.chain)
            if self._active >= self.max_connections:
                raise _Reject(f"too many copies in progress ({self.max_connections})")
            if self._per_peer.get(host, 0) >= self.max_per_peer:
                raise _Reject(f"peer {host} has {self.max_per_peer} copies in progress already")
            try:
                self.expectations.claim(exp)
            except AuthError as e:
                raise _Reject(str(e)) from None
            self._active += 1
            self._per_peer[host] = self._per_peer.get(host, 0) + 1
            counted = True
            # authenticated and claimed: only now is room reserved and are the blocks counted as arriving
            self.sink.begin(copy_id, chain, peer_s)
            begun = True
            deadline = self.clock() + self.deadline_s(n, hello.block_bytes)
            self._event(
                "transfer_authorized",
                copy_id=copy_id,
                peer=peer_s,
                blocks=n,
                bytes=n * hello.block_bytes,
                deadline_s=round(self.deadline_s(n, hello.block_bytes), 3),
            )
            chan = AsyncFrames(reader.readexactly, writer.write)
            chan.send_json({"op": wire.AUTH_OK, "mac": self.expectations.answer(exp, hello, nonce)})
            await writer.drain()
            phase = "copy"
            blocks: list[bytes] = []
            for k in range(n):
                blocks.append(await self._read_block(reader, k, chain[k], hello.block_bytes, deadline))
                received += hello.block_bytes
                self.sink.progress(copy_id, k + 1, received)
            self.sink.commit(copy_id, chain, blocks)
            self._event("transfer_done", copy_id=copy_id, peer=peer_s, blocks=n, bytes=received)
            chan.send_json({"op": "done", "blocks_verified": n, "bytes": received})
            await writer.drain()
        except (_Reject, CopyRefused) as e:
            if begun and copy_id is not None:
                self.sink.fail(copy_id, str(e))
                self._event("transfer_failed", copy_id=copy_id, peer=peer_s, block=e.block, reason=str(e))
            else:
                self._event("transfer_refused", copy_id=copy_id, peer=peer_s, reason=str(e))
            with contextlib.suppress(Exception):
                writer.write(frames.json_frame(_refusal(str(e), e.block)))
                await asyncio.wait_for(writer.drain(), 2.0)
        except _Deadline:
            if begun and copy_id is not None:
                blocks_in = _blocks_in(received, self.sink.block_bytes)
                reason = f"copy deadline passed after {blocks_in} of {n} blocks; partial copy discarded"
                self.sink.fail(copy_id, reason)
                self._event("transfer_timed_out", copy_id=copy_id, peer=peer_s, reason=reason)
                with contextlib.suppress(Exception):
                    writer.write(frames.json_frame(_refusal(reason)))
                    await asyncio.wait_for(writer.drain(), 2.0)
            else:
                self._event(
                    "transfer_timed_out", copy_id=copy_id, peer=peer_s, reason=f"no {phase} within the deadline"
                )
        except asyncio.TimeoutError:
            if begun and copy_id is not None:
                blocks_in = _blocks_in(received, self.sink.block_bytes)
                reason = f"sender went quiet after {blocks_in} of {n} blocks; partial copy discarded"
                self.sink.fail(copy_id, reason)
                self._event("transfer_timed_out", copy_id=copy_id, peer=peer_s, reason=reason)
            else:
                self._event("transfer_timed_out", copy_id=copy_id, peer=peer_s, reason=f"idle during the {phase}")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            if begun and copy_id is not None:
                blocks_in = _blocks_in(received, self.sink.block_bytes)
                reason = f"connection lost after {blocks_in} of {n} blocks; partial copy discarded"
                self.sink.fail(copy_id, reason)
                self._event("transfer_failed", copy_id=copy_id, peer=peer_s, reason=reason)
        except asyncio.CancelledError:
            if begun and copy_id is not None:
                self.sink.fail(copy_id, "receiver shut down; partial copy discarded")
            raise
        finally:
            self._preauth.pop(task, None)
            if counted:
                self._active -= 1
                left = self._per_peer.get(host, 1) - 1
                if left > 0:
                    self._per_peer[host] = left
                else:
                    self._per_peer.pop(host, None)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            if task is not None:
                self._tasks.discard(task)

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, task: asyncio.Task | None, peer_s: str
    ) -> tuple[Expected, Hello, str]:
        """The handshake (module docstring) within ``auth_timeout_s``, in one of the ``max_unauthenticated`` slots
        (the oldest connection still in its handshake is pushed out for a new one). Returns the expectation and the
        hello once the sender proved it knows the copy's token. Raises :class:`_Reject` (refusals), :class:`_Deadline`
        or I/O errors."""
        while len(self._preauth) >= self.max_unauthenticated:
            _old, old_writer = self._preauth.popitem(last=False)
            self._event(
                "transfer_refused",
                peer=_peer_of(old_writer)[1],
                reason=f"{self.max_unauthenticated} connections in the handshake: the oldest is dropped",
            )
            old_writer.transport.abort()
        self._preauth[task] = writer
        deadline = self.clock() + self.auth_timeout_s
        chan = AsyncFrames(lambda n: self._read(reader, n, deadline), writer.write)
        handshake = ServerHandshake(COPY_AUTH_LABEL, COPY_AUTH_VERSION)
        try:
            hello = parse_hello(handshake.read_hello(await chan.recv_json(frames.MAX_PREAUTH_BYTES)))
        except FrameError as e:
            raise _Reject(f"not a btbctl block transfer: {e}") from None
        except HandshakeError as e:  # AuthError too
            raise _Reject(str(e)) from None
        limit = min(frames.MAX_COPY_PAGES, self.sink.max_blocks)
        if hello.blocks > limit:
            raise _Reject(f"chain of {hello.blocks} blocks exceeds this receiver's limit of {limit}")
        try:
            exp = self.expectations.lookup(hello, self.sink.block_bytes)
        except AuthError as e:
            raise _Reject(str(e)) from None
        chan.send_json(handshake.challenge())
        await asyncio.wait_for(writer.drain(), max(0.0, deadline - self.clock()) or 0.001)
        try:
            proof = await chan.recv_json(frames.MAX_PREAUTH_BYTES)
        except FrameError as e:
            raise _Reject(f"malformed proof: {e}") from None
        try:
            if proof.get("op") != wire.AUTH:
                raise AuthError("expected an auth frame")
            self.expectations.verify(exp, hello, handshake.nonce, proof.get("mac"))
        except AuthError as e:
            raise _Reject(str(e)) from None
        self._preauth.pop(task, None)
        return exp, hello, handshake.nonce

    async def _read_block(
        self, reader: asyncio.StreamReader, k: int, expect_hash: str, block_bytes: int, deadline: float
    ) -> bytes:
        kind, length = frames.FRAME_HEAD.unpack(await self._read(reader, frames.FRAME_HEAD.size, deadline))
        if kind != frames.KIND_PAGE:
            raise _Reject(f"block {k}: expected a page frame, got kind {kind}", k)
        length -= frames.PAGE_HEAD.size
        if length != block_bytes:
            raise _Reject(f"block {k}: length {length} differs from the block size {block_bytes}", k)
        index, digest = frames.PAGE_HEAD.unpack(await self._read(reader, frames.PAGE_HEAD.size, deadline))
        if index != k:
            raise _Reject(f"block {k}: frame carries index {index}", k)
        data = await self._read(reader, length, deadline)
        try:
            wire.check_page(k, expect_hash, data, digest, "block")
        except DigestMismatch as e:
            raise _Reject(str(e), k) from None
        try:
            self.sink.check_block(k, expect_hash, data)
        except CopyRefused as e:
            raise _Reject(str(e), k if e.block is None else e.block) from None
        return data


def _blocks_in(received: int, block_bytes: int) -> int:
    return received // block_bytes if block_bytes > 0 else 0


__all__ = [
    "FAULT_ENV",
    "FaultPlan",
    "TcpReceiver",
    "TcpTransport",
]
