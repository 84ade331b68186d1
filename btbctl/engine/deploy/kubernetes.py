"""Kubernetes manifests of a BTB fleet, rendered from a cluster file (``btbctl deploy render``).

What a cluster file becomes (``NAME`` is ``kubernetes.name``, every object in ``kubernetes.namespace``):

* The Namespace (unless ``create_namespace = false``), at the ``privileged`` Pod Security level when node agents
  run (host network, hostPath), else ``restricted``.

* ``NAME-gateway`` ConfigMap: ``gateway.json``, the gateway's settings as ``btbctl up`` writes them
  (:meth:`~btbctl.engine.launcher.cluster.ClusterFile.gateway_config`), listening on all of the pod's addresses,
  workers by their stable DNS names, tokens read from the mounted Secret. In replication mode ``l3`` it has no
  agent map: each node's agent registers with the ``NAME-control`` Service (``--gateway``), signed with a key of
  the fleet secret (mounted in the gateway to check it), naming the workers whose HiCache stores connected to its
  socket; each worker's extra config carries its own URL (``$(POD_NAME)``) for that. With several gateways each
  must hold every registration, so the agents register instead through ``NAME-control-pods``
  (``--gateway-service``), a headless Service with one address record per gateway pod (not-ready ones included,
  so a gateway learns the agents before it takes traffic): at each announcement an agent resolves it and
  registers with every gateway.
* ``NAME-gateway`` Deployment of ``[gateway] replicas`` gateways running ``up``'s own gateway command line
  (:func:`~btbctl.engine.launcher.fleet.gateway_argv`); ``NAME-gateway`` Service (data plane,
  ``gateway_service_type``) and ``NAME-control`` Service (control API, always ClusterIP). One gateway is
  ``Recreate`` (two at once would each see half of every burst). Several share burst detection, copy orders and
  tuning through Redis (:mod:`~btbctl.engine.gateway.fleetshare`) and roll one at a time: ``gateway.settings.
  redis_url`` when given (refused with a password in it, which would land in the ConfigMap), else ``NAME-redis``
  (``redis.yaml``: a StatefulSet of one :data:`REDIS_IMAGE` pod behind a headless Service, no persistence, no
  password, reachable from the gateways' pods only).
* ``NAME-workers`` headless Service and one StatefulSet per ``[[workers]]`` entry (``NAME-<entry name>``, or
  ``NAME-workers<N>``): stable pod names and DNS (``NAME-x-0.NAME-workers.NS.svc.DOMAIN``) for the gateway's worker
  list, all pods started at once as ``up`` does. Each container's command line is the launcher's own
  (:func:`~btbctl.engine.launcher.cluster.worker_argv`, the function ``btbctl up`` calls), with the worker bound
  to all of the pod's addresses and the image's interpreter, as the SSH launcher does for a remote host
  (:func:`~btbctl.engine.launcher.ssh.remote_argv`): flags are never written here. SGLang workers ask for
  ``tp_size`` GPUs (``gpu_resource``), run on the nodes of ``node_selector``/``tolerations`` with the environment of
  ``secret_env``, get a memory-backed ``/dev/shm`` and, with ``model_cache_gib``, a volume per pod for the weights.
  An entry with ``kv_events = "tcp://HOST:PORT"`` publishes on PORT and replays on PORT + 1 in every pod (each pod
  has its own addresses; ``up`` spreads one host's workers over PORT + 2i), with the launcher's
  ``--kv-events-config`` (:func:`~btbctl.engine.launcher.cluster.kv_events_args`) and container ports
  ``kv-events``/``kv-replay``; ``gateway.json`` lists each pod's endpoints at its DNS name (:func:`kv_events_ref`).
  Emulated workers run on any node, without those. Real and emulated workers never share a served model name
  (:func:`check_one_kind_per_model`).
* ``NAME-agent`` DaemonSet and headless Service: one ``btbctl agent`` per node (host network, see below), its Unix
  socket in the host directory ``agent_socket_dir`` that the node's SGLang workers mount at the same path. The
  arena is a memfd the agent hands to SGLang's ``BtbL3Store`` over that socket, so nothing else is shared between
  the pods (no hostIPC, no host ``/dev/shm``); the memfd is charged to the agent's memory limit.

Resources: every container requests CPU and memory (:data:`GATEWAY_RESOURCES`, :func:`worker_resources`, the
agents' arena plus 512 MiB); memory limits on all but the SGLang workers, whose host memory grows with the model and
HiCache; no CPU limits (throttling shows up as latency). Overlays adjust them per site.

Why host network for the agents: they move KV pages between nodes at NIC speed and, where the fabric has it, over
RDMA; on the host network they use the node's NICs (and RDMA devices) directly, without an overlay in the path,
and each node's agent has one stable address, the node's (``status.hostIP``), which a worker pod on the same node
also knows from the downward API. The headless ``NAME-agent`` Service lists every agent (DNS, endpoints) for
discovery and scraping. Host network and a hostPath need the ``privileged`` Pod Security level in the namespace.

Secrets: the fleet secret and both tokens come from the Secret ``secret_name`` (keys
:data:`~btbctl.engine.launcher.kubernetes.SECRET_KEYS`), mounted as files; environment variables that hold secrets
come from ``secret_env``. The render refuses a worker environment variable or flag that looks like a secret value
(:func:`check_no_secret_values`) and never renders a Secret. The agents' DaemonSet mounts the fleet secret itself
(``--secret-file``): its nodes are not known when the manifests are written, so each agent derives its own node
key and its peers' link keys from it (:mod:`~btbctl.engine.replication.credentials`). Unlike ``btbctl up``, which hands
each agent only its node credentials, here one node's files can speak for another (README, "Trust boundary").

Prometheus: the gateway's and the workers' (with ``enable_metrics``) pods carry ``prometheus.io/scrape``, ``/port``
and ``/path`` annotations. The agents' do not: off loopback their ``/metrics`` needs the control token, so they are
scraped by a job that presents it (``bearer_token_file``; deploy/README.md).

Security: every pod runs as a non-root user (:data:`RUN_AS_USER`) under the runtime's default seccomp profile; no
container may escalate privileges, all capabilities are dropped, and the gateway's and the agents' root file systems
are read-only (a ``/tmp`` volume each). The agents' init container alone runs as root, with ``CHOWN`` and ``FOWNER``
only, to hand the host folder of the socket to that user. ``networkpolicy.yaml`` admits the gateway's data port from
every pod of the namespace (from anywhere when its Service is not ClusterIP), its control port and the workers'
ports (KV events included) only from this fleet's pods, and the rendered Redis's port only from the gateways; the
agents, on the host network, are outside NetworkPolicy and authenticate every connection themselves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml

from btbctl.engine.errors import ConfigError
from btbctl.engine.launcher.cluster import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_GATEWAY_PORT,
    ClusterFile,
    WorkerInstance,
    hicache_args,
    worker_argv,
)
from btbctl.engine.launcher.cluster import kv_events_ref as launcher_kv_events_ref
from btbctl.engine.launcher.kubernetes import KubernetesSection

#: Where the Secret's files are mounted in every pod that needs them.
SECRET_DIR = "/var/run/secrets/btbctl"
#: Where the gateway's ConfigMap is mounted.
GATEWAY_CONFIG_DIR = "/etc/btbctl"
#: Every pod and worker listens on all of its own addresses (a pod's network namespace is its own).
BIND_ALL = "0.0.0.0"
#: Name of the agent's socket in ``agent_socket_dir`` (``btbctl agent --socket``).
AGENT_SOCKET_NAME = "agent.sock"
#: Environment variable of ``btbctl.sglang_l3``'s default agent socket (``btbctl.sglang_l3.store.AGENT_SOCKET_ENV``).
AGENT_SOCKET_ENV = "BTBCTL_AGENT_SOCKET"
#: SGLang's flag carrying the HiCache backend's JSON settings (SGLANG.md, "Worker flags").
HICACHE_EXTRA_FLAG = "--hicache-storage-backend-extra-config"
#: Words of an environment variable's or a flag's name that say its value is a secret.
_SECRET_WORDS = {"token", "secret", "password", "passwd", "apikey", "credential", "credentials"}
#: Last words that say the value only names where a secret is (a file, a path).
_REFERENCE_WORDS = {"file", "path", "dir", "name", "id"}

#: How every rendered file starts (``btbctl deploy render`` writes it in its header).
RENDERED_MARK = "# Rendered by `btbctl deploy render"
#: Files a render writes only for some cluster files (a later render without them removes its own old copy).
OPTIONAL_FILES = ("namespace.yaml", "agents.yaml", "redis.yaml")
#: Image of the Redis the gateways share when ``[gateway] replicas`` > 1 and no ``redis_url`` is given: the official
#: Debian-based image (an overlay's ``images`` entry renames it for a mirror).
REDIS_IMAGE = "redis:7.4.2-bookworm"
#: Port of that Redis.
REDIS_PORT = 6379

_WORKER_TOKEN = f"{SECRET_DIR}/worker-token"
_CONTROL_TOKEN = f"{SECRET_DIR}/control-token"
_FLEET_SECRET = f"{SECRET_DIR}/fleet-secret"
#: Environment variable holding a worker pod's name (downward API), for its URL in the HiCache extra config.
POD_NAME_ENV = "POD_NAME"


@dataclass(frozen=True)
class Manifest:
    """One file of the rendered fleet: ``name`` (e.g. ``gateway.yaml``) and its objects, in apply order."""

    name: str
    objects: list[dict]


def render(cluster: ClusterFile, path: str | None = None) -> list[Manifest]:
    """The manifests of ``cluster`` (files ``namespace.yaml`` when asked for, ``gateway.yaml``, ``workers.yaml``,
    ``agents.yaml`` when agents run), every object a plain dict as the Kubernetes API takes it.

    Raises:
        ConfigError: no ``[kubernetes]`` section; a worker entry that Kubernetes cannot run as written (a command
            using ``{name}`` or ``{index}``, which differ per pod of one StatefulSet); an environment variable or
            flag that would put a secret value in a manifest; the workers' HiCache settings naming another agent
            socket than the agents'. The message names ``path`` and the key.
    """
    k8s = cluster.kubernetes
    if k8s is None:
        raise ConfigError(
            "kubernetes",
            'missing: add a [kubernetes] section with at least image = "REGISTRY/btbctl:TAG" '
            "(see examples/cluster-k8s.toml)",
            path,
        )
    try:
        return _render(cluster, k8s)
    except ConfigError as e:
        raise ConfigError(e.key, e.reason, path) from None


def _render(cluster: ClusterFile, k8s: KubernetesSection) -> list[Manifest]:
    check_no_secret_values(cluster)
    check_one_kind_per_model(cluster)
    l3 = cluster.replication_mode == "l3"
    if k8s.agents is False and l3:
        raise ConfigError("kubernetes.agents", "replication mode l3 needs a node agent on every node (its L3 tier)")
    agents = k8s.agents if k8s.agents is not None else any(w.kind == "sglang" for w in cluster.workers)
    redis_url = _redis_url(cluster, k8s)
    workers = _workers(cluster, k8s, agents)
    files = []
    if k8s.create_namespace:
        files.append(Manifest("namespace.yaml", [_namespace(k8s, agents)]))
    files.append(Manifest("gateway.yaml", _gateway(cluster, k8s, workers, redis_url)))
    files.append(Manifest("workers.yaml", workers.objects))
    if agents:
        files.append(Manifest("agents.yaml", _agents(cluster, k8s)))
    own_redis = cluster.gateway.replicas > 1 and "redis_url" not in cluster.gateway.settings
    if own_redis:
        files.append(Manifest("redis.yaml", _redis(k8s)))
    files.append(Manifest("networkpolicy.yaml", _network_policies(cluster, k8s, own_redis)))
    return files


def _redis_url(cluster: ClusterFile, k8s: KubernetesSection) -> str | None:
    """The Redis the gateways share: None with one gateway; ``gateway.settings.redis_url`` when given (refused when
    it holds a password, which the render would write into the ConfigMap), else the rendered ``NAME-redis``."""
    gw = cluster.gateway
    if gw.replicas == 1:
        return None
    given = gw.settings.get("redis_url")
    if given is None:
        return redis_url(k8s)
    from urllib.parse import urlsplit

    if urlsplit(str(given)).password is not None:
        raise ConfigError(
            "gateway.settings.redis_url",
            "holds a password, which the render would write into the gateway's ConfigMap (it never writes secret "
            "values): give a Redis that the gateway pods reach without one (NetworkPolicy), or leave redis_url out "
            "and the render adds a Redis of the fleet's own",
        )
    return str(given)


def redis_url(k8s: KubernetesSection) -> str:
    """The URL of the rendered Redis (``NAME-redis-0`` under its headless Service ``NAME-redis``), database 0."""
    return f"redis://{k8s.name}-redis-0.{k8s.name}-redis.{k8s.namespace}.svc.{k8s.cluster_domain}:{REDIS_PORT}/0"


def worker_pod_argv(
    inst: WorkerInstance, k8s: KubernetesSection, port: int, cluster: ClusterFile | None = None
) -> list[str]:
    """The command line of ``inst``'s container: :func:`worker_argv` (what ``btbctl up`` runs) for the worker bound
    to all of the pod's addresses, on ``port``, with the image's interpreter unless the entry names its own, and
    the Secret's worker token for emulated workers; in replication mode ``l3`` (of ``cluster``) with the HiCache
    flags ``up`` generates (:func:`~btbctl.engine.launcher.cluster.hicache_args`), naming the node agent's socket in
    ``agent_socket_dir``. Same construction as the SSH launcher's ``remote_argv``."""
    spec = inst.spec.model_copy(update={"host": BIND_ALL, "python": inst.spec.python or k8s.python})
    local = WorkerInstance(
        name=inst.name,
        entry=inst.entry,
        # every pod has its own addresses: the KV event ports of worker 0 (kv_events' PORT, PORT + 1) serve them all
        index=0,
        spec=spec,
        port=port,
        transfer_port=inst.transfer_port,
        gpu_ids=None,
    )
    l3 = None
    if cluster is not None and cluster.replication_mode == "l3":
        l3 = hicache_args(
            cluster,
            inst.spec,
            inst.entry,
            f"{k8s.agent_socket_dir}/{AGENT_SOCKET_NAME}",
            worker_url=worker_url(k8s, f"$({POD_NAME_ENV})", port),
        )
    return worker_argv(local, port, local.transfer_port, token_file=_WORKER_TOKEN, l3=l3)


