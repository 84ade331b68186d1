"""The cost model's GPU figures read against one real GPU (not a test; never gates CI; needs PyTorch with CUDA).

BTB's decisions rest on a few hardware figures of :mod:`btbctl.engine.costmodel` (a preset's dense BF16 FLOP/s and
the prefill MFU, HBM and host-link bandwidth) and of the emulated worker (the L3 read rate per TP rank,
``L3_READ_BYTES_PER_S_PER_RANK``). This measures each on the GPU at hand and prints it beside the figure the
model uses, as a ratio:

* ``nvml``: the GPUs as btbctl's own NVML reader (:func:`btbctl.engine.telemetry.nvml.read_gpus`) sees them;
* ``gemm``: an 8192 x 8192 x 8192 BF16 matrix product, TFLOP/s against the preset's peak;
* ``hbm``: a device-to-device copy, bytes read and written per second against ``hbm_bytes_per_s``;
* ``host_link``: pinned host to device and back, one 1 GiB copy, against ``pcie_bytes_per_s``;
* ``kv_pages``: the reload of a 16,384-token Llama-3.3-70B prefix's KV on one TP-4 rank (64 pages of 256 tokens)
  from pinned host memory into a device page pool, as HiCache's two layouts do it: ``layer_first`` (one copy per
  page, layer and K/V: 10,240 copies of 128 KiB) and ``page_first`` (one copy per page: 64 of 10 MiB);
* ``shm_read``: a memcpy out of a ``/dev/shm`` arena into pinned host memory (the L3 to host step of a prefetch),
  one thread and one per rank of a TP-4 replica, against ``L3_READ_BYTES_PER_S_PER_RANK``;
* ``prefill``: one Llama-3.3-70B decoder layer at the shape of one TP-4 rank (QKV, causal attention over the
  chunk and its context with grouped KV heads, O, gated MLP), in SGLang's 8,192-token prefill chunks, for 16,384-
  and 65,536-token prompts, times 80 layers (the all-reduces between ranks are left out), against
  ``ReplicaCost.prefill_time_s`` summed over the same chunks; the achieved MFU is the FLOPs the cost model counts
  over the measured time and the GPU's peak.

    python benchmarks/bench_gpu_costmodel.py                 # table
    python benchmarks/bench_gpu_costmodel.py --format json   # one object

Each timing is the median of ``--repeats`` timed runs after warm-ups, with CUDA events (device work) or the
monotonic clock (host copies). Exits with the reason when PyTorch or a CUDA device is missing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from btbctl.engine.costmodel import L3_READ_BYTES_PER_S_PER_RANK, ReplicaCost, gpu_preset, model_preset
from btbctl.engine.telemetry.nvml import read_gpus

GIB = 1 << 30
#: Llama-3.3-70B's shapes (its config.json): hidden 8192, MLP 28672, 64 query / 8 KV heads of 128, 80 layers.
HIDDEN, MLP, Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 8192, 28672, 64, 8, 128, 80
TP = 4
PAGE_TOKENS = 256
#: SGLang's ``--chunked-prefill-size`` on 80 GB-class GPUs (costmodel.DEFAULT_CHUNKED_PREFILL_TOKENS).
CHUNK_TOKENS = 8192


def _cuda_time_s(torch, fn, repeats: int, warmups: int = 2) -> float:
    """Median seconds of ``fn()`` on the current stream (CUDA events)."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


def _wall_time_s(fn, repeats: int, warmups: int = 1) -> float:
    for _ in range(warmups):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.monotonic()
        fn()
        out.append(time.monotonic() - t0)
    return statistics.median(out)


def gemm(torch, repeats: int, peak_flops: float) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    s = _cuda_time_s(torch, lambda: a @ b, repeats, warmups=3)
    flops = 2.0 * n**3 / s
    return {
        "tflops": round(flops / 1e12, 1),
        "model_peak_tflops": peak_flops / 1e12,
        "of_peak": round(flops / peak_flops, 3),
    }


def hbm(torch, repeats: int, model_bytes_per_s: float) -> dict:
    src = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s = _cuda_time_s(torch, lambda: dst.copy_(src), repeats)
    rate = 2 * src.numel() / s  # read + write
    return {
        "gb_per_s": round(rate / 1e9, 1),
        "model_gb_per_s": model_bytes_per_s / 1e9,
        "ratio": round(rate / model_bytes_per_s, 3),
    }


def host_link(torch, repeats: int, model_bytes_per_s: float) -> dict:
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    h2d = GIB / _cuda_time_s(torch, lambda: dev.copy_(host, non_blocking=True), repeats)
    d2h = GIB / _cuda_time_s(torch, lambda: host.copy_(dev, non_blocking=True), repeats)
    return {
        "h2d_gb_per_s": round(h2d / 1e9, 1),
        "d2h_gb_per_s": round(d2h / 1e9, 1),
        "model_gb_per_s": model_bytes_per_s / 1e9,
        "h2d_ratio": round(h2d / model_bytes_per_s, 3),
    }


