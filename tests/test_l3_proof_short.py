"""A copy whose warm-up proof falls short counts for nothing: a fleet of emulated workers in replication mode ``l3``
on this machine (one node agent, four workers) whose HiCache prefetch policy is ``best_effort``, under which SGLang
admits an idle worker's request before its L3 read lands, so the warm-up reuses none of the copied prefix. Every
copy ends ``failed`` with ``proof short``, no target is recorded as holding the prefix, none gets a request of the
burst, and every request is answered once, without an error."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from launcher_helpers import cli, cli_json, force_cleanup, http_json
from netns_fleet import metric

pytestmark = pytest.mark.slow

N = 16


def test_short_proofs_keep_the_burst_on_the_holder(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("""
[gateway]
policy = "btb"  # copies as soon as the detector fires (btb_plus, the default, would recompute 4 blocks)
port = 0
control_port = 0

[btb]
prefix_blocks = 4
warm_replicas = 4

[replication]
mode = "l3"
arena_mib = 64
prefetch_policy = "best_effort"

[[workers]]
name = "w"
count = 4
time_scale = 10.0
kv_bytes_scale = 64
ready_timeout_s = 30.0
""")
    run_dir = tmp_path / "run"
    try:
        st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), timeout=90)
        out = tmp_path / "requests.jsonl"
        rep = cli_json(
            "bench",
            "--run-dir",
            str(run_dir),
            "--burst-size",
            str(N),
            "--prefix-blocks",
            "4",
            "--spread-s",
            "1.0",
            "--requests-out",
            str(out),
            timeout=90,
        )
        lines = [json.loads(x) for x in out.read_text().splitlines()]
        assert (rep["ok"], rep["errors"]) == (N, 0)
        assert sorted(x["request_id"] for x in lines) == sorted({x["request_id"] for x in lines})
        control = st["control_url"].rstrip("/")
        for _ in range(300):
            tr = http_json(control + "/control/transfers")
            if tr["in_flight"] == 0 and tr["totals"]["failed"] >= 3:
                break
            time.sleep(0.1)
        copies = [t for t in tr["transfers"] if t["mode"] == "l3"]
        assert len(copies) == 3 and {t["state"] for t in copies} == {"failed"}, copies
        for t in copies:
            assert t["error"].startswith("proof short:"), t
            assert t["proof"] is not None and t["proof"]["storage"] < t["covered_tokens"] == 4 * 256, t
        # only the source holds the prefix, and it served the whole burst
        source = copies[0]["source"]
        assert {t["source"] for t in copies} == {source}
        assert list(rep["by_worker"]) == [source], rep["by_worker"]
        prefixes = http_json(control + "/control/prefixes")
        held = [p for p in prefixes["prefixes"] if p["id"] == copies[0]["prefix"]]
        assert held and held[0]["holders"] == [source], held
        with urllib.request.urlopen(st["gateway_url"] + "/metrics", timeout=10) as r:
            m = r.read().decode()
        assert metric(m, "btb_copy_proofs_total", result="short") == 3
        assert metric(m, "btb_copy_proofs_total", result="proved") == 0
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
        force_cleanup(run_dir)
