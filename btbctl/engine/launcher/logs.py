"""The logs of a fleet for ``btbctl logs``: the files in ``<run dir>/logs`` (they stay after ``down``), a remote
worker's brought up to date first (its log lives in its run folder on its host; the new bytes are fetched over SSH
and appended); filtered by time (``--since``) and parsed into JSON objects (``--json``)."""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone
from pathlib import Path

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.rundir import ProcessRecord, RunDir
from btbctl.engine.logfmt import parse_line

#: Bytes read from the end of a log to find its last lines (256 KiB holds thousands of lines).
TAIL_BYTES = 256 * 1024


def log_names(rd: RunDir, previous: bool = False) -> list[str]:
    """Every name ``btbctl logs NAME`` accepts: the logs on disk and the recorded processes (``previous``: the
    logs of the run before the last ``up``, ``logs.previous``)."""
    names = set(rd.log_names(previous))
    if previous:
        return sorted(names)
    try:
        state = rd.load()
    except BtbctlError:
        state = None
    if state is not None:
        names.update(p.name for p in state.processes)
    return sorted(names)


def find_log(rd: RunDir, name: str, previous: bool = False) -> tuple[Path, ProcessRecord | None]:
    """The log file called ``name`` and its process record (None once ``down`` forgot it, and always for
    ``previous``: the run before the last ``up``). The gateway's log is ``gateway.log`` (its output, the ready
    line, is ``gateway.out``). Raises :class:`BtbctlError` listing the valid names."""
    if previous:
        path = rd.log_path(name, previous=True)
        if not path.exists():
            names = ", ".join(log_names(rd, previous=True)) or "none"
            raise BtbctlError(f"no log called {name!r} in {rd.previous_logs_dir}; valid: {names}")
        return path, None
    rec = None
    try:
        state = rd.load()
    except BtbctlError:
        state = None
    if state is not None:
        rec = next((p for p in state.processes if p.name == name), None)
    path = rd.log_path(name)
    if rec is not None and rec.role != "gateway":
        path = Path(rec.log)
    if rec is None and not path.exists():
        names = ", ".join(log_names(rd)) or "none"
        where = "" if state is not None else " (no fleet is recorded there now)"
        raise BtbctlError(f"no log called {name!r} in {rd.logs_dir}{where}; valid: {names}")
    return path, rec


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


def refresh(rec: ProcessRecord | None) -> str | None:
    """Append what is new in a remote worker's log to its local copy. Returns None, or one line saying why the
    host could not be read (the local copy is then what was fetched before). Local processes: nothing to do."""
    if rec is None or not rec.host:
        return None
    from btbctl.engine.launcher import ssh

    with ssh.SshPool() as pool:
        st = ssh.poll_records(pool, [rec])[rec.name]
    return st["error"] if st["state"] == "unreachable" else None


def read_tail(path: Path, lines: int, whole: bool = False) -> str:
    """The last ``lines`` lines of the log at ``path`` (0 = all of it; ``whole``: all of it, the rotated copies
    ``NAME.log.N`` ... ``NAME.log.1`` first), as text."""
    paths = [path]
    if whole or lines <= 0:
        rotated = sorted(path.parent.glob(path.name + ".*"), key=lambda p: -_suffix_num(p))
        paths = [p for p in rotated if _suffix_num(p) > 0] + [path]
    chunks = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                if lines > 0 and not whole:
                    f.seek(0, 2)
                    f.seek(max(0, f.tell() - TAIL_BYTES))
                chunks.append(f.read().decode("utf-8", "replace"))
        except FileNotFoundError:
            continue
        except OSError as e:
            raise BtbctlError(f"cannot read {p}: {e.strerror or e}") from None
    data = "".join(chunks)
    if lines <= 0:
        return data
    return "".join(data.splitlines(keepends=True)[-lines:])


