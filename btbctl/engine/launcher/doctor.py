"""``btbctl doctor``: can every host of a cluster file run its workers?

For each ``[[hosts]]`` entry: connect over SSH (reachable? host key and authentication accepted?), then run a small
fixed Python probe with the host's Python (its ``command_prefix`` first) that reports the Python version, whether
btbctl and SGLang are importable, whether the worker ports are free on the host's bind address, GPUs
(``nvidia-smi -L``) and RDMA devices (``/sys/class/infiniband``). Workers on this machine are probed the same way
with a local subprocess, so a cluster file without hosts is checked too.

In replication mode ``l3`` every place that runs workers also runs a node agent, and SGLang loads btbctl's L3
backend (``btbctl.sglang_l3``) into each worker: there the probe also checks that the agent's Python can start
``btbctl agent`` (btbctl with its dependencies), that every SGLang worker's Python (its ``python``, else the host's)
imports ``btbctl.sglang_l3`` (installed there with ``pip install --no-deps``: :data:`L3_INSTALL`), that the agent's
fixed ports (``replication.peer_port``, ``control_port``; 0 is picked at ``up``) are free, and that ``/dev/shm`` has
room for the agent's arena (``replication.arena_mib``, allocated when the agent starts). A row then carries ``l3``:
``{"arena_mib", "shm_free_mib", "sglang_l3": {python: "ok" | why not}}`` (None in other modes). The agent's Python
and other interpreters than the row's own are probed with :data:`IMPORT_PROBE_CODE` (over the same SSH connection
on a host).

Where a host runs a node agent, its agent must reach the gateways' registration listener on this machine
(``[gateway] register_host``, else the address this machine sends from towards the host): doctor listens there on a
free port for the check and has the host's Python connect to it. A row then carries ``register``: ``"ok"``, why
not (a problem: the agent could not register), or why it was not checked (an address that is not this machine's,
such as a NAT's).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from btbctl import __version__
from btbctl.engine.launcher.cluster import ClusterFile
from btbctl.engine.launcher.hosts import HostSpec

#: Seconds the probe may run on one host (``nvidia-smi -L`` answers in well under a second on a healthy node).
PROBE_TIMEOUT_S = 30.0

#: How SGLang's Python gets btbctl's L3 backend, run in a btbctl checkout (docs/sglang-install.md; the SGLang image
#: runs the same command): without dependencies, since ``btbctl.sglang_l3`` needs only the standard library and
#: SGLang's own torch.
L3_INSTALL = "{python} -m pip install --no-deps ."

# Sets out["btbctl"] (installed version, "present", or None) and out["sglang_l3"] ("ok" or why not): the modules
# SGLang's scheduler imports from btbctl (the store module, which needs torch and SGLang, is only located).
_IMPORTS = r"""
try:
    from importlib.metadata import version
    out["btbctl"] = version("btbctl")
except Exception:
    out["btbctl"] = "present" if importlib.util.find_spec("btbctl") else None
try:
    import btbctl.sglang_l3, btbctl.sglang_l3.client, btbctl.sglang_l3.config, btbctl.sglang_l3.wire
    found = importlib.util.find_spec("btbctl.sglang_l3.store")
    out["sglang_l3"] = "ok" if found else "btbctl.sglang_l3.store is missing"
except Exception as e:
    out["sglang_l3"] = (("%s: %s" % (type(e).__name__, e)).strip().splitlines() or ["import failed"])[0]
"""

# argv: BIND_ADDRESS PORT... ; prints one JSON object.
PROBE_CODE = (
    r"""
import importlib.util, json, os, platform, shutil, socket, subprocess, sys
bind, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
out = {"python": platform.python_version(), "btbctl": None, "sglang": None, "ports": {}, "gpus": None,
       "rdma": None, "setsid": shutil.which("setsid") is not None, "shm_free_mib": None, "sglang_l3": None}
try:
    st = os.statvfs("/dev/shm")
    out["shm_free_mib"] = st.f_bavail * st.f_frsize // (1 << 20)
except OSError:
    pass
"""
    + _IMPORTS
    + r"""
try:
    if importlib.util.find_spec("sglang"):
        from importlib.metadata import version
        try:
            out["sglang"] = version("sglang")
        except Exception:
            out["sglang"] = "present"
except Exception:
    pass
for p in ports:
    fam = socket.AF_INET6 if ":" in bind else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.bind((bind.strip("[]"), p))
        out["ports"][str(p)] = "free"
    except OSError as e:
        out["ports"][str(p)] = e.strerror or str(e)
    finally:
        s.close()