def worker_host(k8s: KubernetesSection, pod: str) -> str:
    """Worker pod ``pod``'s stable DNS name under the headless workers Service."""
    return f"{pod}.{k8s.name}-workers.{k8s.namespace}.svc.{k8s.cluster_domain}"


def worker_url(k8s: KubernetesSection, pod: str, port: int) -> str:
    """The URL the gateway knows worker pod ``pod`` by (its stable DNS name under the headless workers Service)."""
    return f"http://{worker_host(k8s, pod)}:{port}"


def kv_events_ref(inst: WorkerInstance, k8s: KubernetesSection, pod: str) -> dict | None:
    """Where the gateway subscribes to worker pod ``pod``'s KV events (a ``KvEventsRef`` as a dict: the entry's
    ``kv_events`` PORT and PORT + 1 on the pod's DNS name), or None when ``inst``'s entry publishes none: the
    launcher's :func:`kv_events_ref` for worker 0 of the entry, whose ports every pod uses."""
    ev = inst.spec.kv_events
    if ev is None:
        return None
    port = int(ev.rsplit(":", 1)[1])
    pod_spec = inst.spec.model_copy(update={"kv_events": f"tcp://{worker_host(k8s, pod)}:{port}"})
    pod_inst = WorkerInstance(inst.name, inst.entry, 0, pod_spec, inst.port, inst.transfer_port, None)
    return launcher_kv_events_ref(pod_inst)