def kv_pages(torch, repeats: int, model_bytes_per_s: float) -> dict:
    """HiCache's reload of 64 pages of one rank's KV from pinned host memory into scattered slots of a device pool:
    ``layer_first`` host layout (each layer's K and V pages contiguous: one copy per layer and K/V, then a scatter
    into the pool), ``page_first`` (each page's layers contiguous: one copy per page) and ``per_page_layer`` (one
    copy per page, layer and K/V: the cost of many small copies)."""
    pages, kv_heads = 64, KV_HEADS // TP
    page_bytes_layer = PAGE_TOKENS * kv_heads * HEAD_DIM * 2  # one K or V of one layer, bf16
    total = pages * LAYERS * 2 * page_bytes_layer
    host_lf = torch.empty((LAYERS, 2, pages, page_bytes_layer), dtype=torch.uint8, pin_memory=True)
    pool = torch.empty((LAYERS, 2, pages * 2, page_bytes_layer), dtype=torch.uint8, device="cuda")
    staging = torch.empty((pages, page_bytes_layer), dtype=torch.uint8, device="cuda")
    slots = torch.arange(0, pages * 2, 2, device="cuda")
    slot_list = slots.tolist()

    def layer_first():
        for layer in range(LAYERS):
            for kv in range(2):
                staging.copy_(host_lf[layer, kv], non_blocking=True)
                pool[layer, kv].index_copy_(0, slots, staging)

    def per_page_layer():
        for layer in range(LAYERS):
            for kv in range(2):
                for p, slot in enumerate(slot_list):
                    pool[layer, kv, slot].copy_(host_lf[layer, kv, p], non_blocking=True)

    host_pf = torch.empty((pages, LAYERS * 2 * page_bytes_layer), dtype=torch.uint8, pin_memory=True)
    pool_pf = torch.empty((pages * 2, LAYERS * 2 * page_bytes_layer), dtype=torch.uint8, device="cuda")

    def page_first():
        for p, slot in enumerate(slot_list):
            pool_pf[slot].copy_(host_pf[p], non_blocking=True)

    out: dict = {"bytes": total, "page_bytes_per_layer": page_bytes_layer}
    for name, fn in (("layer_first", layer_first), ("page_first", page_first), ("per_page_layer", per_page_layer)):
        s = _cuda_time_s(torch, fn, repeats, warmups=1)
        out[name] = {
            "s": round(s, 5),
            "gb_per_s": round(total / s / 1e9, 1),
            "ratio": round(total / s / model_bytes_per_s, 3),
        }
    return out


def _shm_rates(np, arena, dsts: list, per_rank: int, repeats: int) -> tuple[float, float]:
    def one(r: int) -> None:
        np.copyto(dsts[r], arena[r * per_rank : (r + 1) * per_rank])

    s1 = _wall_time_s(lambda: one(0), repeats)
    with ThreadPoolExecutor(TP) as pool:
        s4 = _wall_time_s(lambda: list(pool.map(one, range(TP))), repeats)
    return per_rank / s1, per_rank / s4