smi = shutil.which("nvidia-smi")
if smi:
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
        out["gpus"] = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("GPU")]
    except Exception as e:
        out["gpus"] = ["nvidia-smi failed: %s" % e]
try:
    out["rdma"] = sorted(os.listdir("/sys/class/infiniband"))
except OSError:
    out["rdma"] = []
print(json.dumps(out))
"""
)

#: Listen backlog of the registration check's listener (its connections are closed as soon as accepted).
REACH_BACKLOG = 16

# argv: ADDRESS PORT; prints one JSON object {"register": "ok" | why not}: whether this host reaches ADDRESS:PORT.
REACH_PROBE_CODE = r"""
import json, socket, sys
try:
    socket.create_connection((sys.argv[1].strip("[]"), int(sys.argv[2])), timeout=5).close()
    out = "ok"
except OSError as e:
    out = "%s: %s" % (type(e).__name__, e.strerror or e)
print(json.dumps({"register": out}))
"""

# argv: [agent]; prints {"btbctl", "sglang_l3", "agent"}: what one interpreter of a place imports (a worker's or the
# node agent's Python). With "agent": whether `python -m btbctl agent` can start there ("ok" or why not: the agent
# needs btbctl with its dependencies, which a --no-deps install leaves out).
IMPORT_PROBE_CODE = (
    'import importlib, importlib.util, json, sys\nout = {"btbctl": None, "sglang_l3": None, "agent": None}\n'
    + _IMPORTS
    + r"""
if "agent" in sys.argv[1:]:
    try:  # the agent and what its command line needs (the CLI's own libraries)
        for name in ("btbctl.engine.agent.agent", "typer", "rich"):
            importlib.import_module(name)
        out["agent"] = "ok"
    except Exception as e:
        out["agent"] = (("%s: %s" % (type(e).__name__, e)).strip().splitlines() or ["import failed"])[0]
