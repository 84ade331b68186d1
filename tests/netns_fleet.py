"""A BTB fleet on the namespace testbed (not a test module): two hosts, each with its sshd, two emulated workers and
(``l3`` mode) its node agent, brought up by ``btbctl up -d`` from the operator side, with helpers to replay a burst
with ``btbctl bench`` and read what the gateway did (copies, proofs, Prometheus counters)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from btbctl.engine.launcher.rundir import RunDir, process_start_time
from launcher_helpers import cli, force_cleanup, http_json

ROOT = Path(__file__).resolve().parents[1]

#: Emulated workers: Llama-3.3-70B on 4 x H100, compute 2x faster than modelled, KV bytes / 64 (a 4-block prefix is
#: then 5.2 MB per worker: 0.21 s at 0.2 Gbit/s).
WORKER = {"time_scale": 2.0, "kv_bytes_scale": 64, "ready_timeout_s": 30.0}
PREFIX_BLOCKS = 4
PAGE = 256


def _toml(v) -> str:
    return (
        json.dumps(v) if not isinstance(v, dict) else "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    )


def host_entry(server) -> dict:
    """A ``[[hosts]]`` entry reaching ``server`` (a :class:`netns.HostSshd`) at its namespace address; the remote
    Python is this one (the namespaces share the file system)."""
    return {
        "name": server.host.name,
        "address": server.host.address,
        "port": server.port,
        "user": server.user,
        "identity_file": str(server.client_key),
        "known_hosts": str(server.known_hosts),
        "python": sys.executable,
        "workdir": str(server.dir / "remote" / server.host.name),
        "env": {"PYTHONPATH": str(ROOT)},
        "connect_timeout_s": 5.0,
        "start_timeout_s": 30.0,
    }


def fleet_toml(
    hosts: list[dict],
    mode: str,
    *,
    policy: str | None = "btb",
    workers_per_host: int = 2,
    worker: dict | None = None,
    base_worker: dict | None = None,
    replication: dict | None = None,
    gateway: dict | None = None,
    prefix_blocks: int = PREFIX_BLOCKS,
    max_retries: int | None = 3,
) -> str:
    """The cluster file (TOML text) of a fleet on ``hosts`` (``[[hosts]]`` entries, :func:`host_entry`'s shape):
    ``workers_per_host`` emulated workers on each host (entries ``n0``/``n1``..., workers ``n0-0``...),
    replication ``mode`` (``arena_mib`` 64 unless ``replication`` says otherwise), ``[btb] prefix_blocks =
    prefix_blocks, threshold = 2, window_s = 1.0, warm_replicas = 4``.

    ``policy``: the gateway's routing policy (None: the gateway's default); ``base_worker``: the worker settings
    every entry starts from (None: :data:`WORKER`), ``worker`` laid over them; ``gateway``: more gateway settings
    (``[gateway.settings]``); ``max_retries``: the gateway's (None: its default). Raises ValueError for no host or
    ``workers_per_host`` < 1."""
    if not hosts or workers_per_host < 1:
        raise ValueError(f"need at least one host and one worker per host, got {len(hosts)} x {workers_per_host}")
    lines = ["[gateway]"]
    if policy is not None:
        lines.append(f"policy = {_toml(policy)}")
    lines += ["port = 0", "control_port = 0"]
    if max_retries is not None:
        lines.append(f"max_retries = {max_retries}")
    lines.append("")
    if gateway:
        lines.append("[gateway.settings]")
        lines += [f"{k} = {_toml(v)}" for k, v in gateway.items()]
        lines.append("")
    lines += [
        "[btb]",
        f"prefix_blocks = {prefix_blocks}",
        "threshold = 2",
        "window_s = 1.0",
        "warm_replicas = 4",
        "",
        "[replication]",
        f"mode = {_toml(mode)}",
    ]
    lines += [f"{k} = {_toml(v)}" for k, v in {"arena_mib": 64, **(replication or {})}.items()]
    lines.append("")
    for h in hosts:
        lines.append("[[hosts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in h.items()]
        lines.append("")
    base = WORKER if base_worker is None else base_worker
    for i, h in enumerate(hosts):
        lines.append("[[workers]]")
        w = {"name": f"n{i}", "host": h["name"], "count": workers_per_host, **base, **(worker or {})}
        lines += [f"{k} = {_toml(v)}" for k, v in w.items()]
        lines.append("")
    return "\n".join(lines)


def write_fleet(path: Path, servers, mode: str, **kw) -> Path:
    """Write :func:`fleet_toml` (keyword arguments as there) for ``servers`` (:class:`netns.HostSshd`, reached
    through :func:`host_entry`) to ``path``. The tests' fleets keep its defaults: two workers per host and the
    ``btb`` policy, the published rule, which copies as soon as the detector fires (these tests measure the copy
    path; btb_plus, the default, finds a 4-block prefix cheaper to recompute than to copy over these links and
    makes no copy)."""
    path.write_text(fleet_toml([host_entry(s) for s in servers], mode, **kw))
    return path


@dataclass
class Fleet:
    """A fleet ``up`` started: its status (``btbctl status --format json``), run directory and testbed."""

    status: dict
    run_dir: Path
    testbed: object
    tmp: Path

    @property
    def control(self) -> str:
        return self.status["control_url"].rstrip("/")

    def host_of_url(self, url: str) -> str:
        """The testbed host (name) a worker URL is on."""
        addr = urlparse(url).hostname
        return next(h.name for h in self.testbed.hosts if h.address == addr)

    def pid(self, name: str) -> int:
        state = RunDir(self.run_dir).load()
        return next(p.pid for p in state.processes if p.name == name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the process group ``up`` recorded for ``name`` (a worker or an agent, on any host: the
        namespaces share the PID space)."""
        state = RunDir(self.run_dir).load()
        os.killpg(next(p.pgid for p in state.processes if p.name == name), sig)

    def worker_name(self, url: str) -> str:
        return next(w["name"] for w in self.status["workers"] if w["url"].rstrip("/") == url.rstrip("/"))

    def bench(
        self,
        seed: int,
        n: int,
        spread_s: float,
        timeout: float = 120.0,
        background: bool = False,
        prefix_blocks: int = PREFIX_BLOCKS,
    ):
        """``btbctl bench`` of one burst (``n`` requests over ``spread_s``, a fresh prefix per ``seed``); returns
        ``(report, per-request lines)``, or with ``background`` the running process (see :meth:`bench_result`)."""
        out = self.tmp / f"requests-{seed}.jsonl"
        args = [
            "bench",
            "--run-dir",
            str(self.run_dir),
            "--burst-size",
            str(n),
            "--prefix-blocks",
            str(prefix_blocks),
            "--spread-s",
            str(spread_s),
            "--seed",
            str(seed),
            "--requests-out",
            str(out),
            "--format",
            "json",
        ]
        if background:
            import subprocess

            env = dict(os.environ)
            env.pop("BTBCTL_RUN_DIR", None)
            return subprocess.Popen(
                [sys.executable, "-m", "btbctl", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=env,
            ), out
        proc = cli(*args, timeout=timeout)
        return json.loads(proc.stdout), read_lines(out)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.status["gateway_url"].rstrip("/") + "/metrics", timeout=10) as r:
            return r.read().decode()

    def transfers(self) -> dict:
        return http_json(self.control + "/control/transfers")

    def wait_transfer(self, pred, timeout_s: float = 20.0) -> dict:
        """The first transfer of ``GET /control/transfers`` for which ``pred`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            tr = self.transfers()
            for t in tr["transfers"]:
                if pred(t):
                    return t
            assert time.monotonic() < deadline, f"no such transfer within {timeout_s} s: {tr}"
            time.sleep(0.02)

    def settle(self, timeout_s: float = 60.0) -> dict:
        """``GET /control/transfers`` once no copy is in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            tr = self.transfers()
            if tr["in_flight"] == 0:
                return tr
            assert time.monotonic() < deadline, f"copies still in flight after {timeout_s} s: {tr}"
            time.sleep(0.1)


