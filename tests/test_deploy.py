"""``btbctl deploy render``: Kubernetes manifests from a cluster file. The rendered objects validate against the
Kubernetes API schemas (offline, kubernetes-validate, strict: no unknown field), the worker containers run exactly
the command line ``btbctl up`` generates, secrets never appear as values, ``[kubernetes]`` errors are one line
naming the file and the key, the committed kustomize base is what the renderer writes, and the example overlay
builds (``kubectl kustomize``) into objects that validate too. No API server is involved."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.commands.app import main
from btbctl.engine.config import read_toml
from btbctl.engine.deploy import kubernetes as kube
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.launcher import cluster as cl

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cluster-k8s.toml"
EMULATED = ROOT / "examples" / "cluster-k8s-emulated.toml"
#: Oldest and newest Kubernetes minor the manifests are checked against.
VERSIONS = ("1.28.0", "1.37.0")

kv = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (in the test extra)")


def _validate(obj: dict) -> None:
    for version in VERSIONS:
        kv.validate(obj, version, strict=True)


def _load(path=EXAMPLE, **kube_overrides) -> cl.ClusterFile:
    data = read_toml(path)
    data["kubernetes"] = {**data.get("kubernetes", {}), **kube_overrides}
    return cl.validate_cluster(data, str(path))


def _mixed_data(**kube_overrides) -> dict:
    """The example's SGLang workers and the emulated example's workers (a model name of their own) in one file:
    replication mode push."""
    data = read_toml(EXAMPLE)
    data["workers"] += read_toml(EMULATED)["workers"]
    data["kubernetes"] = {**data.get("kubernetes", {}), **kube_overrides}
    return data


def _load_mixed(**kube_overrides) -> cl.ClusterFile:
    return cl.validate_cluster(_mixed_data(**kube_overrides), "mixed.toml")


def _objects(cluster: cl.ClusterFile) -> list[dict]:
    return kube.objects(kube.render(cluster))


def _by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_every_rendered_object_validates_against_the_api_schemas():
    objs = _objects(_load_mixed())
    assert sorted(o["kind"] for o in objs) == sorted(
        ["Namespace", "ConfigMap", "Deployment", "Service", "Service", "Service", "StatefulSet", "StatefulSet"]
        + ["DaemonSet", "Service", "NetworkPolicy", "NetworkPolicy"]
    )
    for obj in objs:
        _validate(obj)
    # the check is not vacuous: a misspelled field or a wrong type fails it
    sts = json.loads(json.dumps(_by_kind(objs, "StatefulSet")[0]))
    sts["spec"]["replica"] = 2
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, VERSIONS[0], strict=True)
    sts = json.loads(json.dumps(_by_kind(objs, "StatefulSet")[0]))
    sts["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(sts, VERSIONS[0], strict=True)


#: Values that differ between ``up`` and a pod by design: where the worker listens and where its token file is.
MASKED = ("--host", "--port", "--btb-token-file")


def _flags(argv: list[str]) -> list[str]:
    """``argv`` without the interpreter, the values of :data:`MASKED` replaced by a placeholder."""
    return [("<value>" if i > 0 and argv[i - 1] in MASKED else a) for i, a in enumerate(argv)][1:]


@pytest.mark.parametrize("l3", [False, True])
def test_worker_containers_run_the_command_line_btbctl_up_generates(l3):
    cluster = _load() if l3 else _load_mixed()  # the example is all SGLang: replication mode l3
    k8s = cluster.kubernetes
    assert cluster.replication_mode == ("l3" if l3 else "push")
    socket = f"{k8s.agent_socket_dir}/{kube.AGENT_SOCKET_NAME}"
    sts = {o["metadata"]["name"]: o for o in _by_kind(_objects(cluster), "StatefulSet")}
    for inst in cluster.instances():
        command = sts[f"btb-{inst.spec.name}"]["spec"]["template"]["spec"]["containers"][0]["command"]
        # what `btbctl up` runs for this worker (launcher.fleet.up), flag for flag, HiCache flags included in l3
        # (on Kubernetes the extra config also names the pod's own URL, which its store names to the agent)
        pod_url = kube.worker_url(k8s, "$(POD_NAME)", k8s.worker_port)
        flags = cl.hicache_args(cluster, inst.spec, inst.entry, socket, worker_url=pod_url) if l3 else None
        up = cl.worker_argv(inst, 31000 + inst.index, inst.transfer_port, token_file="/run/tok", l3=flags)
        assert _flags(command) == _flags(up), inst.name
        # and the masked values are the pod's: all addresses, the pod port, the mounted Secret, the image's python
        assert command[0] == k8s.python
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == str(k8s.worker_port)
        if inst.spec.kind == "emulated":
            assert command[command.index("--btb-token-file") + 1] == f"{kube.SECRET_DIR}/worker-token"
        assert ("--enable-hierarchical-cache" in command) == l3
        if l3:  # the extra config names the socket the agents serve
            extra = json.loads(command[command.index(kube.HICACHE_EXTRA_FLAG) + 1])
            assert extra["module_path"] == "btbctl.sglang_l3" and extra["agent_socket"] == socket
            assert extra["worker_url"] == f"http://$(POD_NAME).btb-workers.llm.svc.cluster.local:{k8s.worker_port}"
    if l3:  # l3 needs the agents: turning them off is refused by key
        with pytest.raises(ConfigError) as err:
            kube.render(_load(agents=False), "f.toml")
        assert err.value.key == "kubernetes.agents"


class _Captured(Exception):
    """Stops ``fleet.up`` once it has spawned every local worker."""


def test_worker_containers_run_what_fleet_up_spawns(monkeypatch, tmp_path):
    """The command lines ``btbctl up`` hands to ``spawn`` for this cluster file (captured, nothing of them runs),
    flag for flag against the containers' commands."""
    from btbctl.engine.launcher import fleet, local
    from btbctl.engine.launcher.rundir import RunDir

    data = _mixed_data()
    data["gateway"].update(port=0, control_port=0)  # any free ports: only the workers' command lines matter here
    cluster = cl.validate_cluster(data, "mixed.toml")
    spawned: dict[str, list[str]] = {}
    harmless = [sys.executable, "-c", "pass"]

    def record_spawn(name, argv, log, env=None):
        spawned[name] = list(argv)
        return local.spawn(name, harmless, log)

    def stop(*args, **kwargs):
        raise _Captured

    monkeypatch.setattr(fleet, "spawn", record_spawn)
    monkeypatch.setattr(fleet, "wait_ready", stop)  # called once every local worker was spawned
    with pytest.raises(_Captured):
        fleet.up(cluster, RunDir(tmp_path / "run"), detach=False)
    assert list(spawned) == [inst.name for inst in cluster.instances()]
    sts = {o["metadata"]["name"]: o for o in _by_kind(_objects(cluster), "StatefulSet")}
    for inst in cluster.instances():
        command = sts[f"btb-{inst.spec.name}"]["spec"]["template"]["spec"]["containers"][0]["command"]
        assert _flags(command) == _flags(spawned[inst.name]), inst.name


