"""The run directory: what ``btbctl up`` started, so that ``down``, ``status``, ``bench``, ``tune``, ``replicate``
and the dashboard find the running fleet.

Layout (the directory is created with mode 0700; every file in it is 0600)::

    <run dir>/state.json      the fleet: urls, and per process pid, process group, start time, argv, log file
    <run dir>/control.token   bearer token for the control API's writes (``secrets.token_urlsafe(32)``)
    <run dir>/worker.token    token the gateway presents to the workers' BTB routes
    <run dir>/agent.secret    fleet secret of the node agents (replication mode l3): stays on this machine (the
                              gateway derives each agent's control token from it); each agent gets its node
                              credentials and control token derived from it
    <run dir>/<agent>.keys    the node credentials of an agent on this machine (``agent-local.keys``)
    <run dir>/<agent>.token   the bearer token of that agent's control API (``agent-local.token``)
    <run dir>/agent.sock      the local node agent's socket (l3; elsewhere when this path is too long)
    <run dir>/tuned.json      the constants and policy of the last confirmed control-API write, whoever made it
                              (``btbctl tune``, the dashboard, a raw ``PUT /control/constants``); the gateway
                              writes it; kept by ``down``; reapplied by ``up --gateway-only``, and by ``up`` with
                              the same cluster file
    <run dir>/.lock           held (``flock``, exclusive) by the ``up``, ``down``, ``restart`` working on the fleet
                              (:meth:`RunDir.locked`): a second one waits for nothing and says so
    <run dir>/logs/<name>.log stdout + stderr of each worker and agent
    <run dir>/logs/gateway.log the gateway's log: one logfmt line per event (the operations log), rotated at
                              10 MiB (gateway.log.1 ... .5); kept by ``down``
    <run dir>/logs/gateway.out.log the gateway's own output (its ready line; a crash's traceback)
    <run dir>/logs.previous/  the logs of the run before: ``up`` moves ``logs`` here (one generation is kept;
                              ``btbctl logs --previous`` reads them)

The default run directory is ``platformdirs.user_state_dir("btbctl")/runs/default`` (for example
``~/.local/state/btbctl/runs/default`` on Linux). Several fleets run side by side under names, as compose projects
do: ``--fleet NAME`` or ``BTBCTL_FLEET=NAME`` uses ``runs/NAME``; ``--run-dir DIR`` or ``BTBCTL_RUN_DIR=DIR`` names
the directory itself (see :func:`default_run_dir` for the order).

A process recorded in ``state.json`` is only ever signalled after checking it is still the same process: its pid must
exist, not be a zombie, and have the start time recorded when it was launched (``/proc/<pid>/stat`` field 22, clock
ticks since boot, on Linux; ``ps -o lstart=`` elsewhere). A pid that is gone or now belongs to another program is
left alone, so a stale ``state.json`` after a reboot is harmless.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from btbctl.engine.control.tuned import TUNED_FILE, load_tuned, save_tuned
from btbctl.engine.errors import BtbctlError
from btbctl.engine.fileio import RECORD_LIMIT_BYTES, ReadRefused, read_bounded, read_text_bounded, write_atomic

#: Version of the ``state.json`` layout; bumped on incompatible changes.
STATE_VERSION = 1
#: Name of the run under the state directory when ``--run-dir`` is not given.
DEFAULT_RUN_NAME = "default"
#: Folder, inside the run directory, holding the logs of the run before the last ``up``.
PREVIOUS_LOGS = "logs.previous"
#: Name of the lock file inside the run directory (:meth:`RunDir.locked`).
LOCK_FILE = ".lock"
#: Run directories this process holds the lock of, with how deep (``restart`` of the gateway runs
#: ``up --gateway-only`` inside its own hold).
_held_locks: dict[str, int] = {}
#: Bytes of randomness in each token (``secrets.token_urlsafe(32)``: 256 bits, 43 characters).
TOKEN_BYTES = 32


#: What a fleet name may be (``--fleet NAME`` / ``BTBCTL_FLEET``): it names a folder under :func:`runs_root`.
FLEET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
#: The fleet named on the command line (``--fleet``), set by :func:`select_fleet`; wins over the environment.
_selected_fleet: str | None = None


def check_fleet_name(name: str, where: str = "--fleet") -> str:
    """``name`` when it is a valid fleet name. Raises :class:`BtbctlError` naming ``where`` and what is valid."""
    if not FLEET_NAME.fullmatch(name):
        raise BtbctlError(
            f"{where}: {name[:80]!r} is not a fleet name; valid: 1-63 letters, digits, '-' or '_', starting with a "
            "letter or digit"
        )
    return name


def select_fleet(name: str | None) -> None:
    """Make ``name`` the fleet every :class:`RunDir` without a path refers to (``--fleet NAME``); None: none
    chosen on the command line. Raises :class:`BtbctlError` for an invalid name."""
    global _selected_fleet
    _selected_fleet = None if name is None else check_fleet_name(name)


def fleet_name() -> str | None:
    """The fleet named by ``--fleet`` or else ``BTBCTL_FLEET``; None when neither names one (the default fleet).
    Raises :class:`BtbctlError` for an invalid ``BTBCTL_FLEET``."""
    if _selected_fleet is not None:
        return _selected_fleet
    env = os.environ.get("BTBCTL_FLEET")
    return check_fleet_name(env, "BTBCTL_FLEET") if env else None


def runs_root() -> Path:
    """Where named fleets live: ``platformdirs.user_state_dir("btbctl")/runs`` (one folder per fleet name)."""
    import platformdirs

    return Path(platformdirs.user_state_dir("btbctl")) / "runs"


def default_run_dir() -> Path:
    """The run directory when ``--run-dir`` is not given, first match wins: ``--fleet NAME`` (``runs/NAME``),
    ``BTBCTL_RUN_DIR`` (a path), ``BTBCTL_FLEET`` (``runs/NAME``), else ``runs/default``, all under
    :func:`runs_root`."""
    if _selected_fleet is not None:
        return runs_root() / _selected_fleet
    env = os.environ.get("BTBCTL_RUN_DIR")
    if env:
        return Path(env)
    return runs_root() / (fleet_name() or DEFAULT_RUN_NAME)


@dataclass
class ProcessRecord:
    """One process ``up`` started.

    Attributes:
        name: ``worker-0`` ..., ``gateway``, or ``agent-local`` / ``agent-<host>`` (a node agent, l3 mode).
        role: ``worker``, ``gateway`` or ``agent``.
        kind: ``emulated``, ``sglang``, ``command`` (a worker's command override), ``gateway`` or ``agent``.
        pid: process id; the process leads its own session and process group, so ``pgid == pid``.
        pgid: process group id (what ``down`` signals).
        start_time: identity of the process as read by :func:`process_start_time` at launch.
        argv: the command line.
        log: path of its log file.
        url: its HTTP base URL (``http://host:port``), once known.
        extra: whatever else its ready line reported (``transfer``, ``control``).
        started_at: Unix time of the launch, seconds.
        host: the ``[[hosts]]`` name for a worker started over SSH (its pid, group and start time are the remote
            machine's; ``extra["ssh"]`` says how to reach it); None for a process on this machine.
        env: the variables it was started with on top of the launcher's environment (``btbctl restart`` starts it
            again with them).
    """

    name: str
    role: str
    kind: str
    pid: int
    pgid: int
    start_time: str
    argv: list[str]
    log: str
    url: str | None = None
    extra: dict = field(default_factory=dict)
    started_at: float = 0.0
    host: str | None = None
    env: dict = field(default_factory=dict)


@dataclass
class RunState:
    """The contents of ``state.json``.

    Attributes:
        run_dir: the run directory.
        created_at: Unix time ``up`` began, seconds.
        detached: True for ``up -d``; False while a foreground ``up`` holds the fleet.
        owner_pid: pid of the ``btbctl up`` process (foreground) or None.
        owner_start_time: its start time, to tell whether it is still alive.
        cluster_file: the cluster file used, or None for the embedded default.
        policy: routing policy the gateway started with.
        replication: the fleet's replication mode (``l3``, ``push``, ``none``).
        gateway_url: data-plane base URL, once the gateway is ready.
        control_url: control-API base URL, once the gateway is ready.
        processes: every process started, workers first, the gateway last.
        complete: False while ``up`` is still starting things.
    """

    run_dir: str
    created_at: float
    detached: bool
    owner_pid: int | None = None
    owner_start_time: str | None = None
    cluster_file: str | None = None
    policy: str | None = None
    replication: str | None = None
    gateway_url: str | None = None
    control_url: str | None = None
    processes: list[ProcessRecord] = field(default_factory=list)
    complete: bool = False
    version: int = STATE_VERSION

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RunState:
        """The state of a parsed ``state.json``. Raises ValueError or TypeError (naming the field) for a layout
        this version cannot use, e.g. a process whose ``pid`` or ``pgid`` is not a positive integer: ``down``
        signals those, so a damaged file must be refused rather than guessed at."""
        procs = [ProcessRecord(**p) for p in data.get("processes", [])]
        for p in procs:
            for key in ("pid", "pgid"):
                v = getattr(p, key)
                if type(v) is not int or v < 1:
                    raise ValueError(f"process {p.name!r}: {key} must be a positive integer, got {v!r}")
            if p.pgid != p.pid:
                # every process up starts leads its own group; another pgid would make down signal a stranger
                raise ValueError(f"process {p.name!r}: pgid {p.pgid} differs from pid {p.pid}")
        kw = {k: v for k, v in data.items() if k in cls.__dataclass_fields__ and k != "processes"}
        for key in ("gateway_url", "control_url"):
            url = kw.get(key)
            if url is not None and not _is_http_url(url):
                raise ValueError(f"{key} must be an http:// or https:// URL with a host, got {str(url)[:80]!r}")
        return cls(processes=procs, **kw)

    def workers(self) -> list[ProcessRecord]:
        return [p for p in self.processes if p.role == "worker"]

    def agents(self) -> list[ProcessRecord]:
        return [p for p in self.processes if p.role == "agent"]

    def gateway(self) -> ProcessRecord | None:
        for p in self.processes:
            if p.role == "gateway":
                return p
        return None


def _is_http_url(url: object) -> bool:
    from urllib.parse import urlsplit

    if not isinstance(url, str):
        return False
    try:
        parts = urlsplit(url)
        _ = parts.port  # a malformed port raises ValueError
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


# ----------------------------------------------------------------------------------------------------------------
# process identity


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (field 3, the state, is index 0), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may itself hold spaces or parentheses
    return raw[raw.rfind(")") + 2 :].split()


def _has_proc() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self")


def process_start_time(pid: int) -> str | None:
    """An identity string for a live process: its start time (``/proc/<pid>/stat`` field 22 on Linux, ``ps -o
    lstart=`` elsewhere). None when the pid does not exist or is a zombie (exited, not yet reaped)."""
    if pid <= 0:
        return None
    if _has_proc():
        st = _proc_stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return None
        return st[19]
    try:
        out = subprocess.run(["ps", "-o", "stat=,lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip()
    if out.returncode != 0 or not line or line.startswith("Z"):
        return None
    return line.split(None, 1)[1] if " " in line else line


def is_same_process(pid: int, start_time: str | None) -> bool:
    """Whether ``pid`` is alive (not a zombie) and is still the process that had ``start_time``."""
    return start_time is not None and process_start_time(pid) == start_time


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``. On systems without ``/proc`` this is
    ``[pgid]`` when the group can still be signalled, else ``[]``."""
    if pgid <= 1:
        return []
    if not _has_proc():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _proc_stat(int(entry))
        if st is None or st[0] in ("Z", "X"):
            continue
        if st[2] == str(pgid):
            out.append(int(entry))
    return out


def record_is_ours(rec: ProcessRecord) -> bool:
    """Whether signalling ``rec``'s process group reaches only processes ``up`` started.

    True when the leader is alive with its recorded start time. Also true when the leader has exited but members of
    its group live on (a pid that is still some group's id cannot be handed to a new process, so those members are
    the leader's children). False otherwise, including when the pid now belongs to an unrelated process, and always
    for a process on another host (``rec.host`` set: its pid means nothing here; the SSH launcher checks it there).
    """
    if rec.host:
        return False
    if is_same_process(rec.pid, rec.start_time):
        try:
            return os.getpgid(rec.pid) == rec.pgid
        except OSError:
            return False
    if process_start_time(rec.pid) is not None:
        return False  # the pid was reused by another process
    return bool(group_members(rec.pgid))


# ----------------------------------------------------------------------------------------------------------------
# the directory


class RunDir:
    """A run directory (see the module docstring). Creating the object touches nothing on disk."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_run_dir()

    def selector(self) -> str:
        """The flag that names this run directory to another btbctl command: ``""`` for the default one,
        `` --fleet NAME`` for a named fleet's, else `` --run-dir PATH`` (quoted for a shell)."""
        import shlex

        if self.path == runs_root() / DEFAULT_RUN_NAME and fleet_name() is None:
            return ""
        if self.path.parent == runs_root() and FLEET_NAME.fullmatch(self.path.name):
            return f" --fleet {self.path.name}"
        return f" --run-dir {shlex.quote(str(self.path))}"

    @property
    def state_path(self) -> Path:
        return self.path / "state.json"

    @property
    def token_path(self) -> Path:
        return self.path / "control.token"

    @property
    def worker_token_path(self) -> Path:
        return self.path / "worker.token"

    @property
    def agent_secret_path(self) -> Path:
        return self.path / "agent.secret"

    def agent_credentials_path(self, agent: str) -> Path:
        """The node credentials file of agent ``agent`` (one on this machine)."""
        return self.path / f"{agent}.keys"

    def agent_control_token_path(self, agent: str) -> Path:
        """The control token file of agent ``agent`` (one on this machine)."""
        return self.path / f"{agent}.token"

    def write_agent_credentials(self, agents: list[str], local: list[str]) -> dict[str, tuple[str, str]]:
        """Derive each agent's node credentials (:func:`~btbctl.engine.replication.credentials.
        node_credentials_text`: it can speak to every other agent of ``agents``, only as itself) and control token
        (:func:`~btbctl.engine.replication.credentials.control_token`) from the fleet secret; write those of the agents
        in ``local`` (on this machine) to :meth:`agent_credentials_path` and :meth:`agent_control_token_path` (0600,
        atomically); return them all, ``{agent: (credentials, token)}``. Raises :class:`BtbctlError` when a file
        cannot be read or written."""
        from btbctl.engine.replication.credentials import control_token, node_credentials_text

        try:
            secret = read_text_bounded(self.agent_secret_path).strip().encode()
        except (OSError, UnicodeDecodeError) as e:
            raise BtbctlError(f"cannot read {self.agent_secret_path}: {e}") from None
        out = {a: (node_credentials_text(secret, a, agents), control_token(secret, a)) for a in agents}
        for a in local:
            for p, text in zip((self.agent_credentials_path(a), self.agent_control_token_path(a)), out[a], strict=True):
                try:
                    write_atomic(p, (text + "\n").encode())
                except OSError as e:
                    raise BtbctlError(f"cannot write {p}: {e.strerror or e}") from None
        return out

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def previous_logs_dir(self) -> Path:
        """The logs of the run before the last ``up`` (``logs.previous``): ``up`` moves ``logs`` here."""
        return self.path / PREVIOUS_LOGS

    def log_path(self, name: str, previous: bool = False) -> Path:
        return (self.previous_logs_dir if previous else self.logs_dir) / f"{name}.log"

    def archive_logs(self) -> Path | None:
        """Keep the last run's logs: move ``logs`` to ``logs.previous`` (replacing an older one), so a new run
        starts with empty logs and the last one stays readable (``btbctl logs --previous``). Returns the archive,
        or None when there were no logs. Raises :class:`BtbctlError` when the move fails."""
        try:
            if not self.logs_dir.is_dir() or not any(self.logs_dir.iterdir()):
                return None
            if self.previous_logs_dir.exists():
                shutil.rmtree(self.previous_logs_dir)
            os.replace(self.logs_dir, self.previous_logs_dir)
        except OSError as e:
            raise BtbctlError(
                f"cannot keep the last run's logs in {self.previous_logs_dir}: {e.strerror or e}"
            ) from None
        return self.previous_logs_dir

    @property
    def tuned_path(self) -> Path:
        return self.path / TUNED_FILE

    def load_tuned(self) -> dict | None:
        """The last confirmed tuning (:func:`~btbctl.engine.control.tuned.load_tuned`), or None when there is none
        or it sets neither constants nor a policy (nothing to apply). Raises :class:`BtbctlError` (naming the file,
        the key and what is valid) for a damaged record."""
        tuned = load_tuned(self.tuned_path)
        return tuned if tuned and (tuned.get("constants") or tuned.get("policy")) else None

    def save_tuned(self, constants: dict, policy: str | None, cluster_file: str | None) -> None:
        """Write ``tuned.json`` (:func:`~btbctl.engine.control.tuned.save_tuned`; raises OSError)."""
        save_tuned(self.tuned_path, constants, policy, cluster_file)

    def log_names(self, previous: bool = False) -> list[str]:
        """Names of the logs on disk (``gateway``, ``gateway.out``, ``worker-0`` ...), sorted; rotated copies
        (``gateway.log.1``) are not names of their own. ``previous``: those of the run before (``logs.previous``)."""
        folder = self.previous_logs_dir if previous else self.logs_dir
        try:
            return sorted(p.name[: -len(".log")] for p in folder.iterdir() if p.name.endswith(".log"))
        except OSError:
            return []

    @contextlib.contextmanager
    def locked(self, create: bool = True) -> Iterator[None]:
        """Hold the run directory's lock (``flock`` on ``<run dir>/.lock``, exclusive, not waiting) for the block;
        the kernel releases it when the process ends, also on a crash. Re-entrant within one process.

        Args:
            create: create the run directory (0700) if missing; else a missing directory is not locked (nothing
                is recorded there to protect).

        Raises:
            BtbctlError: another process holds the lock (one line naming the fleet, the run directory and its
                pid), or the directory or lock file cannot be created.
        """
        key = str(self.path.absolute())
        if key in _held_locks:
            _held_locks[key] += 1
            try:
                yield
            finally:
                _held_locks[key] -= 1
            return
        if not create and not self.path.is_dir():
            yield
            return
        lock_path = self.path / LOCK_FILE
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as e:
            raise BtbctlError(f"cannot create the lock {lock_path}: {e.strerror or e}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = ""
                with contextlib.suppress(OSError, ValueError):
                    holder = f", pid {int(os.pread(fd, 32, 0).decode('ascii').strip())}"
                raise BtbctlError(
                    f"another btbctl up/down is working on fleet {self.path.name} (run dir {self.path}{holder}); "
                    f"try again when it has finished"
                ) from None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
            _held_locks[key] = 1
            try:
                yield
            finally:
                del _held_locks[key]
        finally:
            os.close(fd)  # closing the only descriptor releases the lock

    def prepare(self) -> None:
        """Create the directory (0700) and its ``logs`` folder. Raises :class:`BtbctlError` when that fails."""
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(self.path, 0o700)
            self.logs_dir.mkdir(exist_ok=True, mode=0o700)
        except OSError as e:
            raise BtbctlError(f"cannot create run directory {self.path}: {e.strerror or e}") from None

    def new_tokens(self) -> tuple[str, str]:
        """Write a fresh control token and worker token (0600 each, replacing old ones, atomically); return both.
        Raises :class:`BtbctlError` when a file cannot be written (a full disk)."""
        return _write_secret(self.token_path), _write_secret(self.worker_token_path)

    def new_agent_secret(self) -> str:
        """Write a fresh fleet secret for the node agents (0600, atomically; :meth:`write_agent_credentials` derives
        what each agent gets); return it. Raises :class:`BtbctlError` when the file cannot be written."""
        return _write_secret(self.agent_secret_path)

    def read_token(self) -> str:
        """The control API token. Raises :class:`BtbctlError` when the file is missing or unreadable."""
        try:
            return read_text_bounded(self.token_path).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise BtbctlError(
                f"cannot read the control token {self.token_path}: {getattr(e, 'strerror', None) or e}; is a fleet "
                f"running with this --run-dir?"
            ) from None

    def load(self) -> RunState | None:
        """The recorded state, or None when there is none. Raises :class:`BtbctlError` for a corrupt file."""
        try:
            raw = read_bounded(self.state_path, limit_bytes=RECORD_LIMIT_BYTES)
        except FileNotFoundError:
            return None
        except ReadRefused as e:
            raise BtbctlError(f"cannot read {self.state_path}: {e}") from None
        except OSError as e:
            raise BtbctlError(f"cannot read {self.state_path}: {e.strerror or e}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
                raise ValueError(f"unknown layout version {data.get('version') if isinstance(data, dict) else None}")
            return RunState.from_dict(data)
        except (ValueError, TypeError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise BtbctlError(
                f"{self.state_path}: unreadable run state ({e}); remove the file if no fleet from it is running"
            ) from None

    def save(self, state: RunState) -> None:
        """Write ``state.json`` atomically (:func:`~btbctl.engine.fileio.write_atomic`), mode 0600."""
        write_atomic(self.state_path, (json.dumps(state.as_dict(), indent=2) + "\n").encode("utf-8"))

    def live_processes(self, state: RunState) -> list[ProcessRecord]:
        """Records of ``state`` whose process (group) is still ours and alive."""
        return [p for p in state.processes if record_is_ours(p)]

    def owner_alive(self, state: RunState) -> bool:
        """Whether the foreground ``btbctl up`` that owns ``state`` is still running."""
        return state.owner_pid is not None and is_same_process(state.owner_pid, state.owner_start_time)

    def clear(self) -> None:
        """Forget the run: remove ``state.json``, the tokens and secrets and ``gateway.json`` (logs stay for a
        post-mortem)."""
        for p in (
            self.state_path,
            self.token_path,
            self.worker_token_path,
            self.agent_secret_path,
            self.path / "gateway.json",
            *self.path.glob("agent-*.keys"),
            *self.path.glob("agent-*.token"),
        ):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def live_state(self) -> RunState:
        """The state of a running fleet. Raises :class:`BtbctlError` (naming the directory) when there is none."""
        state = self.load()
        if state is None:
            raise BtbctlError(
                f"no fleet is running (nothing recorded in {self.path}); start one with `btbctl up` "
                f"or pass the --run-dir it used"
            )
        if not self.live_processes(state) and not self.owner_alive(state):
            raise BtbctlError(
                f"the fleet recorded in {self.path} is no longer running; `btbctl down` cleans up its state"
            )
        return state


def _write_secret(path: Path) -> str:
    """A fresh token written to ``path`` (0600) atomically (:func:`write_atomic`): a failed write (a full disk)
    leaves the old file or none, never an empty one."""
    token = secrets.token_urlsafe(TOKEN_BYTES)
    try:
        write_atomic(path, (token + "\n").encode("utf-8"))
    except OSError as e:
        raise BtbctlError(f"cannot write {path}: {e.strerror or e}") from None
    return token


def now_s() -> float:
    """Wall-clock time for records (Unix seconds)."""
    return time.time()


_F = TypeVar("_F", bound=Callable[..., Any])


def holding_lock(create: bool = True) -> Callable[[_F], _F]:
    """Run the decorated function (which takes the :class:`RunDir` as ``rd``) holding ``rd``'s lock
    (:meth:`RunDir.locked` with ``create``): one ``up``/``down``/``restart`` at a time per run directory."""

    def decorate(f: _F) -> _F:
        sig = inspect.signature(f)

        @functools.wraps(f)
        def held(*args: Any, **kwargs: Any) -> Any:
            rd = sig.bind_partial(*args, **kwargs).arguments["rd"]
            with rd.locked(create):
                return f(*args, **kwargs)

        return cast(_F, held)

    return decorate


__all__ = [
    "holding_lock",
    "ProcessRecord",
    "RunDir",
    "RunState",
    "check_fleet_name",
    "default_run_dir",
    "fleet_name",
    "group_members",
    "is_same_process",
    "process_start_time",
    "record_is_ours",
    "runs_root",
    "select_fleet",
]
