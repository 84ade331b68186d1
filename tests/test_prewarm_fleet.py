"""``btbctl prewarm``, ``btbctl replicate`` and a declared burst on a live local fleet of emulated workers, end to
end through the real commands."""

from __future__ import annotations

import json
import urllib.request

import pytest

from btbctl.engine.hashing import chain_hashes, text_to_tokens
from launcher_helpers import FREE_PORTS, cli, cli_json, http_json

PAGE = 256


@pytest.mark.slow
def test_prewarm_then_replicate_then_a_declared_burst_on_a_live_fleet(tmp_path, run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", "btb", *FREE_PORTS)
    try:
        urls = [w["url"] for w in st["workers"]]
        system = "".join(f"rule {i:04d}: answer briefly and cite the ticket id.\n" for i in range(120))
        chain = chain_hashes(text_to_tokens(system), PAGE)
        assert len(chain) >= 2
        f = tmp_path / "system.txt"
        f.write_text(system)

        # prewarm: computed by one worker, copied to 2 more, every copy proved
        proc = cli("prewarm", str(f), "--replicas", "2", "--run-dir", str(run_dir), "--format", "json")
        res = json.loads(proc.stdout)
        assert res["status"] == "done" and res["prefix"] == chain[-1] and res["prefix_blocks"] == len(chain)
        assert res["computed_by"] == res["source"] and len(res["targets"]) == 2 and res["bytes"] > 0
        assert "computed " in proc.stderr and "copy " in proc.stderr
        held = [http_json(u + "/btb/match", {"chain": chain})["cached_blocks"] for u in urls]
        assert sorted(held) == [0, len(chain), len(chain), len(chain)]

        # replicate to more than are left: the last worker; then nothing to copy, exit 0 and who holds it
        cli("replicate", "--prefix", chain[-1][:10], "-n", "3", "--run-dir", str(run_dir))
        again = cli("replicate", "--prefix", chain[-1][:10], "-n", "3", "--run-dir", str(run_dir))
        names = ", ".join(f"worker-{i}" for i in range(4))
        assert again.stdout.strip() == f"prefix {chain[-1][:12]} already held by 4 workers: {names}"
        pre = cli("prewarm", str(f), "-n", "1", "--run-dir", str(run_dir))
        assert "already held by 4 workers" in pre.stdout
        unknown = cli("replicate", "--prefix", "0123456789abcdef", "--run-dir", str(run_dir), check=False)
        assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1

        # a declared burst: one request counted as 6 arrivals makes its prefix hot at once
        cli("tune", "--run-dir", str(run_dir), "prefix_blocks=2", "threshold=5", "window_s=30")
        batch = "".join(f"batch rule {i:04d}: one line per ticket.\n" for i in range(120))
        req = urllib.request.Request(
            st["gateway_url"] + "/generate",
            data=json.dumps({"text": batch + "ticket 1", "sampling_params": {"max_new_tokens": 1}}).encode(),
            headers={"Content-Type": "application/json", "X-BTB-Expected-Requests": "6"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        key = chain_hashes(text_to_tokens(batch), PAGE)[1]
        row = next(p for p in cli_json("prefixes", "--run-dir", str(run_dir))["prefixes"] if p["id"] == key)
        assert row["hot"] and row["arrivals_in_window"] == 6 and row["fires"] == 1
        ops = cli("logs", "gateway", "--run-dir", str(run_dir), "-n", "0").stdout
        assert "event=control_prewarm" in ops and "event=prewarm_compute" in ops and "event=detector_fired" in ops
    finally:
        cli("down", "--run-dir", str(run_dir))
