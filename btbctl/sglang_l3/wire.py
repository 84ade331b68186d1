"""Framing of the local protocol between :class:`~btbctl.sglang_l3.store.BtbL3Store` and its node's ``btbctl agent``.

A Unix stream socket carries JSON frames (``J``, :mod:`btbctl.sglang_l3.frames`: the frame layout and limits every
btbctl page protocol shares), one request and (for every request but ``release``) one reply. Page bytes never travel
on the socket: the agent's arena is a memfd the agent passes with the ``hello`` reply (``SCM_RIGHTS``) and the store
maps it. Requests (``ns`` = namespace id, ``keys`` = SGLang page keys, ``size`` = bytes of one page)::

    hello   {"ns": {namespace description} | null}      -> {"ok", "arena_id", "arena_bytes", "ns_id"} + fd
    exists  {"ns", "keys"}                               -> {"ok", "n"}   leading run of ready pages
    get     {"ns", "keys", "size"}                       -> {"ok", "offsets": [leading run], "lease"}
    release {"lease"}                                    (no reply) the leased pages may be evicted again
    put     {"ns", "keys", "size"}                       -> {"ok", "offsets": [int | -1 (have it) | null], "token"}
    commit  {"token", "written": [bool per key]}         -> {"ok", "committed": [bool per key]}

Errors are ``{"ok": false, "error": str}``. Only the standard library is used here.
"""

from __future__ import annotations

import socket

from btbctl.sglang_l3.frames import (
    FRAME_HEAD,
    MAX_JSON_BYTES,
    FrameError,
    check_json_head,
    json_frame,
    parse_json_body,
)

#: Largest local frame, bytes: the shared JSON frame limit (a has() of a 1M-token prefix at page size 1 would be
#: about 70 MB, beyond what the store sends: its batches are at most SGLang's STORAGE_BATCH_SIZE = 128 pages,
#: ``srt/mem_cache/hicache_storage.py:25``).
MAX_FRAME_BYTES = MAX_JSON_BYTES


class WireError(FrameError):
    """A malformed or oversized frame, or a closed connection."""


#: One frame carrying a JSON object.
encode = json_frame


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
        return parse_json_body(body)
    except FrameError as e:
        raise WireError(str(e)) from None


def recv_frame(sock: socket.socket, prefix: bytes = b"") -> dict:
    """Read one frame (blocking, under the socket's timeout). ``prefix``: bytes of it already read. Raises
    :class:`WireError`, ``socket.timeout`` or OSError."""
    hs = FRAME_HEAD.size
    head = prefix[:hs]
    if len(head) < hs:
        head += _recv_exact(sock, hs - len(head))
    try:
        n = check_json_head(*FRAME_HEAD.unpack(head), MAX_FRAME_BYTES)
    except FrameError as e:
        raise WireError(str(e)) from None
    rest = prefix[hs : hs + n]
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
