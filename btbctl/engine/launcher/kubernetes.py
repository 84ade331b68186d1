"""The ``[kubernetes]`` section of a cluster file: what a fleet on Kubernetes needs beyond what ``btbctl up`` reads.

The same cluster file drives ``btbctl up`` (this machine, or ``[[hosts]]`` over SSH) and ``btbctl deploy render``
(manifests for Kubernetes, :mod:`btbctl.engine.deploy`); ``up`` ignores this section, the render needs it. Example::

    [kubernetes]
    namespace = "llm"
    image = "registry.example.com/btbctl:0.1.0"            # btbctl installed: gateway, agents, emulated workers
    sglang_image = "registry.example.com/sglang-btb:0.5.23" # SGLang with btbctl installed (the L3 backend)
    node_selector = { "node.kubernetes.io/instance-type" = "p5.48xlarge" }
    gpu_resource = "nvidia.com/gpu"
    storage_class = "fast-nvme"
    model_cache_gib = 400

Secrets are never values here: the fleet secret and the tokens live in the Kubernetes Secret ``secret_name``, and
environment variables of the workers that hold secrets are mapped from Secrets with ``secret_env``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Keys of the Secret ``secret_name`` and what each holds (``kubectl create secret generic NAME --from-file=KEY=...``).
SECRET_KEYS = {
    "fleet-secret": "the fleet secret the node agents authenticate each other with (at least 16 bytes)",
    "control-token": "bearer token of the gateway's control API and of the agents' control API",
    "worker-token": "bearer token the gateway sends to emulated workers' /btb/push",
}

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_RESOURCE = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SECRET_REF = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-._A-Za-z0-9]+$")
_TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")


def _dns_label(v: str, max_len: int = 63) -> str:
    if len(v) > max_len or not _DNS_LABEL.fullmatch(v):
        raise ValueError(
            f"{v!r} is not a DNS label: 1-{max_len} lowercase letters, digits or '-', starting and ending with a "
            "letter or digit"
        )
    return v


class KubernetesSection(BaseModel):
    """``[kubernetes]``: where and how ``btbctl deploy render`` places the fleet on a Kubernetes cluster."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    namespace: str = "btb"
    """Namespace of every object (a DNS label)."""
    name: str = "btb"
    """Prefix of every object's name and the ``app.kubernetes.io/instance`` label (a DNS label of at most 30
    characters, so the longest derived name fits)."""
    create_namespace: bool = True
    """Render the Namespace (labelled for the Pod Security level its pods need: ``privileged`` with node agents, for
    their host network and hostPath, else ``restricted``). False: the namespace exists and is managed elsewhere."""
    image: str = Field(min_length=1)
    """Image with btbctl installed (same version as this one), for the gateway, the node agents and emulated
    workers."""
    sglang_image: str | None = None
    """Image of SGLang workers: SGLang with btbctl installed (for the ``btbctl.sglang_l3`` HiCache backend).
    Default: ``image``."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of every container."""
    python: str = "python3"
    """Interpreter inside the images: the first element of the worker, gateway and agent command lines (a worker's
    own ``python`` wins)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a node must carry to run SGLang workers and node agents (e.g. a GPU node pool); emulated workers run
    on any node."""
    tolerations: list[dict[str, str | int]] = Field(default_factory=list)
    """Tolerations of SGLang workers and node agents (Kubernetes ``Toleration`` objects: key, operator, value,
    effect, tolerationSeconds), e.g. for tainted GPU nodes."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU (``nvidia.com/gpu``, ``amd.com/gpu``); an SGLang worker asks for
    ``tp_size`` of them."""
    extra_resources: dict[str, int] = Field(default_factory=dict)
    """More extended resources per SGLang worker, by name (e.g. an RDMA device plugin's
    ``rdma/hca_shared_devices_a = 1``)."""
    storage_class: str | None = None
    """StorageClass of the workers' model-cache volumes (None: the cluster's default class)."""
    model_cache_gib: int | None = Field(None, ge=1)
    """Size of a PersistentVolumeClaim per SGLang worker, GiB, mounted at ``model_cache_path`` so weights are
    downloaded once per worker. None: no volume (weights in the image or downloaded at every start)."""
    model_cache_path: str = "/root/.cache/huggingface"
    """Where the model-cache volume is mounted (Hugging Face's default cache)."""
    shm_gib: int = Field(16, ge=1)
    """Size of ``/dev/shm`` in SGLang workers, GiB (memory-backed ``emptyDir``; NCCL and torch exchange tensors
    through it, and a container's default 64 MiB breaks tensor parallelism)."""
    worker_port: int = Field(30000, ge=1, le=65535)
    """Port of every worker container (each pod has its own address, so the workers of an entry share one port);
    a ``workers.N.port`` set in the file wins for that entry. 30000 is SGLang's default."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain (workers are reached as ``POD.SERVICE.NAMESPACE.svc.DOMAIN``)."""
    gateway_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    """Service type of the gateway's data plane. The control API always gets its own ClusterIP Service."""
    secret_name: str = "btb-secrets"
    """Secret holding ``fleet-secret``, ``control-token`` and ``worker-token`` (create it yourself; the render
    never writes secret values)."""
    secret_env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of every SGLang worker taken from Secrets: ``NAME = "SECRET/KEY"`` (e.g.
    ``HF_TOKEN = "hf/token"``); emulated workers download nothing and get none."""
    agents: bool | None = None
    """Render the node agents (one ``btbctl agent`` per node, a DaemonSet) that hold SGLang's HiCache L3 pages
    and copy them between nodes. None: when a worker entry is ``kind = "sglang"`` (False is refused in replication
    mode ``l3``)."""
    agent_socket_dir: str = "/run/btbctl"
    """Host directory of the agent's Unix socket (``agent.sock``), mounted at the same path in the agents and in
    the SGLang workers of the node."""
    agent_peer_port: int = Field(30090, ge=1, le=65535)
    """Port the agents copy pages on (host network: a port of the node)."""
    agent_control_port: int = Field(30091, ge=1, le=65535)
    """Port of the agents' control API and ``/metrics`` (host network)."""
    agent_arena_mib: int = Field(16384, ge=1)
    """Page store of each agent, MiB (a memfd charged to the agent's memory limit)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra labels on every object and pod."""

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        return _dns_label(v)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return _dns_label(v, 30)

    @field_validator("secret_name")
    @classmethod
    def _secret_name(cls, v: str) -> str:
        return _dns_label(v, 253)

    @field_validator("node_selector", "labels")
    @classmethod
    def _label_map(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if len(key) > 316 or not _QUALIFIED.fullmatch(key):
                raise ValueError(f"{key!r} is not a label key ([prefix/]name of letters, digits, '-', '_', '.')")
            if value and (len(value) > 63 or not _QUALIFIED.fullmatch(value) or "/" in value):
                raise ValueError(f"{value!r} (of {key!r}) is not a label value (at most 63 letters, digits, -_.)")
        return v

    @field_validator("tolerations")
    @classmethod
    def _tolerations(cls, v: list[dict[str, str | int]]) -> list[dict[str, str | int]]:
        for t in v:
            bad = sorted(set(t) - set(_TOLERATION_KEYS))
            if bad:
                raise ValueError(f"unknown toleration key {bad[0]!r}; valid: {', '.join(_TOLERATION_KEYS)}")
            if t.get("operator", "Equal") not in ("Equal", "Exists"):
                raise ValueError(f"toleration operator must be Equal or Exists, got {t['operator']!r}")
            if t.get("effect", "NoSchedule") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
                raise ValueError(
                    f"toleration effect must be NoSchedule, PreferNoSchedule or NoExecute, got {t['effect']!r}"
                )
        return v

    @field_validator("gpu_resource")
    @classmethod
    def _gpu_resource(cls, v: str) -> str:
        if not _RESOURCE.fullmatch(v):
            raise ValueError(f"{v!r} is not an extended resource name (DOMAIN/NAME, e.g. nvidia.com/gpu, amd.com/gpu)")
        return v

    @field_validator("extra_resources")
    @classmethod
    def _extra_resources(cls, v: dict[str, int]) -> dict[str, int]:
        for name, n in v.items():
            if not _QUALIFIED.fullmatch(name) or "/" not in name:
                raise ValueError(f"{name!r} is not an extended resource name (DOMAIN/NAME)")
            if isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {n!r}")
        return v

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name, ref in v.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not an environment variable name")
            if not _SECRET_REF.fullmatch(ref):
                raise ValueError(f'{name} = {ref!r}: must be "SECRET/KEY" (a Secret\'s name and one of its keys)')
        return v

    @field_validator("cluster_domain")
    @classmethod
    def _domain(cls, v: str) -> str:
        for part in v.split("."):
            _dns_label(part)
        return v

    @field_validator("agent_socket_dir", "model_cache_path")
    @classmethod
    def _abs_path(cls, v: str) -> str:
        if not v.startswith("/") or v != v.rstrip("/") or "//" in v or "/../" in v + "/":
            raise ValueError(f"{v!r} must be an absolute path without a trailing '/' or '..'")
        return v


__all__ = ["KubernetesSection", "SECRET_KEYS"]
