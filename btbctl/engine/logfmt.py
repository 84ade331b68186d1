"""Structured log lines: ``event=<name> key=value ...`` (logfmt), one line per state change.

Values with spaces, tabs, quotes, ``=`` or newlines are double-quoted (newlines become spaces); fields whose value is
None are left out. The node agent (:mod:`btbctl.engine.agent.events`), the workers' transfer receivers
(:mod:`btbctl.engine.replication.tcp`) and the gateway's copy executors write their events this way, so one
``grep event=`` follows a copy across processes.
"""

from __future__ import annotations

import io
import logging
import logging.handlers
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

#: Size at which a log file written through :func:`rotating_handler` is rotated, bytes.
ROTATE_BYTES = 10 * 1024 * 1024
#: Rotated files kept (``NAME.log.1`` ... ``NAME.log.N``).
ROTATE_BACKUPS = 5
#: Seconds during which an identical line is written once; the repeats are counted and reported after.
REPEAT_WINDOW_S = 10.0


def _fmt(v: object) -> str:
    s = str(v)
    if not s or any(c in s for c in ' \t"=\n'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
    return s


def format_event(event: str, fields: Mapping[str, object]) -> str:
    """``event=<event> k=v ...`` (one line)."""
    return " ".join([f"event={event}"] + [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None])


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object) -> None:
    """Write one structured line ``event=<event> k=v ...`` on ``logger``."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s", format_event(event, fields))


def parse_line(line: str) -> dict[str, str] | None:
    """The fields of one logfmt line (``k=v k="quoted v"``), or None when the line is not logfmt (a traceback, a
    print). Inverse of :func:`format_event` for the lines it writes."""
    out: dict[str, str] = {}
    i, n = 0, len(line)
    while i < n:
        while i < n and line[i] == " ":
            i += 1
        if i >= n:
            break
        eq = line.find("=", i)
        sp = line.find(" ", i)
        if eq < 0 or (0 <= sp < eq) or eq == i:
            return None
        key = line[i:eq]
        i = eq + 1
        if i < n and line[i] == '"':
            i += 1
            buf = []
            while i < n and line[i] != '"':
                if line[i] == "\\" and i + 1 < n:
                    i += 1
                buf.append(line[i])
                i += 1
            if i >= n:
                return None
            i += 1
            out[key] = "".join(buf)
        else:
            end = line.find(" ", i)
            end = n if end < 0 else end
            out[key] = line[i:end]
            i = end
    return out or None


def iso_ts(t: float) -> str:
    """``t`` (Unix seconds) as an ISO 8601 UTC timestamp with milliseconds (``2026-01-02T03:04:05.678Z``)."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(t * 1000) % 1000:03d}Z"


class LogfmtFormatter(logging.Formatter):
    """``ts=<iso> level=<level> logger=<name> event=...`` for event lines, ``... msg="<text>"`` for the rest; an
    exception's traceback is folded into one ``exc=`` field, so every record is one line."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        head = f"ts={iso_ts(record.created)} level={record.levelname.lower()} logger={record.name}"
        body = msg if msg.startswith("event=") else f"msg={_fmt(msg)}"
        if record.exc_info:
            body += " exc=" + _fmt(self.formatException(record.exc_info).replace("\n", " | "))
        return f"{head} {body}"


class RateLimiter:
    """At most one log line per key and ``interval_s``: :meth:`allow` says whether to log now and how many
    occurrences were held back since the last line."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str) -> tuple[bool, int]:
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False, 0
        self._last[key] = now
        return True, self._held.pop(key, 0)


class LineBudget:
    """A token bucket for per-event log lines (one per request): up to ``burst`` lines at once, then ``per_s`` a
    second; :meth:`allow` says whether to write this one and how many were held back since the last one written
    (so a line can say ``held=N``). The cost of a flood is bounded; a quiet fleet logs every request."""

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_s = per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()
        self._held = 0

    def allow(self) -> tuple[bool, int]:
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.per_s)
        self._at = now
        if self._tokens < 1.0:
            self._held += 1
            return False, 0
        self._tokens -= 1.0
        held, self._held = self._held, 0
        return True, held


class RepeatFilter(logging.Filter):
    """Let an identical line (same logger, level and text) through once per ``window_s``; the next one after the
    window carries ``repeated=N`` (how many were held back), so a flood of one error costs a line per window."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock=time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[tuple, list] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        with self._lock:
            ent = self._seen.get(key)
            if ent is not None and now - ent[0] < self.window_s:
                ent[1] += 1
                return False
            held = ent[1] if ent is not None else 0
            self._seen[key] = [now, 0]
            if len(self._seen) > 4096:  # forget the oldest lines
                for k in list(self._seen)[:2048]:
                    del self._seen[k]
        if held:
            record.msg = f"{record.getMessage()} repeated={held}"
            record.args = ()
        return True


class _PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A :class:`~logging.handlers.RotatingFileHandler` whose files are mode 0600 (a log may hold request data and
    peer addresses), the current one and each fresh one after a rotation."""

    def _open(self) -> io.TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)


def rotating_handler(path: str, max_bytes: int = ROTATE_BYTES, backups: int = ROTATE_BACKUPS) -> logging.Handler:
    """A handler appending logfmt lines (:class:`LogfmtFormatter`) to ``path`` (mode 0600), rotated at
    ``max_bytes`` with ``backups`` old files kept, identical repeats held back (:class:`RepeatFilter`)."""
    h = _PrivateRotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    h.setFormatter(LogfmtFormatter())
    h.addFilter(RepeatFilter())
    return h


def configure_logging(level: int, log_file: str | None = None, stream=None) -> None:
    """Set up a process's logging: with ``log_file``, every record at ``level`` or above goes there
    (:func:`rotating_handler`) and ``stream`` (stderr) gets warnings and errors only; without it, everything goes to
    ``stream``. Identical repeats are held back on both (:class:`RepeatFilter`)."""
    import sys

    root = logging.getLogger()
    root.setLevel(level)
    err = logging.StreamHandler(stream or sys.stderr)
    err.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    err.addFilter(RepeatFilter())
    if log_file:
        err.setLevel(max(level, logging.WARNING))
        root.addHandler(rotating_handler(log_file))
    root.addHandler(err)


__all__ = [
    "LineBudget",
    "LogfmtFormatter",
    "configure_logging",
    "RateLimiter",
    "RepeatFilter",
    "format_event",
    "iso_ts",
    "log_event",
    "parse_line",
    "rotating_handler",
]