def control_service_url(cluster: ClusterFile, k8s: KubernetesSection) -> str:
    """The gateway's control API through its ``NAME-control`` Service (what the node agents register with)."""
    port = cluster.gateway.control_port or DEFAULT_CONTROL_PORT
    return f"http://{k8s.name}-control.{k8s.namespace}.svc.{k8s.cluster_domain}:{port}"


def control_pods_service(k8s: KubernetesSection) -> str:
    """Name of the headless Service of the gateways' control ports (several gateways in replication mode ``l3``)."""
    return f"{k8s.name}-control-pods"


def control_pods_service_url(cluster: ClusterFile, k8s: KubernetesSection) -> str:
    """``http://NAME-control-pods.NS.svc.DOMAIN:PORT``: the name that resolves to every gateway pod (one address
    record each), what the node agents of several gateways register through (``--gateway-service``)."""
    port = cluster.gateway.control_port or DEFAULT_CONTROL_PORT
    return f"http://{control_pods_service(k8s)}.{k8s.namespace}.svc.{k8s.cluster_domain}:{port}"


def agents_register_with(cluster: ClusterFile, k8s: KubernetesSection) -> list[str]:
    """The registration flags of the node agents: none outside replication mode ``l3``; ``--gateway`` and the
    ``NAME-control`` Service with one gateway; ``--gateway-service`` and the ``NAME-control-pods`` headless Service
    with several (a ClusterIP Service would take each agent to one gateway only)."""
    if cluster.replication_mode != "l3":
        return []
    if cluster.gateway.replicas == 1:
        return ["--gateway", control_service_url(cluster, k8s)]
    return ["--gateway-service", control_pods_service_url(cluster, k8s)]


def agent_argv(k8s: KubernetesSection, register: list[str] | None = None) -> list[str]:
    """The node agent's command line (``btbctl agent``); ``$(HOST_IP)`` and ``$(NODE_NAME)`` are filled in by the
    kubelet from the pod's environment (downward API). ``register``: the flags naming the gateways it registers
    with (:func:`agents_register_with`; replication mode ``l3``: it announces its node, its addresses and the
    workers connected to its socket)."""
    return [
        k8s.python,
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        _FLEET_SECRET,
        "--socket",
        f"{k8s.agent_socket_dir}/{AGENT_SOCKET_NAME}",
        "--peer",
        f"$(HOST_IP):{k8s.agent_peer_port}",
        "--control",
        f"$(HOST_IP):{k8s.agent_control_port}",
        "--control-token-file",
        _CONTROL_TOKEN,
        "--arena-mib",
        str(k8s.agent_arena_mib),
        "--agent-id",
        "$(NODE_NAME)",
        *(register or []),
    ]