def _suffix_num(p: Path) -> int:
    tail = p.name.rsplit(".", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def tail(rec: ProcessRecord, lines: int) -> str:
    """The last ``lines`` lines of ``rec``'s log (0 = all of it), as text."""
    return read_tail(Path(rec.log), lines)


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a duration back from now (``90s``, ``10m``, ``2h``, ``1d``) or a timestamp (ISO 8601, e.g.
    ``2026-01-02T03:04:05`` (UTC unless it names a zone), or Unix seconds). Returns Unix seconds. Raises
    :class:`BtbctlError`."""
    now = time.time() if now is None else now
    t = text.strip()
    m = _DURATION.match(t)
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return float(t)
    except ValueError:
        pass
    ts = line_time_of(t)
    if ts is None:
        raise BtbctlError(
            f"--since: expected a duration like 10m or 2h, or a timestamp like 2026-01-02T03:04:05, got {text!r}"
        )
    return ts


def line_time_of(text: str) -> float | None:
    """Unix seconds of an ISO 8601 timestamp (``Z`` or an offset; naive ones are UTC), or None."""
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00").replace(" ", "T", 1))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def line_time(line: str) -> float | None:
    """The time of a log line: its ``ts=`` field (the gateway's, the agents'), or a leading ``YYYY-MM-DD
    HH:MM:SS[,mmm]`` (Python's default log format, local time), else None."""
    if line.startswith("ts="):
        end = line.find(" ")
        return line_time_of(line[3 : end if end > 0 else None])
    m = re.match(r"^(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[,.](\d+))?", line)
    if m:
        try:
            base = datetime.strptime(m.group(1).replace("T", " "), "%Y-%m-%d %H:%M:%S").timestamp()
        except ValueError:
            return None
        return base + (float("0." + m.group(2)) if m.group(2) else 0.0)
    return None


def since_filter(text: str, since: float) -> str:
    """The lines of ``text`` at or after ``since``; a line without a time (a traceback's) goes with the line
    before it."""
    out = []
    keep = False
    for line in text.splitlines(keepends=True):
        t = line_time(line)
        if t is not None:
            keep = t >= since
        if keep:
            out.append(line)
    return "".join(out)


#: Fields that hold ids: kept as strings in :func:`as_json` even when every character is a digit (a hex prefix
#: id, a request id).
ID_FIELDS = frozenset({"prefix", "copy_id", "request", "rid", "token", "event", "msg"})
_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def _typed(key: str, value: str) -> object:
    """``value`` as an int or float when it is written as a number (``3``, ``0.25``, ``1e-3``) and ``key`` is not
    an id; else the text."""
    if key in ID_FIELDS or not _NUMBER.fullmatch(value):
        return value
    if value.lstrip("-").isdigit():
        return int(value)
    return float(value)


def as_json(line: str) -> dict:
    """One log line as a JSON object: its logfmt fields (numbers as JSON numbers, ids and other text as strings),
    or ``{"msg": line}`` for a line that is not logfmt."""
    stripped = line.rstrip("\n")
    fields = parse_line(stripped)
    if fields is None:
        return {"msg": stripped}
    return {k: _typed(k, v) for k, v in fields.items()}


#: Events of the operations log a foreground ``up`` echoes under its table: what an operator acts on.
ECHO_EVENTS = frozenset(
    {
        "detector_fired",
        "copy_done",
        "copy_failed",
        "control_write",
        "control_replicate",
        "control_flush",
        "worker_down",
        "worker_up",
        "gateway_stop",
    }
)
#: Fields an echoed line leaves out (the time is printed first; the rest is in ``btbctl logs gateway``).
_ECHO_SKIP = ("ts", "level", "logger", "event", "source_url", "target_url", "token", "saved")


def echo_line(line: str) -> str | None:
    """A short line for one operations-log line whose event is in :data:`ECHO_EVENTS` (``17:25:40
    detector_fired prefix=... count=3 ...``), or None for any other line."""
    fields = parse_line(line.rstrip("\n"))
    if fields is None or fields.get("event") not in ECHO_EVENTS:
        return None
    ts = fields.get("ts", "")
    clock = ts[11:19] if len(ts) >= 19 else "--:--:--"
    rest = " ".join(f"{k}={v}" for k, v in fields.items() if k not in _ECHO_SKIP)
    return f"{clock} {fields['event']} {rest}".rstrip()


class LogFollower:
    """New complete lines of a growing log file, from where it ended when the follower was made (a file that
    shrinks, rotated or truncated, is read again from its start). Reads at most :data:`TAIL_BYTES` per call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.pos = path.stat().st_size
        except OSError:
            self.pos = 0
        self._buf = ""

    def poll(self) -> list[str]:
        try:
            size = self.path.stat().st_size
            if size < self.pos:
                self.pos, self._buf = 0, ""
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read(TAIL_BYTES)
        except OSError:
            return []
        self.pos += len(data)
        done, _, self._buf = (self._buf + data.decode("utf-8", "replace")).rpartition("\n")
        return done.splitlines() if done else []


__all__ = [
    "ECHO_EVENTS",
    "LogFollower",
    "as_json",
    "echo_line",
    "find_log",
    "find_record",
    "line_time",
    "log_names",
    "parse_since",
    "read_tail",
    "refresh",
    "since_filter",
    "tail",
]
