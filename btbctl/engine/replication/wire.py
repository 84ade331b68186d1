"""The one wire protocol KV pages travel on between btbctl processes: frames, handshake, digest check, channels.

Used by the worker-to-worker push (:mod:`~btbctl.engine.replication.tcp`, asyncio streams) and the agent-to-agent
copies (:mod:`~btbctl.engine.agent.peer`, blocking sockets). What each protocol says after the handshake (offers,
pages, replies) is its own; how it is framed, authenticated and checked is defined here once.

**Frames** (defined in :mod:`btbctl.sglang_l3.frames`, standard-library only so that SGLang's side of the local
protocol shares them; import them from there): ``u8 kind | u32 length | body``; kind ``J`` = one JSON object, kind
``P`` = ``u32 index | u64 xxh3_64(payload) | payload``; limits ``MAX_PREAUTH_BYTES``, ``MAX_JSON_BYTES``,
``MAX_COPY_PAGES``, ``MAX_PAGE_BYTES``.

**Handshake** (mutual HMAC-SHA256 challenge-response, all ``J`` frames of at most :data:`MAX_PREAUTH_BYTES`; nothing
else is read before it succeeds)::

    client -> server  {"op": "hello", "v": version, "nonce": n_c, ...claims}
    server -> client  {"op": "challenge", "nonce": n_s, ...claims}         or {"op": "refuse", "error", ...}
    client -> server  {"op": "auth", "mac": proof(key, label, "client", n_s, n_c, bind)}
    server -> client  {"op": "auth_ok", "mac": proof(key, label, "server", n_c, n_s, bind)}   or a refusal

``proof`` (:func:`proof_mac`) is HMAC-SHA256 under the shared ``key`` of ``label | role | the peer's nonce | one's
own nonce | bind...``: each side answers the other's fresh 128-bit nonce (no replay), the roles differ (a reflected
proof is not an answer), ``bind`` ties both proofs to what was announced (the copy's id, chain digest and sizes; or
both agents' ids), and every MAC is compared in constant time (:func:`macs_equal`). Each protocol chooses its
``label`` (domain separation), its version, its claims, how the server finds the key, and the bind.

**Digest check**: every page carries its xxh3_64 (:func:`page_digest`); :func:`check_page` refuses one whose bytes
do not match (:class:`DigestMismatch`).

**Channels**: :class:`PageChannel` is the seam a copy talks through once connected (the agents' copies call it, never
a raw socket); :class:`FrameConn` is the TCP one and :func:`connect_channel` opens it. A transport that moves pages
another way (NIXL, pyverbs) plugs in as another :class:`PageChannel`. :class:`AsyncFrames` frames asyncio streams
the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import re
import secrets
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import xxhash

from btbctl.sglang_l3.frames import (
    FRAME_HEAD,
    KIND_JSON,
    MAX_JSON_BYTES,
    PAGE_HEAD,
    FrameError,
    check_json_head,
    json_frame,
    page_frame_head,
    parse_json_body,
)

#: Handshake operations (the ``op`` of its frames) and the refusal either side may answer with instead.
HELLO, CHALLENGE, AUTH, AUTH_OK, REFUSE = "hello", "challenge", "auth", "auth_ok", "refuse"
#: The two roles a proof is made in.
CLIENT, SERVER = b"client", b"server"

_HEX = re.compile(r"^[0-9a-f]+\Z")


class ChannelError(FrameError):
    """A protocol violation, refusal or I/O failure on a page channel (one line)."""


class HandshakeError(ValueError):
    """A handshake message that is malformed, a refusal, or a proof that does not verify (one line)."""


class DigestMismatch(ValueError):
    """A page whose bytes do not match the xxh3_64 it was sent with. ``index``: the page; ``digest``: what the
    bytes hash to."""

    def __init__(self, message: str, index: int, digest: int) -> None:
        super().__init__(message)
        self.index = index
        self.digest = digest


# -- HMAC primitives ------------------------------------------------------------------------------------------------


def mac(key: bytes, label: bytes, *parts: bytes) -> str:
    """HMAC-SHA256 (hex) of ``label | part | part ...`` joined with NUL bytes, under ``key``."""
    return hmac.new(key, b"\0".join((label, *parts)), hashlib.sha256).hexdigest()


def macs_equal(a: object, b: str) -> bool:
    """Constant-time comparison of a received MAC or token (any JSON value) with the expected one."""
    return isinstance(a, str) and hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii"))


def new_nonce() -> str:
    """A fresh handshake nonce (128 random bits, hex)."""
    return secrets.token_hex(16)


def check_hex(value: object, what: str) -> str:
    """A nonce or token must be 32..128 lowercase hex digits. Raises :class:`HandshakeError` naming ``what``."""
    if not isinstance(value, str) or not 32 <= len(value) <= 128 or not _HEX.match(value):
        raise HandshakeError(f"{what} must be 32..128 lowercase hex digits")
    return value


def check_nonce(nonce: object) -> str:
    """A nonce must be 32..128 lowercase hex digits. Raises :class:`HandshakeError`."""
    return check_hex(nonce, "nonce")


def proof_mac(key: bytes, label: bytes, role: bytes, peer_nonce: str, own_nonce: str, bind: Sequence[str]) -> str:
    """One side's handshake proof: HMAC(key, label | role | peer_nonce | own_nonce | bind...) (module docstring)."""
    return mac(key, label, role, peer_nonce.encode(), own_nonce.encode(), *(b.encode() for b in bind))