def check_no_secret_values(cluster: ClusterFile) -> None:
    """Refuse what would write a secret value into a manifest: a worker environment variable named like a secret
    (``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ``*API_KEY*``, ...) or such a flag in ``extra_args`` or
    ``command`` (SGLang's ``--api-key``). Raises :class:`ConfigError` naming the key."""
    for e, spec in enumerate(cluster.workers):
        for name in spec.env:
            if _secretish(name.split("_")):
                raise ConfigError(
                    f"workers.{e}.env.{name}",
                    "looks like a secret, and the render never writes secret values: put it in a Kubernetes Secret "
                    f'and map it with kubernetes.secret_env.{name} = "SECRET/KEY"',
                )
        for field in ("extra_args", "command"):
            for arg in getattr(spec, field) or []:
                flag = arg.split("=", 1)[0]
                if flag.startswith("--") and _secretish(flag[2:].split("-")):
                    raise ConfigError(
                        f"workers.{e}.{field}",
                        f"{flag} would write a secret value into the manifests; the render never does (pass it "
                        "through an environment variable from kubernetes.secret_env where the program reads one)",
                    )


def check_one_kind_per_model(cluster: ClusterFile) -> None:
    """Refuse SGLang and emulated workers serving one model name: the gateway routes a request for that name to
    any of them, so clients would get emulated answers. Raises :class:`ConfigError` naming both entries."""
    first: dict[str, int] = {}
    for e, spec in enumerate(cluster.workers):
        model = spec.served_model_name or spec.model
        ref = first.setdefault(model, e)
        other = cluster.workers[ref]
        if other.kind != spec.kind:
            raise ConfigError(
                f"workers.{e}.kind",
                f"workers.{e} ({_entry_label(spec, e)}) and workers.{ref} ({_entry_label(other, ref)}) both serve "
                f"model {model!r}: clients of that name would get emulated answers; render real and emulated "
                "workers from separate cluster files (examples/cluster-k8s.toml, examples/cluster-k8s-emulated.toml) "
                "or give them different served_model_name",
            )


def _entry_label(spec: Any, e: int) -> str:
    return f"{spec.name or f'workers{e}'}, {spec.kind}"


def _secretish(words: list[str]) -> bool:
    """``HF_TOKEN``, ``OPENAI_API_KEY``, ``--api-key``, ``DB_PASSWORD``: yes; ``TOKENIZERS_PARALLELISM``,
    ``--max-total-tokens``, ``--btb-token-file``: no."""
    w = [x.lower() for x in words if x]
    if not w or w[-1] in _REFERENCE_WORDS:
        return False
    pairs = {"".join(w[i : i + 2]) for i in range(len(w) - 1)}
    return bool(_SECRET_WORDS & set(w)) or bool({"apikey", "privatekey", "accesskey"} & pairs) or w[-1] == "key"


# -- objects ---------------------------------------------------------------------------------------------------------


def _labels(k8s: KubernetesSection, component: str | None = None) -> dict[str, str]:
    out = {"app.kubernetes.io/name": "btbctl", "app.kubernetes.io/instance": k8s.name}
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def _meta(k8s: KubernetesSection, name: str, component: str | None, **extra: Any) -> dict:
    labels = {**_labels(k8s, component), "app.kubernetes.io/managed-by": "btbctl", **k8s.labels}
    return {"name": name, "namespace": k8s.namespace, "labels": labels, **extra}


#: The user (and group) every container runs as: not root. The image's files must be readable by it.
RUN_AS_USER = 65532


def _pod_security() -> dict:
    """A pod's securityContext: not root, the runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security(read_only_root: bool) -> dict:
    """A container's securityContext: no privilege escalation, every capability dropped, and a read-only root file
    system where the process writes nothing outside its volumes (the gateway, the agents)."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": read_only_root,
    }


