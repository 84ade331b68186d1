"""The cluster file: which workers to start, the gateway in front of them and BTB's constants.

A cluster file is TOML::

    [gateway]
    host = "127.0.0.1"          # data plane (OpenAI / SGLang routes)
    port = 30080
    control_port = 30081        # control API (loopback by default)
    policy = "btb_plus"         # the default; "btb" is the published rule
    settings = { seed = 7 }     # optional: fixed tie-breaks for a reproducible run (default: fresh per start)

    [btb]                       # BTB's four constants (published defaults)
    prefix_blocks = 256
    threshold = 2
    window_s = 1.0
    warm_replicas = 4

    [[workers]]
    kind = "emulated"           # or "sglang"
    count = 4
    model = "llama-3.3-70b"
    gpu = "h100"
    tp_size = 4

    [[hosts]]                   # optional: machines reached over SSH (see hosts.py)
    name = "node-a"
    address = "10.0.0.11"

    [replication]               # optional: how copies are made (see ReplicationSection)
    mode = "l3"                 # l3 (default for sglang workers), push (default for emulated ones) or none

A worker entry whose ``host`` is the name of a ``[[hosts]]`` entry runs on that machine over SSH
(:mod:`~btbctl.engine.launcher.ssh`); any other ``host`` is an address on this machine. Every section and key is
optional; :func:`default_cluster` is what an empty file (and ``btbctl up`` without ``-c``) means: 4 emulated
Llama-3.3-70B workers on 4 x H100 each behind the gateway (policy ``btb_plus``), all on loopback, the published BTB
setting (REFERENCE.md s1).

Command lines are always argv lists, never shell strings: :func:`sglang_argv` builds SGLang's
``python -m sglang.launch_server`` line (REFERENCE.md s5), :func:`emulated_argv` the emulated worker's
``python -m btbctl worker`` line, :func:`agent_argv` a node agent's ``python -m btbctl agent`` line, and a worker's
``command`` replaces either worker line with a user-given argv in which ``{host}``, ``{port}``, ``{model}``,
``{tp_size}``, ``{page_size}``, ``{name}``, ``{index}`` and ``{transfer_port}`` are substituted element by element.

**Replication modes** (``[replication] mode``): ``l3`` (BTB on stock SGLang, SGLANG.md): one ``btbctl agent`` per
host, and every worker started with SGLang's HiCache flags and btbctl's L3 backend (:func:`hicache_args`; the emulated
worker emulates HiCache with the same flags); the gateway copies a hot prefix agent to agent and proves each copy
with a warm-up request. ``push``: the emulated workers' own ``/btb/push`` (no agents, no HiCache flags). ``none``: the
gateway only routes. Absent: ``l3`` when the workers are SGLang, ``push`` when they are emulated.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from btbctl.engine.config import read_toml, validate
from btbctl.engine.constants import BtbConstants
from btbctl.engine.costmodel import (
    DEFAULT_MEM_FRACTION,
    MODELS,
    ReplicaCost,
    default_chunked_prefill_tokens,
    gpu_preset,
    model_preset,
)
from btbctl.engine.errors import ConfigError
from btbctl.engine.launcher.hosts import HostSpec, check_hostname, is_address
from btbctl.engine.launcher.kubernetes import KubernetesSection
from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES
from btbctl.engine.netaddr import is_loopback

#: Default data-plane port of the gateway. SGLang workers default to 30000 (REFERENCE.md s5); the gateway sits
#: next to that range so a single-host fleet keeps its ports together.
DEFAULT_GATEWAY_PORT = 30080
#: Default control-API port of the gateway (data-plane port + 1).
DEFAULT_CONTROL_PORT = 30081
#: Seconds to wait for an emulated worker or the gateway to report ready (they start in about a second).
DEFAULT_EMULATED_READY_TIMEOUT_S = 60.0
#: Seconds to wait for a real SGLang worker: loading 70B weights from local disk takes minutes.
DEFAULT_SGLANG_READY_TIMEOUT_S = 1800.0
#: Substitutions allowed in a worker's ``command`` override.
COMMAND_FIELDS = ("host", "port", "model", "tp_size", "page_size", "name", "index", "transfer_port")

#: Replication modes of a fleet (see the module docstring).
REPLICATION_MODES = ("l3", "push", "none")
#: Default byte budget of each host's agent, MiB (a product choice: a 64k-token prefix of an 8B model is 9 GiB at
#: bf16, of a 70B model 20 GiB; 4 GiB holds the published 64-block prefix of an 8B model at page size 256 twice).
DEFAULT_AGENT_ARENA_MIB = 4096
#: SGLang flags ``up`` generates for every worker in ``l3`` mode; a worker's ``extra_args`` must not set them.
HICACHE_FLAGS = (
    "--enable-hierarchical-cache",
    "--enable-hicache",
    "--hicache-ratio",
    "--hicache-size",
    "--hicache-mem-layout",
    "--hicache-write-policy",
    "--hicache-storage-backend",
    "--hicache-storage-prefetch-policy",
    "--hicache-storage-backend-extra-config",
    "--kv-cache-dtype",
    "--page-size",
    "--tp-size",
    "--served-model-name",
    "--enable-cache-report",
)

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")


class GatewaySection(BaseModel):
    """The BTB gateway in front of the workers (data plane + control API)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    host: str = "127.0.0.1"
    """Address the data plane binds to. Loopback by default; bind another address only on a trusted network."""
    port: int = Field(DEFAULT_GATEWAY_PORT, ge=0, le=65535)
    """Data-plane port (SGLang-native and OpenAI routes); 0 picks a free port at ``up``."""
    control_host: str = "127.0.0.1"
    """Address the control API binds to (fleet state, constants, replication). Loopback by default."""
    control_port: int = Field(DEFAULT_CONTROL_PORT, ge=0, le=65535)
    """Control-API port; 0 picks a free port at ``up``."""
    policy: str = "btb_plus"
    """Routing policy at start: ``btb_plus`` (the default: BTB with copies checked against recompute and routing by
    expected time to first token), ``btb`` (the published rule), ``cache_aware`` (SGLang's router),
    ``cache_aware_spill``, ``least_load``, ``power_of_two``, ``round_robin`` or ``random``; ``btbctl tune
    policy=NAME`` changes it later."""
    page_size: int = Field(256, ge=1)
    """Tokens per KV block the gateway hashes prompts into; must equal the workers' ``page_size`` (256 = the
    published block size, REFERENCE.md s1)."""
    max_retries: int = Field(2, ge=0, le=10)
    """Further workers the gateway tries when one fails before the first byte of its answer reached the client
    (the gateway's default, 2)."""
    health_interval_s: float = Field(1.0, gt=0)
    """Seconds between the gateway's health checks of each worker."""
    max_body_bytes: int = Field(MAX_REQUEST_BODY_BYTES, ge=1024)
    """Largest request body the gateway accepts, bytes (8 MiB, the gateway's default and the emulated worker's own
    limit: never set it above what the workers accept, or the gateway hashes prompts the worker then refuses)."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Further gateway settings by name (``GatewayConfig`` fields such as ``unhealthy_after = 1``,
    ``connect_timeout_s = 2.0`` or ``seed = 7``, which fixes the policy's tie-breaks for a reproducible run; without
    it each start draws a fresh seed); the ones above and the listen addresses, workers and tokens are set by ``up``."""
    ready_timeout_s: float = Field(DEFAULT_EMULATED_READY_TIMEOUT_S, gt=0)
    """Seconds to wait for the gateway to report ready."""
    register_host: str | None = None
    """``l3`` with ``[[hosts]]``: the address the node agents on those hosts reach this machine at, where each gateway
    takes their registrations on a listener of its own (signed announcements only; the control API stays on
    ``control_host``). Default: the address this machine sends from towards each host (a NAT or a proxy in between
    needs it set)."""
    register_port: int = Field(0, ge=0, le=65535)
    """Port of that listener (gateway ``i`` uses ``register_port + 2i``); 0 picks free ports at ``up``."""
    replicas: int = Field(1, ge=1, le=16)
    """Gateways ``up`` starts in front of the same workers (``gateway``, ``gateway-1``, ...; gateway ``i`` listens on
    ``port + 2i`` and ``control_port + 2i``, or on free ports where those are 0). With more than one they share burst
    detection, copy orders and tuning through Redis: ``settings.redis_url`` when given, else a ``redis-server``
    (from PATH) that ``up`` starts for the fleet on a free loopback port and ``down`` stops."""

    @field_validator("register_host")
    @classmethod
    def _register_host(cls, v: str | None) -> str | None:
        return v if v is None else check_hostname(v)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from btbctl.engine.policies import live_policy_error

        why = live_policy_error(v)
        if why is not None:
            raise ValueError(why)
        return v