# -- handshake messages ---------------------------------------------------------------------------------------------


def _refused(msg: dict, want: str) -> dict:
    if msg.get("op") == REFUSE:
        raise HandshakeError(f"refused: {msg.get('error')}")
    if msg.get("op") != want:
        raise HandshakeError(f"expected {want}, got {str(msg.get('op'))[:32]!r}")
    return msg


class ClientHandshake:
    """The connecting side: :meth:`hello`, then :meth:`answer` the challenge (once the key is known, which may
    depend on the server's claims), then :meth:`confirm` the server's proof. ``key`` never goes on the wire."""

    def __init__(self, label: bytes, version: int) -> None:
        self.label = label
        self.version = version
        self.nonce = new_nonce()
        self._server_proof: str | None = None

    def hello(self, **claims: object) -> dict:
        """Step 1 (no secret in it)."""
        return {"op": HELLO, "v": self.version, "nonce": self.nonce, **claims}

    def proof(self, server_nonce: object, key: bytes, bind: Sequence[str]) -> str:
        """The client's proof for the server's nonce. Raises :class:`HandshakeError` for a malformed nonce."""
        n_s = check_nonce(server_nonce)
        self._server_proof = proof_mac(key, self.label, SERVER, self.nonce, n_s, bind)
        return proof_mac(key, self.label, CLIENT, n_s, self.nonce, bind)

    def answer(self, challenge: dict, key: bytes, bind: Sequence[str]) -> dict:
        """Step 3: the ``auth`` frame for a ``challenge`` frame. Raises :class:`HandshakeError` (refused, not a
        challenge, malformed nonce)."""
        return {"op": AUTH, "mac": self.proof(_refused(challenge, CHALLENGE).get("nonce"), key, bind)}

    def server_ok(self, server_proof: object) -> bool:
        """Whether the server's proof shows it knows the key (after :meth:`proof`)."""
        return self._server_proof is not None and macs_equal(server_proof, self._server_proof)

    def confirm(self, reply: dict) -> None:
        """Step 4: check the server's ``auth_ok``. Raises :class:`HandshakeError` (refused, wrong proof)."""
        if not self.server_ok(_refused(reply, AUTH_OK).get("mac")):
            raise HandshakeError("the server failed authentication (it does not know the key)")


class ServerHandshake:
    """The accepting side: :meth:`read_hello`, then :meth:`challenge`, then :meth:`verify` the client's proof
    (which answers with the server's own)."""

    def __init__(self, label: bytes, version: int) -> None:
        self.label = label
        self.version = version
        self.nonce = new_nonce()
        self.client_nonce = ""

    def read_hello(self, hello: dict) -> dict:
        """Step 1: check a ``hello`` frame's op, version and nonce; returns it. Raises :class:`HandshakeError`."""
        if hello.get("op") != HELLO:
            raise HandshakeError("first frame was not a hello")
        if hello.get("v") != self.version:
            raise HandshakeError(f"unsupported protocol version {hello.get('v')!r}; this end speaks {self.version}")
        self.client_nonce = check_nonce(hello.get("nonce"))
        return hello

    def challenge(self, **claims: object) -> dict:
        """Step 2."""
        return {"op": CHALLENGE, "nonce": self.nonce, **claims}

    def client_ok(self, client_proof: object, key: bytes, bind: Sequence[str]) -> bool:
        """Whether the client's proof verifies (constant time)."""
        return macs_equal(client_proof, proof_mac(key, self.label, CLIENT, self.nonce, self.client_nonce, bind))

    def proof(self, key: bytes, bind: Sequence[str]) -> str:
        """The server's proof (step 4)."""
        return proof_mac(key, self.label, SERVER, self.client_nonce, self.nonce, bind)

    def verify(self, auth: dict, key: bytes, bind: Sequence[str]) -> dict:
        """Step 3: check an ``auth`` frame; returns the ``auth_ok`` frame to send. Raises :class:`HandshakeError`."""
        if auth.get("op") != AUTH:
            raise HandshakeError("expected an auth frame")
        if not self.client_ok(auth.get("mac"), key, bind):
            raise HandshakeError("authentication failed (wrong proof of the key)")
        return {"op": AUTH_OK, "mac": self.proof(key, bind)}


