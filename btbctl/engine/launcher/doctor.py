"""``btbctl doctor``: can every host of a cluster file run its workers?

For each ``[[hosts]]`` entry: connect over SSH (reachable? host key and authentication accepted?), then run a small
fixed Python probe with the host's Python (its ``command_prefix`` first) that reports the Python version, whether
btbctl and SGLang are importable, whether the worker ports are free on the host's bind address, GPUs
(``nvidia-smi -L``) and RDMA devices (``/sys/class/infiniband``). Workers on this machine are probed the same way
with a local subprocess, so a cluster file without hosts is checked too.

In replication mode ``l3`` every place that runs workers also runs a node agent, and SGLang loads btbctl's L3
backend (``btbctl.sglang_l3``) into each worker: there the probe also checks that btbctl is importable by the
workers' Python, that the agent's fixed ports (``replication.peer_port``, ``control_port``; 0 is picked at ``up``)
are free, and that ``/dev/shm`` has room for the agent's arena (``replication.arena_mib``, allocated when the agent
starts). A row then carries ``l3``: ``{"arena_mib", "shm_free_mib"}`` (None in other modes).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from btbctl.engine.launcher.cluster import ClusterFile
from btbctl.engine.launcher.hosts import HostSpec

#: Seconds the probe may run on one host (``nvidia-smi -L`` answers in well under a second on a healthy node).
PROBE_TIMEOUT_S = 30.0

# argv: BIND_ADDRESS PORT... ; prints one JSON object.
PROBE_CODE = r"""
import importlib.util, json, os, platform, shutil, socket, subprocess, sys
bind, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
out = {"python": platform.python_version(), "btbctl": None, "sglang": None, "ports": {}, "gpus": None,
       "rdma": None, "setsid": shutil.which("setsid") is not None, "shm_free_mib": None}
try:
    st = os.statvfs("/dev/shm")
    out["shm_free_mib"] = st.f_bavail * st.f_frsize // (1 << 20)
except OSError:
    pass
try:
    from importlib.metadata import version
    out["btbctl"] = version("btbctl")
except Exception:
    out["btbctl"] = "present" if importlib.util.find_spec("btbctl") else None
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
        "problems": [],
    }


def _fill(row: dict, probe: dict, need_btbctl: bool, need_sglang: bool, arena_mib: int | None = None) -> None:
    row.update({k: probe.get(k) for k in ("python", "btbctl", "sglang", "ports", "gpus", "rdma")})
    if need_btbctl and not row["btbctl"]:
        why = " (replication mode l3: the node agent and SGLang's L3 backend need it)" if arena_mib else ""
        row["problems"].append(f"btbctl is not importable by this Python{why}")
    if arena_mib is not None:
        shm = probe.get("shm_free_mib")
        row["l3"] = {"arena_mib": arena_mib, "shm_free_mib": shm}
        if isinstance(shm, int) and shm < arena_mib:
            row["problems"].append(
                f"/dev/shm has {shm} MiB free; the node agent's arena needs {arena_mib} MiB (replication.arena_mib)"
            )
    if need_sglang and not row["sglang"]:
        row["problems"].append("sglang is not importable by this Python")
    for port, st in (row["ports"] or {}).items():
        if st != "free":
            row["problems"].append(f"port {port}: {st}")
    if probe.get("setsid") is False:
        row["problems"].append("setsid is not installed (util-linux)")


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


async def _check_host(
    host: HostSpec, ports: list[int], need_btbctl: bool, need_sglang: bool, arena_mib: int | None = None
) -> dict:
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
    try:
        argv = list(host.command_prefix) + [host.python, "-c", PROBE_CODE, host.bind_address, *map(str, ports)]
        rc, out = await ssh.run_script(conn, '"$@"', argv, timeout_s=PROBE_TIMEOUT_S)
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
        _fill(row, probe, need_btbctl, need_sglang, arena_mib)
    return row


def _check_local(
    address: str, ports: list[int], need_btbctl: bool, need_sglang: bool, python: str, arena_mib: int | None = None
) -> dict:
    row = _row("local", address)
    row["reachable"] = row["auth"] = "yes"
    try:
        res = subprocess.run(
            [python, "-c", PROBE_CODE, address, *map(str, ports)],
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        row["python"] = "not found"
        row["problems"].append(f"command not found: {python}")
        return row
    except subprocess.TimeoutExpired:
        row["problems"].append(f"the probe did not finish within {PROBE_TIMEOUT_S:g} s")
        return row
    probe = _parse_probe(res.stdout)
    if probe is None:
        row["problems"].append(f"probe failed with status {res.returncode}")
    else:
        _fill(row, probe, need_btbctl, need_sglang, arena_mib)
    return row


def doctor(cluster: ClusterFile) -> dict:
    """Check every place ``cluster`` runs something.

    Returns ``{"ok": bool, "hosts": [row]}``; a row (keys stable) is ``{"host", "address", "reachable", "auth",
    "python", "btbctl", "sglang", "ports": {port: "free" | reason}, "gpus": [line] | None (no nvidia-smi),
    "rdma": [device], "l3": {"arena_mib", "shm_free_mib"} | None, "problems": [line]}``. ``ok`` is true when no
    row has problems. Hosts are checked in parallel. In replication mode ``l3`` every worker's Python must import
    btbctl (the agent runs it, SGLang loads its L3 backend) and the agent's arena must fit in ``/dev/shm``.
    """
    l3 = cluster.replication_mode == "l3"
    arena = cluster.replication.arena_mib if l3 else None
    places = _ports_by_place(cluster)
    needs: dict[str, tuple[bool, bool, str]] = {}
    for spec in cluster.workers:
        host = cluster.host_of(spec)
        key = host.name if host is not None else f"local {spec.host}"
        b, s, py = needs.get(key, (False, False, spec.python or (host.python if host else sys.executable)))
        emulated = spec.kind == "emulated" and spec.command is None
        needs[key] = (b or emulated or l3, s or (spec.kind == "sglang" and spec.command is None), py)
    agent_places = {h.name if h is not None else f"local {spec_host}" for h, spec_host in _agent_places(cluster)}
    remote = [(h, places.get(h.name, (h.bind_address, []))[1]) for h in cluster.hosts]

    async def _all():
        return await asyncio.gather(
            *[
                _check_host(
                    h, ports, *needs.get(h.name, (False, False, ""))[:2], arena if h.name in agent_places else None
                )
                for h, ports in remote
            ]
        )

    rows = []
    for key, (bind, ports) in places.items():
        if key.startswith("local "):
            need = needs.get(key, (True, False, sys.executable))
            rows.append(_check_local(bind, ports, need[0], need[1], need[2], arena if key in agent_places else None))
    rows += asyncio.run(_all()) if remote else []
    return {"ok": not any(r["problems"] for r in rows), "hosts": rows}


def _agent_places(cluster: ClusterFile) -> list[tuple[HostSpec | None, str]]:
    """``(host, address of its first worker)`` of each place that runs a node agent (l3; empty otherwise)."""
    out = []
    for h in cluster.agent_hosts():
        first = next(s for s in cluster.workers if cluster.host_of(s) == h)
        out.append((h, first.host))
    return out


__all__ = ["PROBE_CODE", "doctor"]
