"""``btbctl deploy render`` of several gateways (``[gateway] replicas``) and of workers' KV events (``kv_events``):
a Redis of the fleet's own (or the ``redis_url`` given) in the gateways' settings, the workers' ``--kv-events-config``
(the launcher's own JSON) and ports, the gateways' subscriptions at the pods' DNS names, the network policies; every
object validates against the Kubernetes API schemas offline (kubernetes-validate, strict). No API server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from btbctl.commands.app import main
from btbctl.engine.config import read_toml
from btbctl.engine.deploy import kubernetes as kube
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.launcher import cluster as cl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cluster-k8s.toml"
EMULATED = ROOT / "examples" / "cluster-k8s-emulated.toml"
VERSIONS = ("1.28.0", "1.37.0")
KV_PORT = 5557

kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (in the test extra)")


def _cluster(path: Path = EMULATED, replicas: int = 2, kv_events: bool = True, **settings) -> cl.ClusterFile:
    data = read_toml(path)
    data["gateway"]["replicas"] = replicas
    if settings:
        data["gateway"]["settings"] = settings
    if kv_events:
        for w in data["workers"]:
            w["kv_events"] = f"tcp://127.0.0.1:{KV_PORT}"
    return cl.validate_cluster(data, str(path))


def _by(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def _gateway_config(objs: list[dict]) -> dict:
    (cm,) = _by(objs, "ConfigMap", "btb-gateway")
    return json.loads(cm["data"]["gateway.json"])


def test_two_gateways_with_kv_events_render_a_redis_subscriptions_and_policies():
    cluster = _cluster()
    manifests = kube.render(cluster)
    assert [m.name for m in manifests] == [
        "namespace.yaml",
        "gateway.yaml",
        "workers.yaml",
        "redis.yaml",
        "networkpolicy.yaml",
    ]
    objs = kube.objects(manifests)
    for obj in objs:
        for version in VERSIONS:
            kv.validate(obj, version, strict=True)

    (dep,) = _by(objs, "Deployment", "btb-gateway")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    (svc,) = _by(objs, "Service", "btb-gateway")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]

    # the Redis: one pod of the official image behind a headless Service, no persistence, the gateways' settings
    # pointing at its stable name
    (redis,) = _by(objs, "StatefulSet", "btb-redis")
    (rsvc,) = _by(objs, "Service", "btb-redis")
    assert rsvc["spec"]["clusterIP"] == "None" and redis["spec"]["serviceName"] == "btb-redis"
    assert redis["spec"]["replicas"] == 1 and "volumeClaimTemplates" not in redis["spec"]
    (rc,) = redis["spec"]["template"]["spec"]["containers"]
    assert rc["image"] == kube.REDIS_IMAGE
    argv = rc["command"]
    assert argv[argv.index("--save") + 1] == "" and argv[argv.index("--appendonly") + 1] == "no"
    assert rsvc["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    config = _gateway_config(objs)
    assert config["redis_url"] == "redis://btb-redis-0.btb-redis.btb-emu.svc.cluster.local:6379/0"
    GatewayConfig.model_validate(config)

    # KV events: every pod publishes on the entry's PORT and replays on PORT + 1 (its own addresses), with the
    # launcher's --kv-events-config; the gateways subscribe at each pod's DNS name
    (sts,) = _by(objs, "StatefulSet", "btb-emu")
    (wc,) = sts["spec"]["template"]["spec"]["containers"]
    insts = cluster.instances()
    assert cl.kv_events_args(insts[0]) == wc["command"][-2:]
    assert json.loads(wc["command"][-1])["endpoint"] == f"tcp://*:{KV_PORT}"
    ports = {p["name"]: p["containerPort"] for p in wc["ports"]}
    assert ports["kv-events"] == KV_PORT and ports["kv-replay"] == KV_PORT + 1
    host = "btb-emu-{}.btb-workers.btb-emu.svc.cluster.local"
    assert config["kv_events"] == [
        {
            "endpoint": f"tcp://{host.format(i)}:{KV_PORT}",
            "replay_endpoint": f"tcp://{host.format(i)}:{KV_PORT + 1}",
            "topic": "kv",
        }
        for i in range(len(insts))
    ]
    assert [u.split("//")[1].split(":")[0] for u in config["workers"]] == [host.format(i) for i in range(len(insts))]

    # network policies: gateway -> workers (every port, KV events included) from the fleet's pods; Redis from the
    # gateways only, on its port
    pols = {o["metadata"]["name"]: o["spec"] for o in _by(objs, "NetworkPolicy")}
    fleet = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "btbctl", "app.kubernetes.io/instance": "btb"}}}
    assert pols["btb-workers"]["ingress"] == [{"from": [fleet]}]
    gateway_pods = dep["spec"]["template"]["metadata"]["labels"]
    assert all(gateway_pods[k] == v for k, v in fleet["podSelector"]["matchLabels"].items())
    (rule,) = pols["btb-redis"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": kube.REDIS_PORT}]
    sel = rule["from"][0]["podSelector"]["matchLabels"]
    assert all(gateway_pods[k] == v for k, v in sel.items()) and sel["app.kubernetes.io/component"] == "gateway"
    assert pols["btb-redis"]["podSelector"]["matchLabels"] == redis["spec"]["selector"]["matchLabels"]
    assert kube.secrets_needed(objs) == {"btb-secrets": ["control-token", "worker-token"]}


def test_one_gateway_renders_no_redis_and_the_same_gateway_as_before():
    objs = kube.objects(kube.render(_cluster(replicas=1, kv_events=False)))
    assert not _by(objs, "StatefulSet", "btb-redis") and not _by(objs, "NetworkPolicy", "btb-redis")
    (dep,) = _by(objs, "Deployment", "btb-gateway")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    config = _gateway_config(objs)
    assert "redis_url" not in config and "kv_events" not in config
    (wc,) = _by(objs, "StatefulSet", "btb-emu")[0]["spec"]["template"]["spec"]["containers"]
    assert "--kv-events-config" not in wc["command"] and [p["name"] for p in wc["ports"]] == ["http"]


def test_kv_events_with_one_gateway_and_sglang_workers():
    """The SGLang example (replication l3, one gateway) with kv_events: the SGLang line carries the flag, the
    gateway subscribes, and no Redis is rendered."""
    cluster = _cluster(EXAMPLE, replicas=1)
    objs = kube.objects(kube.render(cluster))
    assert not _by(objs, "StatefulSet", "btb-redis")
    config = _gateway_config(objs)
    assert len(config["kv_events"]) == len(config["workers"]) == len(cluster.instances())
    GatewayConfig.model_validate(config)
    for sts in _by(objs, "StatefulSet"):
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["command"][-2] == "--kv-events-config"
        kv.validate(sts, VERSIONS[-1], strict=True)


def test_an_external_redis_url_is_used_and_one_with_a_password_is_refused():
    url = "redis://redis.shared.svc.cluster.local:6379/3"
    objs = kube.objects(kube.render(_cluster(redis_url=url)))
    assert _gateway_config(objs)["redis_url"] == url
    assert not _by(objs, "StatefulSet", "btb-redis") and not _by(objs, "NetworkPolicy", "btb-redis")
    with pytest.raises(ConfigError) as e:
        kube.render(_cluster(redis_url="redis://:hunter2@redis.shared:6379/0"))
    assert e.value.key == "gateway.settings.redis_url" and "hunter2" not in str(e.value)


def test_several_gateways_in_l3_render_a_headless_control_service_the_agents_register_through(tmp_path, capsys):
    """An l3 fleet of two gateways: the agents resolve the headless ``btb-control-pods`` (every gateway pod, ready or
    not) at each announcement (``--gateway-service``) instead of one ClusterIP Service, the gateways share a Redis,
    and the gateway policy admits the control port on every gateway pod from the host network."""
    from btbctl.engine.agent.agent import parse_gateway_service

    cluster = _cluster(EXAMPLE, replicas=2, kv_events=False)
    k8s = cluster.kubernetes
    assert k8s is not None
    objs = kube.objects(kube.render(cluster))
    for obj in objs:
        for version in VERSIONS:
            kv.validate(obj, version, strict=True)
    config = _gateway_config(objs)
    GatewayConfig.model_validate(config)
    assert config["replication"] == "l3" and config["agents"] == [] and config["agent_secret_file"]
    assert config["redis_url"] == kube.redis_url(k8s) and _by(objs, "StatefulSet", "btb-redis")
    control_port = config["control_port"]

    (dep,) = _by(objs, "Deployment", "btb-gateway")
    assert dep["spec"]["replicas"] == 2
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    (pods,) = _by(objs, "Service", "btb-control-pods")
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["publishNotReadyAddresses"] is True
    assert pods["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert all(pod_labels[k] == v for k, v in pods["spec"]["selector"].items())
    (port,) = pods["spec"]["ports"]
    assert port["port"] == control_port and port["targetPort"] == "control"
    (gc,) = dep["spec"]["template"]["spec"]["containers"]
    assert {"name": "control", "containerPort": control_port, "protocol": "TCP"} in gc["ports"]
    assert _by(objs, "Service", "btb-control")  # still there, for status, tune and the dashboard

    (ds,) = _by(objs, "DaemonSet", "btb-agent")
    argv = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--gateway" not in argv
    url = argv[argv.index("--gateway-service") + 1]
    assert url == f"http://btb-control-pods.llm.svc.cluster.local:{control_port}"
    assert url == kube.control_pods_service_url(cluster, k8s)
    assert parse_gateway_service(url) == ("btb-control-pods.llm.svc.cluster.local", control_port)
    assert ds["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"  # the host network resolves it

    # the gateway policy selects every gateway pod and admits the control port from anywhere (the agents'
    # addresses are the nodes'), so a pod's own address is covered as the ClusterIP was
    (pol,) = _by(objs, "NetworkPolicy", "btb-gateway")
    assert all(pod_labels[k] == v for k, v in pol["spec"]["podSelector"]["matchLabels"].items())
    (rule,) = [r for r in pol["spec"]["ingress"] if {"protocol": "TCP", "port": control_port} in r["ports"]]
    assert "from" not in rule

    # one gateway: the ClusterIP Service and --gateway, as before
    one = kube.objects(kube.render(_cluster(EXAMPLE, replicas=1, kv_events=False)))
    assert not _by(one, "Service", "btb-control-pods")
    argv = _by(one, "DaemonSet", "btb-agent")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--gateway-service" not in argv and argv[argv.index("--gateway") + 1] == kube.control_service_url(
        cluster, k8s
    )

    # the command renders it (it refused before)
    path = tmp_path / "c.toml"
    path.write_text((EXAMPLE.read_text()).replace("[gateway]\n", "[gateway]\nreplicas = 2\n", 1))
    with pytest.raises(SystemExit) as e:  # standalone typer: exits 0 on success
        main(["deploy", "render", "-c", str(path)])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "name: btb-control-pods" in out and f"- {url}" in out


def test_a_later_render_with_one_gateway_removes_its_redis_file(tmp_path):
    out = tmp_path / "base"
    k8s = _cluster().kubernetes
    assert k8s is not None
    kube.write(kube.render(_cluster()), k8s, str(out), header=kube.RENDERED_MARK + "`\n")
    assert (out / "redis.yaml").exists()
    kube.write(kube.render(_cluster(replicas=1)), k8s, str(out), header=kube.RENDERED_MARK + "`\n")
    assert not (out / "redis.yaml").exists()
    assert "redis.yaml" not in (out / "kustomization.yaml").read_text()