# -- digest ---------------------------------------------------------------------------------------------------------


def page_digest(data: bytes | bytearray | memoryview) -> int:
    """The xxh3_64 of a page's bytes (what a ``P`` frame carries)."""
    return xxhash.xxh3_64_intdigest(data)


def check_page(index: int, name: str, data: bytes | bytearray | memoryview, digest: int, noun: str = "page") -> None:
    """Refuse page ``index`` (named ``name``; ``noun``: what the protocol calls a page) when its bytes do not hash
    to ``digest``. Raises :class:`DigestMismatch`."""
    got = xxhash.xxh3_64_intdigest(data)
    if got != digest:
        what = "xxh3_64 digest mismatch (corrupted in transit or forged)"
        raise DigestMismatch(f"{noun} {index} ({name}): {what}", index, got)


# -- channels -------------------------------------------------------------------------------------------------------


class PageChannel(Protocol):
    """A connected, blocking page channel one copy talks through (the seam where another transport plugs in).

    Attributes:
        deadline: monotonic seconds past which every call raises :class:`ChannelError` (None: none).
        idle_timeout_s: longest a single send or receive may wait, seconds.
        received: bytes received so far (0: the peer has sent nothing yet).
    """

    deadline: float | None
    idle_timeout_s: float
    received: int

    def send_json(self, obj: dict) -> None:
        """Send one ``J`` frame."""

    def recv_json(self, max_bytes: int = MAX_JSON_BYTES) -> dict:
        """Receive one frame that must be a ``J`` frame of at most ``max_bytes``."""

    def send_page(self, index: int, data: memoryview, digest: int) -> None:
        """Send one ``P`` frame."""

    def recv_head(self) -> tuple[int, int]:
        """Receive a frame header: ``(kind, body length)``."""

    def json_body(self, n: int, max_bytes: int = MAX_JSON_BYTES) -> dict:
        """Receive the body of a ``J`` frame whose header said ``n`` bytes."""

    def recv_page_head(self) -> tuple[int, int]:
        """Receive a ``P`` frame's ``(index, digest)``; its payload (``length - PAGE_HEAD.size`` bytes) follows."""

    def recv_into(self, view: memoryview) -> None:
        """Receive exactly ``len(view)`` bytes into ``view`` (a page's payload goes straight to its slot)."""

    def close(self) -> None:
        """Close the channel (idempotent)."""