def shm_read(torch, repeats: int) -> dict:
    """memcpy out of a /dev/shm arena (the node agent's) into pinned host memory, 1 and TP threads."""
    import numpy as np

    per_rank = 512 << 20
    shm_dir = None  # the temporary directory's page cache when /dev/shm is missing or too small (a SIGBUS else)
    if os.path.isdir("/dev/shm"):
        st = os.statvfs("/dev/shm")
        shm_dir = "/dev/shm" if st.f_bavail * st.f_frsize > 2 * per_rank * TP else None
    dsts = [torch.empty(per_rank, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(TP)]
    with tempfile.NamedTemporaryFile(dir=shm_dir) as f:
        f.truncate(per_rank * TP)
        mm = mmap.mmap(f.fileno(), per_rank * TP)
        try:
            np.frombuffer(mm, dtype=np.uint8)[:] = 1
            one_rate, per_rank_rate = _shm_rates(np, np.frombuffer(mm, dtype=np.uint8), dsts, per_rank, repeats)
        finally:
            mm.close()
    return {
        "arena": shm_dir or tempfile.gettempdir(),
        "one_thread_gb_per_s": round(one_rate / 1e9, 1),
        "per_rank_of_4_gb_per_s": round(per_rank_rate / 1e9, 1),
        "model_per_rank_gb_per_s": L3_READ_BYTES_PER_S_PER_RANK / 1e9,
        "per_rank_ratio": round(per_rank_rate / L3_READ_BYTES_PER_S_PER_RANK, 3),
    }


def prefill(torch, repeats: int, cost: ReplicaCost, prompts: list[int]) -> dict:
    """One decoder layer at a TP-4 rank's shape, chunk by chunk, x LAYERS, against the cost model."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    bf = torch.bfloat16
    qh, kvh = Q_HEADS // TP, KV_HEADS // TP
    w_qkv = torch.randn(HIDDEN, (qh + 2 * kvh) * HEAD_DIM, device="cuda", dtype=bf) * 0.01
    w_o = torch.randn(qh * HEAD_DIM, HIDDEN, device="cuda", dtype=bf) * 0.01
    w_up = torch.randn(HIDDEN, 2 * (MLP // TP), device="cuda", dtype=bf) * 0.01
    w_down = torch.randn(MLP // TP, HIDDEN, device="cuda", dtype=bf) * 0.01
    out: dict = {"chunk_tokens": CHUNK_TOKENS, "layers": LAYERS, "tp": TP, "peak_tflops": cost.gpu.flops / 1e12}

    def layer(x, k_ctx, v_ctx):
        qkv = x @ w_qkv
        q, k, v = qkv.split([qh * HEAD_DIM, kvh * HEAD_DIM, kvh * HEAD_DIM], dim=-1)
        n = x.shape[0]
        q = q.view(1, n, qh, HEAD_DIM).transpose(1, 2)
        k = torch.cat([k_ctx, k.view(1, n, kvh, HEAD_DIM).transpose(1, 2)], dim=2)
        v = torch.cat([v_ctx, v.view(1, n, kvh, HEAD_DIM).transpose(1, 2)], dim=2)
        k, v = k.repeat_interleave(qh // kvh, dim=1), v.repeat_interleave(qh // kvh, dim=1)  # grouped KV heads
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, k.shape[2]))
        h = x + a.transpose(1, 2).reshape(n, qh * HEAD_DIM) @ w_o
        g, u = (h @ w_up).chunk(2, dim=-1)
        return h + (F.silu(g) * u) @ w_down

    for prompt in prompts:
        measured = modelled = 0.0
        for start in range(0, prompt, CHUNK_TOKENS):
            n = min(CHUNK_TOKENS, prompt - start)
            x = torch.randn(n, HIDDEN, device="cuda", dtype=bf)
            k_ctx = torch.randn(1, kvh, start, HEAD_DIM, device="cuda", dtype=bf)
            v_ctx = torch.randn(1, kvh, start, HEAD_DIM, device="cuda", dtype=bf)
            measured += LAYERS * _cuda_time_s(torch, lambda x=x, k=k_ctx, v=v_ctx: layer(x, k, v), repeats)
            modelled += cost.prefill_time_s(n, start)
        flops = cost.prefill_flops(prompt, 0) / TP  # one rank's share of the prompt's FLOPs
        out[str(prompt)] = {
            "measured_s": round(measured, 4),
            "model_s": round(modelled, 4),
            "measured_over_model": round(measured / modelled, 3),
            "achieved_mfu": round(flops / measured / cost.gpu.flops, 3),
            "model_mfu": cost.mfu,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h200", help="cost-model GPU preset to compare with (default h200)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", default="16384,65536", help="prompt lengths for the prefill check, tokens")
    ap.add_argument("--format", choices=("table", "json"), default="table")
    args = ap.parse_args(argv)
    res: dict = {}
    nv = read_gpus()
    res["nvml"] = {"reason": nv.reason} if nv.reason else [dataclasses.asdict(g) for g in nv.gpus]
    try:
        import torch
    except ImportError:
        print("bench_gpu_costmodel: PyTorch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_gpu_costmodel: no CUDA device", file=sys.stderr)
        return 2
    res["device"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    gpu = gpu_preset(args.gpu)
    cost = ReplicaCost(model_preset("llama-3.3-70b"), gpu, gpus_per_replica=TP)
    steps = (
        ("gemm", lambda: gemm(torch, args.repeats, gpu.flops)),
        ("hbm", lambda: hbm(torch, args.repeats, gpu.hbm_bytes_per_s)),
        ("host_link", lambda: host_link(torch, args.repeats, gpu.pcie_bytes_per_s)),
        ("kv_pages", lambda: kv_pages(torch, args.repeats, gpu.pcie_bytes_per_s)),
        ("shm_read", lambda: shm_read(torch, args.repeats)),
        ("prefill", lambda: prefill(torch, args.repeats, cost, [int(p) for p in args.prompts.split(",")])),
    )
    for name, fn in steps:
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failed measurement does not lose the others
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.empty_cache()
    if args.format == "json":
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:10} {json.dumps(v)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
