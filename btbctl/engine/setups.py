"""Named fleet setups: the six model x hardware settings of the published BTB table.

Source: Birmiwal & Bhat, "Biting the Bullet" (2026-07-22), headline table on Bursted-ART (REFERENCE.md s1); the
setups (model preset, GPU, GPUs per replica, 4 replicas) are those of the BTB experiment harness
(github.com/jwlaboratory/bite-the-bullet, ``2-bite-the-bullet``), with models and GPUs from the Infer-Sim tables
(REFERENCE.md s2; :mod:`btbctl.engine.costmodel` presets). The NIC bandwidth per GPU is the GPU table's (H100:
50 GB/s = 400 Gb/s, B300: 100 GB/s = 800 Gb/s).

Each setup carries the published cache-aware and BTB mean/p95 TTFT for reference. Those numbers came from
Bursted-ART's test set, which mixed real ART-Chat windows (not obtainable here) with synthetic windows, run in the
reference simulator; the ``infersim`` fidelity on synthetic windows alone gives other absolute numbers
(REFERENCE.md s1).
"""

from __future__ import annotations

from dataclasses import dataclass

from btbctl.engine.config import ClusterConfig, validate
from btbctl.engine.costmodel import gpu_preset
from btbctl.engine.errors import ConfigError

#: Replicas in every published setup (REFERENCE.md s1: "4 replicas").
SETUP_REPLICAS = 4


@dataclass(frozen=True)
class PublishedTtft:
    """One row of the published headline table (REFERENCE.md s1), seconds.

    Attributes:
        cache_aware_mean_s, cache_aware_p95_s: mean and p95 TTFT under cache-aware routing.
        btb_mean_s, btb_p95_s: mean and p95 TTFT under BTB (``early_rdma``).
    """

    cache_aware_mean_s: float
    cache_aware_p95_s: float
    btb_mean_s: float
    btb_p95_s: float

    def as_dict(self) -> dict:
        return {
            "cache_aware": {"mean": self.cache_aware_mean_s, "p95": self.cache_aware_p95_s},
            "btb": {"mean": self.btb_mean_s, "p95": self.btb_p95_s},
        }


@dataclass(frozen=True)
class Setup:
    """A named fleet setup.

    Attributes:
        name: the setup's key (``70b_h100x4`` ...).
        model: model preset name.
        gpu: GPU preset name.
        gpus_per_replica: TP degree.
        replicas: replicas in the fleet (4).
        description: the setup as the published table names it.
        published: the published cache-aware / BTB TTFT on Bursted-ART.
        precision: weights/activation precision (``bf16``, ``fp8``; :data:`~btbctl.engine.costmodel.PRECISIONS`).
    """

    name: str
    model: str
    gpu: str
    gpus_per_replica: int
    description: str
    published: PublishedTtft
    replicas: int = SETUP_REPLICAS
    precision: str = "bf16"

    @property
    def nic_gbps(self) -> float:
        """NIC bandwidth per GPU in gigabits per second, from the GPU preset (bytes/s x 8 / 1e9)."""
        return gpu_preset(self.gpu).nic_bytes_per_s * 8 / 1e9

    def cluster_settings(self) -> dict:
        """The :class:`~btbctl.engine.config.ClusterConfig` keys this setup fills: ``model``, ``gpu``,
        ``gpus_per_replica``, ``replicas``, ``nic_gbps``, and ``precision`` when it is not the default bf16."""
        out: dict = {
            "model": self.model,
            "gpu": self.gpu,
            "gpus_per_replica": self.gpus_per_replica,
            "replicas": self.replicas,
            "nic_gbps": self.nic_gbps,
        }
        if self.precision != "bf16":
            out["precision"] = self.precision
        return out


#: The published setups by name, in the order of the published table.
SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup(
            "70b_h100x4",
            "llama-3.3-70b",
            "h100",
            4,
            "Llama-3.3-70B, 4 replicas x 4xH100",
            PublishedTtft(1.373, 4.697, 0.632, 4.697),
        ),
        Setup(
            "qwen3_8b_h100x4", "qwen3-8b", "h100", 4, "Qwen3-8B, 4 x 4xH100", PublishedTtft(0.034, 0.325, 0.023, 0.059)
        ),
        Setup(
            "glm45_h100x4",
            "glm-4.5-like",
            "h100",
            4,
            "GLM-4.5-like (355B/32B active, int4), 4 x 4xH100",
            PublishedTtft(0.288, 1.905, 0.115, 0.780),
        ),
        Setup(
            "glm52_h100x8",
            "glm-5.2-like",
            "h100",
            8,
            "GLM-5.2-like (744B/40B, int4), 4 x 8xH100",
            PublishedTtft(0.134, 1.101, 0.062, 0.243),
        ),
        Setup(
            "kimi_k2_h100x8",
            "kimi-k2-like",
            "h100",
            8,
            "Kimi-K2-like (1T/32B, int4), 4 x 8xH100",
            PublishedTtft(0.093, 0.832, 0.048, 0.167),
        ),
        Setup(
            "dense1t_b300x4",
            "dense-1t",
            "b300",
            4,
            "dense 1T fp8, 4 x 4xB300",
            PublishedTtft(436.8, 926.1, 392.0, 857.9),
        ),
    )
}


#: Variants of the published setups (not in the published table): the 70B setup in FP8.
VARIANT_SETUPS: dict[str, Setup] = {
    s.name: s
    for s in (
        Setup(
            "70b_h100x4_fp8",
            "llama-3.3-70b",
            "h100",
            4,
            "Llama-3.3-70B in FP8 (weights and activations; KV cache BF16), 4 replicas x 4xH100",
            PublishedTtft(1.373, 4.697, 0.632, 4.697),  # the published table is BF16 only: its 70B row
            precision="fp8",
        ),
    )
}
#: Every named setup: :data:`SETUPS` then :data:`VARIANT_SETUPS`.
ALL_SETUPS: dict[str, Setup] = {**SETUPS, **VARIANT_SETUPS}


def get_setup(name: str) -> Setup:
    """The setup ``name`` (published or variant). Raises :class:`ConfigError` (key ``setup``) naming the valid ones
    if unknown."""
    try:
        return ALL_SETUPS[name]
    except (KeyError, TypeError):
        raise ConfigError("setup", f"unknown setup {name!r}; valid: {', '.join(ALL_SETUPS)}") from None


def setup_cluster(name: str, **overrides) -> ClusterConfig:
    """A :class:`~btbctl.engine.config.ClusterConfig` for the setup ``name``; ``overrides`` replace any of its keys
    (or set others, e.g. ``mem_fraction``).

    Raises:
        ConfigError: unknown setup (key ``setup``, the message lists the valid ones); an override with an unknown
            key or a bad value (the key named).
    """
    data = get_setup(name).cluster_settings()
    data.update(overrides)
    return validate(ClusterConfig, data)


__all__ = [
    "ALL_SETUPS",
    "SETUPS",
    "VARIANT_SETUPS",
    "SETUP_REPLICAS",
    "PublishedTtft",
    "Setup",
    "get_setup",
    "setup_cluster",
]
