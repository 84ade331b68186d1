"""A size-capped log writer for the output of the processes the launcher starts.

A child's stdout redirected to a file grows without bound, and its parent cannot rotate it (the child holds the
descriptor). So :func:`~btbctl.engine.launcher.local.spawn` points the child's stdout and stderr at a pipe and
starts ``python -m btbctl.engine.launcher.logcap LOG MAX_BYTES BACKUPS`` on the other end: it appends what arrives
to ``LOG`` (mode 0600: a log may hold request data), and when the next chunk would take the file past ``MAX_BYTES``
it renames ``LOG`` to ``LOG.1`` (``LOG.1`` to ``LOG.2`` ..., ``BACKUPS`` kept) and starts a fresh one, so a
process's output never takes more than ``(BACKUPS + 1) x MAX_BYTES`` (a chunk larger than a whole file is cut, at a
line's end where it has one). The same caps apply to every log btbctl writes
(:data:`~btbctl.engine.logfmt.ROTATE_BYTES`, :data:`~btbctl.engine.logfmt.ROTATE_BACKUPS`).

The writer is not in the child's process group, so stopping the child never loses its last lines: it ignores
SIGTERM, SIGINT and SIGHUP and exits when the pipe closes (the child and everything it started are gone). A write
that fails (a full disk) drops that chunk and goes on, rather than stalling the child on a full pipe. It imports
only the standard library.
"""

from __future__ import annotations

import os
import signal
import sys

#: Bytes read from the pipe at a time.
CHUNK_BYTES = 64 * 1024


def _open(path: str, truncate: bool) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0), 0o600)
    os.fchmod(fd, 0o600)
    return fd


def rotate(path: str, backups: int) -> None:
    """``path`` becomes ``path.1`` (``path.1`` becomes ``path.2`` ...; ``path.<backups>`` is dropped); with
    ``backups`` 0, ``path`` is only emptied by the caller."""
    if backups <= 0:
        return
    for i in range(backups - 1, 0, -1):
        try:
            os.replace(f"{path}.{i}", f"{path}.{i + 1}")
        except FileNotFoundError:
            pass
    try:
        os.replace(path, f"{path}.1")
    except FileNotFoundError:
        pass


def pump(src: int, path: str, max_bytes: int, backups: int, truncate: bool = True) -> None:
    """Copy ``src`` (a descriptor) to ``path`` until end of file, rotated at ``max_bytes`` (see the module)."""
    out = _open(path, truncate)
    size = os.fstat(out).st_size
    try:
        while True:
            chunk = os.read(src, CHUNK_BYTES)
            if not chunk:
                return
            while chunk:
                if size and size + len(chunk) > max_bytes:
                    os.close(out)
                    out = -1
                    rotate(path, backups)
                    out = _open(path, True)
                    size = 0
                piece = chunk
                if len(piece) > max_bytes:  # more than a whole file holds: cut it, at a line's end where one is
                    piece = piece[: piece.rfind(b"\n", 0, max_bytes) + 1 or max_bytes]
                chunk = chunk[len(piece) :]
                try:
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(out, view) :]
                    size += len(piece)
                except OSError:
                    pass  # a full disk: this piece is lost, the child goes on
    finally:
        if out >= 0:
            os.close(out)


def main(argv: list[str]) -> int:
    path, max_bytes, backups = argv[0], int(argv[1]), int(argv[2])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pump(0, path, max_bytes, backups)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
