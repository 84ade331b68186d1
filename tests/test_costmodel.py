"""Cost model: KV sizing, fit check, prefill / decode / transfer times and the copy-vs-recompute break-even.

Reference figures (public sources): Llama-3.3-70B KV = 80 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 bytes
= 327,680 B/token = 320 KiB (40 KiB per GPU at TP8); Mooncake Transfer Engine moves 190 GB/s over 8 x 400G RoCE,
kernel TCP about 9.5 GB/s; 70B FP8 prefill runs at about 6k tokens/s per H100 (~50% MFU). With those, copying a
32k-token prefix beats recomputing it by about 10x on 8 x 400G RDMA, 2-3x on one 400G NIC, and loses on TCP.
"""

from __future__ import annotations

import dataclasses

import pytest

from btbctl.engine.config import ClusterConfig
from btbctl.engine.costmodel import FABRICS, GB, GPUS, MODELS, ReplicaCost
from btbctl.engine.errors import ConfigError

LLAMA = MODELS["llama-3.3-70b"]
H100 = GPUS["h100"]
KIB = 1024
GIB = 1024**3

#: H100 SXM dense FP8 peak, 1,979 TFLOP/s (NVIDIA H100 datasheet): the FP8 prefill of the break-even figures.
H100_FP8_FLOPS = 1979e12


def test_llama_70b_kv_bytes_per_token():
    assert LLAMA.kv_bytes_per_token == 327_680
    assert LLAMA.kv_bytes_per_token / KIB == 320
    assert LLAMA.kv_bytes_per_token / 8 / KIB == 40  # per GPU at TP8: KV heads split over 8 GPUs
    # a 32k-token prefix is 10 GiB
    assert ReplicaCost(LLAMA, H100, 8).kv_bytes(32 * 1024) == 10 * GIB


def test_70b_does_not_fit_one_h100():
    with pytest.raises(ConfigError) as ei:
        ReplicaCost(LLAMA, H100, 1)
    assert ei.value.key == "gpus_per_replica"
    assert str(ei.value).startswith("gpus_per_replica:")
    assert "llama-3.3-70b" in str(ei.value)
    with pytest.raises(ConfigError, match="gpus_per_replica"):
        ClusterConfig(model="llama-3.3-70b", gpu="h100", gpus_per_replica=1).replica_cost()
    # 2 x H100 = 160 GB x 0.9 = 144 GB > 141.2 GB of weights: fits, with a small KV budget
    two = ReplicaCost(LLAMA, H100, 2)
    assert 0 < two.kv_budget_tokens < ReplicaCost(LLAMA, H100, 4).kv_budget_tokens


def test_unknown_presets_name_valid_ones():
    with pytest.raises(ConfigError, match=r"llama-3\.3-70b") as ei:
        ClusterConfig(model="llama-4").replica_cost()
    assert ei.value.key == "model"
    with pytest.raises(ConfigError, match="h100") as ei:
        ClusterConfig(gpu="tpu").replica_cost()
    assert ei.value.key == "gpu"


def test_prefill_grows_superlinearly_with_context():
    rc = ReplicaCost(LLAMA, H100, 4, step_overhead_s=0.0)
    n = 16 * 1024
    t1, t2 = rc.prefill_time_s(n), rc.prefill_time_s(2 * n)
    assert t2 / t1 > 2.2  # the attention term is quadratic
    # the same new tokens cost more after a longer cached context
    assert rc.prefill_time_s(1024, context_tokens=64 * 1024) > 1.5 * rc.prefill_time_s(1024, context_tokens=0)
    flat = ReplicaCost(LLAMA, H100, 4, step_overhead_s=0.0, attention_term=False)
    assert flat.prefill_time_s(2 * n) / flat.prefill_time_s(n) == pytest.approx(2.0)
    # Infer-Sim's formula without attention: 2 x active params x tokens / (FLOP/s x 0.5)
    assert flat.prefill_time_s(n) == pytest.approx(2 * LLAMA.active_params * n / (4 * H100.flops * 0.5))


def test_decode_step_grows_with_kv():
    rc = ReplicaCost(LLAMA, H100, 4, step_overhead_s=0.0)
    empty = rc.decode_step_time_s(running=8, kv_tokens=0)
    full = rc.decode_step_time_s(running=8, kv_tokens=200_000)
    # weights once: 141.2 GB / (4 x 3.35 TB/s x 0.8) = 13.2 ms
    assert empty == pytest.approx(141.2e9 / (4 * 3.35e12 * 0.8))
    assert full - empty == pytest.approx(200_000 * 327_680 / (4 * 3.35e12 * 0.8))
    assert rc.decode_step_time_s(8, 100_000) < full


def test_transfer_time():
    rc = ReplicaCost(LLAMA, H100, 4)  # 4 x 400 Gb/s = 200 GB/s of NIC
    assert rc.nic_bytes_per_s == 200 * GB
    assert rc.transfer_time_s(10 * GB) == pytest.approx(0.05)
    assert rc.transfer_time_s(10 * GB, FABRICS["tcp"]) == pytest.approx(10 / 9.5)
    assert ReplicaCost(LLAMA, H100, 4, nic_gbps=100).transfer_time_s(10 * GB) == pytest.approx(0.2)


def _fp8_tp8_replica() -> ReplicaCost:
    """A Llama-3.3-70B replica on 8 x H100 with FP8 weights and BF16 KV (the setting of the break-even figures)."""
    model = dataclasses.replace(LLAMA, name="llama-3.3-70b-fp8", dtype_bytes=1, kv_dtype_bytes=2)
    gpu = dataclasses.replace(H100, name="h100-fp8", flops=H100_FP8_FLOPS)
    return ReplicaCost(model, gpu, 8)


def test_fp8_prefill_rate_matches_published_figure():
    rc = _fp8_tp8_replica()
    tokens = 32 * 1024
    per_gpu_tokens_per_s = tokens / rc.prefill_time_s(tokens) / 8
    assert 4_000 < per_gpu_tokens_per_s < 8_000  # "at least about 6k tokens/s per H100"


@pytest.mark.parametrize(
    "fabric, lo, hi",
    [
        ("rdma-8x400g", 8.0, 25.0),  # "about 10x"
        ("rdma-1x400g", 1.8, 6.0),  # "2-3x"
        ("tcp", 0.0, 1.0),  # loses
        ("100gbe", 0.0, 1.0),  # loses
    ],
)
def test_copy_vs_recompute_break_even_32k_prefix(fabric, lo, hi):
    rc = _fp8_tp8_replica()
    tokens = 32 * 1024
    copy_s = rc.transfer_time_s(rc.kv_bytes(tokens), FABRICS[fabric])
    recompute_s = rc.prefill_time_s(tokens)
    ratio = recompute_s / copy_s
    assert lo < ratio < hi, (fabric, ratio)
    assert rc.copy_beats_recompute(tokens, FABRICS[fabric]) is (ratio > 1)


def test_copy_time_of_10_gib_on_8x400g():
    rc = _fp8_tp8_replica()
    assert rc.transfer_time_s(10 * GIB, FABRICS["rdma-8x400g"]) == pytest.approx(10 * GIB / 190e9)
    assert 0.05 < rc.transfer_time_s(10 * GIB, FABRICS["rdma-8x400g"]) < 0.06
