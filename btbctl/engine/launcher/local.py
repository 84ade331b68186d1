"""Start and stop fleet processes on this machine.

* :func:`spawn` starts an argv (never a shell string) in a new session, so it leads its own process group and a
  Ctrl-C at the terminal reaches only ``btbctl up``, which then stops the fleet in order. Output (stdout and stderr)
  goes to a log file.
* :func:`wait_ready` waits until the process prints a ready line (``ready http://HOST:PORT ...``, as the emulated
  worker and the gateway do) or, when a health URL is given, until ``GET <url>/health`` answers 2xx (how a real
  SGLang server is recognised), and fails early when the process exits or its log says its port is taken (a
  server whose bind failed may stay alive: SGLang's scheduler and detokenizer children keep its process up).
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
from urllib.parse import urlsplit

from btbctl.engine.errors import BtbctlError
from btbctl.engine.httpclient import urlopen
from btbctl.engine.launcher.rundir import ProcessRecord, group_members, process_start_time, record_is_ours
from btbctl.engine.logfmt import ROTATE_BACKUPS, ROTATE_BYTES
from btbctl.engine.netaddr import hostport

#: The first line a btbctl process prints once it accepts connections: ``ready <url> [key value]...``
#: (emulated worker: ``ready http://H:P transfer H:TP``; gateway: ``ready http://H:P control http://H:CP``).
READY_LINE = re.compile(r"^ready (https?://\S+)((?: \S+ \S+)*)\s*$", re.MULTILINE)
#: Seconds between SIGTERM and SIGKILL when stopping a process group. A product choice: the emulated worker and
#: the gateway stop in about a second (open connections get 2 s), SGLang in a few; ten seconds leaves room.
DEFAULT_GRACE_S = 10.0
#: Lines of a failed process's log quoted in the error (enough for a Python exception's last frame and message).
LOG_TAIL_LINES = 5
#: Bytes at the head of a log searched for the ready line (it is among a process's first lines) and the port-busy
#: text; the SSH launcher searches its mirror of a remote log the same way.
LOG_HEAD_BYTES = 65536
#: Bytes at the end of a log read for its last lines and the port-busy text (a few lines of any length).
LOG_TAIL_BYTES = 8192
#: Seconds an exited process's log writer is given to write its last lines before the log is read for the error
#: (it exits once the pipe is closed; a child of the process still holding the pipe keeps it open).
LOG_DRAIN_S = 1.0
#: Log text by which a process that could not bind its port is recognised (``strerror(EADDRINUSE)`` on Linux and
#: macOS, as the emulated worker and SGLang's uvicorn print it).
PORT_BUSY_TEXT = ("Address already in use", "address already in use")
#: The cause both launchers name when a worker's port is taken (:class:`~btbctl.engine.launcher.ssh.SshFailure`'s
#: ``cause`` tag; the local error's word).
PORT_BUSY = "port busy"
#: The address in asyncio's bind error, which uvicorn (SGLang) and aiohttp (the emulated worker) print:
#: ``error while attempting to bind on address ('127.0.0.1', 30000): address already in use`` (CPython's
#: ``BaseEventLoop.create_server``; an IPv6 address is a 4-tuple there).
BIND_ADDRESS = re.compile(r"bind on address \('([^']*)', (\d+)")


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


def parse_ready_line(text: str) -> tuple[str, dict[str, str]] | None:
    """The URL (without a trailing ``/``) and the ``key value`` words of the first :data:`READY_LINE` in ``text``, or
    None."""
    m = READY_LINE.search(text)
    if m is None:
        return None
    words = m.group(2).split()
    return m.group(1).rstrip("/"), dict(zip(words[0::2], words[1::2], strict=False))


def same_btbctl_env(argv: list[str], env: dict[str, str]) -> dict[str, str]:
    """``env`` for ``argv``, with, when it runs a btbctl module with this interpreter (``[sys.executable, "-m",
    "btbctl...", ...]``), what makes the child import the btbctl this process runs: this btbctl's directory first
    on ``PYTHONPATH`` and ``PYTHONSAFEPATH=1`` (Python 3.11+: the working directory is not put before it, so a
    checkout in the directory ``btbctl up`` runs from does not replace the installed, possibly compiled, build:
    README "Compiled core"). Other programs (SGLang, a worker's own ``python``) get ``env`` unchanged."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or argv[2].partition(".")[0] != "btbctl":
        return env
    root = str(Path(__file__).resolve().parents[3])  # the directory holding this btbctl package
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": root + (os.pathsep + path if path else ""), "PYTHONSAFEPATH": "1"}


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

    ``env`` adds to (and overrides) this process's environment; a btbctl module run by this interpreter imports the
    btbctl this process runs (:func:`same_btbctl_env`). Raises :class:`BtbctlError` when the program
    cannot be started (not found, not executable).
    """
    if not argv or not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise BtbctlError(f"{name}: the command must be a non-empty list of strings")
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    if env:
        full_env.update(env)
    full_env = same_btbctl_env(argv, full_env)
    log.parent.mkdir(parents=True, exist_ok=True)
    for old in log.parent.glob(log.name + ".*"):
        if old.name[len(log.name) + 1 :].isdigit():
            old.unlink(missing_ok=True)  # the rotated output of an earlier run
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)  # the file exists (readers wait on it) before either process starts
    r, w = os.pipe()
    writer_argv = [sys.executable, "-m", "btbctl.engine.launcher.logcap", str(log), str(max_bytes), str(backups)]
    try:
        writer = subprocess.Popen(
            writer_argv,
            env=same_btbctl_env(writer_argv, dict(os.environ)),
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


def log_head(path: Path) -> str:
    """The first :data:`LOG_HEAD_BYTES` of a log as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(LOG_HEAD_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def _read_tail(path: Path) -> str:
    """The last :data:`LOG_TAIL_BYTES` of a log as text, read from there (not the whole file); "" when unreadable."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_TAIL_BYTES))
            return f.read(LOG_TAIL_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of a log, joined with `` | `` (for one-line error messages)."""
    tail = [ln.strip() for ln in _read_tail(path).splitlines() if ln.strip()][-lines:]
    return " | ".join(tail)


def port_busy_line(path: Path, head: str | None = None) -> str | None:
    """The last line of a log's head or tail that holds :data:`PORT_BUSY_TEXT` (stripped), None when none does.

    Reads at most :data:`LOG_HEAD_BYTES` + :data:`LOG_TAIL_BYTES` (``head``: the head already read, by
    :func:`log_head`), so it is cheap enough to run on every poll of a starting process.
    """
    text = (log_head(path) if head is None else head) + "\n" + _read_tail(path)
    if not any(t in text for t in PORT_BUSY_TEXT):
        return None
    return [ln.strip() for ln in text.splitlines() if any(t in ln for t in PORT_BUSY_TEXT)][-1]


def port_busy(proc: Started, line: str, health_url: str | None = None) -> BtbctlError:
    """The error for ``proc`` whose log says (``line``) that a port it binds is taken: one line naming it, the
    address (from ``line`` when it names one, else ``health_url``'s) and its log."""
    m = BIND_ADDRESS.search(line)
    url = urlsplit(health_url) if health_url is not None else None
    if m is not None:
        where = hostport(m.group(1), int(m.group(2)))
    elif url is not None and url.port is not None:
        where = url.netloc
    else:
        where = "a port it binds"
    return BtbctlError(
        f"{proc.name}: {PORT_BUSY}: {where} is taken by another process, so it cannot listen (log {proc.log}): {line}"
    )


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
    ``GET <health_url>/health`` answers 2xx (then ``proc.url = health_url``). Each poll reads only the log's head
    and tail (:func:`port_busy_line`).

    Raises:
        BtbctlError: its log says a port it binds is taken (:func:`port_busy`, at once, whether it exited or stays
            up), the process exited first (status and the last log lines in the message), or ``timeout_s`` passed.
            A process still running is left so; the caller stops its group.
    """
    deadline = time.monotonic() + timeout_s
    last_health = 0.0
    while True:
        head = log_head(proc.log)
        ready = parse_ready_line(head)
        if ready is not None:
            proc.url, proc.extra = ready
            return proc
        rc = proc.popen.poll()  # before the log is searched, so an exit just after a busy line is told by that line
        if rc is not None:
            _drain(proc)
        busy = port_busy_line(proc.log, head)
        if busy is not None:
            raise port_busy(proc, busy, health_url)
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


def _drain(proc: Started) -> None:
    """Give an exited process's log writer up to :data:`LOG_DRAIN_S` to write what is still in the pipe."""
    if proc.writer is None:
        return
    try:
        proc.writer.wait(timeout=LOG_DRAIN_S)
    except subprocess.TimeoutExpired:
        pass


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
    "PORT_BUSY",
    "PORT_BUSY_TEXT",
    "READY_LINE",
    "Started",
    "health_ok",
    "log_head",
    "log_tail",
    "parse_ready_line",
    "port_busy",
    "port_busy_line",
    "same_btbctl_env",
    "spawn",
    "stop_group",
    "stop_groups",
    "stop_record",
    "stop_records",
    "wait_ready",
]