#: The gateway's container: one asyncio process (routing, detector, copies' bookkeeping); no CPU limit (throttling
#: shows up as TTFT).
GATEWAY_RESOURCES = {"requests": {"cpu": "1", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
#: An emulated worker's container: a CPU-only process whose KV store holds bytes scaled down (``kv_bytes_scale``).
EMULATED_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
#: The shared Redis's container (several gateways): small keys and pub/sub only.
REDIS_RESOURCES = {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
#: CPUs and memory (GiB) an SGLang worker requests per GPU (tokenizer, scheduler, host KV tier).
SGLANG_CPU_PER_GPU = 8
SGLANG_MEMORY_GIB_PER_GPU = 32

#: A writable ``/tmp`` for containers with a read-only root file system.
_TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}
_TMP_VOLUME = {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}


def _network_policies(cluster: ClusterFile, k8s: KubernetesSection, own_redis: bool = False) -> list[dict]:
    """Ingress rules: the gateway's data port from every pod of the namespace (from anywhere when its Service is
    exposed beyond the cluster), its control port only from this fleet's pods (from anywhere in replication mode
    ``l3``, where the node agents register from the host network), the workers' ports (HTTP and KV events) only
    from this fleet's pods, and with ``own_redis`` the rendered Redis's port only from the gateways.
    The agents run on the host network, where NetworkPolicy does not apply: their peer port authenticates every
    connection with the fleet secret and their control API needs the token."""
    gw = cluster.gateway
    port = gw.port or DEFAULT_GATEWAY_PORT
    control_port = gw.control_port or DEFAULT_CONTROL_PORT
    fleet = {"podSelector": {"matchLabels": _labels(k8s)}}
    data_from: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": port}]}
    if k8s.gateway_service_type == "ClusterIP":
        data_from["from"] = [{"podSelector": {}}]
    control_from: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": control_port}]}
    if cluster.replication_mode != "l3":
        control_from["from"] = [fleet]
    # l3: the node agents register on the control port from the host network, whose source addresses (the nodes')
    # no pod selector matches: the port is open, and every request on it is authenticated (bearer token on all
    # routes, as the listener is not on loopback; registrations signed with a node key). The policy is per pod, so
    # it covers the port however it is reached: the NAME-control Service or, with several gateways, each pod's
    # own address from the NAME-control-pods headless Service
    gateway = _ingress_policy(k8s, "gateway", [data_from, control_from])
    policies = [gateway, _ingress_policy(k8s, "worker", [{"from": [fleet]}])]
    if own_redis:
        gateways = {"podSelector": {"matchLabels": _labels(k8s, "gateway")}}
        redis_from = {"from": [gateways], "ports": [{"protocol": "TCP", "port": REDIS_PORT}]}
        policies.append(_ingress_policy(k8s, "redis", [redis_from]))
    return policies


def _ingress_policy(k8s: KubernetesSection, component: str, ingress: list[dict]) -> dict:
    """A NetworkPolicy ``NAME-<component>s`` (``NAME-gateway``, ``NAME-redis``) admitting only ``ingress`` to the
    pods of ``component``."""
    name = f"{k8s.name}-{component}" if component in ("gateway", "redis") else f"{k8s.name}-{component}s"
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(k8s, name, component),
        "spec": {
            "podSelector": {"matchLabels": _labels(k8s, component)},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _namespace(k8s: KubernetesSection, agents: bool) -> dict:
    """The Namespace, at the Pod Security level its pods need: ``privileged`` with node agents (host network and a
    hostPath), else ``restricted`` (every other pod runs non-root, without privileges, under RuntimeDefault)."""
    meta = _meta(k8s, k8s.namespace, None)
    del meta["namespace"]
    meta["labels"]["pod-security.kubernetes.io/enforce"] = "privileged" if agents else "restricted"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def secrets_needed(objects: Iterable[dict]) -> dict[str, list[str]]:
    """``{Secret name: [keys]}`` the rendered ``objects`` read (volumes and ``secretKeyRef`` environment variables):
    what an operator must create before applying them, sorted."""
    need: dict[str, set[str]] = {}

    def walk(node: object) -> None:
        if isinstance(node, dict):
            ref = node.get("secretKeyRef")
            if isinstance(ref, dict) and "name" in ref:
                need.setdefault(ref["name"], set()).add(ref.get("key", ""))
            vol = node.get("secret")
            if isinstance(vol, dict) and "secretName" in vol:
                keys = need.setdefault(vol["secretName"], set())
                keys.update(i["key"] for i in vol.get("items") or [] if "key" in i)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for o in objects:
        walk(o)
    return {name: sorted(k for k in keys if k) for name, keys in sorted(need.items())}


def _secret_volume(k8s: KubernetesSection, keys: list[str]) -> dict:
    return {
        "name": "secrets",
        "secret": {
            "secretName": k8s.secret_name,
            "defaultMode": 0o400,
            "items": [{"key": key, "path": key} for key in keys],
        },
    }


def _gateway(cluster: ClusterFile, k8s: KubernetesSection, workers: _Workers, redis_url: str | None) -> list[dict]:
    from btbctl.engine.config import validate
    from btbctl.engine.gateway.config import GatewayConfig
    from btbctl.engine.launcher.fleet import gateway_argv

    gw = cluster.gateway
    port = gw.port or DEFAULT_GATEWAY_PORT
    control_port = gw.control_port or DEFAULT_CONTROL_PORT
    if port == control_port:
        raise ConfigError("gateway.control_port", f"port {control_port} is already gateway.port")
    config = cluster.gateway_config(
        workers.urls, port=port, control_port=control_port, token_file=_CONTROL_TOKEN, worker_token_file=_WORKER_TOKEN
    )
    config.update({"host": BIND_ALL, "control_host": BIND_ALL})
    # l3: which node agent serves which worker only pod placement decides, so the agents register with the gateway
    # (signed with keys of the fleet secret it checks them against) and name the workers connected to their socket;
    # the agents share one control token here (the Secret's control-token)
    config["replication"] = cluster.replication_mode
    if cluster.replication_mode == "l3":
        config.update(agents=[], worker_agents=[], agent_secret_file=_FLEET_SECRET, agent_token_file=_CONTROL_TOKEN)
    if any(workers.kv_events):  # the workers' KV events, at the pods' DNS names (as `up` lists them)
        config["kv_events"] = list(workers.kv_events)
    if redis_url is not None:  # several gateways: one Redis shares detection, copy orders and tuning
        config["redis_url"] = redis_url
    validate(GatewayConfig, config, None, "gateway")
    text = json.dumps(config, indent=2) + "\n"
    name = f"{k8s.name}-gateway"
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(k8s, name, "gateway"),
        "data": {"gateway.json": text},
    }
    container = {
        "name": "gateway",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": gateway_argv(f"{GATEWAY_CONFIG_DIR}/gateway.json", python=k8s.python),
        "ports": [
            {"name": "http", "containerPort": port, "protocol": "TCP"},
            {"name": "control", "containerPort": control_port, "protocol": "TCP"},
        ],
        # ready while at least one worker is healthy (the data plane's /health answers 503 before)
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": copy.deepcopy(GATEWAY_RESOURCES),
        "volumeMounts": [
            {"name": "config", "mountPath": GATEWAY_CONFIG_DIR, "readOnly": True},
            {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True},
            _TMP_MOUNT,
        ],
        "securityContext": _container_security(True),
    }
    pod_labels = {**_labels(k8s, "gateway"), **k8s.labels}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(k8s, name, "gateway"),
        "spec": {
            "replicas": gw.replicas,
            # one gateway: Recreate (two at once would each see half of every burst); several share what they see
            # through Redis, so they roll one at a time and keep serving
            "strategy": (
                {"type": "Recreate"}
                if gw.replicas == 1
                else {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
            ),
            "selector": {"matchLabels": _labels(k8s, "gateway")},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        **_scrape(port),
                        # a changed gateway.json rolls the gateway
                        "btbctl.io/config-sha256": hashlib.sha256(text.encode()).hexdigest(),
                    },
                },
                "spec": {
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": [
                        {"name": "config", "configMap": {"name": name}},
                        _secret_volume(
                            k8s,
                            ["control-token", "worker-token"]
                            + (["fleet-secret"] if cluster.replication_mode == "l3" else []),
                        ),
                        _TMP_VOLUME,
                    ],
                },
            },
        },
    }
    data_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k8s, name, "gateway"),
        "spec": {
            "type": k8s.gateway_service_type,
            "selector": _labels(k8s, "gateway"),
            "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}],
        },
    }
    control_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k8s, f"{k8s.name}-control", "gateway"),
        "spec": {
            "type": "ClusterIP",
            "selector": _labels(k8s, "gateway"),
            "ports": [{"name": "control", "port": control_port, "targetPort": "control", "protocol": "TCP"}],
        },
    }
    objects = [config_map, deployment, data_service, control_service]
    if cluster.replication_mode == "l3" and gw.replicas > 1:
        # the node agents resolve this name at each announcement and register with every gateway pod it lists;
        # not-ready pods too: a gateway should know the agents before its data plane takes traffic
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _meta(k8s, control_pods_service(k8s), "gateway"),
                "spec": {
                    "clusterIP": "None",
                    "publishNotReadyAddresses": True,
                    "selector": _labels(k8s, "gateway"),
                    "ports": [{"name": "control", "port": control_port, "targetPort": "control", "protocol": "TCP"}],
                },
            }
        )
    return objects