def test_gateway_agents_and_workers_fit_together():
    cluster = _load_mixed()
    objs = _objects(cluster)
    k8s = cluster.kubernetes
    config_map = _by_kind(objs, "ConfigMap")[0]
    gw = GatewayConfig.model_validate(json.loads(config_map["data"]["gateway.json"]))
    assert gw.host == gw.control_host == "0.0.0.0" and (gw.port, gw.control_port) == (30080, 30081)
    assert gw.token is None and gw.token_file == f"{kube.SECRET_DIR}/control-token"
    assert gw.constants.prefix_blocks == 64 and gw.policy == "btb"
    # one URL per worker, in cluster-file order: the StatefulSets' pods behind the headless Service
    assert gw.workers == [f"http://btb-llama-{i}.btb-workers.llm.svc.cluster.local:30000" for i in range(2)] + [
        f"http://btb-emu-{i}.btb-workers.llm.svc.cluster.local:30000" for i in range(4)
    ]
    headless = next(o for o in objs if o["metadata"]["name"] == "btb-workers")
    assert headless["spec"]["clusterIP"] == "None"
    for sts in _by_kind(objs, "StatefulSet"):
        assert sts["spec"]["serviceName"] == "btb-workers" and sts["spec"]["podManagementPolicy"] == "Parallel"
    llama, emu = _by_kind(objs, "StatefulSet")
    pod = llama["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert llama["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-nvme"
    emu_container = emu["spec"]["template"]["spec"]["containers"][0]
    assert emu_container["resources"] == kube.EMULATED_RESOURCES  # emulated: no GPU
    # the node agent: host network, its socket in the host directory the SGLang workers mount at the same path
    ds = _by_kind(objs, "DaemonSet")[0]
    dpod = ds["spec"]["template"]["spec"]
    assert dpod["hostNetwork"] is True and dpod["dnsPolicy"] == "ClusterFirstWithHostNet"
    argv = dpod["containers"][0]["command"]
    socket = argv[argv.index("--socket") + 1]
    assert socket == f"{k8s.agent_socket_dir}/agent.sock" == "/run/btbctl/agent.sock"
    assert {"name": "agent-socket", "mountPath": k8s.agent_socket_dir} in pod["containers"][0]["volumeMounts"]
    assert {"name": "BTBCTL_AGENT_SOCKET", "value": socket} in pod["containers"][0]["env"]
    host_dirs = {v["hostPath"]["path"] for p in (pod, dpod) for v in p["volumes"] if "hostPath" in v}
    assert host_dirs == {k8s.agent_socket_dir}
    assert argv[argv.index("--peer") + 1] == "$(HOST_IP):30090"
    assert dpod["containers"][0]["resources"]["limits"]["memory"] == f"{65536 + 512}Mi"
    # Prometheus annotations: gateway, workers with metrics (the agents' /metrics needs a token: a scrape job)
    for obj in (*_by_kind(objs, "Deployment"), llama, emu):
        ann = obj["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"
    # the control API is never exposed beyond the cluster; the data plane's type is the file's choice
    control = next(o for o in objs if o["metadata"]["name"] == "btb-control")
    assert control["spec"]["type"] == "ClusterIP"
    # without SGLang workers there is no agent (nothing reads HiCache pages), unless asked for
    data = read_toml(EMULATED)
    emu_only = cl.validate_cluster(data)
    assert not _by_kind(_objects(emu_only), "DaemonSet")
    data["kubernetes"]["agents"] = True
    assert _by_kind(_objects(cl.validate_cluster(data)), "DaemonSet")


def test_an_all_sglang_l3_fleet_renders_a_gateway_that_copies_and_agents_that_register():
    """The rendered gateway of an all-SGLang fleet runs replication l3 without an agent map (the agents register),
    checks registrations against the fleet secret it mounts, and drives the agents with their shared control token;
    each node's agent registers with the control Service; each worker's extra config names its own URL, the one the
    gateway knows it by."""
    cluster = _load()
    assert cluster.replication_mode == "l3" and {w.kind for w in cluster.workers} == {"sglang"}
    objs = _objects(cluster)
    config = json.loads(_by_kind(objs, "ConfigMap")[0]["data"]["gateway.json"])
    gw = GatewayConfig.model_validate(config)
    assert gw.replication == "l3" and gw.agents == [] and gw.worker_agents == []
    assert gw.agent_secret_file == f"{kube.SECRET_DIR}/fleet-secret"
    assert gw.agent_token_file == f"{kube.SECRET_DIR}/control-token"
    dep = _by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]
    items = next(v for v in dep["volumes"] if v["name"] == "secrets")["secret"]["items"]
    assert "fleet-secret" in {i["key"] for i in items}
    argv = _by_kind(objs, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    control = next(o for o in objs if o["metadata"]["name"] == "btb-control")
    port = control["spec"]["ports"][0]["port"]
    assert (
        argv[argv.index("--gateway") + 1]
        == f"http://btb-control.llm.svc.cluster.local:{port}"
        == (kube.control_service_url(cluster, cluster.kubernetes))
    )
    urls = set(gw.workers)
    for sts in _by_kind(objs, "StatefulSet"):
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
        extra = json.loads(c["command"][c["command"].index(kube.HICACHE_EXTRA_FLAG) + 1])
        for i in range(sts["spec"]["replicas"]):  # the pod's URL once the kubelet fills in its name
            assert extra["worker_url"].replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}") in urls
    # a push fleet's agents (if any) register nowhere and its gateway has no fleet secret
    push = _objects(_load_mixed())
    assert "--gateway" not in _by_kind(push, "DaemonSet")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert json.loads(_by_kind(push, "ConfigMap")[0]["data"]["gateway.json"]).get("agent_secret_file") is None


def test_secrets_come_from_kubernetes_secrets_and_values_are_refused():
    cluster = _load()
    objs = _objects(cluster)
    text = kube.dump_all(objs)
    assert not _by_kind(objs, "Secret")
    secret_volumes = [
        v["secret"]
        for o in objs
        if "template" in o.get("spec", {})
        for v in o["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    ]
    assert secret_volumes and all(v["secretName"] == "btb-secrets" for v in secret_volumes)
    keys = {i["key"] for v in secret_volumes for i in v["items"]}
    assert keys == {"fleet-secret", "control-token", "worker-token"}
    assert '"token":' not in text and "hf_" not in text
    env = _by_kind(objs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env

    def refused(edit) -> ConfigError:
        data = _mixed_data()
        edit(data)
        with pytest.raises(ConfigError) as err:
            kube.render(cl.validate_cluster(data, "c.toml"), "c.toml")
        assert str(err.value).startswith("c.toml: ") and "\n" not in str(err.value)
        return err.value

    err = refused(lambda d: d["workers"][0]["env"].update(HF_TOKEN="hf_abc"))
    assert err.key == "workers.0.env.HF_TOKEN" and "kubernetes.secret_env.HF_TOKEN" in err.reason
    err = refused(lambda d: d["workers"][1].update(env={"OPENAI_API_KEY": "sk-1"}))
    assert err.key == "workers.1.env.OPENAI_API_KEY"
    err = refused(lambda d: d["workers"][0].update(extra_args=["--api-key", "k"]))
    assert err.key == "workers.0.extra_args" and "--api-key" in err.reason
    # names that only mention tokens are fine
    data = read_toml(EXAMPLE)
    data["workers"][0]["env"] = {"TOKENIZERS_PARALLELISM": "false", "HF_TOKEN_PATH": "/secrets/hf"}
    data["workers"][0]["extra_args"] = ["--max-total-tokens", "65536", "--tokenizer-path", "x"]
    kube.render(cl.validate_cluster(data))


@pytest.mark.parametrize(
    "edit,key,says",
    [
        ({"namespace": "Bad_NS"}, "kubernetes.namespace", "is not a DNS label"),
        ({"imagee": "x"}, "kubernetes.imagee", "unknown key; valid keys: namespace, name,"),
        ({"gpu_resource": "gpu"}, "kubernetes.gpu_resource", "nvidia.com/gpu, amd.com/gpu"),
        ({"secret_env": {"HF_TOKEN": "hf"}}, "kubernetes.secret_env", '"SECRET/KEY"'),
        ({"tolerations": [{"key": "a", "effect": "Never"}]}, "kubernetes.tolerations", "NoSchedule"),
        ({"model_cache_gib": 0}, "kubernetes.model_cache_gib", "greater than or equal to 1"),
        ({"agent_socket_dir": "run/btbctl"}, "kubernetes.agent_socket_dir", "absolute path"),
        ({"image_pull_policy": "Sometimes"}, "kubernetes.image_pull_policy", "Always"),
    ],
)
def test_kubernetes_section_errors_are_one_line_naming_file_and_key(tmp_path, capsys, edit, key, says):
    fields = {"image": "registry.example.com/btbctl:0.1.0", **edit}
    path = tmp_path / "c.toml"
    path.write_text(
        EXAMPLE.read_text().split("\n[kubernetes]\n")[0]
        + "\n"
        + "[kubernetes]\n"
        + "".join(f"{k} = {_toml(v)}\n" for k, v in fields.items())
    )
    with pytest.raises(SystemExit) as exit_:
        main(["deploy", "render", "-c", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.match(rf"btbctl: error: {re.escape(str(path))}:\d+: {re.escape(key)}: ", err), err
    assert err.count("\n") == 1, err
    assert says in err, err


def _toml(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return json.dumps(v)


def test_missing_section_and_per_pod_placeholders_are_refused(tmp_path, capsys):
    path = tmp_path / "ssh.toml"
    path.write_text(EXAMPLE.read_text().split("\n[kubernetes]\n")[0] + "\n")
    with pytest.raises(SystemExit):
        main(["deploy", "render", "-c", str(path)])
    assert capsys.readouterr().err.startswith(f"btbctl: error: {path}: kubernetes: missing: add a [kubernetes]")
    data = _mixed_data()
    data["workers"][1]["command"] = ["/opt/run", "--name", "{name}", "--port", "{port}"]
    with pytest.raises(ConfigError) as err:
        kube.render(cl.validate_cluster(data))
    assert err.value.key == "workers.1.command" and "{name} or {index}" in err.value.reason
    data["workers"][1]["command"] = ["/opt/run", "--port", "{port}"]  # the same for every pod: fine
    sts = _by_kind(_objects(cl.validate_cluster(data)), "StatefulSet")[1]
    assert sts["spec"]["template"]["spec"]["containers"][0]["command"] == ["/opt/run", "--port", "30000"]


def test_cli_writes_a_kustomize_base_or_a_stream(tmp_path, capsys):
    out = tmp_path / "base"
    with pytest.raises(SystemExit) as exit_:
        main(["deploy", "render", "-c", str(EXAMPLE), "--out", str(out), "--format", "json"])
    assert exit_.value.code in (0, None)
    summary = json.loads(capsys.readouterr().out)
    assert sorted(os.listdir(out)) == [
        "agents.yaml",
        "gateway.yaml",
        "kustomization.yaml",
        "namespace.yaml",
        "networkpolicy.yaml",
        "workers.yaml",
    ]
    assert len(summary["objects"]) == 11 and summary["secret"] == "btb-secrets"
    # every Secret the pods read, with its keys: the model's token too, not only btbctl's own
    assert summary["secrets"] == {"btb-secrets": ["control-token", "fleet-secret", "worker-token"], "hf": ["token"]}
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert kust["namespace"] == "llm"
    assert kust["resources"] == [
        "namespace.yaml",
        "gateway.yaml",
        "workers.yaml",
        "agents.yaml",
        "networkpolicy.yaml",
    ]
    with pytest.raises(SystemExit):
        main(["deploy", "render", "-c", str(EXAMPLE)])
    stream = list(yaml.safe_load_all(capsys.readouterr().out))
    assert stream == _objects(_load())
    # a later render without agents removes the agents.yaml the first one wrote, and nothing else
    (out / "notes.yaml").write_text("kind: mine\n")
    emu_only = EMULATED
    with pytest.raises(SystemExit):
        main(["deploy", "render", "-c", str(emu_only), "--out", str(out)])
    said = capsys.readouterr().out
    assert "create the Secret btb-secrets (keys control-token, worker-token) in it" in said, said
    assert sorted(os.listdir(out)) == [
        "gateway.yaml",
        "kustomization.yaml",
        "namespace.yaml",
        "networkpolicy.yaml",
        "notes.yaml",
        "workers.yaml",
    ]
    # an agents.yaml someone else wrote is left alone
    (out / "agents.yaml").write_text("# my agents\nkind: mine\n")
    with pytest.raises(SystemExit):
        main(["deploy", "render", "-c", str(emu_only), "--out", str(out)])
    said = capsys.readouterr().out
    assert "create the Secret btb-secrets (keys control-token, worker-token) in it" in said, said
    assert (out / "agents.yaml").read_text() == "# my agents\nkind: mine\n"


def test_the_committed_base_is_what_the_renderer_writes(tmp_path):
    cluster = cl.load_cluster(EXAMPLE)
    from btbctl import __version__
    from btbctl.commands.deploy import HEADER

    assert HEADER.startswith(kube.RENDERED_MARK)

    header = HEADER.format(config="cluster-k8s.toml", version=__version__, secret="btb-secrets")
    kube.write(kube.render(cluster), cluster.kubernetes, str(tmp_path), header)
    base = ROOT / "deploy" / "base"
    stale = [n for n in sorted(os.listdir(tmp_path)) if (base / n).read_text() != (tmp_path / n).read_text()]
    assert sorted(os.listdir(base)) == sorted(os.listdir(tmp_path))
    assert not stale, (
        f"deploy/base is stale ({stale}): btbctl deploy render -c examples/cluster-k8s.toml --out deploy/base"
    )


def test_the_example_overlay_builds_and_validates():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its built-in kustomize builds the overlay)")
    proc = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy" / "overlays" / "example")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    objs = list(yaml.safe_load_all(proc.stdout))
    assert len(objs) == 11
    for obj in objs:
        _validate(obj)
        where = obj["metadata"]["name"] if obj["kind"] == "Namespace" else obj["metadata"]["namespace"]
        assert where == "llm" and obj["metadata"]["labels"]["team"] == "inference-platform"
    svc = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "btb-gateway")
    assert svc["spec"]["type"] == "LoadBalancer"
    # behind the load balancer the data port is open to all; the control port (a ClusterIP Service) to the nodes'
    # agents, which register from the host network (l3: every request on it is authenticated)
    pol = next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "btb-gateway")
    assert "from" not in pol["spec"]["ingress"][0] and "from" not in pol["spec"]["ingress"][1]
    images = {
        c["image"] for o in objs if "template" in o.get("spec", {}) for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images == {
        "registry.internal.example/ml/btbctl:0.1.0",
        "registry.internal.example/ml/sglang-btb:0.5.23-btbctl0.1.0",
    }


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12)
)
_DATA = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_DATA)
def test_yaml_text_reads_back_as_the_same_data(data):
    assert yaml.safe_load(kube.dump({"x": data})) == {"x": data}


def test_yaml_text_keeps_strings_strings():
    tricky = ["0.9", "30000", "true", "no", "ON", "null", "~", "-m", "--port", "1e3", "0x1f", "2024-01-01", "a: b"]
    tricky += ["#x", "*a", "&a", "!t", "%x", "@x", "`x", "{x}", "[x]", "x/", "", " lead", "line\n", "a\nb\n", "\x7f"]
    tricky += ["\x85", "a\u2028b", "x\u2029\n", "trailing \nspace\n", "\n", "\ttab\n"]
    assert yaml.safe_load(kube.dump(tricky)) == tricky
    assert kube.dump({"a": "x\ny\n"}) == "a: |\n  x\n  y\n"
    # floats in exponent form keep a dot in the mantissa (YAML 1.1 reads 1e-05 as a string); infinities are floats
    floats = [5e-324, 1e16, 1e-05, -2.5e100, 0.1, -0.0, float("inf"), float("-inf")]
    assert yaml.safe_load(kube.dump(floats)) == floats
    assert kube.dump([1e-05]) == "- 1.0e-05\n"
    assert sys.version_info >= (3, 10)


def test_yaml_text_quotes_number_like_strings_and_writes_scripts_as_literal_blocks():
    # quoted in the text itself, for YAML 1.2 readers (go-yaml in kubectl) too: 1e3 and 1.0e5 are floats there
    words = ("30000", "0.9", "1e3", "1.0e5", "+1E3", ".5", "0o17", "0x1f", "true", "yes", "Off", "null", "~", "y", "N")
    for word in words:  # y/n: YAML 1.1 booleans to go-yaml
        text = kube.dump({"v": word})
        assert text in (f"v: '{word}'\n", f'v: "{word}"\n'), text
        assert yaml.safe_load(text) == {"v": word}
    assert kube.dump({"v": "--port"}) == "v: --port\n"
    script = "#!/bin/sh\nset -eu\nexec python3 -m btbctl agent \\\n  --socket /run/btbctl/agent.sock\n"
    text = kube.dump({"data": {"run.sh": script, "no-newline": "a\nb"}})
    assert text == (
        "data:\n  run.sh: |\n    #!/bin/sh\n    set -eu\n    exec python3 -m btbctl agent \\\n"
        "      --socket /run/btbctl/agent.sock\n  no-newline: |-\n    a\n    b\n"
    )
    assert yaml.safe_load(text) == {"data": {"run.sh": script, "no-newline": "a\nb"}}


def test_yaml_text_has_no_aliases_and_keeps_key_order():
    shared = {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
    text = kube.dump_all([{"z": shared, "a": [shared]}, {"kind": "B"}])
    assert "&" not in text and "*" not in text
    assert text.splitlines()[0] == "z:" and text.index("\na:") < text.index("---\nkind: B\n")
    assert list(yaml.safe_load_all(text)) == [{"z": shared, "a": [shared]}, {"kind": "B"}]


@pytest.mark.parametrize("example", [EXAMPLE, EMULATED])
def test_rendered_yaml_reads_back_as_the_objects_built(example):
    objs = _objects(cl.load_cluster(example))
    assert list(yaml.safe_load_all(kube.dump_all(objs))) == objs


def _pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objs
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    ]


def test_every_pod_runs_non_root_without_privileges():
    """Every rendered pod: non-root, RuntimeDefault seccomp; every container: no privilege escalation, all
    capabilities dropped; the gateway's and the agents' root file systems read-only."""
    objs = _objects(_load_mixed())
    pods = _pod_templates(objs)
    assert {n for n, _ in pods} >= {"btb-gateway", "btb-agent"} and len(pods) >= 4
    for name, spec in pods:
        sc = spec["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"]:
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"], name
            assert "add" not in csc["capabilities"] and not csc.get("privileged"), name
            if name in ("btb-gateway", "btb-agent"):
                assert csc["readOnlyRootFilesystem"] is True, name
        for c in spec.get("initContainers", []):  # the agents' socket folder owner: CHOWN/FOWNER only
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
            assert set(csc["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}


def test_network_policies_and_scrape_annotations():
    """The gateway's data port is open to the namespace, its control port and the workers only to the fleet's own
    pods; the agents' pods carry no scrape annotation (their /metrics needs the token off loopback)."""
    cluster = _load()
    objs = _objects(cluster)
    pols = {o["metadata"]["name"]: o["spec"] for o in _by_kind(objs, "NetworkPolicy")}
    fleet = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "btbctl", "app.kubernetes.io/instance": "btb"}}}
    gw = pols["btb-gateway"]
    assert gw["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    data, control = gw["ingress"]
    assert data["ports"] == [{"protocol": "TCP", "port": cluster.gateway.port or cl.DEFAULT_GATEWAY_PORT}]
    assert data.get("from", [{"podSelector": {}}]) == [{"podSelector": {}}]
    assert "from" not in control  # l3: the agents register from the host network (authenticated, not selected)
    push_pols = {o["metadata"]["name"]: o["spec"] for o in _by_kind(_objects(_load_mixed()), "NetworkPolicy")}
    assert push_pols["btb-gateway"]["ingress"][1]["from"] == [fleet]
    assert control["ports"][0]["port"] == (cluster.gateway.control_port or cl.DEFAULT_CONTROL_PORT)
    wk = pols["btb-workers"]
    assert wk["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "worker"
    assert wk["ingress"] == [{"from": [fleet]}]
    for obj in objs:
        if obj["kind"] == "NetworkPolicy":
            _validate(obj)
    ds = _by_kind(objs, "DaemonSet")[0]
    assert "prometheus.io/scrape" not in ds["spec"]["template"]["metadata"].get("annotations", {})
    dep = _by_kind(objs, "Deployment")[0]
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_real_and_emulated_workers_under_one_model_name_are_refused(tmp_path, capsys):
    """Clients of one model name would get emulated answers: the render refuses, naming both entries."""
    path = tmp_path / "mixed.toml"
    text = EXAMPLE.read_text()
    emulated = EMULATED.read_text().split("[[workers]]")[1].split("\n[kubernetes]")[0]
    same_name = emulated.replace('"llama-3.3-70b-emulated"', '"llama-3.3-70b"')
    cut = text.index("\n[kubernetes]\n")
    path.write_text(text[:cut] + "\n[[workers]]" + same_name + text[cut:])
    with pytest.raises(SystemExit) as exit_:
        main(["deploy", "render", "-c", str(path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.match(rf"btbctl: error: {re.escape(str(path))}:\d+: workers\.1\.kind: ", err), err
    assert err.count("\n") == 1, err
    assert "workers.1 (emu, emulated) and workers.0 (llama, sglang) both serve model 'llama-3.3-70b'" in err
    assert "emulated answers" in err
    # the committed example is all SGLang, and the emulated one serves a name of its own
    assert {w.kind for w in _load().workers} == {"sglang"}
    emu = cl.load_cluster(EMULATED)
    assert {w.kind for w in emu.workers} == {"emulated"}
    assert {w.served_model_name for w in emu.workers} == {"llama-3.3-70b-emulated"}


def test_emulated_pods_run_on_any_node_without_the_model_secret():
    """The GPU pool's node selector and tolerations and ``secret_env`` (the HF token) are for SGLang workers and
    the node agents only."""
    gpu_pool = read_toml(EXAMPLE)["kubernetes"]
    objs = _objects(
        _load_mixed(
            node_selector=gpu_pool["node_selector"],
            tolerations=gpu_pool["tolerations"],
            secret_env={"HF_TOKEN": "hf/t"},
        )
    )
    pods = dict(_pod_templates(objs))
    emu, llama, agent = pods["btb-emu"], pods["btb-llama"], pods["btb-agent"]
    assert "nodeSelector" not in emu and "tolerations" not in emu
    assert all(e["name"] != "HF_TOKEN" for e in emu["containers"][0].get("env", []))
    assert llama["nodeSelector"] == agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert llama["tolerations"] == agent["tolerations"] == gpu_pool["tolerations"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}} in llama["containers"][0][
        "env"
    ]
    for obj in objs:
        _validate(obj)


def test_the_namespace_is_rendered_at_the_pod_security_level_its_pods_need():
    ns = _by_kind(_objects(_load()), "Namespace")
    assert [o["metadata"]["name"] for o in ns] == ["llm"]
    assert ns[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"  # agents: host network
    emu = _by_kind(_objects(cl.load_cluster(EMULATED)), "Namespace")
    assert emu[0]["metadata"]["name"] == "btb-emu"
    assert emu[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert not _by_kind(_objects(_load(create_namespace=False)), "Namespace")
    manifests = kube.render(_load())
    assert manifests[0].name == "namespace.yaml"  # applied first
    for obj in (*ns, *emu):
        _validate(obj)


def test_gateway_and_workers_request_resources():
    objs = _objects(_load_mixed())
    containers = {name: spec["containers"][0] for name, spec in _pod_templates(objs)}
    gw = containers["btb-gateway"]["resources"]
    assert gw == kube.GATEWAY_RESOURCES and gw["requests"]["cpu"] and gw["limits"]["memory"]
    llama = containers["btb-llama"]["resources"]
    assert llama["limits"] == {"nvidia.com/gpu": "4"}  # tp_size 4
    assert llama["requests"] == {
        "cpu": str(4 * kube.SGLANG_CPU_PER_GPU),
        "memory": f"{4 * kube.SGLANG_MEMORY_GIB_PER_GPU}Gi",
        "nvidia.com/gpu": "4",
    }
    assert containers["btb-emu"]["resources"] == kube.EMULATED_RESOURCES
    # the GPU count follows tp_size and the entry's share of gpu_ids, with extra resources beside it
    data = _mixed_data(extra_resources={"rdma/hca": 1})
    data["workers"][0].update(tp_size=2, gpu_ids=[0, 1, 2, 3])
    res = kube.worker_resources(cl.validate_cluster(data).workers[0], cl.validate_cluster(data).kubernetes)
    assert res["limits"] == {"nvidia.com/gpu": "2", "rdma/hca": "1"}
    assert res["requests"]["cpu"] == str(2 * kube.SGLANG_CPU_PER_GPU)