class WorkerSpec(BaseModel):
    """One ``[[workers]]`` entry: ``count`` identical workers.

    ``emulated`` workers are ``python -m btbctl worker`` processes that speak SGLang's HTTP API with timings from
    the cost model; ``sglang`` workers are ``python -m sglang.launch_server`` (needs SGLang and GPUs on this
    machine). ``command`` replaces either command line.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    kind: Literal["emulated", "sglang"] = "emulated"
    """``emulated`` (runs anywhere) or ``sglang`` (a real SGLang server)."""
    name: str | None = None
    """Name prefix; workers are called ``<name>-<i>`` (i from 0). Default: ``worker-<n>`` numbered across all
    entries."""
    count: int = Field(1, ge=1, le=256)
    """How many workers this entry starts."""
    model: str = "llama-3.3-70b"
    """emulated: a model preset (``btbctl presets``). sglang: ``--model-path`` (a Hugging Face id or a local
    directory; on this machine one starting with ``./`` or ``../`` resolves against the cluster file's folder)."""
    served_model_name: str | None = None
    """Model id the worker reports (``/v1/models``); keep it the same on all workers behind one router. Default:
    ``model``."""
    gpu: str = "h100"
    """GPU preset (``btbctl presets``) the emulated worker takes its timings from; for sglang it only picks the
    default ``chunked_prefill_size``."""
    tp_size: int = Field(4, ge=1, le=64)
    """GPUs per worker, tensor parallel (SGLang ``--tp-size``)."""
    gpu_ids: list[int] | None = None
    """sglang: physical GPU indices for this entry, ``tp_size`` consecutive ones per worker (sets
    ``CUDA_VISIBLE_DEVICES``); must hold ``count x tp_size`` ids. None: leave ``CUDA_VISIBLE_DEVICES`` alone."""
    host: str = "127.0.0.1"
    """Address the worker binds to and the gateway connects to (loopback by default), or the ``name`` of a
    ``[[hosts]]`` entry: the workers then start on that machine over SSH and bind to its address."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the first worker; worker i uses ``port + i``. 0 picks a free port for each worker at ``up``."""
    transfer_port: int = Field(0, ge=0, le=65535)
    """emulated: port of the KV transfer listener of the first worker (``+ i`` for the others); 0 = free port."""
    page_size: int = Field(256, ge=1)
    """Tokens per KV page (SGLang ``--page-size``); must equal ``gateway.page_size``."""
    mem_fraction: float = Field(DEFAULT_MEM_FRACTION, gt=0, le=1)
    """Fraction of GPU memory for weights + KV cache (SGLang ``--mem-fraction-static``; 0.9 = the cost model's
    default)."""
    chunked_prefill_size: int | None = Field(None, ge=64)
    """Prefill chunk, tokens (SGLang ``--chunked-prefill-size``). None: SGLang's default for ``gpu`` (16,384 above
    120 GB of HBM, 8,192 for 80 GB-class GPUs, 4,096 below)."""
    enable_metrics: bool = True
    """Pass ``--enable-metrics`` (Prometheus ``/metrics``)."""
    time_scale: float = Field(1.0, gt=0)
    """emulated: model seconds per wall-clock second (10 = every modelled prefill, decode step and copy runs ten
    times faster than on the real hardware)."""
    zero_delay: bool = False
    """emulated: answer without any modelled delay (to measure gateway overhead)."""
    kv_bytes_scale: int | None = Field(None, ge=1)
    """emulated: divisor of the real KV block size in the worker's block store, so replication moves real but
    fewer bytes (1 = real sizes; None: the worker's default, 65,536)."""
    python: str | None = None
    """Interpreter for ``python -m ...`` (default: the one running btbctl). For sglang, an environment where
    SGLang is installed. On this machine a path starting with ``./`` or ``../`` resolves against the cluster file's
    folder."""
    extra_args: list[str] = Field(default_factory=list)
    """More command-line arguments, appended as given (argv elements, e.g. ``["--load-format", "dummy"]``)."""
    command: list[str] | None = None
    """Replace the whole command line (argv list). Elements may use ``{host}``, ``{port}``, ``{model}``,
    ``{tp_size}``, ``{page_size}``, ``{name}``, ``{index}``, ``{transfer_port}``. A relative first element
    containing ``/`` resolves against the cluster file's folder. Such a worker is ready when ``GET /health``
    answers 2xx."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for these workers."""
    kv_cache_dtype: str = "auto"
    """SGLang ``--kv-cache-dtype`` (``auto``, ``bf16``, ``fp8_e4m3``, ...); passed in ``l3`` mode, where it must be
    the same on every worker (it is part of the L3 pages' namespace)."""
    model_preset: str | None = None
    """sglang: the model preset (``btbctl presets``) of ``model``, to size ``--hicache-size`` in ``l3`` mode. None:
    the preset whose name ``model`` ends with or starts with (``meta-llama/Llama-3.3-70B-Instruct`` ->
    ``llama-3.3-70b``), if any."""
    ready_timeout_s: float | None = Field(None, gt=0)
    """Seconds to wait for each worker to become ready. None: 60 for emulated, 1,800 for sglang."""
    kv_events: str | None = None
    """``tcp://HOST:PORT``: the workers publish SGLang's KV events (``--kv-events-config``, both kinds) and the
    gateway keeps their holdings from them (:mod:`btbctl.engine.gateway.kv_events`). Worker i publishes on
    ``PORT + 2i`` and answers replays on ``PORT + 2i + 1`` (bound on every address); HOST is where the gateway
    connects. Ignored with ``command``. None: no events."""

    @field_validator("kv_events")
    @classmethod
    def _kv_events_ok(cls, v: str | None) -> str | None:
        if v is None:
            return v
        m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", v)
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(f"{v!r} must look like tcp://host:port")
        return v

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.match(v):
            raise ValueError(
                "must be 1-63 characters of letters, digits, '_', '.', '-' (starting with a letter or digit)"
            )
        return v

    @field_validator("env")
    @classmethod
    def _env_ok(cls, v: dict[str, str]) -> dict[str, str]:
        for key, val in v.items():
            if not key or "=" in key or "\0" in key:
                raise ValueError(f"variable name {key!r} must be non-empty, without '=' or NUL")
            if "\0" in val:
                raise ValueError(f"{key}: a value cannot hold a NUL character")
        return v

    @field_validator("extra_args", "command")
    @classmethod
    def _no_nul(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any("\0" in a for a in v):
            raise ValueError("an argument cannot hold a NUL character")
        return v

    @field_validator("command")
    @classmethod
    def _command_ok(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v or not v[0]:
            raise ValueError("must be a non-empty list of arguments")
        for arg in v:
            for m in _PLACEHOLDER.finditer(arg):
                if m.group(1) not in COMMAND_FIELDS:
                    raise ValueError(
                        f"unknown placeholder {{{m.group(1)}}}; valid: "
                        + ", ".join("{" + f + "}" for f in COMMAND_FIELDS)
                    )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> WorkerSpec:
        if self.port and self.port + self.count - 1 > 65535:
            raise ValueError(f"port {self.port} + count {self.count} runs past 65535")
        if self.transfer_port and self.transfer_port + self.count - 1 > 65535:
            raise ValueError(f"transfer_port {self.transfer_port} + count {self.count} runs past 65535")
        if self.kv_events and int(self.kv_events.rsplit(":", 1)[1]) + 2 * self.count - 1 > 65535:
            raise ValueError(f"kv_events {self.kv_events}: two ports per worker x count {self.count} run past 65535")
        if self.gpu_ids is not None and len(self.gpu_ids) != self.count * self.tp_size:
            raise ValueError(
                f"gpu_ids holds {len(self.gpu_ids)} ids; count x tp_size needs {self.count * self.tp_size}"
            )
        return self

    @property
    def effective_ready_timeout_s(self) -> float:
        """Seconds to wait for one worker of this entry."""
        if self.ready_timeout_s is not None:
            return self.ready_timeout_s
        return DEFAULT_SGLANG_READY_TIMEOUT_S if self.kind == "sglang" else DEFAULT_EMULATED_READY_TIMEOUT_S

    def chunk_tokens(self) -> int:
        """The ``--chunked-prefill-size`` to pass, tokens. Raises :class:`ConfigError` for an unknown ``gpu``."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return default_chunked_prefill_tokens(gpu_preset(self.gpu))


class ReplicationSection(BaseModel):
    """``[replication]``: how BTB copies a hot prefix between workers, and (``l3``) the node agents and HiCache
    flags ``up`` generates."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    mode: Literal["l3", "push", "none"] | None = None
    """``l3`` (node agents + SGLang's HiCache L3 backend; warm-up proofs), ``push`` (the emulated workers'
    ``/btb/push``) or ``none`` (routing only). None: ``l3`` when every worker is SGLang, else ``push``."""
    arena_mib: int = Field(DEFAULT_AGENT_ARENA_MIB, ge=1)
    """l3: byte budget of each host's agent (its shared-memory page store), MiB; allocated when the agent starts."""
    peer_port: int = Field(0, ge=0, le=65535)
    """l3: port the agents accept copies on (authenticated by the fleet secret); 0 = a free port per agent."""
    control_port: int = Field(0, ge=0, le=65535)
    """l3: port of each agent's control API (bearer token); 0 = a free port."""
    local_peer_host: str = "127.0.0.1"
    """l3: address the agent on this machine accepts copies on. Loopback by default; with workers on this machine
    and on ``[[hosts]]`` it must be an address the other hosts reach this machine at."""
    python: str | None = None
    """l3: interpreter that runs ``-m btbctl agent`` (default: this machine's btbctl interpreter here, the host's
    ``python`` on ``[[hosts]]``)."""
    fanout: Literal["chain", "tree", "star"] = "chain"
    """l3: how one copy reaches several agents (``chain``: each relays to the next)."""
    prefetch_policy: Literal["wait_complete", "timeout", "best_effort"] = "wait_complete"
    """l3: ``--hicache-storage-prefetch-policy`` (``wait_complete``: a warm-up waits for the whole prefix)."""
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    """l3: ``--hicache-write-policy`` (``write_through``: a computed prefix reaches L3 right after its prefill)."""
    mem_layout: Literal["page_first", "page_first_direct", "layer_first"] = "page_first"
    """l3: ``--hicache-mem-layout``."""
    prefetch_threshold: int = Field(256, ge=0)
    """l3: SGLang's ``prefetch_threshold`` (extra config): tokens beyond the device/host hit below which no L3
    prefetch is tried."""
    store_timeout_s: float = Field(2.0, gt=0, le=60)
    """l3: ``timeout_s`` of the L3 backend: bound of each call from a worker to its agent, seconds."""
    hicache_size_gb: int | None = Field(None, ge=1)
    """l3: ``--hicache-size`` (host pool per TP rank, GB). None: twice the largest replicated prefix, at least the
    device pool (sized from the model preset, the GPU and ``mem_fraction``)."""
    max_prefix_tokens: int | None = Field(None, ge=1)
    """l3: the largest prefix that will be replicated, tokens (sizes ``--hicache-size``); None: ``btb.prefix_blocks
    x gateway.page_size``."""
    env: dict[str, str] = Field(default_factory=dict)
    """l3: extra environment of the agents."""
    ready_timeout_s: float = Field(30.0, gt=0)
    """l3: seconds to wait for each agent to report ready."""


class ClusterFile(BaseModel):
    """A whole fleet: the gateway, BTB's constants and the workers. Defaults: :func:`default_cluster`."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    gateway: GatewaySection = Field(default_factory=GatewaySection)
    """The gateway (data plane + control API)."""
    btb: BtbConstants = Field(default_factory=BtbConstants)
    """BTB's four constants at start."""
    workers: list[WorkerSpec] = Field(default_factory=lambda: [WorkerSpec(count=4)], min_length=1)
    """Worker entries; default one entry of 4 emulated Llama-3.3-70B workers on 4 x H100."""
    hosts: list[HostSpec] = Field(default_factory=list)
    """Machines reached over SSH, referred to by ``workers.N.host``; none: every worker runs on this machine."""
    replication: ReplicationSection = Field(default_factory=ReplicationSection)
    """How copies are made (``mode``) and, in ``l3`` mode, the node agents and HiCache flags."""
    kubernetes: KubernetesSection | None = None
    """Namespace, images, node selector, GPU resource name and storage for ``btbctl deploy render`` (manifests for
    Kubernetes); ``up`` does not read it."""

    @property
    def replication_mode(self) -> str:
        """The fleet's replication mode: ``replication.mode``, else ``l3`` when every worker is SGLang and ``push``
        otherwise (emulated workers; in a mixed fleet the SGLang ones only take requests, as before ``l3``)."""
        if self.replication.mode is not None:
            return self.replication.mode
        return "l3" if all(w.kind == "sglang" for w in self.workers) else "push"

    def agent_hosts(self) -> list[HostSpec | None]:
        """Where ``l3`` mode runs an agent: each ``[[hosts]]`` entry with workers, and None (this machine) when
        some worker runs here; in that order, each once. Empty in other modes."""
        if self.replication_mode != "l3":
            return []
        out: list[HostSpec | None] = []
        for spec in self.workers:
            h = self.host_of(spec)
            if h not in out:
                out.append(h)
        return sorted(out, key=lambda h: (h is not None, self.hosts.index(h) if h is not None else -1))

    def register_address(self, host: HostSpec) -> str:
        """The address the node agent on ``host`` reaches this machine at, to register with the gateways: ``[gateway]
        register_host``, else the address this machine sends from towards ``host``
        (:func:`~btbctl.engine.netaddr.source_address`). Raises ``OSError`` when no route leads to ``host``."""
        from btbctl.engine.netaddr import source_address

        return self.gateway.register_host or source_address(host.address, host.port)

    def host_of(self, spec: WorkerSpec) -> HostSpec | None:
        """The ``[[hosts]]`` entry a worker entry runs on, or None for this machine."""
        for h in self.hosts:
            if h.name == spec.host:
                return h
        return None

    def instances(self) -> list[WorkerInstance]:
        """Every worker to start, in order, with its name, port and GPUs. Names are unique."""
        out: list[WorkerInstance] = []
        n = 0
        for e, spec in enumerate(self.workers):
            for i in range(spec.count):
                name = f"{spec.name}-{i}" if spec.name else f"worker-{n}"
                gpus = None
                if spec.gpu_ids is not None:
                    gpus = tuple(spec.gpu_ids[i * spec.tp_size : (i + 1) * spec.tp_size])
                out.append(
                    WorkerInstance(
                        name=name,
                        entry=e,
                        index=i,
                        spec=spec,
                        port=spec.port + i if spec.port else 0,
                        transfer_port=spec.transfer_port + i if spec.transfer_port else 0,
                        gpu_ids=gpus,
                    )
                )
                n += 1
        return out

    def check(self) -> None:
        """Checks across fields: presets exist for emulated workers, unique names, no port used twice on one host,
        page sizes agree with the gateway. Raises :class:`ConfigError` naming the key."""
        for e, spec in enumerate(self.workers):
            if spec.kind == "emulated" and spec.command is None:
                try:
                    model_preset(spec.model)
                except ConfigError as err:
                    raise ConfigError(f"workers.{e}.model", err.reason) from None
                try:
                    gpu_preset(spec.gpu)
                except ConfigError as err:
                    raise ConfigError(f"workers.{e}.gpu", err.reason) from None
            elif spec.chunked_prefill_size is None:
                try:
                    gpu_preset(spec.gpu)
                except ConfigError as err:
                    raise ConfigError(f"workers.{e}.gpu", err.reason) from None
            if spec.page_size != self.gateway.page_size:
                raise ConfigError(
                    f"workers.{e}.page_size",
                    f"is {spec.page_size} but gateway.page_size is {self.gateway.page_size}; they must be equal",
                )
        self._check_gateway_settings()
        self._check_hosts()
        self._check_replication()
        names: dict[str, int] = {}
        ports: dict[tuple[str, int], str] = {}
        gw = self.gateway
        if gw.port:
            ports[(gw.host, gw.port)] = "gateway.port"
        if gw.control_port:
            key = (gw.control_host, gw.control_port)
            if key in ports:
                raise ConfigError("gateway.control_port", f"port {gw.control_port} is already gateway.port")
            ports[key] = "gateway.control_port"
        for inst in self.instances():
            if inst.name in names and names[inst.name] != inst.entry:
                raise ConfigError(f"workers.{inst.entry}.name", f"worker name {inst.name!r} is used twice")
            names[inst.name] = inst.entry
            for field, port in (("port", inst.port), ("transfer_port", inst.transfer_port)):
                if not port:
                    continue
                key = (inst.spec.host, port)
                if key in ports:
                    raise ConfigError(f"workers.{inst.entry}.{field}", f"port {port} is already {ports[key]}")
                ports[key] = f"workers.{inst.entry}.{field} (+{inst.index})"

    def _check_hosts(self) -> None:
        seen: set[str] = set()
        for i, h in enumerate(self.hosts):
            if h.name in seen:
                raise ConfigError(f"hosts.{i}.name", f"host name {h.name!r} is used twice")
            seen.add(h.name)
        if not self.hosts:
            return
        for e, spec in enumerate(self.workers):
            if spec.host in seen or is_address(spec.host):
                continue
            raise ConfigError(
                f"workers.{e}.host",
                f"{spec.host!r} is not the name of a [[hosts]] entry "
                f"(valid: {', '.join(sorted(seen))}) nor an IP address of this "
                f"machine",
            )

    def _check_replication(self) -> None:
        """``l3`` needs byte-compatible pages on every worker: the same kind, served model name, TP size, page size
        and KV dtype (a mix is refused, naming the first key that differs); the generated flags must not be set by
        hand; sizes must be derivable."""
        rep = self.replication
        if self.replication_mode != "l3":
            return
        first = self.workers[0]
        for e, spec in enumerate(self.workers):
            for key, value, ref in (
                ("kind", spec.kind, first.kind),
                ("served_model_name", spec.served_model_name or spec.model, first.served_model_name or first.model),
                ("tp_size", spec.tp_size, first.tp_size),
                ("page_size", spec.page_size, first.page_size),
                ("kv_cache_dtype", spec.kv_cache_dtype, first.kv_cache_dtype),
            ):
                if value != ref:
                    raise ConfigError(
                        f"workers.{e}.{key}",
                        f"is {value!r} but workers.0 has {ref!r}; replication mode l3 shares pages by key, so every "
                        f"worker needs the same {key}",
                    )
            for arg in spec.extra_args:
                if arg.split("=", 1)[0] in HICACHE_FLAGS:
                    raise ConfigError(
                        f"workers.{e}.extra_args",
                        f"{arg.split('=', 1)[0]} is generated by `up` in replication mode l3 (set it through "
                        "[replication] or the worker's own key)",
                    )
            if spec.command is not None:
                raise ConfigError(
                    f"workers.{e}.command",
                    "a command override cannot get the generated HiCache flags; use replication mode push or none",
                )
        if any(h is not None for h in self.agent_hosts()) and None in self.agent_hosts():
            if is_loopback(rep.local_peer_host):
                raise ConfigError(
                    "replication.local_peer_host",
                    "workers run on this machine and on [[hosts]]: give the address the other hosts reach this "
                    "machine at (the agent here accepts their copies there)",
                )
        if rep.hicache_size_gb is None:
            for e, spec in enumerate(self.workers):
                self.hicache_size_gb(spec, e)

    def kv_preset(self, spec: WorkerSpec, entry: int):
        """The model preset of a worker entry (for sizes): ``model_preset``, else the model itself (emulated), else
        the preset ``model`` names. Raises :class:`ConfigError` naming ``workers.N.model_preset``."""
        name = spec.model_preset
        if name is None and spec.kind == "emulated":
            name = spec.model
        if name is None:
            base = spec.model.strip().lower().rstrip("/").rsplit("/", 1)[-1]
            for cand in sorted(MODELS, key=len, reverse=True):
                if base == cand or base.startswith(cand):
                    name = cand
                    break
        if name is None:
            raise ConfigError(
                f"workers.{entry}.model_preset",
                f"cannot size --hicache-size for model {spec.model!r}: name its architecture preset (valid: "
                f"{', '.join(sorted(MODELS))}) or set replication.hicache_size_gb",
            )
        try:
            return model_preset(name)
        except ConfigError as err:
            raise ConfigError(f"workers.{entry}.model_preset", err.reason) from None

    def hicache_size_gb(self, spec: WorkerSpec, entry: int) -> int:
        """``--hicache-size`` of a worker entry, GB per TP rank: ``replication.hicache_size_gb``, else twice the
        largest replicated prefix (``max_prefix_tokens``, default ``btb.prefix_blocks x gateway.page_size``) and at
        least the device pool (SGLANG.md: a prefetch is refused once half the host pool is in flight; SGLang wants
        the host pool no smaller than the device pool), rounded up to whole GB."""
        rep = self.replication
        if rep.hicache_size_gb is not None:
            return rep.hicache_size_gb
        m = self.kv_preset(spec, entry)
        try:
            cost = ReplicaCost(m, gpu_preset(spec.gpu), spec.tp_size, mem_fraction=spec.mem_fraction)
        except ConfigError as err:
            raise ConfigError(f"workers.{entry}.tp_size", err.reason) from None
        per_rank = m.kv_bytes_per_token / spec.tp_size
        prefix = rep.max_prefix_tokens or self.btb.prefix_blocks * self.gateway.page_size
        need = max(2 * prefix * per_rank, cost.kv_budget_bytes / spec.tp_size)
        return max(1, math.ceil(need / 1e9))

    def _check_gateway_settings(self) -> None:
        from btbctl.engine.gateway.config import GatewayConfig

        reserved = set(GATEWAY_SET_BY_UP)
        for key in self.gateway.settings:
            if key in reserved:
                raise ConfigError(
                    f"gateway.settings.{key}",
                    "is set by `btbctl up` (use the [gateway] or [btb] key of that name where there is one)",
                )
        try:
            validate(
                GatewayConfig, {"workers": ["http://127.0.0.1:1"], **self.gateway.settings}, None, "gateway.settings"
            )
        except ConfigError as e:
            raise ConfigError(e.key, e.reason) from None

    def gateway_config(
        self,
        worker_urls: list[str],
        *,
        policy: str | None = None,
        port: int | None = None,
        control_port: int | None = None,
        token_file: str | None = None,
        worker_token_file: str | None = None,
    ) -> dict:
        """The gateway's settings (``GatewayConfig`` fields as a JSON-ready dict) for these workers."""
        gw = self.gateway
        data = dict(gw.settings)
        data.update(
            {
                "workers": list(worker_urls),
                "host": gw.host,
                "port": gw.port if port is None else port,
                "control_host": gw.control_host,
                "control_port": gw.control_port if control_port is None else control_port,
                "policy": policy or gw.policy,
                "constants": self.btb.model_dump(),
                "page_size": gw.page_size,
                "max_retries": gw.max_retries,
                "health_interval_s": gw.health_interval_s,
                "max_body_bytes": gw.max_body_bytes,
                "token_file": token_file,
                "worker_token_file": worker_token_file,
            }
        )
        return data


#: ``GatewayConfig`` fields ``up`` fills in itself (not allowed in ``gateway.settings``).
GATEWAY_SET_BY_UP = (
    "workers",
    "worker_names",
    "log_file",
    "host",
    "port",
    "control_host",
    "control_port",
    "policy",
    "constants",
    "page_size",
    "max_retries",
    "health_interval_s",
    "max_body_bytes",
    "token",
    "token_file",
    "worker_token",
    "worker_token_file",
    "replication",
    "agents",
    "worker_agents",
    "agent_token",
    "agent_token_file",
    "agent_secret_file",
    "l3_fanout",
    "register_hosts",
    "register_port",
)


@dataclass(frozen=True)
class WorkerInstance:
    """One concrete worker of a cluster file.

    Attributes:
        name: unique name (``worker-0`` ...).
        entry: index of its ``[[workers]]`` entry.
        index: index within the entry (0 .. count-1).
        spec: the entry.
        port: its HTTP port, 0 = pick at launch.
        transfer_port: its KV transfer port (emulated), 0 = pick at launch.
        gpu_ids: its GPUs (``CUDA_VISIBLE_DEVICES``), or None.
    """

    name: str
    entry: int
    index: int
    spec: WorkerSpec
    port: int
    transfer_port: int
    gpu_ids: tuple[int, ...] | None

    def env(self) -> dict[str, str]:
        """Extra environment for this worker (the entry's ``env`` plus ``CUDA_VISIBLE_DEVICES``)."""
        env = dict(self.spec.env)
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpu_ids)
        return env


def default_cluster() -> ClusterFile:
    """The embedded default fleet: 4 emulated Llama-3.3-70B workers, 4 x H100 each (the published BTB setting,
    REFERENCE.md s1), behind the gateway with the ``btb_plus`` policy, everything on 127.0.0.1."""
    return ClusterFile()


def validate_cluster(data: dict, path: str | None = None) -> ClusterFile:
    """Build and check a :class:`ClusterFile` from parsed TOML. Raises :class:`ConfigError` naming ``path`` and the
    dotted key."""
    cluster = validate(ClusterFile, data, path)
    try:
        cluster.check()
    except ConfigError as e:
        raise ConfigError(e.key, e.reason, path) from None
    if path is not None:
        base = os.path.dirname(os.path.abspath(path))
        workers = []
        for spec in cluster.workers:
            cmd = spec.command
            if cmd and "/" in cmd[0] and not os.path.isabs(cmd[0]):
                spec = spec.model_copy(update={"command": [os.path.normpath(os.path.join(base, cmd[0]))] + cmd[1:]})
            if cluster.host_of(spec) is None:  # paths of workers on [[hosts]] are that host's
                update = {}
                if spec.python and _file_relative(spec.python):
                    update["python"] = os.path.normpath(os.path.join(base, spec.python))
                if spec.kind == "sglang" and _file_relative(spec.model):
                    update["model"] = os.path.normpath(os.path.join(base, spec.model))
                spec = spec.model_copy(update=update) if update else spec
            workers.append(spec)
        cluster = cluster.model_copy(update={"workers": workers})
    return cluster


def _file_relative(p: str) -> bool:
    """Whether a path of a cluster file is relative to the file's folder: it starts with ``./`` or ``../`` (a Hugging
    Face id such as ``meta-llama/Llama-3.1-8B`` never does)."""
    return p.startswith(("./", "../"))


def load_cluster(path: str | os.PathLike) -> ClusterFile:
    """Read a cluster file (TOML).

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 or not TOML (the message names the file and line), or a
            key is unknown or has a bad value (the message names the file, the dotted key such as
            ``workers.0.port`` and what is valid).
    """
    spath = os.fspath(path)
    data = read_toml(spath, "cluster file")
    return validate_cluster(data, spath)


def _python(spec: WorkerSpec) -> str:
    return spec.python or sys.executable or "python3"


#: The L3 backend's extra-config keys ``up`` writes, in this order (SGLANG.md "Worker flags").
L3_BACKEND = {"backend_name": "btb", "module_path": "btbctl.sglang_l3", "class_name": "BtbL3Store", "interface_v1": 1}


def l3_extra_config(agent_socket: str, timeout_s: float, prefetch_threshold: int, worker_url: str | None = None) -> str:
    """The ``--hicache-storage-backend-extra-config`` JSON of a worker whose node agent listens on
    ``agent_socket``: btbctl's backend (:data:`L3_BACKEND`), its socket and call bound, and SGLang's
    ``prefetch_threshold`` (compact JSON, keys in that order); with ``worker_url``, the URL the gateway knows the
    worker by (its store names it to the agent, which announces it to the gateway)."""
    d = dict(L3_BACKEND)
    d.update(agent_socket=agent_socket, timeout_s=float(timeout_s), prefetch_threshold=int(prefetch_threshold))
    if worker_url is not None:
        d["worker_url"] = worker_url
    return json.dumps(d, separators=(",", ":"))


def hicache_args(
    cluster: ClusterFile, spec: WorkerSpec, entry: int, agent_socket: str, worker_url: str | None = None
) -> list[str]:
    """SGLang's HiCache flags of a worker in ``l3`` mode (SGLANG.md "Worker flags"), whose node agent listens on
    ``agent_socket``::

        --enable-hierarchical-cache --hicache-mem-layout L --hicache-write-policy W --hicache-size GB
        --hicache-storage-prefetch-policy P --hicache-storage-backend dynamic
        --hicache-storage-backend-extra-config JSON --kv-cache-dtype D --enable-cache-report

    (``--page-size``, ``--tp-size``, ``--served-model-name`` and ``--enable-metrics`` are in the worker's line
    already; ``worker_url``: see :func:`l3_extra_config`.) Raises :class:`ConfigError` when ``--hicache-size``
    cannot be sized."""
    rep = cluster.replication
    return [
        "--enable-hierarchical-cache",
        "--hicache-mem-layout",
        rep.mem_layout,
        "--hicache-write-policy",
        rep.write_policy,
        "--hicache-size",
        str(cluster.hicache_size_gb(spec, entry)),
        "--hicache-storage-prefetch-policy",
        rep.prefetch_policy,
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        l3_extra_config(agent_socket, rep.store_timeout_s, rep.prefetch_threshold, worker_url),
        "--kv-cache-dtype",
        spec.kv_cache_dtype,
        "--enable-cache-report",
    ]


def agent_argv(
    python: str,
    *,
    secret_file: str,
    token_file: str,
    socket: str,
    peer: str,
    control: str,
    arena_mib: int,
    agent_id: str,
) -> list[str]:
    """A node agent's command line: ``python -m btbctl agent --secret-file F --control-token-file T --socket S
    --peer HOST:PORT --control HOST:PORT --arena-mib N --agent-id NAME`` (the secrets are files, never arguments)."""
    return [
        python,
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        secret_file,
        "--control-token-file",
        token_file,
        "--socket",
        socket,
        "--peer",
        peer,
        "--control",
        control,
        "--arena-mib",
        str(arena_mib),
        "--agent-id",
        agent_id,
    ]


def _serving_flags(spec: WorkerSpec, port: int, host: str | None) -> list[str]:
    """The flags SGLang and the emulated worker share, in SGLang's order: TP size, address, memory, page, chunk."""
    return [
        "--tp-size",
        str(spec.tp_size),
        "--host",
        host or spec.host,
        "--port",
        str(port),
        "--mem-fraction-static",
        _num(spec.mem_fraction),
        "--page-size",
        str(spec.page_size),
        "--chunked-prefill-size",
        str(spec.chunk_tokens()),
    ]


def sglang_argv(spec: WorkerSpec, port: int, host: str | None = None, l3: list[str] | None = None) -> list[str]:
    """SGLang's launch command for one worker of ``spec`` on ``port`` (REFERENCE.md s5), as an argv list:

    ``[python, "-m", "sglang.launch_server", "--model-path", M, "--tp-size", N, "--host", H, "--port", P,
    "--mem-fraction-static", F, "--page-size", S, "--chunked-prefill-size", C, "--enable-metrics",
    ("--served-model-name", NAME,) *l3, *extra_args]``.

    ``python`` is ``spec.python`` or the running interpreter; ``--enable-metrics`` only when
    ``spec.enable_metrics``; ``--served-model-name`` when set, and always in ``l3`` mode (``l3``: the flags of
    :func:`hicache_args`). Raises :class:`ConfigError` for an unknown ``gpu`` preset when ``chunked_prefill_size``
    is unset.
    """
    argv = [
        _python(spec),
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.model,
        *_serving_flags(spec, port, host),
    ]
    if spec.enable_metrics:
        argv.append("--enable-metrics")
    if spec.served_model_name or l3:
        argv += ["--served-model-name", spec.served_model_name or spec.model]
    argv += list(l3 or ())
    argv += list(spec.extra_args)
    return argv


def emulated_argv(
    spec: WorkerSpec,
    port: int,
    transfer_port: int = 0,
    token_file: str | None = None,
    host: str | None = None,
    l3: list[str] | None = None,
) -> list[str]:
    """The emulated worker's command line (``python -m btbctl worker ...``) as an argv list; the flags mirror
    SGLang's (:func:`sglang_argv`, ``l3``: the HiCache flags of :func:`hicache_args`, which the emulated worker
    honours) plus the emulation's own (``--gpu``, ``--time-scale``, ``--zero-delay``, ``--kv-bytes-scale``,
    ``--transfer-port``, ``--btb-token-file``)."""
    argv = [
        _python(spec),
        "-m",
        "btbctl",
        "worker",
        "--model-path",
        spec.model,
        "--served-model-name",
        spec.served_model_name or spec.model,
        *_serving_flags(spec, port, host),
        "--gpu",
        spec.gpu,
        "--time-scale",
        _num(spec.time_scale),
        "--transfer-port",
        str(transfer_port),
    ]
    if spec.enable_metrics:
        argv.append("--enable-metrics")
    if spec.zero_delay:
        argv.append("--zero-delay")
    if spec.kv_bytes_scale is not None:
        argv += ["--kv-bytes-scale", str(spec.kv_bytes_scale)]
    if token_file:
        argv += ["--btb-token-file", token_file]
    argv += list(l3 or ())
    argv += list(spec.extra_args)
    return argv


def command_argv(inst: WorkerInstance, port: int, transfer_port: int = 0) -> list[str]:
    """A worker's ``command`` override with its placeholders filled in (element by element; no shell)."""
    spec = inst.spec
    assert spec.command is not None
    values = {
        "host": spec.host,
        "port": str(port),
        "model": spec.model,
        "tp_size": str(spec.tp_size),
        "page_size": str(spec.page_size),
        "name": inst.name,
        "index": str(inst.index),
        "transfer_port": str(transfer_port),
    }
    return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in spec.command]


def kv_events_of(inst: WorkerInstance) -> tuple[str, str] | None:
    """``(PUB address, replay address)`` the gateway connects to for ``inst`` (its entry's ``kv_events``: worker
    i on ``PORT + 2i`` and ``PORT + 2i + 1``), or None without events."""
    ev = inst.spec.kv_events
    if ev is None or inst.spec.command is not None:
        return None
    host, port = ev[len("tcp://") :].rsplit(":", 1)
    base = int(port) + 2 * inst.index
    return f"tcp://{host}:{base}", f"tcp://{host}:{base + 1}"


#: The topic a worker's KV events are published under (its ``--kv-events-config``) and the gateway subscribes to.
KV_EVENTS_TOPIC = "kv"


def kv_events_ref(inst: WorkerInstance) -> dict | None:
    """The gateway's ``kv_events`` entry for ``inst`` (a ``KvEventsRef`` as a dict: :func:`kv_events_of`'s
    addresses and :data:`KV_EVENTS_TOPIC`), or None without events."""
    ends = kv_events_of(inst)
    return None if ends is None else {"endpoint": ends[0], "replay_endpoint": ends[1], "topic": KV_EVENTS_TOPIC}


def kv_events_args(inst: WorkerInstance) -> list[str]:
    """``["--kv-events-config", JSON]`` of ``inst`` (SGLang's option; the emulated worker takes the same), binding
    its ports on every address; ``[]`` without events."""
    ends = kv_events_of(inst)
    if ends is None:
        return []
    pub, replay = (e.rsplit(":", 1)[1] for e in ends)
    cfg = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": KV_EVENTS_TOPIC,
    }
    return ["--kv-events-config", json.dumps(cfg, separators=(",", ":"))]