def bench_result(proc, out: Path, timeout: float = 120.0):
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"bench exited {proc.returncode}: {stderr}"
    return json.loads(stdout), read_lines(out)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def start_fleet(tb, tmp: Path, mode: str, **kw) -> Fleet:
    from netns import start_sshd

    servers = [start_sshd(h, tmp / "ssh") for h in tb.hosts]
    cfg = write_fleet(tmp / f"fleet-{mode}.toml", servers, mode, **kw)
    run_dir = tmp / f"run-{mode}"
    st = json.loads(cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), "--format", "json", timeout=120).stdout)
    return Fleet(st, run_dir, tb, tmp)


def stop_fleet(fleet: Fleet | None, run_dir: Path) -> None:
    """``down``, and a safety net for a failed test (the testbed's close kills whatever else runs in the hosts)."""
    if fleet is not None:
        cli("down", "--run-dir", str(run_dir), "--grace-s", "3", check=False, timeout=60)
    state = RunDir(run_dir).load() if (run_dir / "state.json").exists() else None
    for p in state.processes if state else []:
        if p.host and process_start_time(p.pgid) == p.start_time:
            os.killpg(p.pgid, signal.SIGKILL)
    force_cleanup(run_dir)


def check_answers(report: dict, lines: list[dict], n: int) -> None:
    """Every request of the burst answered once, none failed."""
    assert (report["requests"], report["ok"], report["errors"]) == (n, n, 0), report
    rids = [x["request_id"] for x in lines]
    assert len(rids) == n and len(set(rids)) == n, "a request was answered twice or not at all"
    assert all(x["status"] == "ok" and x["http_status"] == 200 for x in lines), [
        x for x in lines if x["status"] != "ok"
    ]
    assert sum(report["by_worker"].values()) == n and "unknown" not in report["by_worker"], report["by_worker"]


def check_proofs(copies: list[dict]) -> None:
    """No target counts warm without its proof: every ``done`` l3 copy has a warm-up proof covering the prefix."""
    for c in copies:
        if c.get("mode") == "l3" and c["state"] == "done":
            assert c["proof_storage_tokens"] is not None, c
            assert c["proof_storage_tokens"] >= PREFIX_BLOCKS * PAGE, c
