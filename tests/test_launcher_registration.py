"""``btbctl up`` of an ``l3`` fleet on this machine: the gateway's settings name no node agent; the agent registers
with the gateway's control API (``--gateway``), ``up`` reports the fleet ready only once it did, copies are proved
through it, and an agent killed and started again registers again, with all its workers (their stores say hello to
it at once), without the gateway being restarted; a copy of a prefix computed before the restart fails at once, with
the reason, until new traffic writes the prefix's pages to the new agent, and then is proved."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from btbctl.engine.launcher.rundir import RunDir
from launcher_helpers import cli, cli_json, http_json
from redis_fixture import needs_redis

pytestmark = pytest.mark.slow

CLUSTER = """
[gateway]
policy = "btb"  # copies as soon as the detector fires
port = 0
control_port = 0

[btb]
prefix_blocks = 4
warm_replicas = 2

[replication]
mode = "l3"
arena_mib = 64

[[workers]]
name = "w"
count = 3
time_scale = 10.0
kv_bytes_scale = 64
ready_timeout_s = 30.0
"""


def _agents(control: str, token: str) -> dict:
    import urllib.request

    req = urllib.request.Request(control + "/control/agents", headers={"Authorization": f"Bearer {token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=5) as resp:
        return {a["name"]: a for a in json.loads(resp.read())["agents"]}


def _generate(url: str, token: str, text: str) -> None:
    """One ``/generate`` of ``text`` straight to a worker (its token), answered (as ``prewarm`` computes a text)."""
    import urllib.request

    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()
    req = urllib.request.Request(
        url + "/generate",
        data=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=30) as resp:
        assert resp.status == 200


def _backed_up_tokens(url: str, token: str) -> float:
    """The worker's ``sglang:backuped_tokens_total`` (tokens written through to L3)."""
    import urllib.request

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("sglang:backuped_tokens_total"))


def _replicate(run_dir, prefix: str) -> dict:
    """``btbctl replicate`` of ``prefix`` to one more worker (exit 0 or 1: done or failed); its JSON."""
    proc = cli(
        "replicate", "--prefix", prefix, "-n", "1", "--timeout-s", "20", "--run-dir", str(run_dir),
        "--format", "json", check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout)


def _proved_copies(run_dir, control: str, seed: int, want: int, target: str | None = None) -> list[dict]:
    """Run a burst (its own prefix, ``seed``; through ``target``, default the fleet's first gateway) and wait until
    ``want`` l3 copies in all are done at the gateway of ``control``; the done ones."""
    rep = cli_json(
        "bench",
        "--run-dir",
        str(run_dir),
        *(("--target", target) if target else ()),
        "--burst-size",
        "12",
        "--prefix-blocks",
        "4",
        "--spread-s",
        "1.0",
        "--seed",
        str(seed),
        timeout=90,
    )
    assert rep["errors"] == 0, rep
    done: list[dict] = []
    for _ in range(300):
        tr = http_json(control + "/control/transfers")
        done = [t for t in tr["transfers"] if t["mode"] == "l3" and t["state"] == "done"]
        if tr["in_flight"] == 0 and len(done) >= want:
            break
        time.sleep(0.1)
    return done


