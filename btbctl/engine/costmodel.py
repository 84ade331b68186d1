"""Cost model: model and GPU presets, KV sizing, prefill / decode / transfer times.

Every number here has a source, named in the preset's ``source`` field or next to the constant.

Shapes and units: parameters are counts, sizes are bytes, rates are bytes/s or FLOP/s, times are seconds.
A *replica* is one model instance running tensor-parallel (TP) over ``gpus_per_replica`` GPUs of one kind:
FLOP/s, HBM capacity, HBM bandwidth and NIC bandwidth add up over its GPUs (the simplification Infer-Sim makes and
a reasonable first-order model for TP within one NVLink domain).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from btbctl.engine.errors import ConfigError

_P = TypeVar("_P")

GB = 1e9  #: REFERENCE/Infer-Sim convention: GB = 1e9 bytes.


@dataclass(frozen=True)
class ModelPreset:
    """Architecture numbers of a model.

    Attributes:
        name: preset key (``llama-3.3-70b`` ...).
        total_params: all parameters (count); with ``dtype_bytes`` gives the weight bytes that must fit in HBM.
        active_params: parameters touched per token (= total for dense models, less for MoE); drives FLOPs and
            the weight bytes read per decode step.
        dtype_bytes: bytes per weight (2 = BF16, 1 = FP8, 0.5 = INT4).
        kv_dtype_bytes: bytes per KV-cache element. Infer-Sim uses one dtype knob for both, so presets set it equal
            to ``dtype_bytes``.
        layers, kv_heads, head_dim: attention shape; KV bytes per token = 2 (K and V) x layers x kv_heads x
            head_dim x kv_dtype_bytes.
        attn_dim: query heads x query/key head dim, the width of the attention score computation; drives the
            attention FLOP term of prefill (4 x layers x attn_dim FLOPs per token per token of context).
        source: where the numbers come from.
        context_tokens: longest sequence the model serves (its config's ``max_position_embeddings``; SGLang's
            ``context_len``, reported by ``/v1/models`` as ``max_model_len``).
    """

    name: str
    total_params: float
    active_params: float
    dtype_bytes: float
    layers: int
    kv_heads: int
    head_dim: int
    attn_dim: int
    source: str
    kv_dtype_bytes: float | None = None
    context_tokens: int = 131072

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token over the whole model (all layers, K and V)."""
        kvb = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * kvb

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights resident in HBM (total parameters x dtype bytes)."""
        return self.total_params * self.dtype_bytes


@dataclass(frozen=True)
class GpuPreset:
    """Per-GPU figures.

    Attributes:
        flops: dense BF16 peak FLOP/s.
        fp8_flops: dense FP8 peak FLOP/s; None for a GPU without FP8 tensor cores.
        hbm_bytes: HBM capacity in bytes (GB = 1e9).
        hbm_bytes_per_s: HBM bandwidth.
        pcie_bytes_per_s: host link bandwidth (used for host-RAM cache reloads).
        nic_bytes_per_s: scale-out NIC bandwidth per GPU (RDMA).
    """

    name: str
    flops: float
    hbm_bytes: float
    hbm_bytes_per_s: float
    pcie_bytes_per_s: float
    nic_bytes_per_s: float
    source: str
    fp8_flops: float | None = None


_INFERSIM = "Infer-Sim model table (jwlaboratory/inference-sim), REFERENCE.md s2"
_INFERSIM_GPU = "Infer-Sim GPU table (jwlaboratory/inference-sim), REFERENCE.md s2"
#: Dense FP8 tensor-core peak = 2 x the dense BF16 peak on Hopper and Blackwell: NVIDIA H100 SXM datasheet
#: (989 TFLOP/s BF16, 1,979 TFLOP/s FP8, dense), H200 (same tensor cores as H100), B200 / B300 (2.25 PFLOP/s
#: BF16, 4.5 PFLOP/s FP8, dense). Ampere (A100) has no FP8 tensor cores.
FP8_FLOPS_PER_BF16 = 2.0
_FP8_GPU = _INFERSIM_GPU + "; FP8 peak: NVIDIA datasheets (2 x dense BF16)"

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset(
            "llama-3.3-70b",
            70.6e9,
            70.6e9,
            2,
            80,
            8,
            128,
            64 * 128,
            _INFERSIM + "; 64 query heads from the Llama 3.3 70B config.json",
        ),
        ModelPreset(
            "llama-3.1-8b",
            8.03e9,
            8.03e9,
            2,
            32,
            8,
            128,
            32 * 128,
            "meta-llama/Llama-3.1-8B config.json (32 layers, 32 query / 8 KV heads, head dim 128)",
        ),
        ModelPreset(
            "qwen3-8b",
            8.19e9,
            8.19e9,
            2,
            36,
            8,
            128,
            32 * 128,
            _INFERSIM + "; 32 query heads from the Qwen3-8B config.json",
            context_tokens=40960,
        ),
        ModelPreset(
            "glm-4.5-like",
            355e9,
            32e9,
            0.5,
            92,
            4,
            128,
            96 * 128,
            _INFERSIM + "; 96 query heads from the GLM-4.5 config.json",
        ),
        ModelPreset(
            "glm-5.2-like",
            744e9,
            40e9,
            0.5,
            78,
            1,
            288,
            64 * 192,
            _INFERSIM + "; attention width 64 x 192 is an estimate (MLA-style latent attention)",
        ),
        ModelPreset(
            "kimi-k2-like",
            1e12,
            32e9,
            0.5,
            61,
            8,
            128,
            64 * 192,
            _INFERSIM + "; 64 query heads x 192 q/k dim from the Kimi-K2 (DeepSeek-V3 MLA) config",
        ),
        ModelPreset(
            "tiny-llama",
            4.17e6,
            4.17e6,
            2,
            2,
            2,
            16,
            4 * 16,
            "the random Llama of btbctl's real-SGLang harness (tests/sglang_cpu/tiny_model.py: hidden 64, 2 layers, "
            "4 query / 2 KV heads of 16, vocabulary 32,000): lets an emulated worker stand for that server",
            context_tokens=16384,
        ),
        ModelPreset(
            "dense-1t",
            1e12,
            1e12,
            1,
            120,
            8,
            128,
            128 * 128,
            _INFERSIM + "; attention width 128 x 128 is an estimate (hypothetical model)",
        ),
    )
}

GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset("a100", 312e12, 80 * GB, 2.0e12, 25 * GB, 25 * GB, _INFERSIM_GPU),
        GpuPreset("h100", 989e12, 80 * GB, 3.35e12, 55 * GB, 50 * GB, _FP8_GPU, FP8_FLOPS_PER_BF16 * 989e12),
        GpuPreset("h200", 989e12, 141 * GB, 4.8e12, 55 * GB, 50 * GB, _FP8_GPU, FP8_FLOPS_PER_BF16 * 989e12),
        GpuPreset("b200", 2250e12, 192 * GB, 8.0e12, 60 * GB, 100 * GB, _FP8_GPU, FP8_FLOPS_PER_BF16 * 2250e12),
        GpuPreset("b300", 2250e12, 288 * GB, 8.0e12, 120 * GB, 100 * GB, _FP8_GPU, FP8_FLOPS_PER_BF16 * 2250e12),
    )
}

#: Fabrics for break-even checks, bytes/s per replica-side link. Source: REFERENCE.md s6 (ConnectX-7 ~48 GB/s
#: achieved; Mooncake Transfer Engine 87 GB/s on 4x200G RoCE and 190 GB/s on 8x400G; kernel TCP ~9.5 GB/s).
FABRICS: dict[str, float] = {
    "rdma-8x400g": 190 * GB,
    "rdma-4x200g": 87 * GB,
    "rdma-1x400g": 48 * GB,
    "tcp": 9.5 * GB,
    "100gbe": 12.5 * GB,
}


def fabric_nic_gbps(name: str, gpus_per_replica: int) -> float:
    """The per-GPU NIC rate (Gb/s, as ``cluster.nic_gbps`` takes it) that gives a replica of ``gpus_per_replica``
    GPUs the copy bandwidth of fabric ``name`` (:data:`FABRICS`).

    Raises:
        ConfigError: unknown fabric (key ``fabric``).
    """
    bw = FABRICS.get(name.lower())
    if bw is None:
        raise ConfigError("fabric", f"unknown fabric {name!r}; valid: {', '.join(FABRICS)}")
    return bw * 8 / 1e9 / max(1, gpus_per_replica)


#: Fraction of peak FLOP/s reached by prefill. Source: REFERENCE.md s6 (70B FP8 prefill on TensorRT-LLM reaches
#: about 50% MFU); Infer-Sim uses the same 0.5.
DEFAULT_MFU = 0.5
#: Fraction of HBM bandwidth reached by decode. Source: Infer-Sim (REFERENCE.md s2), 0.8.
DEFAULT_HBM_EFFICIENCY = 0.8
#: Fraction of HBM SGLang gives to weights + KV pool (``--mem-fraction-static``); 0.9 is in the range SGLang picks
#: for 80 GB-class GPUs (sglang server_args). Infer-Sim uses 1.0.
DEFAULT_MEM_FRACTION = 0.9
#: Per-iteration scheduler/launch overhead, seconds. Estimate: order of SGLang's per-batch CPU overhead that its
#: overlap scheduler hides only partly; small against 70B step times.
DEFAULT_STEP_OVERHEAD_S = 0.002
#: L3 (node agent) to host read rate per TP rank, bytes/s: the emulated worker's HiCache prefetch. Estimate: a
#: memcpy out of the agent's shared-memory arena per rank's storage thread; benchmarks/bench_agent.py measured
#: ``batch_get_v1`` at 6.5 GB/s on a shared 2-core machine (README), a GPU server's cores do more
#: (benchmarks/bench_gpu_costmodel.py reads it on a GPU server).
L3_READ_BYTES_PER_S_PER_RANK = 10e9
#: SGLang's ``--chunked-prefill-size`` default for 80 GB-class GPUs (sglang server_args: 8192 tokens).
DEFAULT_CHUNKED_PREFILL_TOKENS = 8192
#: SGLang caps running requests per instance; Infer-Sim uses 256.
DEFAULT_MAX_RUNNING = 256


#: Weights/activation precisions of the prefill and decode math (``precision``): ``bf16`` (the default: the preset's
#: weight bytes, BF16 tensor-core peak) and ``fp8`` (FP8 weights, 1 byte each, and FP8 activations: the GPU's FP8
#: tensor-core peak, 2x BF16, so prefill compute takes half the time; TensorRT-LLM's and SGLang's FP8 checkpoints).
PRECISIONS = ("bf16", "fp8")
#: KV-cache element types (``kv_dtype``; SGLang ``--kv-cache-dtype``): ``auto`` (the model's: the preset's KV bytes,
#: 2 for the BF16 checkpoints, whatever ``precision`` is, as SGLang keeps the KV in the model dtype unless told),
#: ``bf16`` (2 bytes) or ``fp8`` (1 byte: half the KV bytes to store and to copy).
KV_DTYPES = ("auto", "bf16", "fp8")
_KV_BYTES = {"bf16": 2.0, "fp8": 1.0}


def _lookup(table: Mapping[str, _P], name: str, key: str) -> _P:
    try:
        return table[name.lower()]
    except KeyError:
        raise ConfigError(key, f"unknown preset {name!r}; valid: {', '.join(sorted(table))}") from None


def model_preset(name: str) -> ModelPreset:
    """The model preset ``name`` (case-insensitive). Raises :class:`ConfigError` (key ``model``) if unknown."""
    return _lookup(MODELS, name, "model")


def gpu_preset(name: str) -> GpuPreset:
    """The GPU preset ``name`` (case-insensitive). Raises :class:`ConfigError` (key ``gpu``) if unknown."""
    return _lookup(GPUS, name, "gpu")


@dataclass(frozen=True)
class ReplicaCost:
    """Timing of one replica (TP over ``gpus_per_replica`` GPUs).

    Args:
        model, gpu: presets.
        gpus_per_replica: TP degree (>= 1).
        nic_gbps: NIC bandwidth per GPU in **gigabits** per second; ``None`` takes the GPU preset's (H100: 400,
            i.e. 50 GB/s).
        mem_fraction: fraction of HBM for weights + KV.
        mfu: achieved fraction of peak FLOP/s in prefill.
        hbm_efficiency: achieved fraction of HBM bandwidth in decode.
        step_overhead_s: fixed cost added to every scheduler iteration.
        attention_term: include the quadratic attention FLOPs in prefill (Infer-Sim leaves it out).
        precision: weights/activation precision (:data:`PRECISIONS`): ``bf16`` keeps the preset as it is; ``fp8``
            stores weights at 1 byte (at most; int4 presets stay int4) and computes at the GPU's FP8 peak.
            ``model`` is then the effective preset (its ``dtype_bytes`` and ``kv_dtype_bytes``).
        kv_dtype: KV-cache element type (:data:`KV_DTYPES`), separate from ``precision``: ``auto`` keeps the
            preset's KV bytes; ``bf16`` / ``fp8`` set 2 / 1 bytes per element.

    Raises:
        ConfigError: the weights do not fit in ``mem_fraction`` of the replica's HBM (key ``gpus_per_replica``);
            an unknown ``precision`` or ``kv_dtype``, or ``fp8`` on a GPU without FP8 tensor cores.
    """

    model: ModelPreset
    gpu: GpuPreset
    gpus_per_replica: int = 1
    nic_gbps: float | None = None
    mem_fraction: float = DEFAULT_MEM_FRACTION
    mfu: float = DEFAULT_MFU
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S
    attention_term: bool = True
    precision: str = "bf16"
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", f"unknown precision {self.precision!r}; valid: {', '.join(PRECISIONS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError("kv_dtype", f"unknown KV dtype {self.kv_dtype!r}; valid: {', '.join(KV_DTYPES)}")
        if self.precision == "fp8" and self.gpu.fp8_flops is None:
            raise ConfigError("precision", f"{self.gpu.name} has no FP8 tensor cores; valid for it: bf16")
        given = self.model
        given_kv = given.dtype_bytes if given.kv_dtype_bytes is None else given.kv_dtype_bytes
        kv = given_kv if self.kv_dtype == "auto" else _KV_BYTES[self.kv_dtype]
        weights = min(given.dtype_bytes, 1.0) if self.precision == "fp8" else given.dtype_bytes
        if weights != given.dtype_bytes or kv != given_kv:  # the effective preset; bf16 + auto keep the given one
            object.__setattr__(self, "model", replace(given, dtype_bytes=weights, kv_dtype_bytes=kv))
        if self.gpus_per_replica < 1:
            raise ConfigError("gpus_per_replica", f"must be >= 1, got {self.gpus_per_replica}")
        if not 0 < self.mem_fraction <= 1:
            raise ConfigError("mem_fraction", f"must be in (0, 1], got {self.mem_fraction}")
        if self.nic_gbps is not None and self.nic_gbps <= 0:
            raise ConfigError("nic_gbps", f"must be > 0, got {self.nic_gbps}")
        if self.kv_budget_tokens < 1:
            need = self.model.weight_bytes / (self.gpu.hbm_bytes * self.mem_fraction)
            raise ConfigError(
                "gpus_per_replica",
                f"{self.model.name} weights ({self.model.weight_bytes / GB:.0f} GB) leave no room for KV cache on "
                f"{self.gpus_per_replica} x {self.gpu.name} ({self.hbm_bytes / GB:.0f} GB at mem_fraction "
                f"{self.mem_fraction}); use at least {int(need) + 1} GPUs per replica or a larger GPU",
            )

    # -- capacities -------------------------------------------------------------------------------------------
    @property
    def flops(self) -> float:
        """Peak FLOP/s of the replica at its ``precision`` (BF16, or the GPUs' FP8 peak)."""
        if self.precision == "fp8" and self.gpu.fp8_flops is not None:
            return self.gpu.fp8_flops * self.gpus_per_replica
        return self.gpu.flops * self.gpus_per_replica

    def prefill_tokens_per_s_per_gpu(self, prompt_tokens: int) -> float:
        """Prefill throughput of one GPU on ``prompt_tokens``-token prompts from scratch (tokens/s): the figure
        published benchmarks quote. Step overhead excluded; unchunked (one prefill of the whole prompt)."""
        compute = self.prefill_flops(prompt_tokens, 0) / (self.flops * self.mfu)
        weights = self.model.active_params * self.model.dtype_bytes / (self.hbm_bytes_per_s * self.hbm_efficiency)
        return prompt_tokens / max(compute, weights) / self.gpus_per_replica

    @property
    def hbm_bytes(self) -> float:
        return self.gpu.hbm_bytes * self.gpus_per_replica

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.gpus_per_replica

    @property
    def nic_bytes_per_s(self) -> float:
        """Replica NIC bandwidth (all its GPUs' NICs), bytes/s."""
        per_gpu = self.gpu.nic_bytes_per_s if self.nic_gbps is None else self.nic_gbps * 1e9 / 8
        return per_gpu * self.gpus_per_replica

    @property
    def pcie_bytes_per_s(self) -> float:
        return self.gpu.pcie_bytes_per_s * self.gpus_per_replica

    @property
    def kv_budget_bytes(self) -> float:
        """HBM left for the KV cache after weights."""
        return self.hbm_bytes * self.mem_fraction - self.model.weight_bytes

    @property
    def kv_budget_tokens(self) -> int:
        """KV-cache capacity in tokens."""
        return int(self.kv_budget_bytes // self.model.kv_bytes_per_token)

    def kv_bytes(self, tokens: int) -> float:
        """Bytes of KV cache for ``tokens`` tokens."""
        return tokens * self.model.kv_bytes_per_token

    # -- times ------------------------------------------------------------------------------------------------
    def prefill_flops(self, new_tokens: int, context_tokens: int = 0) -> float:
        """FLOPs to prefill ``new_tokens`` tokens that follow ``context_tokens`` already-cached tokens.

        Linear term 2 x active params per token; attention term 4 x layers x attn_dim per (query, key) pair under
        the causal mask: new x context + new^2 / 2 pairs.
        """
        f = 2.0 * self.model.active_params * new_tokens
        if self.attention_term:
            pairs = new_tokens * context_tokens + new_tokens * new_tokens / 2.0
            f += 4.0 * self.model.layers * self.model.attn_dim * pairs
        return f

    def prefill_time_s(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Seconds for one prefill step computing ``new_tokens`` after ``context_tokens`` of cached context."""
        return self.prefill_flops_time_s(self.prefill_flops(new_tokens, context_tokens))

    def prefill_flops_time_s(self, flops: float) -> float:
        """Seconds for a prefill step of ``flops`` FLOPs: compute-bound, floored by one read of the active
        weights, plus the step overhead."""
        compute = flops / (self.flops * self.mfu)
        weights = self.model.active_params * self.model.dtype_bytes / (self.hbm_bytes_per_s * self.hbm_efficiency)
        return max(compute, weights) + self.step_overhead_s

    def decode_step_time_s(self, running: int, kv_tokens: int) -> float:
        """Seconds for one decode step of ``running`` sequences holding ``kv_tokens`` tokens of KV in total.

        Memory-bound: read the active weights once plus every running sequence's KV; floored by compute
        (2 x active params FLOPs per sequence).
        """
        mem = (self.model.active_params * self.model.dtype_bytes + kv_tokens * self.model.kv_bytes_per_token) / (
            self.hbm_bytes_per_s * self.hbm_efficiency
        )
        compute = 2.0 * self.model.active_params * running / (self.flops * self.mfu)
        return max(mem, compute) + self.step_overhead_s

    def transfer_time_s(self, nbytes: float, bytes_per_s: float | None = None) -> float:
        """Seconds to move ``nbytes`` at ``bytes_per_s`` (default: this replica's NIC)."""
        bw = self.nic_bytes_per_s if bytes_per_s is None else bytes_per_s
        return nbytes / bw

    def copy_beats_recompute(self, tokens: int, bytes_per_s: float | None = None) -> bool:
        """Whether copying the KV of ``tokens`` prefix tokens is faster than prefilling them here."""
        return self.transfer_time_s(self.kv_bytes(tokens), bytes_per_s) < self.prefill_time_s(tokens, 0)


def default_chunked_prefill_tokens(gpu: GpuPreset) -> int:
    """SGLang-like ``--chunked-prefill-size`` default: 16384 above 120 GB of HBM per GPU, 8192 for 80 GB-class
    GPUs, 4096 below (sglang 0.5 server_args picks by GPU memory)."""
    if gpu.hbm_bytes > 120 * GB:
        return 16384
    if gpu.hbm_bytes >= 60 * GB:
        return DEFAULT_CHUNKED_PREFILL_TOKENS
    return 4096
