"""Real SGLang 0.5.23 servers on this CPU for the ``sglang_server`` tests (not a test module): the harness venv
(scripts/sglang-venv.sh), the environment that serves it with the test-only stand-in, a fleet of
examples/cluster-sglang-cpu.toml brought up with ``btbctl up -d``, and a check of what the stand-in replaced.

The tests skip, with the reason, only where the harness venv is not built (``scripts/sglang-venv.sh``; CI builds it
first)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from btbctl.engine.launcher.rundir import RunDir
from launcher_helpers import ROOT, cli, force_cleanup, http_json, recorded_pids, wait_gone
from sglang_cpu.harness import STANDIN_LOG_ENV, cpu_env, missing, venv_dir

EXAMPLE = ROOT / "examples" / "cluster-sglang-cpu.toml"
#: Token ids the tests send are below this (the tiny model's vocabulary, tests/sglang_cpu/tiny_model.py).
VOCAB = 32000
#: Tokens per page of the example fleet.
PAGE = 16


def harness_env(standin_log: Path) -> dict[str, str]:
    """The environment of a process that starts real SGLang servers (the harness's CPU settings and the stand-in
    log); skips the test where the harness venv is not built."""
    venv = venv_dir()
    why = missing(venv)
    if why is not None:
        pytest.skip(why)
    link = ROOT / "examples" / "sglang-cpu"
    if not link.exists():
        pytest.skip("examples/sglang-cpu (the link to the harness venv) is missing: run scripts/sglang-venv.sh")
    return {**cpu_env(venv), STANDIN_LOG_ENV: str(standin_log)}


def check_standin_log(path: Path) -> list[dict]:
    """The stand-in's log: every replaced function called is one of the device<->host copies or the unpinned host
    pool (never an ``sgl_kernel`` function); returns the lines."""
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    allowed = {
        "MHATokenToKVPoolHost.__init__ (pin_memory=False)",
        "MHATokenToKVPoolHost.load_to_device_per_layer",
        "MHATokenToKVPoolHost.backup_from_device_all_layer",
    }
    bad = [x for x in lines if x["kind"] == "kernel" or x["name"] not in allowed]
    assert not bad, f"the stand-in replaced something beyond the CUDA-bound pieces it is for, and it was called: {bad}"
    return lines


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary (no special tokens), seeded."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def generate(url: str, input_ids: list[int], max_new_tokens: int = 1, timeout: float = 120.0) -> dict:
    """``POST {url}/generate`` of ``input_ids`` (greedy) with ``return_cached_tokens_details``; the answer."""
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
        "return_cached_tokens_details": True,
    }
    return http_json(url.rstrip("/") + "/generate", body, timeout=timeout)


def details(ans: dict) -> dict:
    """``{"device", "host", "storage"}`` tokens of an answer's ``cached_tokens_details`` (zeros when null)."""
    d = (ans.get("meta_info") or {}).get("cached_tokens_details") or {}
    return {k: int(d.get(k) or 0) for k in ("device", "host", "storage")}


def sglang_number(text: str, name: str) -> float:
    """The sum of every series of metric ``name`` in SGLang's Prometheus text (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        return r.read().decode()


@dataclass
class SglangFleet:
    """A fleet of real SGLang servers that ``btbctl up -d`` started from a cluster file."""

    run_dir: Path
    env: dict[str, str]
    status: dict
    standin_log: Path
    testbed: object = None

    def cli(self, *args: str, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        """``python -m btbctl ARGS --run-dir RUN`` with the harness environment."""
        full = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
        full.update(self.env)
        proc = subprocess.run(
            [sys.executable, "-m", "btbctl", *args, "--run-dir", str(self.run_dir)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=full,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"btbctl {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def cli_script(self, script: str, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
        """``python SCRIPT ARGS --run-dir RUN`` (a script of the repository) with the harness environment."""
        full = {k: v for k, v in os.environ.items() if k not in ("BTBCTL_RUN_DIR", "BTBCTL_DEBUG")}
        full.update(self.env)
        return subprocess.run(
            [sys.executable, str(ROOT / script), *args, "--run-dir", str(self.run_dir)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=full,
        )

    def json(self, *args: str, timeout: float = 300.0) -> dict:
        return json.loads(self.cli(*args, "--format", "json", timeout=timeout).stdout)

    @property
    def gateway(self) -> str:
        return self.status["gateway_url"].rstrip("/")

    @property
    def control(self) -> str:
        return self.status["control_url"].rstrip("/")

    @property
    def workers(self) -> list[str]:
        return [w["url"].rstrip("/") for w in self.status["workers"]]

    def _agent(self, path: str, body: dict, timeout: float = 30.0) -> dict:
        """``POST`` to the fleet's (first) node agent's control API with its token."""
        agent = self.status["agents"][0]
        token = (self.run_dir / "agent-local.token").read_text().strip()
        req = urllib.request.Request(
            agent["control_url"].rstrip("/") + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def agent_run(self, keys: list[str]) -> int:
        """Leading run of ``keys`` the node agent holds, in the namespace that holds most."""
        return max(self._agent("/v1/has", {"keys": keys})["namespaces"].values(), default=0)

    def wait_written(self, keys: list[str], wait_s: float = 20.0) -> None:
        """Wait until the node agent holds every page of ``keys`` (a worker's write-through is asynchronous)."""
        ans = self._agent("/v1/wait", {"keys": keys, "wait_s": wait_s}, timeout=wait_s + 10)
        assert ans["complete"], f"the agent holds {ans['namespaces']} of {len(keys)} pages after {wait_s} s"

    def settle(self, timeout_s: float = 120.0) -> dict:
        """``GET /control/transfers`` once no copy is in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            tr = http_json(self.control + "/control/transfers")
            if tr["in_flight"] == 0:
                return tr
            assert time.monotonic() < deadline, f"copies still in flight after {timeout_s} s: {tr}"
            time.sleep(0.2)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the process group ``up`` recorded for ``name``."""
        state = RunDir(self.run_dir).load()
        os.killpg(next(p.pgid for p in state.processes if p.name == name), sig)

    def down(self) -> None:
        """``btbctl down``; nothing ``up`` started may run afterwards."""
        pids = recorded_pids(self.run_dir)
        self.cli("down", timeout=120)
        assert wait_gone(pids, 30.0) == [], "processes left after down"


def start(tmp: Path, cluster: Path = EXAMPLE, name: str = "run") -> SglangFleet:
    """``btbctl up -d -c cluster`` with the harness environment (about 1.5-2 minutes on 2 cores)."""
    log = tmp / "standin.jsonl"
    env = harness_env(log)
    run_dir = tmp / name
    fleet = SglangFleet(run_dir, env, {}, log)
    try:
        fleet.status = fleet.json("up", "-d", "-c", str(cluster), timeout=900)
    except BaseException:
        force_cleanup(run_dir)
        raise
    return fleet


def stop(fleet: SglangFleet) -> None:
    """Teardown: ``down`` (checked where it can be), then the safety net."""
    try:
        if RunDir(fleet.run_dir).load() is not None:
            fleet.down()
    finally:
        state = RunDir(fleet.run_dir).load() if (fleet.run_dir / "state.json").exists() else None
        for p in state.processes if state else []:
            try:
                os.killpg(p.pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        force_cleanup(fleet.run_dir)


__all__ = [
    "EXAMPLE",
    "PAGE",
    "SglangFleet",
    "check_standin_log",
    "cli",
    "details",
    "generate",
    "harness_env",
    "ids",
    "metrics_text",
    "sglang_number",
    "start",
    "stop",
]