def worker_argv(
    inst: WorkerInstance,
    port: int,
    transfer_port: int = 0,
    token_file: str | None = None,
    l3: list[str] | None = None,
) -> list[str]:
    """The argv that starts ``inst``: its ``command`` override, else SGLang's or the emulated worker's line (with
    the HiCache flags ``l3`` in ``l3`` mode)."""
    if inst.spec.command is not None:
        return command_argv(inst, port, transfer_port)
    if inst.spec.kind == "sglang":
        return sglang_argv(inst.spec, port, l3=l3) + kv_events_args(inst)
    return emulated_argv(inst.spec, port, transfer_port, token_file, l3=l3) + kv_events_args(inst)


def _num(x: float) -> str:
    """A float as a short command-line number (0.9 -> "0.9", 4.0 -> "4")."""
    return repr(int(x)) if float(x).is_integer() else repr(float(x))


__all__ = [
    "ClusterFile",
    "GatewaySection",
    "REPLICATION_MODES",
    "ReplicationSection",
    "WorkerInstance",
    "WorkerSpec",
    "agent_argv",
    "command_argv",
    "hicache_args",
    "l3_extra_config",
    "default_cluster",
    "emulated_argv",
    "load_cluster",
    "sglang_argv",
    "validate_cluster",
    "KV_EVENTS_TOPIC",
    "kv_events_args",
    "kv_events_of",
    "kv_events_ref",
    "worker_argv",
]