class FrameConn:
    """A :class:`PageChannel` on a blocking TCP socket with an idle timeout and an optional deadline.

    The idle timeout is the kernel's (``SO_RCVTIMEO``/``SO_SNDTIMEO``) on a blocking socket: each ``recv``/``send`` is
    one system call, without the poll round trips of a Python-level socket timeout. The deadline is checked before
    every receive call and before every send. Raises :class:`ChannelError`."""

    def __init__(self, sock: socket.socket, idle_timeout_s: float) -> None:
        self.sock = sock
        sock.settimeout(None)
        self.deadline: float | None = None
        self._hbuf = bytearray(FRAME_HEAD.size)
        self._pbuf = bytearray(PAGE_HEAD.size)
        self.idle_timeout_s = idle_timeout_s
        self.received = 0

    @property
    def idle_timeout_s(self) -> float:
        return self._idle

    @idle_timeout_s.setter
    def idle_timeout_s(self, t: float) -> None:
        self._idle = t
        sec = int(t)
        tv = struct.pack("ll", sec, int((t - sec) * 1e6))
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ChannelError("copy deadline passed")

    def recv_into(self, view: memoryview) -> None:
        got, n = 0, len(view)
        recv = self.sock.recv_into
        while got < n:
            self._check_deadline()
            try:
                k = recv(view[got:])
            except (TimeoutError, BlockingIOError):
                raise ChannelError(f"peer idle for {self._idle} s ({got} of {n} bytes of a frame)") from None
            if k == 0:
                raise ChannelError(f"connection closed ({got} of {n} bytes of a frame)")
            got += k
            self.received += k

    def recv_head(self) -> tuple[int, int]:
        self.recv_into(memoryview(self._hbuf))
        return FRAME_HEAD.unpack(self._hbuf)

    def recv_json(self, max_bytes: int = MAX_JSON_BYTES) -> dict:
        kind, n = self.recv_head()
        if kind != KIND_JSON:
            raise ChannelError(f"expected a control frame, got kind {kind}")
        return self.json_body(n, max_bytes)

    def json_body(self, n: int, max_bytes: int = MAX_JSON_BYTES) -> dict:
        try:
            check_json_head(KIND_JSON, n, max_bytes)
            buf = bytearray(n)
            self.recv_into(memoryview(buf))
            return parse_json_body(buf)
        except FrameError as e:
            raise ChannelError(str(e)) from None

    def recv_page_head(self) -> tuple[int, int]:
        self.recv_into(memoryview(self._pbuf))
        return PAGE_HEAD.unpack(self._pbuf)

    def _sendall(self, data) -> None:
        self._check_deadline()
        try:
            self.sock.sendall(data)
        except (TimeoutError, BlockingIOError):
            raise ChannelError(f"peer did not take data for {self._idle} s") from None

    def send_json(self, obj: dict) -> None:
        self._sendall(json_frame(obj))

    def send_page(self, index: int, data: memoryview, digest: int) -> None:
        head = page_frame_head(index, len(data), digest)
        self._check_deadline()
        try:
            sent = self.sock.sendmsg([head, data])  # one system call for the header and (most of) the page
        except (TimeoutError, BlockingIOError):
            raise ChannelError(f"peer did not take data for {self._idle} s") from None
        if sent < len(head):
            self._sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(data):
            self._sendall(data[sent - len(head) :])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def connect_channel(host: str, port: int, connect_timeout_s: float, idle_timeout_s: float) -> FrameConn:
    """A :class:`FrameConn` to ``host:port`` (TCP_NODELAY). Raises :class:`ChannelError` when it cannot connect."""
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as e:
        raise ChannelError(f"cannot connect: {e}") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return FrameConn(sock, idle_timeout_s)


class AsyncFrames:
    """The same frames on an asyncio stream: ``read(n)`` returns exactly ``n`` bytes (raising what it raises:
    ``IncompleteReadError``, timeouts), ``write(data)`` queues bytes (the caller drains)."""

    def __init__(self, read: Callable[[int], Awaitable[bytes]], write: Callable[[bytes], object]) -> None:
        self.read = read
        self.write = write

    async def recv_head(self) -> tuple[int, int]:
        return FRAME_HEAD.unpack(await self.read(FRAME_HEAD.size))

    async def recv_json(self, max_bytes: int = MAX_JSON_BYTES) -> dict:
        """One ``J`` frame of at most ``max_bytes``. Raises :class:`FrameError` (and what ``read`` raises)."""
        n = check_json_head(*await self.recv_head(), max_bytes)
        return parse_json_body(await self.read(n))

    async def recv_page_head(self) -> tuple[int, int]:
        return PAGE_HEAD.unpack(await self.read(PAGE_HEAD.size))

    def send_json(self, obj: dict) -> None:
        self.write(json_frame(obj))

    def send_page(self, index: int, data: bytes, digest: int) -> None:
        self.write(page_frame_head(index, len(data), digest))
        self.write(data)


__all__ = [
    "AUTH",
    "AUTH_OK",
    "CHALLENGE",
    "CLIENT",
    "HELLO",
    "REFUSE",
    "SERVER",
    "AsyncFrames",
    "ChannelError",
    "ClientHandshake",
    "DigestMismatch",
    "FrameConn",
    "HandshakeError",
    "PageChannel",
    "ServerHandshake",
    "check_hex",
    "check_nonce",
    "check_page",
    "connect_channel",
    "mac",
    "macs_equal",
    "new_nonce",
    "page_digest",
    "proof_mac",
]
