"""The Kubernetes render of an emulated fleet with two gateways and KV events, run outside Kubernetes (marker
``slow``): the Redis from its rendered command line, both gateways from the rendered ``gateway.json`` and the
workers from the StatefulSet's command line, each with what Kubernetes would fill in (the pods' addresses, here one
loopback address per pod, in place of their DNS names and of ``0.0.0.0``; the mounted Secret). Both gateways join
the Redis and subscribe to every worker's KV events and replay socket at its pod's address; a request through one
gateway makes the other record the worker's holdings from that worker's events alone (routing inference off)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from btbctl.engine.config import read_toml
from btbctl.engine.deploy import kubernetes as kube
from btbctl.engine.launcher import cluster as cl
from redis_fixture import needs_redis
from test_k8s_rendered_l3 import _http, _http_ok, _wait

pytestmark = [pytest.mark.slow, needs_redis]

ROOT = Path(__file__).resolve().parents[1]
EMULATED = ROOT / "examples" / "cluster-k8s-emulated.toml"
#: Each worker pod's address.
POD_IPS = ("127.0.0.4", "127.0.0.5")


def _free_on_all(n: int) -> int:
    """A port P with P .. P + n - 1 free on every pod address now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        socks: list[socket.socket] = []
        try:
            for ip in POD_IPS:
                for p in range(base, base + n):
                    t = socket.socket()
                    socks.append(t)
                    t.bind((ip, p))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise AssertionError(f"no {n} consecutive free ports")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_rendered_gateways_share_a_redis_and_hold_from_every_workers_kv_events(tmp_path):
    base = _free_on_all(3)  # HTTP, KV events, replay: the same three in every pod
    data = read_toml(EMULATED)
    data["gateway"].update(replicas=2, page_size=16, settings={"routing_holdings": False})
    data["workers"][0].update(
        count=len(POD_IPS),
        port=base,
        kv_events=f"tcp://unused:{base + 1}",
        zero_delay=True,
        model="qwen3-8b",
        tp_size=1,
        page_size=16,
    )
    cluster = cl.validate_cluster(data, str(EMULATED))
    objs = kube.objects(kube.render(cluster))
    k8s = cluster.kubernetes
    assert k8s is not None
    config = json.loads(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["gateway.json"])
    (redis_sts,) = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "btb-redis"]
    (worker_sts,) = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "btb-emu"]
    worker_argv = worker_sts["spec"]["template"]["spec"]["containers"][0]["command"]
    redis_argv = redis_sts["spec"]["template"]["spec"]["containers"][0]["command"]

    secrets = tmp_path / "secrets"
    secrets.mkdir()
    for key, value in (("control-token", "c" * 64), ("worker-token", "w" * 64)):
        (secrets / key).write_text(value)
        os.chmod(secrets / key, 0o600)
    redis_port = _free_port()
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    pods = {kube.worker_host(k8s, f"btb-emu-{i}"): ip for i, ip in enumerate(POD_IPS)}

    def filled(s: str) -> str:
        s = s.replace(kube.SECRET_DIR, str(secrets)).replace(kube.redis_url(k8s), f"redis://127.0.0.1:{redis_port}/0")
        for host, ip in pods.items():
            s = s.replace(host, ip)
        return s

    procs: list[subprocess.Popen] = []
    try:
        argv = list(redis_argv)
        argv[argv.index("--port") + 1] = str(redis_port)
        argv[argv.index("--bind") + 1] = "127.0.0.1"
        argv[argv.index("--dir") + 1] = str(redis_dir)
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for i, ip in enumerate(POD_IPS):  # each pod's container, on its own address
            argv = [filled(a).replace(kube.BIND_ALL, ip) for a in worker_argv]
            # its events bound on the pod's address alone (a specific host alone would make the publisher connect)
            ev = json.loads(argv[argv.index("--kv-events-config") + 1])
            for key in ("endpoint", "replay_endpoint"):
                ev[key] = ev[key].replace("tcp://*:", f"tcp://{ip}:")
            argv[argv.index("--kv-events-config") + 1] = json.dumps({**ev, "bind": True})
            argv[0] = sys.executable
            log = open(tmp_path / f"worker{i}.log", "w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        gateways = []
        for g in range(2):  # two pods of the gateway Deployment, one config
            port, control = _free_port(), _free_port()
            cfg = json.loads(filled(json.dumps(config)))
            cfg.update(
                host="127.0.0.1",
                control_host="127.0.0.1",
                port=port,
                control_port=control,
                log_file=str(tmp_path / f"gateway{g}.log"),
                health_interval_s=0.2,
            )
            (tmp_path / f"gateway{g}.json").write_text(json.dumps(cfg))
            err = open(tmp_path / f"gateway{g}.err", "w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "btbctl", "gateway", "--config", str(tmp_path / f"gateway{g}.json")],
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            )
            err.close()
            gateways.append((f"http://127.0.0.1:{port}", f"http://127.0.0.1:{control}", tmp_path / f"gateway{g}.log"))
        for url, _control, _ in gateways:
            _wait(lambda u=url: _http_ok(u + "/health"), 60, "a gateway with a healthy worker")

        def connected() -> bool:
            return all(log.read_text().count("event=kv_events_connected") == 2 for _, _, log in gateways)

        _wait(connected, 30, "both gateways subscribed to both workers' KV events")
        ids = list(range(1000, 1064))  # 4 blocks of 16 tokens
        st, ans = _http(
            "POST", gateways[0][0] + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        )
        assert st == 200, ans

        def held_by_the_other() -> bool:  # it never saw the request: its record comes from the worker's events
            st, fleet = _http("GET", gateways[1][1] + "/control/fleet")
            return st == 200 and sorted(w["held_blocks"] for w in fleet["workers"]) == [0, 4]

        _wait(held_by_the_other, 30, "the second gateway to hold the first one's request from the KV events")
        for _, _, log in gateways:
            text = log.read_text()
            assert "event=fleet_share_up" in text, text[-3000:]
            assert text.count("event=kv_events_replayed") == 2, text[-3000:]  # each replay socket answered
            for ip in POD_IPS:
                assert f"endpoint=tcp://{ip}:{base + 1} replay_endpoint=tcp://{ip}:{base + 2}" in text
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
