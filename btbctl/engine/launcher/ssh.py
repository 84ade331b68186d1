"""Workers on other machines: start, watch and stop them over SSH (``asyncssh``, imported lazily).

How a worker runs on a host (everything below is a fixed POSIX ``sh`` script shipped with btbctl; the only strings
from the cluster file that reach the remote shell are its positional arguments, each quoted with
:func:`shlex.join`, so an argument like ``"; rm -rf ~"`` stays one literal argument):

* ``<workdir>/runs/<run id>/`` is created on the host; the gateway's worker token is written there (mode 0600,
  sent on stdin, never on a command line), and in replication mode ``l3`` the fleet secret and the agent control
  token too (same way), before the host's ``btbctl agent`` starts there (:mod:`~btbctl.engine.launcher.agents`;
  it is ready when its ready line is in its log and its control API answers ``/health`` from this machine);
* each worker is started as ``setsid sh -c '"$@"; echo $? > NAME.status' ... ARGV`` in the background with stdin
  from ``/dev/null`` and stdout+stderr appended to ``NAME.log``. ``setsid`` makes it lead a new session and process
  group whose id is the pid printed back; that pid and its start time (``/proc/PID/stat`` field 22, clock ticks
  since boot) are recorded, so ``down`` signals the group (``kill -TERM -PGID``, ``KILL`` after the grace period)
  only while the leader is still that process, or while members of its group remain;
* before launching, ``command -v ARGV0`` must succeed, else the start fails with "command not found" (exit 127);
* the local side polls each host over one SSH connection: exit status files, whether the group is alive, and the
  new bytes of every log, which are appended to ``<run dir>/logs/NAME.log`` (``btbctl logs NAME`` fetches the rest
  later). A worker is ready when it printed its ready line (emulated) or answers ``GET /health`` (others), and
  in both cases ``GET /health`` from this machine (where the gateway runs) answers 2xx.

Failures are :class:`SshFailure`, one line naming the host and the cause: ``connection refused``, ``unreachable``,
``unknown host key`` (with the ``ssh-keyscan`` command that adds it), ``host key mismatch``, ``authentication
failed``, ``command not found``, ``port busy``, ``exited at once``, ``health timeout``.

Host keys are always checked against the host's ``known_hosts`` file; authentication uses the SSH agent and key
files only (password and keyboard-interactive authentication are switched off, so nothing ever prompts).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.cluster import WorkerInstance, worker_argv
from btbctl.engine.launcher.hosts import HostSpec
from btbctl.engine.launcher.local import PORT_BUSY, health_ok, log_head, log_tail, parse_ready_line, port_busy_line
from btbctl.engine.launcher.rundir import ProcessRecord

#: Seconds between two polls of a host while waiting for its workers (one SSH round trip each).
POLL_INTERVAL_S = 0.2
#: Largest slice of one log fetched per poll, bytes (1 MiB keeps a poll short even behind a chatty worker).
LOG_CHUNK_BYTES = 1 << 20
#: Exit status POSIX shells give for a command that was not found.
EXIT_NOT_FOUND = 127
#: Exit status of the launch script when the working directory cannot be created or entered.
EXIT_NO_WORKDIR = 125

# Positional arguments: DIR NAME NENV ENV... ARGV...
LAUNCH_SCRIPT = r"""
d=$1; n=$2; k=$3; shift 3
mkdir -p -- "$d" && cd -- "$d" || { printf 'cannot create or enter working directory %s\n' "$d"; exit 125; }
while [ "$k" -gt 0 ]; do export "$1" || exit 125; shift; k=$((k - 1)); done
command -v setsid >/dev/null 2>&1 || { printf 'command not found: setsid\n'; exit 127; }
command -v -- "$1" >/dev/null 2>&1 || { printf 'command not found: %s\n' "$1"; exit 127; }
rm -f -- "$n.status"
: > "$n.log"
setsid sh -c 'n=$1; shift; "$@"; echo "$?" > "$n.status"' btbctl-worker "$n" "$@" </dev/null >>"$n.log" 2>&1 &
p=$!
s=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f20)
printf 'started %s %s\n' "$p" "${s:--}"
"""

# Positional arguments: DIR, then NAME OFFSET PGID triples. Per worker: one header line
# "NAME STATE FROM TO" (STATE: alive, gone or exit:STATUS) followed by bytes FROM..TO of NAME.log.
POLL_SCRIPT = r"""
cd -- "$1" 2>/dev/null || exit 125; shift
while [ $# -ge 3 ]; do
  n=$1; o=$2; p=$3; shift 3
  st=alive
  if [ -s "$n.status" ]; then st="exit:$(head -c 16 -- "$n.status" | tr -dc 0-9)"
  elif ! kill -0 -"$p" 2>/dev/null; then st=gone; fi
  sz=$(wc -c < "$n.log" 2>/dev/null) || sz=0
  [ "$sz" -gt "$o" ] 2>/dev/null || sz=$o
  [ $((sz - o)) -gt LOGCHUNK ] && sz=$((o + LOGCHUNK))
  printf '%s %s %s %s\n' "$n" "$st" "$o" "$sz"
  if [ "$sz" -gt "$o" ]; then tail -c +$((o + 1)) -- "$n.log" | head -c $((sz - o)); fi
done
exit 0
""".replace("LOGCHUNK", str(LOG_CHUNK_BYTES))

# Positional arguments: GRACE_TENTHS, then PGID START pairs. Prints "stopped|killed|gone PGID" per pair.
STOP_SCRIPT = r"""
g=$1; shift
ours=""
while [ $# -ge 2 ]; do
  p=$1; s=$2; shift 2
  c=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | cut -d' ' -f20)
  if [ -n "$c" ] && [ "$c" = "$s" ]; then ours="$ours $p"
  elif [ -z "$c" ] && kill -0 -"$p" 2>/dev/null; then ours="$ours $p"
  else printf 'gone %s\n' "$p"; fi
done
for p in $ours; do kill -TERM -"$p" 2>/dev/null; done
i=0; left=$ours
while [ -n "$left" ] && [ "$i" -lt "$g" ]; do
  sleep 0.1; i=$((i + 1)); still=""
  for p in $left; do kill -0 -"$p" 2>/dev/null && still="$still $p"; done
  left=$still
done
for p in $ours; do
  case " $left " in
    *" $p "*) kill -KILL -"$p" 2>/dev/null; printf 'killed %s\n' "$p" ;;
    *) printf 'stopped %s\n' "$p" ;;
  esac
