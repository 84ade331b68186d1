"""What an operator reads from the commands on a running emulated fleet: workers by their names (as ``status`` and
the dashboard show them) in ``bench`` and ``replicate``, counts that agree with their nouns."""

from __future__ import annotations

import re

import pytest

from launcher_helpers import FREE_PORTS, cli, cli_json


@pytest.mark.slow
def test_bench_and_replicate_name_workers_and_count_in_the_singular(run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", "cache_aware", *FREE_PORTS)
    try:
        names = {w["url"]: w["name"] for w in st["workers"]}
        # one request of a 64-block prefix: the gateway tracks it at prefix_blocks 64
        cli("tune", "--run-dir", str(run_dir), "prefix_blocks=64")
        bench = cli("bench", "--run-dir", str(run_dir), "--burst-size", "1", "--prefix-blocks", "64")
        assert bench.stdout.startswith("1 request to ") and ": 1 ok, 0 errors" in bench.stdout, bench.stdout
        assert "replaying 1 request over" in bench.stderr, bench.stderr
        assert not any(url in bench.stdout for url in names)  # workers by name, not URL
        served = [n for n in names.values() if re.search(rf"^{n}\s+1\s*$", bench.stdout, re.M)]
        assert len(served) == 1, bench.stdout
        prefix = cli_json("prefixes", "--run-dir", str(run_dir))["prefixes"][0]["id"]
        rep = cli("replicate", "--run-dir", str(run_dir), "--prefix", prefix[:12], "-n", "1")
        first = rep.stdout.splitlines()[0]
        assert first.startswith(f"prefix {prefix[:12]} from {served[0]} to 1 worker: done"), rep.stdout
        target = rep.stdout.splitlines()[1].strip()
        assert target in names.values() and target != served[0], rep.stdout
        assert f"-> {target}: " in rep.stderr and not any(url in rep.stdout + rep.stderr for url in names)
        flushed = cli("flush", "--run-dir", str(run_dir)).stdout
        assert flushed.startswith(f"flushed {len(names)} of {len(names)} workers"), flushed
    finally:
        cli("down", "--run-dir", str(run_dir), check=False)
