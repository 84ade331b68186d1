"""A multi-host testbed on one Linux machine: hosts are network namespaces behind a shaped switch.

Topology (``prefix`` ``btbt``, two hosts)::

    root namespace (the operator's machine: the test process, `btbctl up`, the gateway)
      btbt-op  198.18.N.1/24 ──veth──┐
                                     │  namespace btbt-switch
                                     ├─ op ─┐
                                     │      br0 (bridge, STP off, no address)
      namespace btbt-node0           │      │
        eth0 198.18.N.2/24 ──veth────┼─ node0
      namespace btbt-node1           │      │
        eth0 198.18.N.3/24 ──veth────┴─ node1

* The bridge lives in its own ``<prefix>-switch`` namespace, so the machine's own interfaces are never touched;
  the only thing created in the root namespace is the operator's veth end ``<prefix>-op`` (with its address and
  the connected /24 route), through which the test process reaches every host like a machine on the same switch.
* The /24 comes from 198.18.0.0/15 (RFC 2544's benchmarking range): the first /24 that overlaps no route of any
  routing table, no address of any interface and no other testbed's recorded subnet. Hosts have no default route:
  they reach each other and the operator, nothing else.
* Every link (each host's, and the operator's) is shaped in both directions, on the egress of the host-side end
  and of the switch-side end: a token bucket (``tbf``) for the rate and, where the kernel has it, ``netem`` for a
  fixed one-way delay per link and direction. A host-to-host path crosses two links, so its round trip carries
  ``4 * delay_us`` of added delay (operator-to-host as well). Kernels built without ``sch_netem``
  (``CONFIG_NET_SCH_NETEM`` not set, as on some VM guest kernels) cannot delay: there ``delay_us`` must be 0 (the
  testbed raises :class:`TestbedError` otherwise) and :func:`netem_available` says so.
* Rates, delays and link state change while the testbed runs (:meth:`Endpoint.set_rate`,
  :meth:`Endpoint.set_delay`, :meth:`Endpoint.set_link`); a cut link is its switch port set down (the host sees
  the carrier go, keeps its address; packets either way are dropped until the port is up again).

Processes run inside a host with :meth:`Host.popen` / :meth:`Host.run` (``ip netns exec NS argv...``, argv lists,
never a shell). All namespaces share the file system and the PID space, so a host runs this checkout's Python.

Ownership and cleanup: a testbed holds an ``flock`` on ``/run/btbt-testbed/<prefix>.lock`` for its life and keeps
a record of its layout in ``<prefix>.json``. :meth:`Testbed.close` (also at interpreter exit and in the fixtures'
teardown, whether the test passed or not) kills every process in its namespaces (tracked ones first, then whatever
``ip netns pids`` still lists), deletes the namespaces (which deletes every veth and the bridge) and the record.
A new testbed first sweeps the leftovers of a crashed run of its prefix (namespaces ``<prefix>-*``, the link
``<prefix>-op``): the lock tells a crashed run from a live one, which is never touched. A testbed made with
``persistent=True`` (``scripts/testbed.py up``) outlives its process and is only removed by an explicit
:func:`sweep` with ``include_persistent=True`` (``scripts/testbed.py down``).

Needs Linux, root and iproute2 (``ip``, ``tc``); :func:`require_testbed` skips a test with the reason otherwise.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import getpass
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

DEFAULT_PREFIX = "btbt"
STATE_DIR = Path("/run/btbt-testbed")
#: Where testbed subnets come from: RFC 2544's benchmarking range, never routed on real networks.
SUBNET_POOL = ipaddress.ip_network("198.18.0.0/15")
SWITCH = "switch"
BRIDGE = "br0"
OPERATOR_PORT = "op"
HOST_IFACE = "eth0"
#: Queueing a token bucket allows before it drops (tbf ``latency``).
TBF_LATENCY = "20ms"
#: Packets netem holds at once (its default, 1000, is short for a 10 Gbit/s link with a delay).
NETEM_LIMIT = 100000

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,11}$")  # <prefix>-op must fit IFNAMSIZ (15 characters)
_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,14}$")
_RESERVED = {SWITCH, BRIDGE, OPERATOR_PORT, "lo", HOST_IFACE}


class TestbedError(RuntimeError):
    """The testbed could not be built, changed or removed; the message names the command and its error."""

    __test__ = False  # not a test class, despite the name


class TestbedBusy(TestbedError):
    """Another live process owns this prefix (or it is a persistent testbed left up on purpose)."""


# -- requirements --------------------------------------------------------------------------------------------------


def missing_requirements() -> str | None:
    """Why no testbed can be built here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "needs root for network namespaces (ip netns)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs iproute2: `{tool}` is not installed (apt-get install iproute2)"
    return _probe()[0]


