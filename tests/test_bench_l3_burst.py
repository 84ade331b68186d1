"""benchmarks/bench_l3_burst.py: the namespace testbed's cluster file keeps the single-machine shape, and a copy
across a link reports its rate against the link's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_l3_burst as bench

from btbctl.engine.launcher.cluster import validate_cluster


def _hosts(n: int) -> list[dict]:
    return [
        {"name": f"node{i}", "address": f"198.18.0.{i + 2}", "port": 22, "user": "root", "python": sys.executable}
        for i in range(n)
    ]


@pytest.mark.parametrize("n", bench.TESTBED_HOSTS)
def test_testbed_cluster_spreads_the_single_machine_shape_over_the_hosts(n, tmp_path):
    for mode in ("l3", "push"):
        text = bench.testbed_cluster(_hosts(n), mode)
        one = tomllib.loads(bench.CLUSTER.format(mode=mode, workers=bench.WORKERS))
        two = validate_cluster(tomllib.loads(text), "testbed.toml")
        # the same gateway policy (the default), detector, replication and worker model as on one machine
        assert "policy" not in tomllib.loads(text)["gateway"]
        assert two.gateway.policy == validate_cluster(one, "one.toml").gateway.policy
        assert two.btb.model_dump(exclude_unset=True) == one["btb"]
        assert (two.replication.mode, two.replication.arena_mib) == (mode, one["replication"]["arena_mib"])
        # the workers, spread evenly: one entry per host, the single-machine worker settings (no time_scale or
        # kv_bytes_scale of the tests' fleets)
        assert [h.name for h in two.hosts] == [f"node{i}" for i in range(n)]
        assert [(w.host, w.count) for w in two.workers] == [(f"node{i}", bench.WORKERS // n) for i in range(n)]
        for w in two.workers:
            spec = w.model_dump(exclude_unset=True)
            assert {k: v for k, v in spec.items() if k not in ("name", "host", "count")} == {
                k: v for k, v in one["workers"][0].items() if k not in ("name", "count")
            }
            assert w.time_scale == 1.0 and w.kv_bytes_scale is None
    scaled = validate_cluster(tomllib.loads(bench.testbed_cluster(_hosts(2), "l3", kv_bytes_scale=64)), "t.toml")
    assert {w.kv_bytes_scale for w in scaled.workers} == {64}


@pytest.mark.parametrize("n", [0, 3, 8])
def test_testbed_cluster_refuses_hosts_that_cannot_share_the_workers_evenly(n):
    with pytest.raises(ValueError, match="evenly"):
        bench.testbed_cluster(_hosts(n), "l3")


def test_the_tests_fleets_keep_their_policy_and_two_workers_per_host():
    from netns_fleet import WORKER, fleet_toml

    data = tomllib.loads(fleet_toml(_hosts(2), "l3"))
    assert data["gateway"]["policy"] == "btb" and data["gateway"]["max_retries"] == 3
    assert [(w["host"], w["count"]) for w in data["workers"]] == [("node0", 2), ("node1", 2)]
    assert all({k: w[k] for k in WORKER} == WORKER for w in data["workers"])
    assert data["replication"] == {"mode": "l3", "arena_mib": 64}


def _copy(source: str, target: str, **kw) -> dict:
    return {"source": source, "target": target, "state": "done", "outcome": "proved", "mode": "l3", **kw}


def test_copy_row_rates_only_copies_that_crossed_a_link_and_moved_bytes():
    host = {"http://198.18.0.2:9000": "node0", "http://198.18.0.2:9001": "node0", "http://198.18.0.3:9000": "node1"}
    a, b, far = host
    # 336 MB sent in 0.5 s across a 10 Gbit/s link: 5.376 Gbit/s, 0.5376 x the link
    row = bench.copy_row(_copy(a, far, bytes=336_000_000, send_s=0.5, overlap_s=0.2), host.get, 10.0)
    assert row["crossed"] and (row["source_host"], row["target_host"]) == ("node0", "node1")
    assert row["rate_over"] == "send_s"
    assert row["gbit_s"] == pytest.approx(5.376) and row["link_ratio"] == pytest.approx(0.5376)
    # the same host: no link crossed, no rate
    assert not bench.copy_row(_copy(a, b, bytes=1000, send_s=0.1), host.get, 10.0)["crossed"]
    assert "gbit_s" not in bench.copy_row(_copy(a, b, bytes=1000, send_s=0.1), host.get, 10.0)
    # a second target on the far host shares the first one's pages and sends nothing: no rate
    assert "gbit_s" not in bench.copy_row(_copy(a, far, bytes=1000, send_s=0.0), host.get, 10.0)
    # push copies have no send_s: their transfer time stands in, and says so
    push = bench.copy_row(_copy(a, far, mode="push", bytes=125_000_000, transfer_s=1.0), host.get, 10.0)
    assert (push["rate_over"], push["gbit_s"], push["link_ratio"]) == ("transfer_s", pytest.approx(1.0), 0.1)
    # ... or, without one, the copy's whole duration (a lower bound)
    push = bench.copy_row(_copy(a, far, mode="push", bytes=125_000_000, duration_s=2.0), host.get, 10.0)
    assert (push["rate_over"], push["gbit_s"]) == ("duration_s", pytest.approx(0.5))
    # an l3 copy without send_s is never rated over its duration
    assert "gbit_s" not in bench.copy_row(_copy(a, far, bytes=1000, duration_s=2.0), host.get, 10.0)
    # one machine: no hosts, nothing crossed
    assert not bench.copy_row(_copy(a, far, bytes=1000, send_s=0.1), lambda u: None, None)["crossed"]


def test_summary_reports_medians_of_the_copies_that_crossed_a_link():
    def run(p95: float, rows: list[dict]) -> dict:
        rep = {"ttft_s": {"p50": 0.1, "p95": p95, "mean": 0.2}, "errors": 0, "by_worker": {"a": 150, "b": 50}}
        ca = {"ttft_s": {"p50": 0.2, "p95": 2.0, "mean": 0.4}, "errors": 0, "by_worker": {"a": 200}}
        return {"default": rep, "cache_aware": ca, "copies": rows}

    crossed = {"crossed": True, "rate_over": "send_s", "send_s": 0.2, "bytes": 1e6, "usable_s": 1.0}
    rows = [
        {**crossed, "outcome": "proved", "gbit_s": 4.0, "link_ratio": 0.4, "phases_s": {"source": 0.5}},
        {**crossed, "outcome": "proved", "gbit_s": 8.0, "link_ratio": 0.8, "phases_s": {"source": 0.7}},
        {"outcome": "proved", "crossed": False, "usable_s": 2.0, "phases_s": None},
        {"outcome": "proved", "crossed": True, "bytes": 1e6, "usable_s": 2.0, "phases_s": None},
    ]
    s = bench.summarize("l3", [run(1.0, rows[:1]), run(1.5, rows[1:])])
    assert s["default"]["p95"] == 1.25 and s["ratio_p95"] == pytest.approx(0.625)
    assert s["requests_per_worker"] == [[150, 50], [150, 50]]
    assert (
        (s["crossed"]["copies"], s["crossed"]["rated"]) == (3, 2)
        and s["crossed"]["gbit_s"] == 6.0
        and s["crossed"]["link_ratio"] == pytest.approx(0.6)
    )
    assert s["usable_s_median"] == 1.5 and s["phases_s_median"]["source"] == 0.6


def test_hosts_must_spread_the_workers_evenly(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--hosts", "3"])
    assert "--hosts 3" in capsys.readouterr().err


def test_a_machine_without_the_testbed_gets_one_line(monkeypatch, capsys):
    monkeypatch.setattr(bench, "testbed_missing", lambda: "needs root for network namespaces (ip netns)")
    assert bench.main(["--hosts", "2", "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err and "--hosts 2" in err


def test_the_human_report_says_how_close_the_copies_came_to_the_link_rate(monkeypatch, capsys):
    row = {"crossed": True, "rate_over": "send_s", "send_s": 0.25, "bytes": 2.5e8, "gbit_s": 8.0, "link_ratio": 0.8}
    row |= {"outcome": "proved", "usable_s": 1.5, "overlap_s": 0.1, "phases_s": {"source": 1.2, "transfer": 0.3}}
    rep = {"ttft_s": {"p50": 0.1, "p95": 1.0, "mean": 0.5}, "errors": 0, "by_worker": {"a": 100, "b": 100}}
    run = {"default": rep, "cache_aware": rep, "copies": [row]}
    monkeypatch.setattr(bench, "testbed_missing", lambda: None)
    monkeypatch.setattr(bench, "_run_modes", lambda args, tmp: [bench.summarize(m, [run]) for m in ("l3", "push")])
    assert bench.main(["--hosts", "2", "--link-gbit", "10", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("2 hosts x 2 workers, links at 10 Gbit/s; a 16384-token prefix; medians over 1 run(s)")
    assert "p95 x1.00, mean x1.00" in out and "requests per worker [[100, 100]]" in out
    assert "phases source/transfer/proof 1.200/0.300/- s" in out
    assert "1 copies, 1 that sent bytes: 250.000 MB in 0.250 s of send_s, 8.000 Gbit/s (0.80 x the link)" in out


def test_the_warm_source_request_shares_the_bursts_prefix_and_not_its_suffix(tmp_path):
    lines = [
        {"arrival_s": 0.0, "input_length": 768, "output_length": 4, "hash_ids": ["p0", "p1", "s0"]},
        {"arrival_s": 0.02, "input_length": 768, "output_length": 4, "hash_ids": ["p0", "p1", "s1"]},
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    warm = json.loads(bench.warm_source_trace(trace, tmp_path / "w.jsonl").read_text())
    assert warm["hash_ids"][:2] == ["p0", "p1"] and warm["hash_ids"][2] not in ("s0", "s1")
    assert warm["input_length"] == 768 and warm["arrival_s"] == 0.0