print(json.dumps(out))
"""
)


def _ports_by_place(cluster: ClusterFile) -> dict[str, tuple[str, list[int]]]:
    """``{host name or local address: (bind address, [fixed ports])}``; ports 0 (picked at ``up``) are left out."""
    places: dict[str, tuple[str, list[int]]] = {}
    for inst in cluster.instances():
        host = cluster.host_of(inst.spec)
        key = host.name if host is not None else f"local {inst.spec.host}"
        bind = host.bind_address if host is not None else inst.spec.host
        ports = places.setdefault(key, (bind, []))[1]
        ports += [p for p in (inst.port, inst.transfer_port) if p]
    rep = cluster.replication
    for host in cluster.agent_hosts():  # l3: one agent per place with workers
        if host is not None:
            bind, ports = places.setdefault(host.name, (host.bind_address, []))
            ports += [p for p in (rep.peer_port, rep.control_port) if p]
        else:
            places.setdefault(f"local {rep.local_peer_host}", (rep.local_peer_host, []))[1].extend(
                [rep.peer_port] if rep.peer_port else []
            )
            places.setdefault("local 127.0.0.1", ("127.0.0.1", []))[1].extend(
                [rep.control_port] if rep.control_port else []
            )
    gw = cluster.gateway
    for h, p in ((gw.host, gw.port), (gw.control_host, gw.control_port)):
        places.setdefault(f"local {h}", (h, []))[1].extend([p] if p else [])
    return places


@dataclass
class _Needs:
    """What one place must provide: the probe runs with ``python``; ``btbctl``/``sglang``: that Python must import
    them; ``arena_mib``: the place runs an ``l3`` node agent; ``l3_pythons``: interpreters of that place with their
    role, ``agent`` (runs ``btbctl agent``: imports btbctl) or ``sglang`` (an SGLang worker: imports
    ``btbctl.sglang_l3``)."""

    python: str
    btbctl: bool = False
    sglang: bool = False
    arena_mib: int | None = None
    l3_pythons: list[tuple[str, str]] = field(default_factory=list)
    gpu_ids: set[int] = field(default_factory=set)
    """GPU ids the workers of this place ask for (``gpu_ids`` of their ``[[workers]]`` entries)."""
    register: tuple[str, int] | str | None = None
    """A host's node agent: ``(address, port)`` of this machine it must reach to register (doctor listens there),
    or why that is not checked; None: no agent on a host."""

    def add(self, python: str, role: str) -> None:
        if (python, role) not in self.l3_pythons:
            self.l3_pythons.append((python, role))

    def import_probes(self) -> dict[str, bool]:
        """``{interpreter: with the agent check}`` to run :data:`IMPORT_PROBE_CODE` with: every one but ``python``,
        and the agent's always (the main probe does not import the agent's dependencies)."""
        out: dict[str, bool] = {}
        for py, role in self.l3_pythons:
            if py != self.python or role == "agent":
                out[py] = out.get(py, False) or role == "agent"
        return out


def _ports_of_running_fleets() -> dict[int, str]:
    """``{port: fleet name}`` of the gateway and control ports of the fleets running on this machine (their run
    directories under the state directory), so a busy port can be blamed on the fleet that holds it."""
    from urllib.parse import urlsplit

    from btbctl.engine.launcher.fleet import list_fleets

    out: dict[int, str] = {}
    for f in list_fleets():
        if f["state"] not in ("running", "degraded"):
            continue
        for url in (f["gateway_url"], f["control_url"]):
            try:
                port = urlsplit(url or "").port
            except ValueError:
                port = None
            if port:
                out[port] = f["name"]
    return out


def _row(name: str, address: str) -> dict:
    return {
        "host": name,
        "address": address,
        "reachable": None,
        "auth": None,
        "python": None,
        "btbctl": None,
        "sglang": None,
        "ports": {},
        "gpus": None,
        "rdma": None,
        "l3": None,
        "register": None,
        "problems": [],
    }


def l3_fix(python: str) -> str:
    """One line: how to make ``python`` (SGLang's) import btbctl's L3 backend."""
    cmd = L3_INSTALL.format(python=shlex.quote(python))
    return f"fix: in a btbctl {__version__} checkout run `{cmd}` (docs/sglang-install.md)"


def _fill(row: dict, probe: dict, needs: _Needs, others: dict[str, dict]) -> None:
    """Fill ``row`` from the probe of ``needs.python`` and ``others`` (``{python: its import probe, or {"error":
    why}}``) and list the problems."""
    row.update({k: probe.get(k) for k in ("python", "btbctl", "sglang", "ports", "gpus", "rdma")})
    if needs.btbctl and not row["btbctl"]:
        row["problems"].append("btbctl is not importable by this Python")
    if needs.arena_mib is not None or needs.l3_pythons:
        shm = probe.get("shm_free_mib")
        row["l3"] = {"arena_mib": needs.arena_mib, "shm_free_mib": shm, "sglang_l3": {}}
        if isinstance(shm, int) and needs.arena_mib is not None and shm < needs.arena_mib:
            row["problems"].append(
                f"/dev/shm has {shm} MiB free; the node agent's arena needs {needs.arena_mib} MiB "
                "(replication.arena_mib)"
            )
    failed: set[str] = set()
    for py, role in needs.l3_pythons:
        got = others.get(py) or (probe if py == needs.python else {"error": "not probed"})
        if got.get("error"):
            if py not in failed:
                row["problems"].append(f"{got['error']}: {py}")
                failed.add(py)
            if role == "sglang":
                row["l3"]["sglang_l3"][py] = got["error"]
            continue
        if role == "agent" and got.get("agent") != "ok":
            row["problems"].append(
                f"the node agent cannot run with {py} ({got.get('agent') or 'not probed'}); it needs btbctl with its "
                "dependencies there (`pip install .` in a btbctl checkout), or set replication.python"
            )
        elif role == "sglang":
            status = got.get("sglang_l3") or "not probed"
            row["l3"]["sglang_l3"][py] = status
            if status != "ok":
                row["problems"].append(f"SGLang's Python {py} cannot import btbctl.sglang_l3 ({status}); {l3_fix(py)}")
    if needs.sglang and not row["sglang"]:
        row["problems"].append("sglang is not importable by this Python")
    held = (
        _ports_of_running_fleets()
        if row["host"] == "local" and any(st != "free" for st in (row["ports"] or {}).values())
        else {}
    )
    for port, st in (row["ports"] or {}).items():
        if st != "free":
            fleet = held.get(int(port))
            row["problems"].append(
                f"port {port}: {st}"
                + (
                    f" (btbctl fleet {fleet} holds it: `btbctl down --fleet {fleet}` first, or start this one as "
                    "another named fleet, which takes free gateway ports)"
                    if fleet
                    else ""
                )
            )
    if probe.get("setsid") is False:
        row["problems"].append("setsid is not installed (util-linux)")
    if needs.gpu_ids:
        gpus = row["gpus"]
        asked = sorted(needs.gpu_ids)
        found = [g for g in gpus or [] if g.startswith("GPU")]
        if not found:
            seen = "no nvidia-smi" if gpus is None else "nvidia-smi lists none"
            row["problems"].append(f"gpus: none ({seen}), but workers ask for gpu_ids {asked}")
        elif asked[-1] >= len(found):
            row["problems"].append(f"gpus: {len(found)} (ids 0..{len(found) - 1}), but workers ask for gpu_ids {asked}")


def _parse_probe(out: bytes | str) -> dict | None:
    text = out.decode("utf-8", "replace") if isinstance(out, bytes) else out
    for line in reversed(text.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def _import_result(rc: int | None, out: bytes | str, not_found: bool) -> dict:
    """An import probe's answer, or ``{"error": why}``."""
    if not_found:
        return {"error": "command not found"}
    got = _parse_probe(out)
    return got if got is not None else {"error": f"the import probe failed with status {rc}"}


async def _check_host(host: HostSpec, ports: list[int], needs: _Needs) -> dict:
    from btbctl.engine.launcher import ssh

    row = _row(host.name, f"{host.address}:{host.port}")
    try:
        conn = await ssh.connect(host)
    except ssh.SshFailure as e:
        refused = e.cause in ("connection refused", "unreachable", "ssh error")
        row["reachable"] = "no" if refused else "yes"
        row["auth"] = None if refused else "no"
        row["problems"].append(f"{e.cause}: {e.detail}" if e.detail else e.cause)
        return row
    row["reachable"] = row["auth"] = "yes"
    others: dict[str, dict] = {}
    try:
        argv = list(host.command_prefix) + [host.python, "-c", PROBE_CODE, host.bind_address, *map(str, ports)]
        rc, out = await ssh.run_script(conn, '"$@"', argv, timeout_s=PROBE_TIMEOUT_S)
        for py, agent in needs.import_probes().items():
            argv = list(host.command_prefix) + [py, "-c", IMPORT_PROBE_CODE] + (["agent"] if agent else [])
            irc, iout = await ssh.run_script(conn, '"$@"', argv, timeout_s=PROBE_TIMEOUT_S)
            others[py] = _import_result(irc, iout, irc == ssh.EXIT_NOT_FOUND)
        if isinstance(needs.register, tuple):
            addr, port = needs.register
            argv = list(host.command_prefix) + [host.python, "-c", REACH_PROBE_CODE, addr, str(port)]
            _, rout = await ssh.run_script(conn, '"$@"', argv, timeout_s=PROBE_TIMEOUT_S)
            reach = _parse_probe(rout)
            row["register"] = str(reach.get("register")) if reach else "the reach probe printed nothing"
            if row["register"] != "ok":
                row["problems"].append(
                    f"this host cannot reach this machine's registration address {addr}:{port} "
                    f"({row['register']}): its node agent could not register with the gateways; let it through, "
                    "or set [gateway] register_host to the address the host reaches this machine at"
                )
        elif needs.register is not None:
            row["register"] = needs.register
    except asyncio.TimeoutError:
        row["problems"].append(f"the probe did not finish within {PROBE_TIMEOUT_S:g} s")
        return row
    finally:
        conn.close()
    probe = _parse_probe(out)
    if rc == ssh.EXIT_NOT_FOUND:
        row["python"] = "not found"
        row["problems"].append(f"command not found: {host.python}")
    elif probe is None:
        last = out.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"status {rc}"]
        row["problems"].append(f"probe failed: {last[0]}")
    else:
        _fill(row, probe, needs, others)
    return row


