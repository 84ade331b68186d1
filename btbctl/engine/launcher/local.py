"""Start and stop fleet processes on this machine.

* :func:`spawn` starts an argv (never a shell string) in a new session, so it leads its own process group and a
  Ctrl-C at the terminal reaches only ``btbctl up``, which then stops the fleet in order. Output (stdout and stderr)
  goes to a log file.
* :func:`wait_ready` waits until the process prints a ready line (``ready http://HOST:PORT ...``, as the emulated
  worker and the gateway do) or, when a health URL is given, until ``GET <url>/health`` answers 2xx (how a real
  SGLang server is recognised), and fails early when the process exits.
* :func:`stop_group` sends SIGTERM to a process group, waits a grace period, then SIGKILLs what is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from btbctl.engine.errors import BtbctlError
from btbctl.engine.httpclient import urlopen
from btbctl.engine.launcher.rundir import ProcessRecord, group_members, process_start_time, record_is_ours
from btbctl.engine.logfmt import ROTATE_BACKUPS, ROTATE_BYTES

#: The first line a btbctl process prints once it accepts connections: ``ready <url> [key value]...``
#: (emulated worker: ``ready http://H:P transfer H:TP``; gateway: ``ready http://H:P control http://H:CP``).
READY_LINE = re.compile(r"^ready (https?://\S+)((?: \S+ \S+)*)\s*$", re.MULTILINE)
#: Seconds between SIGTERM and SIGKILL when stopping a process group. A product choice: the emulated worker and
#: the gateway stop in about a second (open connections get 2 s), SGLang in a few; ten seconds leaves room.
DEFAULT_GRACE_S = 10.0
#: Lines of a failed process's log quoted in the error (enough for a Python exception's last frame and message).
LOG_TAIL_LINES = 5


@dataclass
class Started:
    """A process :func:`spawn` started.

    Attributes:
        name: display name.
        popen: the ``subprocess.Popen`` (we are its parent and reap it).
        argv: its command line.
        log: its log file.
        start_time: identity from :func:`~btbctl.engine.launcher.rundir.process_start_time`.
        started_at: Unix time of the launch.
        url: base URL once ready.
        extra: key/value pairs of its ready line (``transfer``, ``control``).
        writer: the size-capped writer of its log (:mod:`~btbctl.engine.launcher.logcap`); it exits by itself.
        env: the variables given to :func:`spawn` on top of this process's environment.
    """

    name: str
    popen: subprocess.Popen
    argv: list[str]
    log: Path
    start_time: str
    started_at: float
    url: str | None = None
    extra: dict = field(default_factory=dict)
    writer: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def record(self, role: str, kind: str) -> ProcessRecord:
        """This process as a ``state.json`` record."""
        return ProcessRecord(
            name=self.name,
            role=role,
            kind=kind,
            pid=self.pid,
            pgid=self.pid,
            start_time=self.start_time,
            argv=list(self.argv),
            log=str(self.log),
            url=self.url,
            extra=dict(self.extra),
            started_at=self.started_at,
            env=dict(self.env),
        )


def spawn(
    name: str,
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    max_bytes: int = ROTATE_BYTES,
    backups: int = ROTATE_BACKUPS,
) -> Started:
    """Start ``argv`` in a new session with stdin from /dev/null and stdout+stderr written to ``log`` (emptied
    first, mode 0600) through a size-capped writer (:mod:`~btbctl.engine.launcher.logcap`: rotated at
    ``max_bytes``, ``backups`` old files kept).

    ``env`` adds to (and overrides) this process's environment. Raises :class:`BtbctlError` when the program
    cannot be started (not found, not executable).
    """
    if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise BtbctlError(f"{name}: the command must be a non-empty list of strings")
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    log.parent.mkdir(parents=True, exist_ok=True)
    for old in log.parent.glob(log.name + ".*"):
        if old.name[len(log.name) + 1 :].isdigit():
            old.unlink(missing_ok=True)  # the rotated output of an earlier run
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)  # the file exists (readers wait on it) before either process starts
    r, w = os.pipe()
    try:
        writer = subprocess.Popen(
            [sys.executable, "-m", "btbctl.engine.launcher.logcap", str(log), str(max_bytes), str(backups)],
            stdin=r,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as e:
        os.close(r)
        os.close(w)
        raise BtbctlError(f"cannot start {name}'s log writer: {e.strerror or e}") from None
    os.close(r)
    try:
        popen = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=w,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=full_env,
            close_fds=True,
        )
    except FileNotFoundError:
        raise BtbctlError(f"cannot start {name}: program not found: {argv[0]}") from None
    except PermissionError:
        raise BtbctlError(f"cannot start {name}: not executable: {argv[0]}") from None
    except OSError as e:
        raise BtbctlError(f"cannot start {name}: {argv[0]}: {e.strerror or e}") from None
    finally:
        os.close(w)  # the writer sees end of file once the child (and what it started) is gone
    start = process_start_time(popen.pid) or ""
    return Started(
        name=name,
        popen=popen,
        argv=list(argv),
        log=log,
        start_time=start,
        started_at=time.time(),
        writer=writer,
        env=dict(env or {}),
    )


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of a log, joined with `` | `` (for one-line error messages)."""
    try:
        data = path.read_bytes()[-8192:].decode("utf-8", "replace")
    except OSError:
        return ""
    tail = [ln.strip() for ln in data.splitlines() if ln.strip()][-lines:]
    return " | ".join(tail)


