"""``benchmarks/bench_decision.py`` runs end to end on a small budget and reports what it claims (no timing is
asserted: CI never gates on time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from btbctl.engine.compiled import core_build

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decision.py"


def test_bench_decision_smoke():
    cmd = [sys.executable, str(BENCH), "--decisions", "300", "--rounds", "2", "--prompts", "2", "--hash-runs", "5"]
    out = json.loads(subprocess.run([*cmd, "--format", "json"], check=True, capture_output=True, text=True).stdout)
    assert out["routing_core"] == core_build()  # the build it measured: this installation's
    rows = {r["policy"]: r for r in out["decisions"]}
    assert set(rows) == {"round_robin", "btb", "btb_plus", "cache_aware"}
    for r in rows.values():
        assert r["decisions"] == 300 and len(r["p99_us_rounds"]) == 2
        assert 0 < r["p50_us"] <= r["p99_us"]
    # the burst is hot: the detector fires and the BTB policies plan copies the replicator starts
    assert rows["btb"]["detector_fires"] > 0 and rows["btb"]["copies_started"] > 0
    assert rows["btb_plus"]["copies_started"] > 0 and rows["round_robin"]["copies_started"] == 0


def test_bench_decision_live_starts_and_finishes_requests():
    """``--live``: the decisions run while the requests they route start, get first bytes and finish."""
    cmd = [sys.executable, str(BENCH), "--decisions", "300", "--rounds", "1", "--prompts", "2", "--hash-runs", "5"]
    out = json.loads(
        subprocess.run([*cmd, "--live", "--format", "json"], check=True, capture_output=True, text=True).stdout
    )
    assert out["live"] is True
    rows = {r["policy"]: r for r in out["decisions"]}
    for r in rows.values():  # 330 arrivals at 50/s over 6.6 s of moved clock, 0.5 s of decode each
        assert r["requests_served"] > 50, r
    static = json.loads(subprocess.run([*cmd, "--format", "json"], check=True, capture_output=True, text=True).stdout)
    assert all(r["requests_served"] == 0 for r in static["decisions"])
