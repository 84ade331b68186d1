"""Bounded reads of user-named files: every reader of a config, trace, token or record goes through
:func:`read_bounded`, so ``-c /dev/zero``, a FIFO without a writer, a gzip bomb or a multi-gigabyte file gives a
one-line error instead of a hang or an exhausted memory.

Rules: regular files and pipes are read; character and block devices, sockets and directories are refused; a FIFO
is opened without blocking and waited on for at most :data:`FIFO_WAIT_S` (never a hang); at most ``limit_bytes``
are read, after gzip decompression when ``gzip=True`` (so the limit is on memory, not on the compressed size).
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import stat
import zlib
from pathlib import Path

#: Largest config file read, bytes (TOML cluster, dry-run and report files are kilobytes; a product choice).
CONFIG_LIMIT_BYTES = 16 * 1024 * 1024
#: Largest trace read, bytes after decompression (a 1M-request JSONL trace with hash ids is about 0.3 GB; a
#: product choice that keeps a hostile file from exhausting a 4 GiB machine).
TRACE_LIMIT_BYTES = 2 * 1024 * 1024 * 1024
#: Largest small record read (tokens, run state, pid records), bytes.
RECORD_LIMIT_BYTES = 4 * 1024 * 1024
#: Longest wait for a FIFO's writer to write (or close), seconds: a producer that has not started by then is taken
#: as absent (a product choice; ``mkfifo`` without a writer used to hang forever).
FIFO_WAIT_S = 30.0
_CHUNK_BYTES = 1 << 20


class ReadRefused(Exception):
    """A file that :func:`read_bounded` will not (or cannot) read; ``str()`` is the reason, without the path."""


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


def read_bounded(path: str | os.PathLike[str], *, limit_bytes: int, gzip: bool = False) -> bytes:
    """The contents of ``path`` (decompressed when ``gzip``), at most ``limit_bytes`` of them.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as :func:`open` would.
        ReadRefused: a device or socket, a file over the limit, or a broken gzip stream.
        OSError: any other read failure.
    """
    spath = os.fspath(path)
    st = os.stat(spath)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), spath)
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        raise ReadRefused("is a device or socket, not a file")
    if stat.S_ISREG(st.st_mode) and not gzip and st.st_size > limit_bytes:
        raise ReadRefused(f"is {_size(st.st_size)}, over the {_size(limit_bytes)} limit")
    fd = os.open(spath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        # A FIFO opened without O_NONBLOCK waits for a writer forever. Opened with it, poll() waits until a writer
        # has written or gone, for at most FIFO_WAIT_S. Blocking reads are then restored so that a pipe whose writer
        # is slow is still read whole.
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(FIFO_WAIT_S * 1000):
                raise ReadRefused(f"is a FIFO with no writer for {FIFO_WAIT_S:g} s")
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        with os.fdopen(fd, "rb", closefd=True) as raw:
            fd = -1
            if not gzip:
                data = raw.read(limit_bytes + 1)
                if len(data) > limit_bytes:
                    raise ReadRefused(f"is over the {_size(limit_bytes)} limit")
                return data
            return _gunzip_bounded(raw, limit_bytes)
    finally:
        if fd >= 0:
            os.close(fd)


def read_text_bounded(path: str | os.PathLike[str], *, limit_bytes: int = RECORD_LIMIT_BYTES) -> str:
    """The UTF-8 text of a small file (token, record), read with :func:`read_bounded`.

    Raises:
        OSError: the file cannot be read; ``strerror`` says why (a refusal reads like one too).
        UnicodeDecodeError: not UTF-8.
    """
    try:
        return read_bounded(path, limit_bytes=limit_bytes).decode("utf-8")
    except ReadRefused as e:
        raise OSError(errno.EINVAL, str(e), os.fspath(path)) from None


def _gunzip_bounded(raw, limit_bytes: int) -> bytes:
    """Decompress a (possibly multi-member) gzip stream, refusing output beyond ``limit_bytes``."""
    out = bytearray()
    dec = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    member_open = False  # input went into a member that has not ended yet
    try:
        while True:
            chunk = raw.read(_CHUNK_BYTES)
            if not chunk:
                break
            while chunk:
                member_open = True
                out += dec.decompress(chunk, limit_bytes + 1 - len(out))
                if len(out) > limit_bytes:
                    raise ReadRefused(f"decompresses to over the {_size(limit_bytes)} limit")
                if dec.unconsumed_tail:
                    chunk = dec.unconsumed_tail
                elif dec.eof:
                    chunk = dec.unused_data
                    dec = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
                    member_open = False
                else:
                    chunk = b""
        out += dec.flush()
    except zlib.error as e:
        raise ReadRefused(f"not a valid gzip file ({e})") from None
    if len(out) > limit_bytes:
        raise ReadRefused(f"decompresses to over the {_size(limit_bytes)} limit")
    if member_open and not dec.eof:
        raise ReadRefused("not a valid gzip file (truncated stream)")
    return bytes(out)


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` as one step: a temporary file beside it (``mode``) is written, flushed to disk
    and renamed over ``path``, so a reader sees the old file or the whole new one, never an empty or cut one.
    Raises OSError (a full disk); the temporary file is then removed and ``path`` is as it was."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a killed writer: created afresh below, with ``mode``
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