_probed: tuple[str | None, bool] | None = None


def _probe() -> tuple[str | None, bool]:
    """Build a throwaway namespace with a veth pair, a bridge and a token bucket, and try netem, once per process:
    ``(why a testbed cannot be built here or None, whether netem works)``. Root in a container without
    CAP_SYS_ADMIN, or a kernel without veth, bridge or tbf, gets the reason instead of a failing test."""
    global _probed
    if _probed is None:
        ns = f"btbtprobe{os.getpid()}"
        r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if r.returncode != 0:
            _probed = (f"cannot create network namespaces here (`ip netns add`: {r.stderr.strip()})", False)
            return _probed
        try:
            steps = [
                ("veth", ["ip", "-n", ns, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"]),
                ("bridge", ["ip", "-n", ns, "link", "add", "name", "br", "type", "bridge"]),
                ("tbf", ["tc", "-n", ns, "qdisc", "add", "dev", "a", "root", *_tbf_args(1.0)]),
            ]
            why = None
            for what, argv in steps:
                r = subprocess.run(argv, capture_output=True, text=True)
                if r.returncode != 0:
                    why = f"the kernel cannot make a {what} here (`{' '.join(argv[3:])}`: {r.stderr.strip()})"
                    break
            netem = (
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1us"],
                    capture_output=True,
                    text=True,
                ).returncode
                == 0
            )
            _probed = (why, netem)
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return _probed


def require_testbed() -> None:
    """Skip the calling test with the reason when no testbed can be built here."""
    why = missing_requirements()
    if why:
        pytest.skip(why)


def sshd_binary() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd"):
        if os.access(p, os.X_OK):
            return p
    return None


def require_sshd() -> str:
    """The sshd binary, or skip the calling test with the reason."""
    path = sshd_binary()
    if path is None:
        pytest.skip("sshd is not installed (apt-get install openssh-server)")
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (openssh-client)")
    return path


def netem_available() -> bool:
    """Whether this kernel has the ``netem`` qdisc (needed for any ``delay_us`` > 0)."""
    return missing_requirements() is None and _probe()[1]


def require_netem() -> None:
    require_testbed()
    if not netem_available():
        pytest.skip("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set): links cannot be delayed")


# -- commands ------------------------------------------------------------------------------------------------------


def _cmd(argv: Sequence[str], check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def _ip(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["ip", *(["-n", ns] if ns else []), *args], check=check)


def _tc(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _cmd(["tc", *(["-n", ns] if ns else []), *args], check=check)


def list_netns() -> list[str]:
    out = _cmd(["ip", "netns", "list"]).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def root_links() -> list[str]:
    """Interface names of the root (current) namespace."""
    out = _cmd(["ip", "-o", "link", "show"]).stdout
    names = []
    for ln in out.splitlines():
        parts = ln.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def netns_pids(ns: str) -> list[int]:
    r = _cmd(["ip", "netns", "pids", ns], check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def leftovers(prefix: str) -> list[str]:
    """What of testbed ``prefix`` exists: namespaces ``<prefix>-*`` and root links ``<prefix>-*``."""
    tag = f"{prefix}-"
    return [f"netns {n}" for n in list_netns() if n.startswith(tag)] + [
        f"link {n}" for n in root_links() if n.startswith(tag)
    ]


def _kill_netns(ns: str, tracked: Iterable[subprocess.Popen] = (), grace_s: float = 1.0) -> None:
    """Stop every process in namespace ``ns``: SIGTERM, up to ``grace_s`` to go, then SIGKILL."""
    tracked = list(tracked)
    for p in tracked:
        if p.poll() is None:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
    for pid in netns_pids(ns):
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (netns_pids(ns) or any(p.poll() is None for p in tracked)):
        time.sleep(0.02)
    for _ in range(20):
        pids = netns_pids(ns)
        if not pids:
            break
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.02)
    for p in tracked:
        if p.poll() is None:
            p.kill()
        try:
            p.wait(2)
        except subprocess.TimeoutExpired:
            pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# -- subnets -------------------------------------------------------------------------------------------------------


def pick_subnet(
    taken: Iterable[ipaddress.IPv4Network], pool: ipaddress.IPv4Network = SUBNET_POOL
) -> ipaddress.IPv4Network:
    """The first /24 of ``pool`` that overlaps none of ``taken``."""
    taken = list(taken)
    for net in pool.subnets(new_prefix=24):
        if not any(net.overlaps(t) for t in taken):
            return net
    raise TestbedError(f"every /24 of {pool} overlaps a route, an address or another testbed on this machine")


def taken_networks() -> list[ipaddress.IPv4Network]:
    """Networks in use here: every IPv4 route of every table (but the default route), every interface address,
    and the subnets other testbeds recorded."""
    nets = []
    for r in json.loads(_cmd(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = r.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.ip_network(dst, strict=False))
    for link in json.loads(_cmd(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    if STATE_DIR.is_dir():
        for rec in STATE_DIR.glob("*.json"):
            try:
                nets.append(ipaddress.ip_network(json.loads(rec.read_text())["subnet"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
    return nets


# -- ownership -----------------------------------------------------------------------------------------------------


def _lock_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.lock"


def _record_path(prefix: str) -> Path:
    return STATE_DIR / f"{prefix}.json"


def read_record(prefix: str) -> dict | None:
    """The layout testbed ``prefix`` recorded (what :meth:`Testbed.describe` returns), or None."""
    try:
        return json.loads(_record_path(prefix).read_text())
    except (OSError, ValueError):
        return None


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created if absent), or None when another process holds it."""
    STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:  # the holder may have unlinked the file between our open and our flock: lock the current one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class _GlobalLock:
    """Serialises subnet choices of testbeds being built at the same time (a blocking flock)."""

    def __enter__(self):
        STATE_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.fd = os.open(STATE_DIR / ".subnets.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _remove(prefix: str) -> list[str]:
    """Delete everything of testbed ``prefix`` (caller holds its lock or knows its owner is gone)."""
    tag = f"{prefix}-"
    spaces = [n for n in list_netns() if n.startswith(tag)]
    for ns in spaces:
        _kill_netns(ns, grace_s=0.5)
    removed = []
    for link in root_links():
        if link.startswith(tag):
            _ip(None, "link", "del", link, check=False)
            removed.append(f"link {link}")
    for ns in sorted(spaces, key=lambda n: n == f"{prefix}-{SWITCH}"):  # hosts first, the switch last
        _cmd(["ip", "netns", "del", ns], check=False)
        removed.append(f"netns {ns}")
    _record_path(prefix).unlink(missing_ok=True)
    return removed


def sweep(prefix: str = DEFAULT_PREFIX, *, include_persistent: bool = False) -> list[str]:
    """Remove the leftovers of testbed ``prefix`` (namespaces, links, processes in them, its record) when no live
    process owns it; returns what was removed. Raises :class:`TestbedBusy` when a live process holds the prefix, or
    when it is a persistent testbed and ``include_persistent`` is false."""
    _check_prefix(prefix)
    fd = _try_lock(_lock_path(prefix))
    if fd is None:
        raise TestbedBusy(f"testbed {prefix!r} is in use by a running process")
    try:
        rec = read_record(prefix)
        if rec and rec.get("persistent") and not include_persistent:
            raise TestbedBusy(
                f"testbed {prefix!r} was brought up on purpose (scripts/testbed.py up); remove it "
                f"with: scripts/testbed.py down --prefix {prefix}"
            )
        removed = _remove(prefix)
        _lock_path(prefix).unlink(missing_ok=True)
        return removed
    finally:
        os.close(fd)


def sweep_stale() -> list[str]:
    """Remove every testbed of this module (any prefix, known by its record) whose owner is gone, but persistent
    ones; returns what was removed. Live testbeds of other runs are left alone."""
    removed: list[str] = []
    for rec in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        if not _PREFIX_RE.match(rec.stem):
            continue
        try:
            removed += sweep(rec.stem)
        except TestbedBusy:
            pass
    return removed


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix {prefix!r}: 1-12 lowercase letters and digits, starting with a letter")


# -- links and hosts -----------------------------------------------------------------------------------------------


def _tbf_args(rate_gbit: float) -> list[str]:
    rate_bps = int(rate_gbit * 1e9)
    burst = max(rate_bps // 8 // 1000, 131072)  # 1 ms at the rate, at least two 64 KiB GSO packets
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", TBF_LATENCY]


@dataclass
class _Port:
    """One end of a link: interface ``dev`` in namespace ``ns`` (None: the root namespace)."""

    ns: str | None
    dev: str

    def shape(self, rate_gbit: float | None, delay_us: float, netem: bool) -> None:
        """Make the egress qdiscs say ``rate_gbit`` (None: unlimited) and ``delay_us`` (netem only)."""
        if netem:
            _tc(
                self.ns,
                "qdisc",
                "replace",
                "dev",
                self.dev,
                "root",
                "handle",
                "1:",
                "netem",
                "delay",
                f"{delay_us:g}us",
                "limit",
                str(NETEM_LIMIT),
            )
            if rate_gbit is None:
                _tc(self.ns, "qdisc", "del", "dev", self.dev, "parent", "1:1", "handle", "10:", check=False)
            else:
                _tc(
                    self.ns,
                    "qdisc",
                    "replace",
                    "dev",
                    self.dev,
                    "parent",
                    "1:1",
                    "handle",
                    "10:",
                    *_tbf_args(rate_gbit),
                )
        elif rate_gbit is None:
            _tc(self.ns, "qdisc", "del", "dev", self.dev, "root", check=False)
        else:
            _tc(self.ns, "qdisc", "replace", "dev", self.dev, "root", "handle", "10:", *_tbf_args(rate_gbit))


@dataclass
class Endpoint:
    """A machine on the testbed's switch: a :class:`Host` or the :class:`Operator`.

    Attributes:
        name: its name (``node0``; ``operator``).
        address: its IPv4 address in the testbed subnet.
        rate_gbit: the current rate of its link, each direction (None: unlimited).
        delay_us: the current one-way delay of its link, each direction.
        up: whether its link is up.
    """

    name: str
    address: str
    rate_gbit: float | None
    delay_us: float
    _near: _Port = field(repr=False)
    _far: _Port = field(repr=False)  # the switch-side end
    _netem: bool = field(repr=False, default=False)
    up: bool = True

    def _shape(self) -> None:
        for port in (self._near, self._far):
            port.shape(self.rate_gbit, self.delay_us, self._netem)

    def set_rate(self, gbit: float | None) -> None:
        """Change the rate of this endpoint's link, both directions, now (None: unlimited)."""
        if gbit is not None and gbit <= 0:
            raise ValueError("rate_gbit must be positive (or None for unlimited); cut a link with set_link")
        self.rate_gbit = gbit
        self._shape()

    def set_delay(self, us: float) -> None:
        """Change the one-way delay of this endpoint's link, both directions, now (needs netem)."""
        if us < 0:
            raise ValueError("delay_us must be >= 0")
        if us and not self._netem:
            raise TestbedError(
                f"delay_us={us:g} needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM is not set)"
            )
        self.delay_us = us
        self._shape()

    def set_link(self, up: bool) -> None:
        """Cut (``up=False``) or restore this endpoint's link: its switch port goes down or up."""
        _ip(self._far.ns, "link", "set", "dev", self._far.dev, "up" if up else "down")
        self.up = up

    def argv(self, argv: Sequence[str]) -> list[str]:
        return [str(a) for a in argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen(argv, **kwargs)`` on this endpoint."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of arguments, not a shell string")
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(argv, **kwargs)`` on this endpoint (argv list; the process is killed on timeout)."""
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of arguments, not a shell string")
        return subprocess.run(self.argv(argv), **kwargs)


@dataclass
class Operator(Endpoint):
    """The root namespace: the test process itself, reaching the hosts through its veth ``<prefix>-op``."""

    interface: str = ""


@dataclass
class Host(Endpoint):
    """A host: network namespace ``netns`` with ``lo`` and ``eth0`` (``address``/24) up, no default route."""

    netns: str = ""
    _procs: list = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this host (``ip netns exec NETNS argv...``)."""
        return ["ip", "netns", "exec", self.netns, *(str(a) for a in argv)]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside this host; the process is killed when the testbed closes."""
        proc = super().popen(argv, **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Processes running inside this host now (``ip netns pids``)."""
        return netns_pids(self.netns)

    def kill_all(self, grace_s: float = 1.0) -> None:
        """Stop every process inside this host (SIGTERM, then SIGKILL after ``grace_s``)."""
        _kill_netns(self.netns, self._procs, grace_s)
        self._procs.clear()


#: Testbeds of this process not closed yet (closed at interpreter exit; a strong reference, so that a testbed
#: dropped without close is still removed).
_open: set[Testbed] = set()


@atexit.register
def _close_open() -> None:
    for tb in list(_open):
        tb.close()


class Testbed:
    """``n_hosts`` hosts (``node0``...) on a switch, each link shaped to ``rate_gbit`` (None: unlimited) and
    ``delay_us`` one-way (each direction; needs netem), and the operator (this process) on the same switch.

    Use as a context manager or call :meth:`close`. ``persistent=True`` leaves it up when this process exits (for
    ``scripts/testbed.py``). ``names`` overrides the host names; ``subnet`` the automatic choice (it must not
    overlap anything in use either).
    """

    __test__ = False

    def __init__(
        self,
        n_hosts: int = 2,
        rate_gbit: float | None = 10.0,
        delay_us: float = 0.0,
        prefix: str = DEFAULT_PREFIX,
        *,
        names: Sequence[str] | None = None,
        subnet: str | None = None,
        persistent: bool = False,
    ) -> None:
        why = missing_requirements()
        if why:
            raise TestbedError(why)
        _check_prefix(prefix)
        names = list(names) if names is not None else [f"node{i}" for i in range(n_hosts)]
        if len(names) != n_hosts or not 1 <= n_hosts <= 250:
            raise ValueError("n_hosts must be 1-250 and match names")
        for n in names:
            if not _NAME_RE.match(n) or n in _RESERVED:
                raise ValueError(f"host name {n!r}: 1-15 lowercase letters and digits, not one of {sorted(_RESERVED)}")
        if len(set(names)) != len(names):
            raise ValueError("host names must be distinct")
        if rate_gbit is not None and rate_gbit <= 0:
            raise ValueError("rate_gbit must be positive (or None for unlimited)")
        if delay_us < 0:
            raise ValueError("delay_us must be >= 0")
        self.prefix = prefix
        self.persistent = persistent
        self.switch_netns = f"{prefix}-{SWITCH}"
        self.hosts: list[Host] = []
        self.operator: Operator | None = None
        self.closed = False
        self._lock_fd = _try_lock(_lock_path(prefix))
        if self._lock_fd is None:
            raise TestbedBusy(f"testbed {prefix!r} is in use by a running process")
        rec = read_record(prefix)
        if rec and rec.get("persistent"):
            os.close(self._lock_fd)
            self._lock_fd = None
            raise TestbedBusy(
                f"testbed {prefix!r} was brought up on purpose (scripts/testbed.py up); remove it "
                f"with: scripts/testbed.py down --prefix {prefix}"
            )
        if not persistent:
            _open.add(self)
        try:
            self.swept = _remove(prefix)  # a crashed run's leftovers
            self._build(names, rate_gbit, delay_us, subnet)
        except BaseException:
            self.close()
            raise

    # -- building --------------------------------------------------------------------------------------------------

    def _build(self, names: list[str], rate_gbit: float | None, delay_us: float, subnet: str | None) -> None:
        sw = self.switch_netns
        op_if = f"{self.prefix}-op"
        self.netem = _probe()[1]
        if delay_us and not self.netem:
            raise TestbedError(
                f"delay_us={delay_us:g} needs the netem qdisc, which this kernel lacks "
                f"(CONFIG_NET_SCH_NETEM is not set); use delay_us=0"
            )
        with _GlobalLock():
            taken = taken_networks()
            if subnet is None:
                net = pick_subnet(taken)
            else:
                net = ipaddress.ip_network(subnet)
                if net.prefixlen > 24 or any(net.overlaps(t) for t in taken):
                    raise TestbedError(
                        f"subnet {net} overlaps a route, an address or another testbed here (or is smaller than a /24)"
                    )
            self.subnet = net
            self._write_record()  # reserves the subnet for other testbeds being built
            _cmd(["ip", "netns", "add", sw])
            _ip(sw, "link", "set", "lo", "up")
            _ip(
                sw,
                "link",
                "add",
                "name",
                BRIDGE,
                "type",
                "bridge",
                "stp_state",
                "0",
                "nf_call_iptables",
                "0",
                "nf_call_ip6tables",
                "0",
                "nf_call_arptables",
                "0",
            )
            _ip(sw, "link", "set", BRIDGE, "addrgenmode", "none")
            _ip(sw, "link", "set", BRIDGE, "up")
            hosts_ip = list(net.hosts())
            # the operator's end in the root namespace, its peer in the switch
            _ip(None, "link", "add", "name", op_if, "type", "veth", "peer", "name", OPERATOR_PORT, "netns", sw)
            _ip(None, "link", "set", op_if, "addrgenmode", "none")
            _ip(None, "addr", "add", f"{hosts_ip[0]}/{net.prefixlen}", "dev", op_if)
            self.operator = Operator(
                name="operator",
                address=str(hosts_ip[0]),
                rate_gbit=rate_gbit,
                delay_us=delay_us,
                _near=_Port(None, op_if),
                _far=_Port(sw, OPERATOR_PORT),
                _netem=self.netem,
                interface=op_if,
            )
            self._plug(self.operator)
            _ip(None, "link", "set", op_if, "up")
        for i, name in enumerate(names):
            ns = f"{self.prefix}-{name}"
            _cmd(["ip", "netns", "add", ns])
            _ip(ns, "link", "set", "lo", "up")
            _ip(sw, "link", "add", "name", name, "type", "veth", "peer", "name", HOST_IFACE, "netns", ns)
            _ip(ns, "link", "set", HOST_IFACE, "addrgenmode", "none")
            addr = str(hosts_ip[1 + i])
            _ip(ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", HOST_IFACE)
            host = Host(
                name=name,
                address=addr,
                rate_gbit=rate_gbit,
                delay_us=delay_us,
                _near=_Port(ns, HOST_IFACE),
                _far=_Port(sw, name),
                _netem=self.netem,
                netns=ns,
            )
            self.hosts.append(host)
            self._plug(host)
            _ip(ns, "link", "set", HOST_IFACE, "up")
        self._write_record()

    def _plug(self, ep: Endpoint) -> None:
        sw = self.switch_netns
        _ip(sw, "link", "set", ep._far.dev, "addrgenmode", "none")
        _ip(sw, "link", "set", ep._far.dev, "master", BRIDGE)
        ep._shape()
        _ip(sw, "link", "set", ep._far.dev, "up")

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> Testbed:
        """A view of testbed ``prefix`` that is up (made by another process, e.g. ``scripts/testbed.py up``), from
        its record: change links, run commands; it does not own the testbed (its close does nothing)."""
        _check_prefix(prefix)
        rec = read_record(prefix)
        if rec is None or rec.get("switch_netns") not in list_netns():
            raise TestbedError(f"no testbed {prefix!r} is up")
        tb = cls.__new__(cls)
        tb.prefix, tb.persistent, tb.switch_netns = prefix, rec["persistent"], rec["switch_netns"]
        tb.subnet, tb.netem, tb.closed, tb._lock_fd, tb.swept = (
            ipaddress.ip_network(rec["subnet"]),
            rec["netem"],
            True,
            None,
            [],
        )
        tb._owner_pid = rec.get("owner_pid")
        sw = tb.switch_netns
        o = rec["operator"]
        tb.operator = Operator(
            name="operator",
            address=o["address"],
            rate_gbit=o["rate_gbit"],
            delay_us=o["delay_us"],
            _near=_Port(None, o["interface"]),
            _far=_Port(sw, OPERATOR_PORT),
            _netem=tb.netem,
            up=o.get("up", True),
            interface=o["interface"],
        )
        tb.hosts = [
            Host(
                name=h["name"],
                address=h["address"],
                rate_gbit=h["rate_gbit"],
                delay_us=h["delay_us"],
                _near=_Port(h["netns"], HOST_IFACE),
                _far=_Port(sw, h["name"]),
                _netem=tb.netem,
                up=h.get("up", True),
                netns=h["netns"],
            )
            for h in rec["hosts"]
        ]
        return tb

    def update_record(self) -> None:
        """Write the current rates, delays and link states to the record (what ``status`` prints)."""
        self._write_record()

    def _write_record(self) -> None:
        path = _record_path(self.prefix)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=1))
        tmp.replace(path)

    # -- use -------------------------------------------------------------------------------------------------------

    def host(self, key: str | int) -> Host:
        """A host by index, name or address."""
        if isinstance(key, int):
            return self.hosts[key]
        for h in self.hosts:
            if key in (h.name, h.address, h.netns):
                return h
        raise KeyError(f"no host {key!r} in testbed {self.prefix!r} ({', '.join(h.name for h in self.hosts)})")

    def endpoints(self) -> list[Endpoint]:
        return ([self.operator] if self.operator else []) + list(self.hosts)

    def set_rate(self, gbit: float | None) -> None:
        """Every link's rate, now."""
        for ep in self.endpoints():
            ep.set_rate(gbit)

    def set_delay(self, us: float) -> None:
        """Every link's one-way delay, now."""
        for ep in self.endpoints():
            ep.set_delay(us)

    def describe(self) -> dict:
        """The layout as JSON-ready data (also what ``scripts/testbed.py`` prints and the record holds)."""
        op = self.operator
        return {
            "prefix": self.prefix,
            "subnet": str(getattr(self, "subnet", "")),
            "switch_netns": self.switch_netns,
            "netem": getattr(self, "netem", None),
            "persistent": self.persistent,
            "owner_pid": getattr(self, "_owner_pid", os.getpid()),
            "operator": {
                "address": op.address,
                "interface": op.interface,
                "rate_gbit": op.rate_gbit,
                "delay_us": op.delay_us,
                "up": op.up,
            }
            if op
            else None,
            "hosts": [
                {
                    "name": h.name,
                    "address": h.address,
                    "netns": h.netns,
                    "rate_gbit": h.rate_gbit,
                    "delay_us": h.delay_us,
                    "up": h.up,
                }
                for h in self.hosts
            ],
        }

    # -- teardown --------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process inside the hosts, delete the namespaces (and with them every veth and the bridge),
        the operator's link and the record. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _open.discard(self)
        try:
            for h in self.hosts:
                _kill_netns(h.netns, h._procs, grace_s=1.0)
                h._procs.clear()
            _remove(self.prefix)
        finally:
            if self._lock_fd is not None:
                _lock_path(self.prefix).unlink(missing_ok=True)
                os.close(self._lock_fd)
                self._lock_fd = None

    def release(self) -> None:
        """Leave a persistent testbed up and let go of it (this process no longer owns it)."""
        self.closed = True
        _open.discard(self)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Testbed({self.prefix!r}, subnet={getattr(self, 'subnet', None)}, hosts={[h.address for h in self.hosts]})"
        )


# -- sshd inside a host --------------------------------------------------------------------------------------------


def _keygen(path: Path) -> str:
    if not path.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "btbctl-testbed", "-f", str(path)],
            check=True,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@dataclass
class HostSshd:
    """An sshd running inside a host, and the files a client on the operator side needs.

    Attributes:
        host: the host it runs in; it listens on ``host.address`` at ``port``.
        port: 22 (each namespace has its own ports).
        client_key: private key accepted for ``user`` (shared by every host started with the same folder).
        known_hosts: known_hosts file listing every host started with the same folder under its address.
        user: the login (the current user).
        proc: the sshd process.
        dir: the folder holding the keys (``dir / host.name`` holds this host's sshd files).
    """

    host: Host
    port: int
    client_key: Path
    known_hosts: Path
    user: str
    proc: subprocess.Popen
    dir: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_sshd(host: Host, folder: Path, port: int = 22, timeout_s: float = 10.0, detach: bool = False) -> HostSshd:
    """Run sshd inside ``host`` listening on its address, with a fresh host key; the client key and known_hosts in
    ``folder`` are shared by all hosts started with the same folder. Returns once the operator side can connect.
    The testbed kills it at close (or call :meth:`HostSshd.stop`). ``detach``: in a session of its own, to outlive
    this process (a persistent testbed)."""
    sshd = sshd_binary()
    if sshd is None:
        raise TestbedError("sshd is not installed (apt-get install openssh-server)")
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    own = folder / host.name
    own.mkdir(exist_ok=True)
    client_key = folder / "client_ed25519"
    client_pub = _keygen(client_key)
    host_pub = _keygen(own / "host_ed25519")
    auth = folder / "authorized_keys"
    auth.write_text(client_pub + "\n")
    os.chmod(auth, 0o600)
    known = folder / "known_hosts"
    entry = host.address if port == 22 else f"[{host.address}]:{port}"
    lines = [ln for ln in (known.read_text().splitlines() if known.exists() else []) if ln.split(" ")[0] != entry]
    known.write_text("".join(ln + "\n" for ln in [*lines, f"{entry} {host_pub}"]))
    cfg = own / "sshd_config"
    cfg.write_text(
        "\n".join(
            [
                f"Port {port}",
                f"ListenAddress {host.address}",
                f"HostKey {own / 'host_ed25519'}",
                f"AuthorizedKeysFile {auth}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "UseDNS no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "MaxSessions 64",
                "MaxStartups 64",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    log_path = own / "sshd.log"
    with open(log_path, "wb") as log:
        proc = host.popen(
            [sshd, "-D", "-e", "-f", str(cfg), "-o", "PidFile=none"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
        )
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise TestbedError(f"sshd in {host.name} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection((host.address, port), timeout=0.5) as s:
                s.settimeout(2)
                if s.recv(4).startswith(b"SSH-"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TestbedError(f"sshd in {host.name} did not answer on {host.address}:{port} within {timeout_s} s")
        time.sleep(0.05)
    return HostSshd(
        host=host, port=port, client_key=client_key, known_hosts=known, user=getpass.getuser(), proc=proc, dir=folder
    )


# -- pytest fixtures -----------------------------------------------------------------------------------------------


def open_testbed(n_hosts: int = 2, **kwargs) -> Testbed:
    """A testbed on the first free prefix of ``btbt``, ``btbt1``, ``btbt2``... (another run, or a persistent
    benchmark testbed, may hold the first; ``$BTBT_TEST_PREFIX`` replaces ``btbt``, so a test can look for what
    one run left without another run taking the same names meanwhile). The leftovers of crashed runs (of any
    prefix) are swept first."""
    sweep_stale()
    base = os.environ.get("BTBT_TEST_PREFIX") or DEFAULT_PREFIX
    last: Exception | None = None
    for i in range(10):
        prefix = base if i == 0 else f"{base}{i}"
        try:
            return Testbed(n_hosts, prefix=prefix, **kwargs)
        except TestbedBusy as e:
            last = e
    raise TestbedError(f"no free testbed prefix: {last}")


@pytest.fixture
def make_testbed():
    """Factory: ``make_testbed(n_hosts, rate_gbit=..., delay_us=...)``; every testbed made is closed at teardown
    (also when the test failed)."""
    require_testbed()
    made: list[Testbed] = []

    def make(n_hosts: int = 2, **kwargs) -> Testbed:
        tb = open_testbed(n_hosts, **kwargs)
        made.append(tb)
        return tb

    yield make
    for tb in made:
        tb.close()


@pytest.fixture
def testbed(make_testbed):
    """Two hosts, 10 Gbit/s links, no added delay."""
    return make_testbed(2, rate_gbit=10.0)
