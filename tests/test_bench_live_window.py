"""benchmarks/bench_live_window.py: the link-rate arithmetic, and its smoke path (btbctl routers on loopback)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_live_window as blw


def test_paced_link_makes_a_copy_take_its_model_time_over_the_time_scale():
    # Llama-3.3-70B: 256 tokens x 327,680 bytes = 83,886,080 bytes a block; 4 x H100 NICs = 200 GB/s
    real, emu = blw.block_sizes(4096)
    assert (real, emu) == (83_886_080, 20_480)
    assert blw.nic_bytes_per_s() == 200e9
    rate = blw.link_rate_bit(3.0, 4096)
    assert rate == pytest.approx(1.6e12 * 3.0 / 4096)
    blocks = 256
    model_s = blocks * real / 200e9
    wall_s = blocks * emu * 8 / rate
    assert wall_s == pytest.approx(model_s / 3.0)


def test_the_window_lasts_the_wall_time_asked_for():
    args = blw.parse_args(["--bursts", "3", "--spread-s", "1", "--wall-s", "30"])
    params = blw.window_params(args)
    assert params.window_end_s() == 20 + 40 * 2 + 2 + 1
    assert blw.time_scale_for(params, 30.0) == pytest.approx(103 / 30)


@pytest.mark.slow
def test_live_window_smoke_on_loopback_with_btbctl_routers():
    args = blw.parse_args(
        ["--quick", "--runs", "1", "--netns", "off", "--routers", "btbctl cache_aware,btbctl btb_plus"]
    )
    res = blw.run_bench(args)
    assert res["network"]["testbed"] == "loopback" and res["network"]["why_not_netns"] == "--netns off"
    n = res["window"]["requests"]
    assert n == args.bursts * args.burst_size + args.decoys
    assert res["time_scale"] > 0
    rows = {r["router"]: r for r in res["rows"]}
    assert set(rows) == {"btbctl cache_aware", "btbctl btb_plus"}
    for r in rows.values():
        assert (r["requests"], r["errors"]) == (n, 0), r["errors_by_status"]
        assert sum(r["served_per_worker"]) == n
        t = r["ttft_model_s"]
        assert t["mean"] > 0 and t["p50"] <= t["p95"] <= t["p99"] <= t["max"]
        # every burst prefix and every decoy is computed at least once; never more than every prompt token
        least = args.bursts * args.prefix_tokens + args.decoys * args.prefix_tokens
        assert least <= r["prefill_tokens_computed"] <= r["prompt_tokens"]
        assert r["prefill_tokens_by_kind"]["burst"] is not None
    plus, ca = rows["btbctl btb_plus"], rows["btbctl cache_aware"]
    assert plus["copies"] > 0 and plus["copied_blocks"] > 0 and plus["copies_failed"] == 0
    assert plus["copied_bytes"] == plus["copied_blocks"] * res["network"]["real_block_bytes"]
    assert ca["copies"] == 0
    # copies spread the bursts: btb_plus serves them from more than one worker
    assert sum(1 for x in plus["served_per_worker"] if x > 0) > 1
    assert res["ratios_btb_plus_over_smg"] == {}  # no smg in this run