def _redis(k8s: KubernetesSection) -> list[dict]:
    """``NAME-redis``: the Redis the gateways share (:func:`redis_url`), a StatefulSet of one (a stable DNS name)
    behind a headless Service, no persistence (what it holds is seconds of arrivals and copy claims; a restarted one
    is joined again by every gateway), no password: only the gateways' pods reach it (NetworkPolicy)."""
    name = f"{k8s.name}-redis"
    selector = _labels(k8s, "redis")
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": [
            "redis-server",
            "--port",
            str(REDIS_PORT),
            "--bind",
            BIND_ALL,
            "--protected-mode",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            "/tmp",
        ],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 6},
        "resources": copy.deepcopy(REDIS_RESOURCES),
        "volumeMounts": [_TMP_MOUNT],
        "securityContext": _container_security(True),
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(k8s, name, "redis"),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**selector, **k8s.labels}},
                "spec": {"securityContext": _pod_security(), "containers": [container], "volumes": [_TMP_VOLUME]},
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k8s, name, "redis"),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [{"name": "redis", "port": REDIS_PORT, "targetPort": "redis", "protocol": "TCP"}],
        },
    }
    return [statefulset, service]


@dataclass
class _Workers:
    """The workers' objects, and per worker pod (in the gateway's order) its URL and where it publishes KV events
    (a ``KvEventsRef`` dict, or None)."""

    objects: list[dict]
    urls: list[str]
    kv_events: list[dict | None]


def _entry_name(cluster: ClusterFile, k8s: KubernetesSection, e: int) -> str:
    spec = cluster.workers[e]
    base = (spec.name or f"workers{e}").lower().replace("_", "-").replace(".", "-")
    name = f"{k8s.name}-{base}"
    # a StatefulSet's pods add "-<ordinal>" and a controller-revision-hash label "<name>-<10 chars>" (63 at most)
    if len(name) > 52 or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name):
        raise ConfigError(
            f"workers.{e}.name",
            f"gives the StatefulSet name {name!r}; on Kubernetes it must be a DNS label of at most 52 characters "
            "(kubernetes.name + '-' + the entry's name)",
        )
    return name


def _workers(cluster: ClusterFile, k8s: KubernetesSection, agents: bool) -> _Workers:
    headless = f"{k8s.name}-workers"
    objects: list[dict] = []
    urls: list[str] = []
    kv_refs: list[dict | None] = []
    ports: dict[int, str] = {}
    seen: dict[str, int] = {}
    by_entry: dict[int, list[WorkerInstance]] = {}
    for inst in cluster.instances():
        by_entry.setdefault(inst.entry, []).append(inst)
    for e, spec in enumerate(cluster.workers):
        name = _entry_name(cluster, k8s, e)
        if name in seen:
            raise ConfigError(f"workers.{e}.name", f"gives the StatefulSet name {name!r} of workers.{seen[name]} too")
        seen[name] = e
        if spec.command is not None and any(("{name}" in a or "{index}" in a) for a in spec.command):
            raise ConfigError(
                f"workers.{e}.command",
                "uses {name} or {index}, which differ per worker, but the pods of one StatefulSet share one command "
                "line; on Kubernetes give each such worker an entry of its own",
            )
        port = spec.port or k8s.worker_port
        ports.setdefault(port, f"http-{len(ports)}" if ports else "http")
        argvs = {tuple(worker_pod_argv(inst, k8s, port, cluster)) for inst in by_entry[e]}
        if len(argvs) != 1:  # pragma: no cover - guarded by the {name}/{index} check above
            raise ConfigError(f"workers.{e}", "the workers of this entry would need different command lines")
        argv = list(next(iter(argvs)))
        for inst in by_entry[e]:
            urls.append(worker_url(k8s, f"{name}-{inst.index}", port))
            kv_refs.append(kv_events_ref(inst, k8s, f"{name}-{inst.index}"))
        objects.append(_statefulset(cluster, k8s, e, name, headless, argv, port, agents))
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k8s, headless, "worker"),
        "spec": {
            "clusterIP": "None",
            # the gateway resolves every worker from the start and tracks their health itself
            "publishNotReadyAddresses": True,
            "selector": _labels(k8s, "worker"),
            "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for p, n in ports.items()],
        },
    }
    return _Workers([service, *objects], urls, kv_refs)


