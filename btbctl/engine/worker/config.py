"""Settings of one emulated SGLang worker (``btbctl worker``), validated.

SGLang's own flags keep SGLang's meaning (``sglang.launch_server``, sglang 0.5 ``server_args``); the emulation
flags say what hardware is pretended and how fast time runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from btbctl.engine.config import ClusterConfig, validate
from btbctl.engine.costmodel import DEFAULT_MAX_RUNNING, DEFAULT_MEM_FRACTION, MODELS, model_preset
from btbctl.engine.errors import ConfigError
from btbctl.engine.fileio import read_text_bounded
from btbctl.engine.netaddr import is_loopback as _is_loopback
from btbctl.sglang_l3.config import load_extra_config, parse_extra_config, split_consumed, worker_url_of

#: Smallest block in the emulated store, bytes (so that a scaled-down block still carries a meaningful payload).
MIN_BLOCK_BYTES = 64
#: Default divisor of real KV block sizes in the emulated store: a Llama-3.3-70B page of 256 tokens (80 MiB real)
#: becomes 1,280 bytes, so thousands of blocks fit in a few MB.
DEFAULT_KV_BYTES_SCALE = 65536


class WorkerConfig(BaseModel):
    """One emulated worker. Every field maps to a ``btbctl worker`` flag of the same name (dashes for
    underscores)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model_path: str = Field(min_length=1, max_length=512)
    """SGLang ``--model-path``: a model preset name (``btbctl presets``) or any string (a HF id, a directory);
    an unknown string is served as ``model_preset``'s architecture."""
    served_model_name: str | None = Field(None, min_length=1, max_length=512)
    """SGLang ``--served-model-name``: the model id in ``/v1/models`` and metric labels (default: model_path)."""
    model_preset: str = "llama-3.3-70b"
    """Architecture used when ``model_path`` names no preset."""
    tp_size: int = Field(4, ge=1, le=64)
    """SGLang ``--tp-size``: GPUs the model is split over (default 4, the published BTB setting; SGLang's is 1)."""
    host: str = "127.0.0.1"
    """Address of the HTTP API and the transfer port (loopback by default)."""
    port: int = Field(30000, ge=0, le=65535)
    """HTTP port (SGLang's default 30000; 0 = ephemeral, the bound port is printed in the ready line)."""
    mem_fraction_static: float = Field(DEFAULT_MEM_FRACTION, gt=0, le=1)
    """SGLang ``--mem-fraction-static``: fraction of HBM for weights + KV pool."""
    page_size: int = Field(256, ge=1, le=65536)
    """SGLang ``--page-size``: tokens per KV page = block of the prefix cache and of replication (default 256, the
    BTB block; SGLang's is 1). Must equal the gateway's block size for prefix ids to agree."""
    chunked_prefill_size: int | None = None
    """SGLang ``--chunked-prefill-size`` in tokens; -1 disables chunking; None = SGLang's default for the GPU."""
    max_running_requests: int = Field(DEFAULT_MAX_RUNNING, ge=1)
    """SGLang ``--max-running-requests``."""
    max_total_tokens: int | None = Field(None, ge=1)
    """SGLang ``--max-total-tokens``: the device KV pool, tokens (None: what the model's presets leave in HBM)."""
    enable_metrics: bool = False
    """SGLang ``--enable-metrics``: serve Prometheus ``/metrics``."""
    gpu: str = "h100"
    """GPU preset pretended (``btbctl presets``)."""
    time_scale: float = Field(1.0, ge=0, le=1e6)
    """Model seconds per wall-clock second (10 = ten times faster than real time; 0 = zero delay)."""
    zero_delay: bool = False
    """Answer at once (cache bookkeeping still applied); for gateway-overhead benchmarks."""
    kv_bytes_scale: int = Field(DEFAULT_KV_BYTES_SCALE, ge=1)
    """Divisor of real KV block sizes in the block store (1 = real sizes)."""
    transfer_port: int = Field(0, ge=0, le=65535)
    """TCP port receiving replicated blocks (0 = ephemeral; printed in the ready line and ``/btb/info``)."""
    btb_token: str | None = Field(None, repr=False)
    """Bearer token required by state-changing routes (``/btb/push``, ``/flush_cache``); None = none required."""
    # -- SGLang's HiCache flags (emulated by :mod:`btbctl.engine.worker.hicache`) ----------------------------------
    enable_hierarchical_cache: bool = False
    """SGLang ``--enable-hierarchical-cache``: a host tier behind the device cache (and an L3 tier with a storage
    backend)."""
    hicache_ratio: float | None = Field(None, gt=0)
    """SGLang ``--hicache-ratio``: host pool size / device pool size (None: SGLang's default 2.0)."""
    hicache_size: int = Field(0, ge=0)
    """SGLang ``--hicache-size``: host pool per TP rank, GB (0: use the ratio)."""
    hicache_write_policy: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    """SGLang ``--hicache-write-policy``."""
    hicache_mem_layout: Literal[
        "layer_first", "page_first", "page_first_direct", "page_first_kv_split", "page_head"
    ] = "page_first"
    """SGLang ``--hicache-mem-layout`` (part of the L3 namespace)."""
    hicache_io_backend: Literal["direct", "kernel", "kernel_ascend"] = "kernel"
    """SGLang ``--hicache-io-backend`` (accepted; no effect on the emulated timing)."""
    hicache_storage_backend: str | None = None
    """SGLang ``--hicache-storage-backend``; the emulation has one L3 tier: ``dynamic`` with btbctl's
    ``BtbL3Store`` (the node's ``btbctl agent``)."""
    hicache_storage_prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    """SGLang ``--hicache-storage-prefetch-policy``."""
    hicache_storage_backend_extra_config: str | None = None
    """SGLang ``--hicache-storage-backend-extra-config``: inline JSON or ``@FILE`` (JSON)."""
    kv_cache_dtype: str = "auto"
    """SGLang ``--kv-cache-dtype`` (part of the L3 namespace; the emulated timing keeps the preset's KV size)."""
    enable_cache_report: bool = False
    """SGLang ``--enable-cache-report`` (accepted: the emulated OpenAI routes always report cached tokens)."""
    kv_events_config: str | None = None
    """SGLang ``--kv-events-config`` (JSON; publisher ``zmq``): publish the cache's stored, removed and cleared pages
    as SGLang does (:mod:`btbctl.engine.worker.kv_events`). None: no events."""

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events(cls, v: str | None) -> str | None:
        if v is not None:
            from btbctl.engine.kvevents import KvEventsConfig

            KvEventsConfig.from_json(v)
        return v

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def served_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def zero(self) -> bool:
        """Whether the worker answers without waiting (``zero_delay`` or ``time_scale == 0``)."""
        return self.zero_delay or self.time_scale == 0

    def preset_name(self) -> str:
        """The model preset: ``model_path`` itself, its last path component, or a preset it starts with (case-
        insensitive), else ``model_preset``."""
        p = self.model_path.strip().lower()
        base = p.rstrip("/").rsplit("/", 1)[-1]
        for cand in (p, base):
            if cand in MODELS:
                return cand
        for name in sorted(MODELS, key=len, reverse=True):
            if base.startswith(name):
                return name
        model_preset(self.model_preset)  # validates (ConfigError key "model")
        return self.model_preset.lower()

    def cluster(self) -> ClusterConfig:
        """A one-replica :class:`ClusterConfig` for the simulator's replica model. Raises ConfigError."""
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk <= 0:
            chunk = 1 << 30  # SGLang: -1 disables chunked prefill
        return validate(
            ClusterConfig,
            {
                "model": self.preset_name(),
                "gpu": self.gpu,
                "gpus_per_replica": self.tp_size,
                "replicas": 1,
                "mem_fraction": self.mem_fraction_static,
                "chunked_prefill_tokens": chunk,
                "max_running": self.max_running_requests,
            },
        )

    def block_bytes(self) -> int:
        """Bytes of one block in the store: ``page_size x kv_bytes_per_token / kv_bytes_scale``, at least
        :data:`MIN_BLOCK_BYTES`."""
        kv = model_preset(self.preset_name()).kv_bytes_per_token
        return max(MIN_BLOCK_BYTES, int(self.page_size * kv // self.kv_bytes_scale))


#: The only L3 backend the emulation has (btbctl's, through the node agent).
BACKEND_MODULE = "btbctl.sglang_l3"
BACKEND_CLASS = "BtbL3Store"


def _num(v: object, key: str, lo: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ConfigError("hicache_storage_backend_extra_config", f"{key} must be a number >= {lo:g}, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class StorageSettings:
    """The L3 tier's settings, from the extra config."""

    agent_socket: str
    timeout_s: float
    interface_v1: bool
    prefetch_threshold: int
    prefetch_timeout_base: float
    prefetch_timeout_per_ki_token: float
    worker_url: str | None = None
    """The URL the gateway knows this worker by (the extra config's ``worker_url``), named in the agent's hello."""


def check_settings(cfg: WorkerConfig) -> StorageSettings | None:
    """Validate the HiCache flags; the L3 settings, or None without a storage backend.

    Raises:
        ConfigError: naming the flag: a storage backend without ``--enable-hierarchical-cache``, another backend
            than btbctl's, a malformed extra config.
    """
    if cfg.hicache_storage_backend is None:
        return None
    if not cfg.enable_hierarchical_cache:
        raise ConfigError("hicache_storage_backend", "needs --enable-hierarchical-cache (as in SGLang)")
    if cfg.hicache_storage_backend != "dynamic":
        raise ConfigError(
            "hicache_storage_backend",
            f"{cfg.hicache_storage_backend!r}: the emulated worker's L3 tier is btbctl's node agent; valid: dynamic "
            f'with extra config {{"module_path": "{BACKEND_MODULE}", "class_name": "{BACKEND_CLASS}"}}',
        )
    try:
        extra = load_extra_config(cfg.hicache_storage_backend_extra_config)
    except ValueError as e:
        raise ConfigError("hicache_storage_backend_extra_config", str(e)) from None
    if extra.get("module_path") != BACKEND_MODULE or extra.get("class_name") != BACKEND_CLASS:
        raise ConfigError(
            "hicache_storage_backend_extra_config",
            f"module_path/class_name must be {BACKEND_MODULE!r}/{BACKEND_CLASS!r} (the emulated L3 tier), got "
            f"{extra.get('module_path')!r}/{extra.get('class_name')!r}",
        )
    consumed, rest = split_consumed(extra)
    try:
        sock, timeout_s, v1 = parse_extra_config(rest)
        worker_url = worker_url_of(rest)
    except ValueError as e:
        raise ConfigError("hicache_storage_backend_extra_config", str(e)) from None
    threshold = consumed["prefetch_threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigError(
            "hicache_storage_backend_extra_config", f"prefetch_threshold must be an integer >= 0, got {threshold!r}"
        )
    return StorageSettings(
        worker_url=worker_url,
        agent_socket=sock,
        timeout_s=timeout_s,
        interface_v1=v1,
        prefetch_threshold=threshold,
        prefetch_timeout_base=_num(consumed["prefetch_timeout_base"], "prefetch_timeout_base", 0),
        prefetch_timeout_per_ki_token=_num(
            consumed["prefetch_timeout_per_ki_token"], "prefetch_timeout_per_ki_token", 0
        ),
    )


def load_token(path: str | None) -> str | None:
    """Read a bearer token from ``path`` (surrounding whitespace stripped). Raises ConfigError when the file cannot
    be read or is empty."""
    if path is None:
        return None
    try:
        tok = read_text_bounded(os.path.expanduser(path)).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("btb_token_file", f"cannot read {path}: {e.strerror or e}") from None
    if not tok or any(c.isspace() for c in tok) or len(tok) > 4096:
        raise ConfigError("btb_token_file", f"{path} must hold one token (no spaces, at most 4096 characters)")
    return tok


def make_config(**kwargs) -> WorkerConfig:
    """Build a validated :class:`WorkerConfig`; raises :class:`ConfigError` naming the flag and what is valid."""
    cfg = validate(WorkerConfig, kwargs)
    if cfg.chunked_prefill_size is not None and 0 <= cfg.chunked_prefill_size < 64:
        raise ConfigError("chunked_prefill_size", "must be >= 64 tokens or -1 (disabled)")
    if cfg.btb_token is None and not _is_loopback(cfg.host):
        raise ConfigError(
            "btb_token_file",
            f"the worker listens on {cfg.host}, beyond loopback: give "
            "--btb-token-file so that /btb/push and /flush_cache require a bearer token",
        )
    cfg.cluster().replica_cost()  # the model must fit its GPUs
    check_settings(cfg)
    return cfg