def _run_local(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)


def _check_local(address: str, ports: list[int], needs: _Needs) -> dict:
    row = _row("local", address)
    row["reachable"] = row["auth"] = "yes"
    try:
        res = _run_local([needs.python, "-c", PROBE_CODE, address, *map(str, ports)])
    except FileNotFoundError:
        row["python"] = "not found"
        row["problems"].append(f"command not found: {needs.python}")
        return row
    except subprocess.TimeoutExpired:
        row["problems"].append(f"the probe did not finish within {PROBE_TIMEOUT_S:g} s")
        return row
    others: dict[str, dict] = {}
    for py, agent in needs.import_probes().items():
        try:
            r = _run_local([py, "-c", IMPORT_PROBE_CODE] + (["agent"] if agent else []))
            others[py] = _import_result(r.returncode, r.stdout, False)
        except (FileNotFoundError, PermissionError):
            others[py] = _import_result(None, b"", True)
        except subprocess.TimeoutExpired:
            others[py] = {"error": f"the import probe did not finish within {PROBE_TIMEOUT_S:g} s"}
    probe = _parse_probe(res.stdout)
    if probe is None:
        row["problems"].append(f"probe failed with status {res.returncode}")
    else:
        _fill(row, probe, needs, others)
    return row


def _needs(cluster: ClusterFile) -> dict[str, _Needs]:
    """``{place key: _Needs}`` of every place with workers (keys as :func:`_ports_by_place`)."""
    l3 = cluster.replication_mode == "l3"
    rep = cluster.replication
    needs: dict[str, _Needs] = {}
    for spec in cluster.workers:
        host = cluster.host_of(spec)
        key = host.name if host is not None else f"local {spec.host}"
        python = spec.python or (host.python if host is not None else sys.executable)
        # the probe's Python: the host's on a [[hosts]] entry, the first worker's on this machine
        n = needs.setdefault(key, _Needs(host.python if host is not None else python))
        n.btbctl = n.btbctl or (spec.kind == "emulated" and spec.command is None)
        launched_sglang = spec.kind == "sglang" and spec.command is None
        n.sglang = n.sglang or launched_sglang
        n.gpu_ids.update(spec.gpu_ids or ())
        if l3 and launched_sglang:
            n.add(python, "sglang")
    for h, first_host in _agent_places(cluster):
        n = needs[h.name if h is not None else f"local {first_host}"]
        n.arena_mib = rep.arena_mib
        n.add(rep.python or (h.python if h is not None else sys.executable), "agent")
    return needs