done
exit 0
"""

# Positional arguments: DIR. Token on stdin.
TOKEN_SCRIPT = r"""
umask 077
mkdir -p -- "$1" && cat > "$1/worker.token" && chmod 600 -- "$1/worker.token"
"""

# Positional arguments: DIR NAME (a fixed file name of btbctl's). Content on stdin.
SECRET_SCRIPT = r"""
umask 077
mkdir -p -- "$1" && cat > "$1/$2" && chmod 600 -- "$1/$2"
"""


class SshFailure(BtbctlError):
    """Something failed on one host. ``str()`` is one line: ``host NAME (ADDRESS:PORT): CAUSE: DETAIL``.

    Attributes:
        host: the host's name.
        cause: a short tag: ``connection refused``, ``unreachable``, ``unknown host key``, ``host key mismatch``,
            ``authentication failed``, ``ssh error``, ``command not found``, ``port busy``, ``exited at once``,
            ``health timeout``, ``start timeout``, ``cannot prepare``.
        detail: what was seen (a log line, the command that fixes it).
    """

    def __init__(self, host: HostSpec, cause: str, detail: str = "", worker: str | None = None) -> None:
        self.host = host.name
        self.cause = cause
        self.detail = detail
        self.worker = worker
        where = f"host {host.name} ({host.address}:{host.port})" + (f": {worker}" if worker else "")
        super().__init__(f"{where}: {cause}" + (f": {detail}" if detail else ""))


# ----------------------------------------------------------------------------------------------------------------
# connections


def _keyscan_hint(host: HostSpec, known_hosts: str) -> str:
    port = f"-p {host.port} " if host.port != 22 else ""
    return f"ssh-keyscan {port}{host.address} >> {shlex.quote(known_hosts)}"


def _host_known(host: HostSpec, known_hosts: str) -> bool:
    """Whether ``known_hosts`` lists any key for the host (to tell an unknown host from a changed key)."""
    import asyncssh

    try:
        kh = asyncssh.read_known_hosts(known_hosts)
    except (OSError, ValueError, asyncssh.KeyImportError):
        return False
    return any(len(part) for part in kh.match(host.address, host.address, host.port)[:2])


async def connect(host: HostSpec):
    """Open an authenticated SSH connection to ``host`` (asyncssh ``SSHClientConnection``).

    Raises:
        SshFailure: ``connection refused``, ``unreachable`` (no answer within ``connect_timeout_s`` or no route),
            ``unknown host key`` (naming the ``ssh-keyscan`` command that adds it), ``host key mismatch``,
            ``authentication failed`` or ``ssh error``.
    """
    import asyncssh

    ident, known_hosts = host.key_paths()
    if not os.path.exists(known_hosts):
        raise SshFailure(
            host,
            "unknown host key",
            f"{known_hosts} does not exist; add the host's key with: {_keyscan_hint(host, known_hosts)}",
        )
    if ident is not None and not os.path.exists(ident):
        raise SshFailure(host, "authentication failed", f"identity file {ident} does not exist")
    try:
        return await asyncio.wait_for(
            asyncssh.connect(
                host.address,
                host.port,
                username=host.login,
                known_hosts=known_hosts,
                client_keys=[ident] if ident else (),
                agent_path=() if ident is None else None,
                password=None,
                password_auth=False,
                kbdint_auth=False,
                gss_auth=False,
                preferred_auth="publickey",
                config=None,
                login_timeout=host.connect_timeout_s,
            ),
            timeout=host.connect_timeout_s,
        )
    except ConnectionRefusedError:
        raise SshFailure(host, "connection refused", "nothing listens on that port (is sshd running?)") from None
    except asyncio.TimeoutError:
        raise SshFailure(host, "unreachable", f"no answer within {host.connect_timeout_s:g} s") from None
    except asyncssh.HostKeyNotVerifiable:
        if _host_known(host, known_hosts):
            raise SshFailure(
                host,
                "host key mismatch",
                f"the key the host offered is not the one in {known_hosts} (if the host was "
                f"reinstalled, check it and replace its line)",
            ) from None
        raise SshFailure(
            host,
            "unknown host key",
            f"{host.address} is not in {known_hosts}; add its key with: {_keyscan_hint(host, known_hosts)}",
        ) from None
    except asyncssh.PermissionDenied:
        how = f"key {ident}" if ident else "the SSH agent and default keys"
        raise SshFailure(host, "authentication failed", f"user {host.login} with {how}") from None
    except asyncssh.Error as e:
        raise SshFailure(host, "ssh error", str(e.reason) if getattr(e, "reason", None) else str(e)) from None
    except OSError as e:
        raise SshFailure(host, "unreachable", e.strerror or str(e)) from None


async def run_script(
    conn, script: str, args: list[str], *, stdin: bytes | None = None, timeout_s: float = 30.0
) -> tuple[int, bytes]:
    """Run a fixed ``sh`` script with quoted positional arguments; return ``(exit status, stdout+stderr bytes)``."""
    cmd = shlex.join(["sh", "-c", script, "btbctl", *args])
    res = await asyncio.wait_for(
        conn.run(cmd, input=stdin, encoding=None, check=False, stderr=_stderr_to_stdout()), timeout=timeout_s
    )
    out = res.stdout or b""
    return (res.exit_status if res.exit_status is not None else 255), out


def _stderr_to_stdout():
    import asyncssh

    return asyncssh.STDOUT


class SshPool:
    """A background event loop holding one SSH connection per host, for synchronous callers.

    ``call(coro)`` runs a coroutine on the loop and returns its result; :meth:`conn` (a coroutine) connects on
    first use. :meth:`close` closes every connection and stops the loop thread.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="btbctl-ssh", daemon=True)
        self._thread.start()
        self._conns: dict[str, Any] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def call(self, coro: Coroutine, timeout_s: float | None = None):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout_s)
        except BaseException:
            fut.cancel()
            raise

    async def conn(self, host: HostSpec):
        key = f"{host.login}@{host.address}:{host.port}"
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            c = self._conns.get(key)
            if c is not None and not c.is_closed():
                return c
            c = await connect(host)
            self._conns[key] = c
            return c

    def close(self) -> None:
        async def _close():
            for c in self._conns.values():
                c.close()
            for c in self._conns.values():
                try:
                    await asyncio.wait_for(c.wait_closed(), 2.0)
                except (asyncio.TimeoutError, OSError):
                    pass
            self._conns.clear()

        if self._loop.is_closed():
            return
        try:
            self.call(_close(), 5.0)
        except Exception:  # noqa: BLE001 - closing is best effort
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()

    def __enter__(self) -> SshPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# starting