def _statefulset(
    cluster: ClusterFile,
    k8s: KubernetesSection,
    e: int,
    name: str,
    headless: str,
    argv: list[str],
    port: int,
    agents: bool,
) -> dict:
    spec = cluster.workers[e]
    gpu = spec.kind == "sglang"
    env: list[dict] = [{"name": k, "value": v} for k, v in spec.env.items()]
    if gpu:  # the Hugging Face token and the like: an emulated worker downloads nothing
        env += [
            {"name": k, "valueFrom": {"secretKeyRef": {"name": ref.split("/", 1)[0], "key": ref.split("/", 1)[1]}}}
            for k, ref in k8s.secret_env.items()
        ]
    if cluster.replication_mode == "l3":  # its URL in the HiCache extra config, which its store names to the agent
        env.append({"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    mounts: list[dict] = []
    volumes: list[dict] = []
    claims: list[dict] = []
    if spec.kind == "emulated" and spec.command is None:
        mounts.append({"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True})
        volumes.append(_secret_volume(k8s, ["worker-token"]))
    if spec.kind == "sglang":
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{k8s.shm_gib}Gi"}})
        if agents:
            socket = f"{k8s.agent_socket_dir}/{AGENT_SOCKET_NAME}"
            _check_agent_socket(argv, socket, e)
            env.append({"name": AGENT_SOCKET_ENV, "value": socket})
            mounts.append({"name": "agent-socket", "mountPath": k8s.agent_socket_dir})
            volumes.append(
                {"name": "agent-socket", "hostPath": {"path": k8s.agent_socket_dir, "type": "DirectoryOrCreate"}}
            )
        if k8s.model_cache_gib is not None:
            mounts.append({"name": "model-cache", "mountPath": k8s.model_cache_path})
            claim_spec: dict[str, Any] = {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": f"{k8s.model_cache_gib}Gi"}},
            }
            if k8s.storage_class is not None:
                claim_spec["storageClassName"] = k8s.storage_class
            claims.append({"metadata": {"name": "model-cache"}, "spec": claim_spec})
    container: dict[str, Any] = {
        "name": "worker",
        "image": (k8s.sglang_image or k8s.image) if spec.kind == "sglang" else k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": argv,
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}, *_kv_event_ports(spec)],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5},
        # loading weights takes minutes: ready_timeout_s bounds the start, as it bounds `btbctl up`'s wait
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": max(1, -(-int(spec.effective_ready_timeout_s) // 10)),
        },
    }
    if env:
        container["env"] = env
    if mounts:
        container["volumeMounts"] = mounts
    # SGLang writes its compile caches under the home folder: its root file system stays writable
    container["securityContext"] = _container_security(False)
    container["resources"] = worker_resources(spec, k8s)
    pod_spec: dict[str, Any] = {"securityContext": _pod_security(), "containers": [container]}
    if gpu:  # an emulated worker runs on any node: the GPU pool's selector and taints are not its business
        _place_on_gpu_nodes(pod_spec, k8s)
    if volumes:
        pod_spec["volumes"] = volumes
    selector = {**_labels(k8s, "worker"), "btbctl.io/worker-entry": name}
    annotations = _scrape(port) if spec.enable_metrics else {}
    template_meta: dict[str, Any] = {"labels": {**selector, **k8s.labels}}
    if annotations:
        template_meta["annotations"] = annotations
    sts: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(k8s, name, "worker"),
        "spec": {
            "serviceName": headless,
            "replicas": spec.count,
            # start every worker at once, as `btbctl up` does
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {"metadata": template_meta, "spec": pod_spec},
        },
    }
    if claims:
        sts["spec"]["volumeClaimTemplates"] = claims
    return sts


def _kv_event_ports(spec: Any) -> list[dict]:
    """The container ports of an entry's KV events (its ``kv_events`` PORT: publisher, PORT + 1: replay; the same in
    every pod), none without events or with a ``command`` override."""
    if spec.kv_events is None or spec.command is not None:
        return []
    port = int(spec.kv_events.rsplit(":", 1)[1])
    return [
        {"name": "kv-events", "containerPort": port, "protocol": "TCP"},
        {"name": "kv-replay", "containerPort": port + 1, "protocol": "TCP"},
    ]


def _place_on_gpu_nodes(pod_spec: dict, k8s: KubernetesSection) -> None:
    """``kubernetes.node_selector`` and ``tolerations`` on ``pod_spec`` (SGLang workers and node agents)."""
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in k8s.tolerations]


def worker_resources(spec: Any, k8s: KubernetesSection) -> dict:
    """A worker container's ``resources``. SGLang: its GPUs (``tp_size``, which is also each worker's share of
    ``gpu_ids``) and ``extra_resources`` as limits, :data:`SGLANG_CPU_PER_GPU` CPUs and
    :data:`SGLANG_MEMORY_GIB_PER_GPU` GiB per GPU requested; no memory limit (the host KV tier and the memory-backed
    ``/dev/shm`` grow with the model and ``hicache_ratio``; an overlay sets one where a site wants it). Emulated:
    :data:`EMULATED_RESOURCES`."""
    if spec.kind != "sglang":
        return copy.deepcopy(EMULATED_RESOURCES)
    gpus = len(spec.gpu_ids) // spec.count if spec.gpu_ids is not None else spec.tp_size
    limits = {k8s.gpu_resource: str(gpus), **{k: str(v) for k, v in k8s.extra_resources.items()}}
    requests = {"cpu": str(SGLANG_CPU_PER_GPU * gpus), "memory": f"{SGLANG_MEMORY_GIB_PER_GPU * gpus}Gi"}
    return {"requests": {**requests, **limits}, "limits": limits}


def _check_agent_socket(argv: list[str], socket: str, e: int) -> None:
    """Where the workers' HiCache settings name the agent's socket, it must be the one the agents serve."""
    for i, arg in enumerate(argv[:-1]):
        if arg != HICACHE_EXTRA_FLAG or not argv[i + 1].startswith("{"):
            continue
        try:
            extra = json.loads(argv[i + 1])
        except ValueError:
            continue
        named = extra.get("agent_socket") if isinstance(extra, dict) else None
        if named is not None and named != socket:
            raise ConfigError(
                "kubernetes.agent_socket_dir",
                f"the agents serve {socket} but workers.{e}'s {HICACHE_EXTRA_FLAG} names agent_socket {named!r}; "
                f"set agent_socket_dir = {os.path.dirname(named)!r} (and the socket name {AGENT_SOCKET_NAME})",
            )