def doctor(cluster: ClusterFile) -> dict:
    """Check every place ``cluster`` runs something.

    Returns ``{"ok": bool, "hosts": [row]}``; a row (keys stable) is ``{"host", "address", "reachable", "auth",
    "python", "btbctl", "sglang", "ports": {port: "free" | reason}, "gpus": [line] | None (no nvidia-smi),
    "rdma": [device], "l3": {"arena_mib", "shm_free_mib", "sglang_l3": {python: "ok" | why}} | None,
    "register": "ok" | why not | None (no node agent on a host), "problems": [line]}``. ``ok`` is true when no row
    has problems. Hosts are checked in parallel. In replication
    mode ``l3`` the agent's Python must start ``btbctl agent``, every SGLang worker's Python must import
    ``btbctl.sglang_l3`` (SGLang loads the L3 backend from it) and the agent's arena must fit in ``/dev/shm``.
    """
    places = _ports_by_place(cluster)
    needs = _needs(cluster)
    remote = [(h, places.get(h.name, (h.bind_address, []))[1]) for h in cluster.hosts]

    async def _all():
        servers = await _registration_listeners(cluster, needs)
        try:
            return await asyncio.gather(
                *[_check_host(h, ports, needs.get(h.name) or _Needs(h.python)) for h, ports in remote]
            )
        finally:
            for srv in servers:
                srv.close()

    rows = []
    for key, (bind, ports) in places.items():
        if key.startswith("local "):
            rows.append(_check_local(bind, ports, needs.get(key) or _Needs(sys.executable, btbctl=True)))
    rows += asyncio.run(_all()) if remote else []
    return {"ok": not any(r["problems"] for r in rows), "hosts": rows}


async def _registration_listeners(cluster: ClusterFile, needs: dict[str, _Needs]) -> list[asyncio.Server]:
    """For each host with a node agent: listen on a free port of the address its agent would register at (set in
    its ``_Needs.register``; connections are closed at once), or say why that is not checked. Returns the
    listeners (the caller closes them)."""
    servers: list[asyncio.Server] = []
    by_addr: dict[str, tuple[str, int] | str] = {}

    async def drop(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    for h in cluster.agent_hosts():
        if h is None or h.name not in needs:
            continue
        try:
            addr = cluster.register_address(h)
        except OSError as e:
            needs[h.name].register = f"not checked: no route from this machine to {h.address} ({e.strerror or e})"
            continue
        if addr not in by_addr:
            try:
                srv = await asyncio.start_server(drop, addr.strip("[]"), 0, backlog=REACH_BACKLOG)
                servers.append(srv)
                by_addr[addr] = (addr, srv.sockets[0].getsockname()[1])
            except OSError as e:
                by_addr[addr] = f"not checked: cannot listen on {addr} here ({e.strerror or e}; a NAT's address?)"
        needs[h.name].register = by_addr[addr]
    return servers


def _agent_places(cluster: ClusterFile) -> list[tuple[HostSpec | None, str]]:
    """``(host, address of its first worker)`` of each place that runs a node agent (l3; empty otherwise)."""
    out = []
    for h in cluster.agent_hosts():
        first = next(s for s in cluster.workers if cluster.host_of(s) == h)
        out.append((h, first.host))
    return out


__all__ = ["IMPORT_PROBE_CODE", "L3_INSTALL", "PROBE_CODE", "REACH_PROBE_CODE", "doctor", "l3_fix"]