@dataclass
class RemoteWorker:
    """A worker started on a host.

    Attributes:
        name: the worker's name.
        inst: its cluster-file instance (None when rebuilt from ``state.json``).
        host: its host.
        argv: the command it runs there (the host's ``command_prefix`` included).
        remote_dir: its run folder on the host (relative to the remote home unless absolute).
        log: the local mirror of its log.
        pid: pid of the group leader on the host (= process group id).
        start_time: the leader's start time there (``/proc/PID/stat`` field 22), ``-`` if unreadable.
        started_at: Unix time of the launch.
        offset: bytes of the remote log mirrored so far.
        state: last polled state: ``alive``, ``gone`` or ``exit:STATUS``.
        url / extra: base URL and ready-line fields once ready.
    """

    name: str
    inst: WorkerInstance | None
    host: HostSpec
    argv: list[str]
    remote_dir: str
    log: Path
    pid: int = 0
    start_time: str = "-"
    started_at: float = 0.0
    offset: int = 0
    state: str = "alive"
    url: str | None = None
    extra: dict = field(default_factory=dict)
    role: str = "worker"

    def record(self) -> ProcessRecord:
        """This worker (or node agent, ``role`` ``agent``) as a ``state.json`` record (``host`` set;
        ``extra["ssh"]`` holds what ``down`` needs to reach the host again)."""
        if self.role == "agent":
            kind = "agent"
        else:
            assert self.inst is not None
            kind = "command" if self.inst.spec.command is not None else self.inst.spec.kind
        extra = dict(self.extra)
        extra["ssh"] = host_record(self.host)
        extra["remote_dir"] = self.remote_dir
        return ProcessRecord(
            name=self.name,
            role=self.role,
            kind=kind,
            pid=self.pid,
            pgid=self.pid,
            start_time=self.start_time,
            argv=list(self.argv),
            log=str(self.log),
            url=self.url,
            extra=extra,
            started_at=self.started_at,
            host=self.host.name,
        )


