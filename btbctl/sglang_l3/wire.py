"""Framing of the local protocol between :class:`~btbctl.sglang_l3.store.BtbL3Store` and its node's ``btbctl agent``.

A Unix stream socket carries frames ``u32 length (big-endian) || UTF-8 JSON object``, one request and (for every
request but ``release``) one reply. Page bytes never travel on the socket: the agent's arena is a memfd the agent
passes with the ``hello`` reply (``SCM_RIGHTS``) and the store maps it. Requests (``ns`` = namespace id, ``keys`` =
SGLang page keys, ``size`` = bytes of one page)::

    hello   {"ns": {namespace description} | null}      -> {"ok", "arena_id", "arena_bytes", "ns_id"} + fd
    exists  {"ns", "keys"}                               -> {"ok", "n"}   leading run of ready pages
    get     {"ns", "keys", "size"}                       -> {"ok", "offsets": [leading run], "lease"}
    release {"lease"}                                    (no reply) the leased pages may be evicted again
    put     {"ns", "keys", "size"}                       -> {"ok", "offsets": [int | -1 (have it) | null], "token"}
    commit  {"token", "written": [bool per key]}         -> {"ok", "committed": [bool per key]}

Errors are ``{"ok": false, "error": str}``. Only the standard library is used here.
"""

from __future__ import annotations

import json
import socket
import struct

_LEN = struct.Struct(">I")
#: Largest local frame, bytes (a batch of 128 keys is about 10 KB; a has() of a 1M-token prefix at page size 1 is
#: about 70 MB, beyond what the store sends: its batches are at most SGLang's STORAGE_BATCH_SIZE = 128 pages,
#: ``srt/mem_cache/hicache_storage.py:25``).
MAX_FRAME_BYTES = 16 << 20


class WireError(Exception):
    """A malformed or oversized frame, or a closed connection."""


def encode(obj: dict) -> bytes:
    """One frame."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("connection closed")
        got += k
    return bytes(buf)


def decode_body(body: bytes) -> dict:
    """Parse one frame body. Raises :class:`WireError`."""
    try:
        obj = json.loads(body)
    except ValueError:
        raise WireError("malformed frame (not JSON)") from None
    if not isinstance(obj, dict):
        raise WireError("frame must be a JSON object")
    return obj


def recv_frame(sock: socket.socket, prefix: bytes = b"") -> dict:
    """Read one frame (blocking, under the socket's timeout). ``prefix``: bytes of it already read. Raises
    :class:`WireError`, ``socket.timeout`` or OSError."""
    head = prefix[:4]
    if len(head) < 4:
        head += _recv_exact(sock, 4 - len(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise WireError(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    rest = prefix[4 : 4 + n]
    body = rest + (_recv_exact(sock, n - len(rest)) if len(rest) < n else b"")
    return decode_body(body)


def recv_frame_with_fds(sock: socket.socket, max_fds: int = 1) -> tuple[dict, list[int]]:
    """Read one frame and the file descriptors sent with it (``SCM_RIGHTS``). Raises like :func:`recv_frame`."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 65536, max_fds)
    if not data:
        for fd in fds:
            _close(fd)
        raise WireError("connection closed")
    try:
        return recv_frame(sock, data), list(fds)
    except BaseException:
        for fd in fds:
            _close(fd)
        raise


def _close(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


__all__ = ["MAX_FRAME_BYTES", "WireError", "decode_body", "encode", "recv_frame", "recv_frame_with_fds"]
