"""A worker's log for ``btbctl logs``: the run directory's copy, brought up to date first for a worker on another
host (its log lives in its run folder there; the new bytes are fetched over SSH and appended)."""

from __future__ import annotations

from pathlib import Path

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.rundir import ProcessRecord, RunDir

#: Bytes read from the end of a log to find its last lines (256 KiB holds thousands of lines).
TAIL_BYTES = 256 * 1024


def find_record(rd: RunDir, name: str) -> ProcessRecord:
    """The recorded process called ``name``. Raises :class:`BtbctlError` listing the valid names."""
    state = rd.load()
    if state is None:
        raise BtbctlError(f"no fleet is recorded in {rd.path}; start one with `btbctl up`")
    for rec in state.processes:
        if rec.name == name:
            return rec
    names = ", ".join(p.name for p in state.processes) or "none"
    raise BtbctlError(f"no process called {name!r} in {rd.path}; valid: {names}")


def refresh(rec: ProcessRecord) -> str | None:
    """Append what is new in a remote worker's log to its local copy. Returns None, or one line saying why the
    host could not be read (the local copy is then what was fetched before). Local processes: nothing to do."""
    if not rec.host:
        return None
    from btbctl.engine.launcher import ssh

    with ssh.SshPool() as pool:
        st = ssh.poll_records(pool, [rec])[rec.name]
    return st["error"] if st["state"] == "unreachable" else None


def tail(rec: ProcessRecord, lines: int) -> str:
    """The last ``lines`` lines of ``rec``'s log (0 = all of it), as text."""
    path = Path(rec.log)
    try:
        with open(path, "rb") as f:
            if lines > 0:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - TAIL_BYTES))
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    except OSError as e:
        raise BtbctlError(f"cannot read {path}: {e.strerror or e}") from None
    if lines <= 0:
        return data
    return "".join(data.splitlines(keepends=True)[-lines:])


__all__ = ["find_record", "refresh", "tail"]