def not_ready(proc: Started, rc: int | None, timeout_s: float) -> BtbctlError:
    """The error for ``proc`` that exited with status ``rc`` before it was ready (``rc`` None: still not ready
    after ``timeout_s``), with the last lines of its log."""
    tail = log_tail(proc.log)
    what = f"exited with status {rc} before it was ready" if rc is not None else f"was not ready after {timeout_s:g} s"
    return BtbctlError(f"{proc.name} {what} (log {proc.log})" + (f": {tail}" if tail else ""))


def health_ok(url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``GET url/health`` answers 2xx within ``timeout_s`` (any failure counts as not healthy); the one
    readiness probe of workers, agents and the gateway, here or on a host, and never through a proxy."""
    try:
        with urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(
    proc: Started,
    timeout_s: float,
    health_url: str | None = None,
    poll_s: float = 0.05,
    should_stop: Callable[[], bool] | None = None,
) -> Started:
    """Wait until ``proc`` is ready; fill in ``proc.url`` and ``proc.extra`` and return it.

    Ready means: its log holds a :data:`READY_LINE` (its URL becomes ``proc.url``), or ``health_url`` is given and
    ``GET <health_url>/health`` answers 2xx (then ``proc.url = health_url``).

    Raises:
        BtbctlError: the process exited first (status and the last log lines in the message), or ``timeout_s``
            passed (the process is left running; the caller stops it).
    """
    deadline = time.monotonic() + timeout_s
    last_health = 0.0
    while True:
        m = _ready_match(proc.log)
        if m is not None:
            proc.url = m.group(1).rstrip("/")
            words = m.group(2).split()
            proc.extra = dict(zip(words[0::2], words[1::2], strict=False))
            return proc
        rc = proc.popen.poll()
        if rc is not None:
            raise not_ready(proc, rc, timeout_s)
        now = time.monotonic()
        if health_url is not None and now - last_health >= 0.25:
            last_health = now
            if health_ok(health_url):
                proc.url = health_url.rstrip("/")
                return proc
        if now >= deadline:
            raise not_ready(proc, None, timeout_s)
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        time.sleep(poll_s)


def _ready_match(log: Path):
    try:
        with open(log, "rb") as f:
            head = f.read(65536).decode("utf-8", "replace")
    except OSError:
        return None
    return READY_LINE.search(head)


def stop_group(pgid: int, grace_s: float = DEFAULT_GRACE_S, popen: subprocess.Popen | None = None) -> bool:
    """Stop process group ``pgid``: SIGTERM, wait up to ``grace_s`` for every member to exit, then SIGKILL.

    The caller must have checked the group is ours (:func:`~btbctl.engine.launcher.rundir.record_is_ours` or being
    its parent). ``popen``, when we are the leader's parent, is reaped. Returns True when SIGKILL was needed.
    """
    return stop_groups([(pgid, popen)], grace_s)[pgid]


def stop_groups(groups: list[tuple[int, subprocess.Popen | None]], grace_s: float = DEFAULT_GRACE_S) -> dict[int, bool]:
    """:func:`stop_group` for several groups at once: SIGTERM to all, one shared grace period, then SIGKILL to the
    groups with members left. Returns ``{pgid: killed}``."""
    out: dict[int, bool] = {}
    live: dict[int, subprocess.Popen | None] = {}
    for pgid, popen in groups:
        out[pgid] = False
        try:
            os.killpg(pgid, signal.SIGTERM)
            live[pgid] = popen
        except ProcessLookupError:
            _reap(popen)
        except PermissionError:
            raise BtbctlError(f"not allowed to signal process group {pgid}") from None
    _wait_gone(live, grace_s)
    for pgid in live:
        out[pgid] = True
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _wait_gone(live, 5.0)
    for _, popen in groups:
        _reap(popen)
    return out


def _wait_gone(live: dict[int, subprocess.Popen | None], timeout_s: float) -> None:
    """Poll for up to ``timeout_s`` until every group in ``live`` has no members; a group leaves ``live`` when its
    last member is gone (its leader reaped on the way)."""
    deadline = time.monotonic() + timeout_s
    while live and time.monotonic() < deadline:
        for pgid, popen in list(live.items()):
            _reap(popen, block=False)
            if not group_members(pgid):
                del live[pgid]
        if live:
            time.sleep(0.05)


def _reap(popen: subprocess.Popen | None, block: bool = True) -> None:
    if popen is None:
        return
    try:
        if block:
            popen.wait(timeout=5)
        else:
            popen.poll()
    except subprocess.TimeoutExpired:
        pass


def stop_record(rec: ProcessRecord, grace_s: float = DEFAULT_GRACE_S) -> str:
    """Stop a recorded process group if it is still ours. Returns ``stopped``, ``killed`` (SIGKILL was needed) or
    ``gone`` (nothing of ours was left; nothing was signalled)."""
    return stop_records([rec], grace_s)[0]


def stop_records(recs: list[ProcessRecord], grace_s: float = DEFAULT_GRACE_S) -> list[str]:
    """:func:`stop_record` for several records at once (one shared grace period); results in order."""
    ours = [r for r in recs if record_is_ours(r)]
    killed = stop_groups([(r.pgid, None) for r in ours], grace_s) if ours else {}
    out = []
    for r in recs:
        if r.pgid not in killed or r not in ours:
            out.append("gone")
        else:
            out.append("killed" if killed[r.pgid] else "stopped")
    return out


__all__ = [
    "READY_LINE",
    "Started",
    "health_ok",
    "log_tail",
    "spawn",
    "stop_group",
    "stop_groups",
    "stop_record",
    "stop_records",
    "wait_ready",
]