def _agents(cluster: ClusterFile, k8s: KubernetesSection) -> list[dict]:
    name = f"{k8s.name}-agent"
    selector = _labels(k8s, "agent")
    container = {
        "name": "agent",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": agent_argv(k8s, agents_register_with(cluster, k8s)),
        "env": [
            {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "ports": [
            {"name": "peer", "containerPort": k8s.agent_peer_port, "protocol": "TCP"},
            {"name": "control", "containerPort": k8s.agent_control_port, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "control"}, "periodSeconds": 5},
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "control"},
            "periodSeconds": 10,
            "failureThreshold": 6,
        },
        # the arena is a memfd the agent fills: its pages count against this container's memory
        "resources": {
            "requests": {"memory": f"{k8s.agent_arena_mib + 512}Mi", "cpu": "1"},
            "limits": {"memory": f"{k8s.agent_arena_mib + 512}Mi"},
        },
        "volumeMounts": [
            {"name": "agent-socket", "mountPath": k8s.agent_socket_dir},
            {"name": "secrets", "mountPath": SECRET_DIR, "readOnly": True},
            _TMP_MOUNT,
        ],
        "securityContext": _container_security(True),
    }
    # the host folder of the socket is created by the kubelet, owned by root: hand it to the agent's user first
    # (the one container that runs as root, with CHOWN alone and nothing else)
    chown = {
        "name": "socket-dir-owner",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": [
            k8s.python,
            "-c",
            (
                f"import os; os.chown({k8s.agent_socket_dir!r}, {RUN_AS_USER}, {RUN_AS_USER}); "
                f"os.chmod({k8s.agent_socket_dir!r}, 0o770)"
            ),
        ],
        "securityContext": {
            "runAsUser": 0,
            "runAsNonRoot": False,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [{"name": "agent-socket", "mountPath": k8s.agent_socket_dir}],
    }
    pod_spec: dict[str, Any] = {
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "securityContext": _pod_security(),
        "initContainers": [chown],
        "containers": [container],
        "volumes": [
            {"name": "agent-socket", "hostPath": {"path": k8s.agent_socket_dir, "type": "DirectoryOrCreate"}},
            _secret_volume(k8s, ["fleet-secret", "control-token"]),
            _TMP_VOLUME,
        ],
    }
    _place_on_gpu_nodes(pod_spec, k8s)
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": _meta(k8s, name, "agent"),
        "spec": {
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                # no scrape annotations: off loopback the agent's /metrics needs the control token (a scrape job
                # with a bearer token file, deploy/README.md)
                "metadata": {"labels": {**selector, **k8s.labels}},
                "spec": pod_spec,
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(k8s, name, "agent"),
        "spec": {
            "clusterIP": "None",
            "selector": selector,
            "ports": [
                {"name": "peer", "port": k8s.agent_peer_port, "targetPort": "peer", "protocol": "TCP"},
                {"name": "control", "port": k8s.agent_control_port, "targetPort": "control", "protocol": "TCP"},
            ],
        },
    }
    return [daemonset, service]


# -- YAML text ------------------------------------------------------------------------------------------------------


class _ManifestDumper(yaml.SafeDumper):
    """PyYAML's safe dumper for manifests: no anchors or aliases (an object built once and used twice is written out
    twice), multi-line strings as literal blocks (``|``) where YAML allows one, and strings that a YAML 1.2 reader
    (go-yaml in kubectl) would take for a number quoted too, not only YAML 1.1's (so ``"1e3"`` and ``"1.0e5"`` stay
    strings), like YAML 1.1's one-letter booleans (``"y"``, ``"N"``)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


#: Line breaks besides ``\n`` that PyYAML's emitter folds wrongly in a plain or single-quoted scalar.
_ODD_BREAKS = frozenset("\x85\u2028\u2029")


def _represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = '"' if _ODD_BREAKS.intersection(data) else "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_ManifestDumper.add_representer(str, _represent_str)
#: YAML 1.2's (and go-yaml's) floats that YAML 1.1 reads as strings: an exponent without a sign or a mantissa dot.
_ManifestDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?0o[0-7]+$"),
    list("-+0123456789."),
)

#: YAML 1.1's one-letter booleans, which go-yaml (kubectl) reads as booleans and PyYAML's resolver does not quote.
_ManifestDumper.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^[yYnN]$"), list("yYnN"))

#: PyYAML's options for every manifest: block style, keys in the order built, long lines never folded.
_DUMP_OPTIONS: dict[str, Any] = {
    "Dumper": _ManifestDumper,
    "default_flow_style": False,
    "sort_keys": False,
    "allow_unicode": True,
    "width": 1 << 30,
}


def dump(data: Any) -> str:
    """One YAML document of plain data (dicts, lists, str, int, float, bool, None), without ``---``, ending in a
    newline. Raises ``yaml.representer.RepresenterError`` for any other type."""
    return yaml.dump(data, **_DUMP_OPTIONS)


def dump_all(docs: list[Any]) -> str:
    """Several documents of plain data, separated by ``---`` lines (none before the first)."""
    return yaml.dump_all(docs, **_DUMP_OPTIONS)


# -- files -----------------------------------------------------------------------------------------------------------


def kustomization(manifests: list[Manifest], k8s: KubernetesSection) -> dict:
    """The ``kustomization.yaml`` of a rendered folder (a kustomize base: overlays patch it)."""
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": k8s.namespace,
        "resources": [m.name for m in manifests],
    }


def write(manifests: list[Manifest], k8s: KubernetesSection, out_dir: str, header: str = "") -> list[str]:
    """Write each manifest and ``kustomization.yaml`` into ``out_dir`` (created if missing), each starting with
    ``header``; remove a file of :data:`OPTIONAL_FILES` that an earlier render wrote (it starts with
    :data:`RENDERED_MARK`) and this one does not. Returns the paths written. Raises :class:`ConfigError` (key
    ``--out``) when the folder cannot be written."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError("--out", f"cannot create {out_dir}: {e.strerror or e}") from None
    texts = {m.name: dump_all(m.objects) for m in manifests}
    texts["kustomization.yaml"] = dump(kustomization(manifests, k8s))
    for name in OPTIONAL_FILES:  # a file an earlier render wrote that this one does not: remove it
        old = os.path.join(out_dir, name)
        if name not in texts and _first_line_starts_with(old, RENDERED_MARK):
            os.unlink(old)
    paths = []
    for name, text in texts.items():
        path = os.path.join(out_dir, name)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(header + text)
        except OSError as e:
            raise ConfigError("--out", f"cannot write {path}: {e.strerror or e}") from None
        paths.append(path)
    return paths


def _first_line_starts_with(path: str, prefix: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(prefix)
    except (OSError, UnicodeDecodeError):
        return False


def objects(manifests: list[Manifest]) -> list[dict]:
    """Every object of ``manifests``, in order."""
    return [obj for m in manifests for obj in m.objects]


__all__ = [
    "AGENT_SOCKET_ENV",
    "AGENT_SOCKET_NAME",
    "GATEWAY_CONFIG_DIR",
    "SECRET_DIR",
    "Manifest",
    "agent_argv",
    "agents_register_with",
    "control_pods_service",
    "control_pods_service_url",
    "control_service_url",
    "check_no_secret_values",
    "check_one_kind_per_model",
    "dump",
    "dump_all",
    "kustomization",
    "kv_events_ref",
    "objects",
    "redis_url",
    "render",
    "worker_pod_argv",
    "worker_host",
    "worker_url",
    "worker_resources",
    "write",
]