def test_up_registers_the_agent_and_a_restarted_agent_registers_again(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLUSTER)
    run_dir = tmp_path / "run"
    try:
        st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), timeout=90)
        rd = RunDir(run_dir)
        settings = json.loads((rd.path / "gateway.json").read_text())
        assert "agents" not in settings and "worker_agents" not in settings
        assert settings["agent_secret_file"] == str(rd.agent_secret_path)
        control = st["control_url"].rstrip("/")
        token = rd.token_path.read_text().strip()
        agents = _agents(control, token)
        assert list(agents) == ["agent-local"]
        assert agents["agent-local"]["workers"] == ["w-0", "w-1", "w-2"] and not agents["agent-local"]["static"]
        assert [(a["name"], a["alive"]) for a in st["agents"]] == [("agent-local", True)]  # status shows it

        done = _proved_copies(run_dir, control, seed=1, want=1)
        assert done and all(t["proof"] is not None for t in done), done
        # a prompt computed on one worker and copied to another: both hold it, in their own tiers and the agent's
        text = "an old system prompt that two workers hold " * 120
        prompt = tmp_path / "prompt.txt"
        prompt.write_text(text)
        pre = cli_json("prewarm", str(prompt), "-n", "1", "--run-dir", str(run_dir), "--timeout-s", "60", timeout=90)
        assert pre["status"] == "done" and len(pre["holders"]) == 2, pre

        # the agent dies; the test starts it again (same ports); the gateway, untouched, takes its registration
        old = rd.load().agents()[0]
        os.killpg(old.pgid, signal.SIGKILL)
        res = cli_json("restart", "agent-local", "--run-dir", str(run_dir), "--grace-s", "1")
        assert res["old_pid"] == old.pid
        gateway_pid = next(p.pid for p in rd.load().processes if p.role == "gateway")
        # no request needed: the workers' stores say hello to the new agent at once, and it announces them
        for _ in range(100):
            agents = _agents(control, token)
            if agents.get("agent-local", {}).get("workers") == ["w-0", "w-1", "w-2"]:
                break
            time.sleep(0.1)
        assert agents["agent-local"]["workers"] == ["w-0", "w-1", "w-2"], agents
        assert next(p.pid for p in rd.load().processes if p.role == "gateway") == gateway_pid

        # the new agent's store is empty and the holders keep the prompt in their own tiers: a copy from one of them
        # fails at once with the reason (no wait for pages that cannot come), and nothing is marked warm
        rep = _replicate(run_dir, pre["prefix"])
        assert rep["status"] == "failed" and len(rep["copies"]) == 1, rep
        assert "it restarted after the source computed the prefix" in rep["copies"][0]["error"], rep
        # new traffic on the holders: they serve the prompt from their device and (emulated workers; SGLang would
        # not) write its pages through to the new agent again; then a copy from the other holder is proved
        wtoken = rd.worker_token_path.read_text().strip()
        before = {u: _backed_up_tokens(u, wtoken) for u in pre["holders"]}
        for u in pre["holders"]:
            _generate(u, wtoken, text)
        for _ in range(100):
            if all(_backed_up_tokens(u, wtoken) > before[u] for u in pre["holders"]):
                break
            time.sleep(0.1)
        rep = _replicate(run_dir, pre["prefix"])
        assert rep["status"] == "done" and rep["copies"][0]["outcome"] == "proved", rep
    finally:
        cli("down", "--run-dir", str(run_dir), "--grace-s", "2", check=False)


@needs_redis
def test_an_l3_fleet_of_two_gateways_registers_its_agent_with_each_and_either_proves_copies(tmp_path):
    cfg = tmp_path / "two.toml"
    cfg.write_text(CLUSTER.replace("[gateway]\n", "[gateway]\nreplicas = 2\n", 1))
    run_dir = tmp_path / "run"
    try:
        cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), timeout=120)
        rd = RunDir(run_dir)
        gws = [p for p in rd.load().processes if p.role == "gateway"]
        assert [g.name for g in gws] == ["gateway", "gateway-1"]
        for name in ("gateway", "gateway-1"):
            settings = json.loads((rd.path / f"{name}.json").read_text())
            assert "agents" not in settings and "worker_agents" not in settings, name
        token = rd.token_path.read_text().strip()
        controls = [rd.load().control_url.rstrip("/"), gws[1].extra["control"].rstrip("/")]
        for control in controls:  # up waited for both registrations
            agents = _agents(control, token)
            assert agents["agent-local"]["workers"] == ["w-0", "w-1", "w-2"], (control, agents)
        # a burst through the second gateway alone: its copies go through the agent it learned by registration
        done = _proved_copies(run_dir, controls[1], seed=7, want=1, target=gws[1].url)
        assert done and all(t["proof"] is not None for t in done), done
    finally:
        cli("down", "--run-dir", str(run_dir), "--grace-s", "2", check=False)
