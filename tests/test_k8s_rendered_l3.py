"""The Kubernetes render of an all-SGLang l3 fleet, run outside Kubernetes: the gateway from its rendered
``gateway.json``, one node agent per "node" from the DaemonSet's command line, and emulated workers with the
StatefulSet's HiCache flags (SGLang itself needs GPUs), each with what the kubelet would fill in (``$(HOST_IP)``,
``$(NODE_NAME)``, ``$(POD_NAME)``, the mounted Secret, the control Service's address). The agents register, the
gateway learns which agent serves which worker from them alone, and a copy between the two nodes is proved."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from btbctl.engine.config import read_toml
from btbctl.engine.deploy import kubernetes as kube
from btbctl.engine.launcher import cluster as cl
from test_worker_support import WorkerProc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cluster-k8s.toml"
NODES = ("node-a", "node-b")
#: Each node's address (``status.hostIP``): distinct loopback addresses, so both agents use the rendered ports.
HOST_IPS = {"node-a": "127.0.0.2", "node-b": "127.0.0.3"}


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait(cond, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _render(agent_peer_port: int, agent_control_port: int):
    data = read_toml(EXAMPLE)
    data["kubernetes"].update(
        agent_arena_mib=64, agent_peer_port=agent_peer_port, agent_control_port=agent_control_port
    )
    cluster = cl.validate_cluster(data, str(EXAMPLE))
    return cluster, kube.objects(kube.render(cluster))


@pytest.mark.slow
def test_the_rendered_l3_fleet_registers_its_agents_and_makes_a_copy(tmp_path):
    peer_port, control_port = _free_port("127.0.0.2"), _free_port("127.0.0.3")
    cluster, objs = _render(peer_port, control_port)
    k8s = cluster.kubernetes
    config = json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["gateway.json"])
    assert config["replication"] == "l3" and config["agents"] == [] and config["worker_agents"] == []
    agent_argv = next(o for o in objs if o["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    worker_argv = next(o for o in objs if o["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0][
        "command"
    ]
    # the mounted Secret
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for key, value in (("fleet-secret", "k8s-rendered-fleet-secret-0123456789"), ("control-token", "c" * 64)):
        (secrets / key).write_text(value)
        os.chmod(secrets / key, 0o600)
    (secrets / "worker-token").write_text("w" * 64)

    def mounted(s: str) -> str:
        return s.replace(kube.SECRET_DIR, str(secrets))

    # one worker per node: ports chosen now, since each worker's extra config names its own URL
    ports = [_free_port() for _ in NODES]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    gw_port, gw_control = _free_port(), _free_port()
    control_url = f"http://127.0.0.1:{gw_control}"
    config.update(
        workers=urls,
        worker_names=None,
        host="127.0.0.1",
        control_host="127.0.0.1",
        port=gw_port,
        control_port=gw_control,
        log_file=str(tmp_path / "gateway.log"),
        health_interval_s=0.2,
    )
    config = json.loads(mounted(json.dumps(config)))
    (tmp_path / "gateway.json").write_text(json.dumps(config))
    procs: list[subprocess.Popen] = []
    workers: list[WorkerProc] = []
    try:
        gw_log = open(tmp_path / "gateway.err", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "btbctl", "gateway", "--config", str(tmp_path / "gateway.json")],
                stdout=subprocess.DEVNULL,
                stderr=gw_log,
            )
        )
        gw_log.close()
        _wait(lambda: _http_ok(control_url + "/control/fleet"), 20, "the gateway")
        for node in NODES:  # the DaemonSet's pod on each node, as the kubelet fills it in
            sock_dir = tmp_path / node
            sock_dir.mkdir()
            argv = [
                mounted(a)
                .replace("$(HOST_IP)", HOST_IPS[node])
                .replace("$(NODE_NAME)", node)
                .replace(k8s.agent_socket_dir, str(sock_dir))
                .replace(kube.control_service_url(cluster, k8s), control_url)
                for a in agent_argv
            ]
            argv[0] = sys.executable
            argv += ["--register-interval-s", "2"]  # held 6 s: a loaded test machine misses none
            log = open(tmp_path / f"{node}.log", "w")
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
            log.close()
            procs.append(p)
            line = p.stdout.readline()
            assert line.startswith("ready "), (line, (tmp_path / f"{node}.log").read_text()[-2000:])
        # the StatefulSet's HiCache flags (its extra config naming the node's socket and the pod's own URL) on an
        # emulated worker of the same page size and TP
        start = worker_argv.index("--enable-hierarchical-cache")
        end = worker_argv.index("--enable-cache-report") + 1
        template = kube.worker_url(k8s, "$(POD_NAME)", k8s.worker_port)
        for node, port, url in zip(NODES, ports, urls, strict=True):
            hicache = [
                a.replace(template, url).replace(k8s.agent_socket_dir, str(tmp_path / node))
                for a in worker_argv[start:end]
            ]
            flags = ["--model-path", "llama-3.3-70b", "--tp-size", worker_argv[worker_argv.index("--tp-size") + 1]]
            flags += ["--page-size", worker_argv[worker_argv.index("--page-size") + 1], "--kv-bytes-scale", "4096"]
            workers.append(WorkerProc(*flags, "--time-scale", "50", *hicache, "--port", str(port)).wait_ready())
            assert workers[-1].url == url

        def agents() -> list | None:
            st, fleet = _http("GET", control_url + "/control/fleet")
            got = [w.get("agent") for w in fleet.get("workers", [])] if st == 200 else []
            return got if got == list(NODES) else None

        _wait(agents, 20, "both agents registered with their workers")
        token = (secrets / "control-token").read_text()
        ids = list(range(1000, 1000 + 4 * 256))  # 4 pages
        st, ans = _http("POST", control_url + "/control/prewarm", {"input_ids": ids, "n": 1}, token)
        assert st == 202, (ans, (tmp_path / "gateway.log").read_text()[-3000:])
        assert len(ans["targets"]) == 1 and ans["targets"] != [ans["source"]]

        def copy() -> dict | None:
            st, rep = _http("GET", control_url + f"/control/replications/{ans['prefix']}")
            done = [c for c in rep.get("copies", []) if c.get("state") in ("done", "failed")] if st == 200 else []
            return done[0] if done else None

        result = _wait(copy, 30, "the copy")
        assert result["state"] == "done", result
        log = (tmp_path / "gateway.log").read_text()
        assert log.count("event=agent_registered") >= 2 and "event=l3_copy_proved" in log, log[-3000:]
    finally:
        for w in workers:
            w.stop()
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _http_ok(url: str) -> bool:
    try:
        return _http("GET", url)[0] == 200
    except OSError:
        return False