@dataclass
class AgentLaunch:
    """A host's node agent to start before its workers (replication mode ``l3``).

    Attributes:
        name: ``agent-<host>``.
        argv: its command line (secrets are files in the run folder there, named in ``files``).
        files: ``(file name, content)`` written into the run folder (mode 0600) over stdin before it starts.
        l3_args: the HiCache flags of each of the host's workers, given the worker and the URL the gateway will
            know it by (its store names that URL to the agent, which announces it).
        env: extra environment of the agent.
        ready_timeout_s: how long to wait for it.
    """

    name: str
    argv: list[str]
    files: list[tuple[str, str]]
    l3_args: Callable[[WorkerInstance, str], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 30.0


def host_record(host: HostSpec) -> dict:
    """The fields of ``host`` that ``down``, ``logs`` and ``status`` need, for ``state.json``."""
    return host.model_dump(
        include={"name", "address", "port", "user", "identity_file", "known_hosts", "connect_timeout_s"}
    )


def host_from_record(rec: ProcessRecord) -> HostSpec:
    """The :class:`HostSpec` stored in a remote worker's record. Raises :class:`BtbctlError` when it is missing."""
    data = (rec.extra or {}).get("ssh")
    if not isinstance(data, dict):
        raise BtbctlError(f"{rec.name}: the run state does not say how to reach host {rec.host}")
    from btbctl.engine.config import validate

    return validate(HostSpec, data, None, f"state.{rec.name}.ssh")


def remote_argv(
    inst: WorkerInstance,
    host: HostSpec,
    port: int,
    transfer_port: int,
    token_file: str,
    l3: list[str] | None = None,
) -> list[str]:
    """The argv of ``inst`` on ``host``: the worker binds to the host's ``bind_address``, ``python -m ...`` uses
    the worker's ``python`` or the host's, and the host's ``command_prefix`` comes first (``l3``: HiCache flags)."""
    spec = inst.spec.model_copy(update={"host": host.bind_address, "python": inst.spec.python or host.python})
    local = replace(inst, spec=spec)
    return list(host.command_prefix) + worker_argv(local, port, transfer_port, token_file=token_file, l3=l3)


def expects_ready_line(inst: WorkerInstance) -> bool:
    """Emulated workers print a ready line; SGLang and command workers are recognised by ``/health``."""
    return inst.spec.kind == "emulated" and inst.spec.command is None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _pick_port(conn, host: HostSpec, python: str, timeout_s: float) -> int:
    code = (
        "import socket,sys\n"
        "s=socket.socket(socket.AF_INET6 if ':' in sys.argv[1] else socket.AF_INET)\n"
        "s.bind((sys.argv[1],0));print(s.getsockname()[1])"
    )
    rc, out = await run_script(conn, '"$@"', [python, "-c", code, host.bind_address], timeout_s=timeout_s)
    text = out.decode("utf-8", "replace").strip()
    if rc == EXIT_NOT_FOUND:
        raise SshFailure(host, "command not found", f"{python} (needed to pick a free port; set workers.N.port)")
    if rc != 0 or not text.isdigit():
        raise SshFailure(host, "cannot prepare", f"picking a free port failed: {text.splitlines()[-1:] or rc}")
    return int(text)


async def launch(conn, w: RemoteWorker, env: dict[str, str], timeout_s: float) -> None:
    """Start ``w`` on its host (see the module docstring); fill in ``pid``, ``start_time`` and ``started_at``.

    Raises:
        SshFailure: ``command not found`` (the program, or ``setsid``, is not on the remote PATH),
            ``cannot prepare`` (the working directory) or ``ssh error``.
    """
    envs = [f"{k}={v}" for k, v in env.items()]
    w.log.parent.mkdir(parents=True, exist_ok=True)
    w.log.write_bytes(b"")
    rc, out = await run_script(
        conn, LAUNCH_SCRIPT, [w.remote_dir, w.name, str(len(envs)), *envs, *w.argv], timeout_s=timeout_s
    )
    text = out.decode("utf-8", "replace").strip()
    if rc == EXIT_NOT_FOUND:
        what = text.splitlines()[-1] if text else w.argv[0]
        what = what[len("command not found: ") :] if what.startswith("command not found: ") else what
        raise SshFailure(w.host, "command not found", what, worker=w.name)
    m = re.search(r"^started (\d+) (\S+)$", text, re.MULTILINE)
    if rc != 0 or m is None:
        raise SshFailure(
            w.host, "cannot prepare", (text.splitlines() or [f"launch exited with status {rc}"])[-1], worker=w.name
        )
    w.pid = int(m.group(1))
    w.start_time = m.group(2)
    w.started_at = time.time()


async def poll(conn, host: HostSpec, remote_dir: str, workers: list[RemoteWorker], timeout_s: float = 30.0) -> None:
    """One round trip: update each worker's ``state`` and append its new log bytes to its local mirror."""
    args = [remote_dir]
    for w in workers:
        args += [w.name, str(w.offset), str(w.pid)]
    rc, out = await run_script(conn, POLL_SCRIPT, args, timeout_s=timeout_s)
    if rc != 0:
        raise SshFailure(host, "ssh error", f"cannot read the run folder {remote_dir} (status {rc})")
    by_name = {w.name: w for w in workers}
    pos = 0
    while pos < len(out):
        nl = out.find(b"\n", pos)
        if nl < 0:
            break
        parts = out[pos:nl].decode("utf-8", "replace").split()
        pos = nl + 1
        if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
            break
        name, state, start, end = parts[0], parts[1], int(parts[2]), int(parts[3])
        chunk = out[pos : pos + (end - start)]
        pos += end - start
        w = by_name.get(name)
        if w is None:
            continue
        w.state = state
        if chunk and start == w.offset:
            with open(w.log, "ab") as f:
                f.write(chunk)
            w.offset += len(chunk)


def _classify_exit(w: RemoteWorker) -> SshFailure:
    """Why ``w`` failed to start: its port is taken (its log says so; it may still be up), else how it exited."""
    state = w.state
    last = log_tail(w.log, 1)
    busy = port_busy_line(w.log)
    if busy is not None:
        return SshFailure(w.host, PORT_BUSY, busy, worker=w.name)
    if state.startswith("exit:"):
        status = state[5:] or "?"
        if status == str(EXIT_NOT_FOUND):
            return SshFailure(w.host, "command not found", last or w.argv[0], worker=w.name)
        return SshFailure(w.host, "exited at once", f"status {status}" + (f": {last}" if last else ""), worker=w.name)
    return SshFailure(w.host, "exited at once", "killed by a signal" + (f": {last}" if last else ""), worker=w.name)


async def wait_ready(
    conn, host: HostSpec, remote_dir: str, workers: list[RemoteWorker], should_stop: Callable[[], bool] | None = None
) -> None:
    """Poll until every worker in ``workers`` is ready and answers ``GET /health`` from this machine.

    Raises:
        SshFailure: a worker exited (``port busy``, ``command not found`` or ``exited at once``, with its last log
            line), logged that its port is taken (``port busy``, also while it stays up: SGLang's process outlives
            its HTTP server's bind error), or did not answer within its ``ready_timeout_s`` (``health timeout``).
        KeyboardInterrupt: ``should_stop()`` turned true.
    """
    t0 = time.monotonic()
    pending = list(workers)
    while pending:
        await poll(conn, host, remote_dir, workers)
        for w in list(pending):
            head = log_head(w.log)  # read once per poll: the busy line and the ready line are searched in it
            if w.state != "alive" or port_busy_line(w.log, head) is not None:
                raise _classify_exit(w)
            url = None
            if w.inst is not None and expects_ready_line(w.inst):
                ready = parse_ready_line(head)
                if ready is not None:
                    url, w.extra = ready
            else:
                url = w.extra.get("health_url")
            if url is not None and await asyncio.to_thread(health_ok, url):
                w.url = url
                w.extra.pop("health_url", None)
                pending.remove(w)
                continue
            limit = w.inst.spec.effective_ready_timeout_s if w.inst is not None else 60.0
            if time.monotonic() - t0 > limit:
                if url and w.inst is not None and expects_ready_line(w.inst):
                    seen = f"{url} printed its ready line but GET {url}/health from here fails"
                else:
                    seen = f"no answer on GET {url or 'its URL'}/health within {limit:g} s"
                last = log_tail(w.log, 1)
                raise SshFailure(
                    host, "health timeout", seen + (f" (last log line: {last})" if last else ""), worker=w.name
                )
        if should_stop is not None and should_stop():
            raise KeyboardInterrupt
        if pending:
            await asyncio.sleep(POLL_INTERVAL_S)


async def wait_agent(conn, host: HostSpec, remote_dir: str, w: RemoteWorker, timeout_s: float) -> None:
    """Poll until the agent ``w`` printed its ready line and its control API answers ``/health`` from this
    machine; fill ``w.url`` (its control URL) and ``w.extra`` (``peer``, ``control``, ``socket``).

    Raises:
        SshFailure: it exited (``port busy``, ``command not found``, ``exited at once``), logged that its port is
            taken (``port busy``, also while it stays up) or ``health timeout``.
    """
    from btbctl.engine.launcher.agents import control_url, parse_ready

    t0 = time.monotonic()
    while True:
        await poll(conn, host, remote_dir, [w])
        head = log_head(w.log)
        if w.state != "alive" or port_busy_line(w.log, head) is not None:
            raise _classify_exit(w)
        info = parse_ready(head)
        if info is not None:
            url = control_url(info["control"], host.bind_address)
            if await asyncio.to_thread(health_ok, url):
                w.url = url
                w.extra = dict(info, control_url=url)
                return
        if time.monotonic() - t0 > timeout_s:
            last = log_tail(w.log, 1)
            seen = "no ready line" if info is None else f"GET {control_url(info['control'])}/health from here fails"
            raise SshFailure(
                host,
                "health timeout",
                f"{seen} within {timeout_s:g} s" + (f" (last log line: {last})" if last else ""),
                worker=w.name,
            )
        await asyncio.sleep(POLL_INTERVAL_S)


async def _launch_recorded(
    conn,
    w: RemoteWorker,
    env: dict[str, str],
    timeout_s: float,
    workers: list[RemoteWorker],
    on_started: Callable[[RemoteWorker], None],
) -> None:
    """:func:`launch`, then record ``w``, as one step that a cancellation (another host failed) waits for: a
    launch already sent to the host finishes and is recorded, so it can be stopped with the rest."""

    async def _step() -> None:
        await launch(conn, w, env, timeout_s)
        workers.append(w)
        on_started(w)

    task = asyncio.ensure_future(_step())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except BaseException:  # noqa: BLE001 - the cancellation below is what matters
            pass
        raise


async def start_host(
    pool: SshPool,
    host: HostSpec,
    instances: list[WorkerInstance],
    *,
    run_id: str,
    logs_dir: Path,
    token: str,
    on_started: Callable[[RemoteWorker], None],
    should_stop: Callable[[], bool] | None = None,
    agent: AgentLaunch | None = None,
) -> list[RemoteWorker]:
    """Connect to ``host``, start its node agent (``agent``, replication mode ``l3``) and wait until it is ready,
    then start its workers and wait until they are ready (the whole start bounded by ``host.start_timeout_s``;
    waiting for readiness by each worker's ``ready_timeout_s``).

    ``on_started`` is called for each worker (and the agent) right after it was launched (before it is ready), so
    the caller can record it and stop it if anything later fails; the agent, once ready, is the first element of
    the list returned. Raises :class:`SshFailure` (see :func:`connect`, :func:`launch`, :func:`wait_ready`,
    :func:`wait_agent`).
    """
    remote_dir = f"{host.workdir.rstrip('/')}/runs/{run_id}"
    workers: list[RemoteWorker] = []
    agents: list[RemoteWorker] = []

    async def _start() -> None:
        conn = await pool.conn(host)
        rc, out = await run_script(
            conn, TOKEN_SCRIPT, [remote_dir], stdin=(token + "\n").encode(), timeout_s=host.start_timeout_s
        )
        if rc != 0:
            text = out.decode("utf-8", "replace").strip().splitlines()
            raise SshFailure(host, "cannot prepare", text[-1] if text else f"cannot create {remote_dir}")
        if agent is not None:
            for fname, content in agent.files:
                rc, out = await run_script(
                    conn, SECRET_SCRIPT, [remote_dir, fname], stdin=content.encode(), timeout_s=host.start_timeout_s
                )
                if rc != 0:
                    text = out.decode("utf-8", "replace").strip().splitlines()
                    raise SshFailure(host, "cannot prepare", text[-1] if text else f"cannot write {fname}")
            aw = RemoteWorker(
                name=agent.name,
                inst=None,
                host=host,
                argv=list(agent.argv),
                remote_dir=remote_dir,
                log=logs_dir / f"{agent.name}.log",
                role="agent",
            )
            env = dict(host.env)
            env.update(agent.env)
            env["PYTHONUNBUFFERED"] = "1"
            await _launch_recorded(conn, aw, env, host.start_timeout_s, agents, on_started)
            await wait_agent(conn, host, remote_dir, aw, agent.ready_timeout_s)
        for inst in instances:
            py = inst.spec.python or host.python
            port = inst.port
            if not port and (agent is not None or not expects_ready_line(inst)):
                # (l3: the port is fixed now, for the URL the worker's store names to the agent)
                port = await _pick_port(conn, host, py, host.start_timeout_s)
            l3 = agent.l3_args(inst, _url(host.bind_address, port)) if agent is not None else None
            argv = remote_argv(inst, host, port, inst.transfer_port, "worker.token", l3=l3)
            w = RemoteWorker(
                name=inst.name,
                inst=inst,
                host=host,
                argv=argv,
                remote_dir=remote_dir,
                log=logs_dir / f"{inst.name}.log",
            )
            if not expects_ready_line(inst):
                w.extra["health_url"] = _url(host.bind_address, port)
            env = dict(host.env)
            env.update(inst.env())
            env["PYTHONUNBUFFERED"] = "1"
            await _launch_recorded(conn, w, env, host.start_timeout_s, workers, on_started)

    try:
        await asyncio.wait_for(_start(), timeout=host.start_timeout_s)
    except asyncio.TimeoutError:
        raise SshFailure(
            host, "start timeout", f"connecting and launching took longer than {host.start_timeout_s:g} s"
        ) from None
    conn = await pool.conn(host)
    await wait_ready(conn, host, remote_dir, workers, should_stop=should_stop)
    return agents + workers


def start_all(
    pool: SshPool,
    plan: list[tuple[HostSpec, list[WorkerInstance]]],
    *,
    run_id: str,
    logs_dir: Path,
    token: str,
    on_started: Callable[[RemoteWorker], None],
    should_stop: Callable[[], bool] | None = None,
    agents: dict[str, AgentLaunch] | None = None,
) -> list[RemoteWorker]:
    """:func:`start_host` for every host in parallel (``agents``: the node agent of each host by name, l3 mode).
    Returns every worker (and agent), ready, in plan order.

    On the first failure the other hosts' starts are cancelled and that failure is raised (workers already
    launched were reported through ``on_started``; stopping them is the caller's job, see :func:`stop_records`).
    Failures of several hosts that happened together are joined into one line with ``; ``.
    """
    lock = threading.Lock()

    def _started(w: RemoteWorker) -> None:
        with lock:
            on_started(w)

    async def _all() -> list[list[RemoteWorker]]:
        tasks = [
            asyncio.ensure_future(
                start_host(
                    pool,
                    h,
                    insts,
                    run_id=run_id,
                    logs_dir=logs_dir,
                    token=token,
                    on_started=_started,
                    should_stop=should_stop,
                    agent=(agents or {}).get(h.name),
                )
            )
            for h, insts in plan
        ]
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        errors = [t.exception() for t in tasks if t in done and t.exception() is not None]
        if errors:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            kb = [e for e in errors if isinstance(e, KeyboardInterrupt)]
            if kb:
                raise KeyboardInterrupt
            ssh = [e for e in errors if isinstance(e, BtbctlError)]
            if not ssh:
                raise errors[0]
            if len(ssh) == 1:
                raise ssh[0]
            raise BtbctlError("; ".join(str(e) for e in ssh))
        return [t.result() for t in tasks]

    results = pool.call(_all())
    return [w for ws in results for w in ws]


# ----------------------------------------------------------------------------------------------------------------
# stopping, watching, logs


def _by_host(recs: list[ProcessRecord]) -> dict[str, tuple[HostSpec, list[ProcessRecord]]]:
    out: dict[str, tuple[HostSpec, list[ProcessRecord]]] = {}
    for rec in recs:
        host = host_from_record(rec)
        out.setdefault(f"{host.name}", (host, []))[1].append(rec)
    return out


def stop_records(pool: SshPool, recs: list[ProcessRecord], grace_s: float) -> list[tuple[str, str]]:
    """Stop remote workers by process group (``TERM``, then ``KILL`` after ``grace_s``), every host in parallel,
    only where the group is still the one ``up`` started (leader's start time, or members left).

    Returns ``(result, reason)`` per record in order: result ``stopped``, ``killed``, ``gone`` or ``unreachable``
    (``reason`` then says why, one line naming the host and cause; else "").
    """
    groups = _by_host(recs)
    tenths = max(1, int(round(grace_s * 10)))

    async def _host(host: HostSpec, hrecs: list[ProcessRecord]) -> dict[int, tuple[str, str]]:
        try:
            conn = await pool.conn(host)
            args = [str(tenths)]
            for r in hrecs:
                args += [str(r.pgid), r.start_time or "-"]
            rc, out = await run_script(conn, STOP_SCRIPT, args, timeout_s=grace_s + 30.0)
        except SshFailure as e:
            return {r.pgid: ("unreachable", str(e)) for r in hrecs}
        except (asyncio.TimeoutError, OSError) as e:
            return {r.pgid: ("unreachable", str(SshFailure(host, "ssh error", str(e) or "timed out"))) for r in hrecs}
        res: dict[int, tuple[str, str]] = {}
        for line in out.decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit() and parts[0] in ("stopped", "killed", "gone"):
                res[int(parts[1])] = (parts[0], "")
        return res

    async def _all():
        return await asyncio.gather(*[_host(h, rs) for h, rs in groups.values()])

    merged: dict[tuple[str, int], tuple[str, str]] = {}
    for (hname, _), res in zip(groups.items(), pool.call(_all()), strict=True):
        for pgid, v in res.items():
            merged[(hname, pgid)] = v
    out = []
    for r in recs:
        out.append(merged.get((r.host or "", r.pgid), ("unreachable", f"host {r.host}: no answer about pid {r.pgid}")))
    return out


def poll_records(pool: SshPool, recs: list[ProcessRecord], offsets: dict[str, int] | None = None) -> dict[str, dict]:
    """Poll remote workers (every host in parallel): append new log bytes to each record's local log and report
    ``{name: {"state": alive|gone|exit:N|unreachable, "error": str|None}}``. ``offsets`` (name -> bytes already
    mirrored) defaults to each local log's size, so repeated calls append only what is new."""
    groups = _by_host(recs)

    async def _host(host: HostSpec, hrecs: list[ProcessRecord]) -> dict[str, dict]:
        ws = []
        for r in hrecs:
            log = Path(r.log)
            off = offsets.get(r.name) if offsets and r.name in offsets else (log.stat().st_size if log.exists() else 0)
            ws.append(
                RemoteWorker(
                    name=r.name,
                    inst=None,
                    host=host,
                    argv=r.argv,
                    remote_dir=str(r.extra.get("remote_dir")),
                    log=log,
                    pid=r.pgid,
                    start_time=r.start_time,
                    offset=off,
                )
            )
        try:
            conn = await pool.conn(host)
            dirs = {w.remote_dir for w in ws}
            for d in dirs:
                await poll(conn, host, d, [w for w in ws if w.remote_dir == d])
        except (SshFailure, asyncio.TimeoutError, OSError) as e:
            return {r.name: {"state": "unreachable", "error": str(e)} for r in hrecs}
        if offsets is not None:
            for w in ws:
                offsets[w.name] = w.offset
        return {w.name: {"state": w.state, "error": None} for w in ws}

    async def _all():
        return await asyncio.gather(*[_host(h, rs) for h, rs in groups.values()])

    out: dict[str, dict] = {}
    for res in pool.call(_all()):
        out.update(res)
    return out


__all__ = [
    "AgentLaunch",
    "LAUNCH_SCRIPT",
    "POLL_SCRIPT",
    "RemoteWorker",
    "SECRET_SCRIPT",
    "STOP_SCRIPT",
    "SshFailure",
    "SshPool",
    "connect",
    "expects_ready_line",
    "host_from_record",
    "host_record",
    "launch",
    "poll",
    "poll_records",
    "remote_argv",
    "run_script",
    "start_all",
    "start_host",
    "stop_records",
    "wait_agent",
    "wait_ready",
]
