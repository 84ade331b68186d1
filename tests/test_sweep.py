"""Sweep: grid expansion and validation, determinism across worker counts, ranking, heatmaps, the CLI."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from btbctl.commands.app import app
from btbctl.engine.dryrun import DryRunConfig
from btbctl.engine.errors import ConfigError
from btbctl.engine.sweep import AXES, SweepGrid, SweepSpec, grid_points, heatmap, parse_list, run_sweep
from ray_helpers import local_ray_fixture

SMALL = {
    "trace.generate.bursts": 2,
    "trace.generate.burst_size": 24,
    "trace.generate.decoys": 3,
    "trace.generate.spread_s": 1.0,
    "policies": ["btb"],
}


def base(**extra) -> DryRunConfig:
    return DryRunConfig().with_overrides({**SMALL, **extra})


local_ray = local_ray_fixture()

GRID = SweepGrid(prefix_blocks=(64, 256), threshold=(2, 8), warm_replicas=(1, 4))


def test_grid_expands_in_axis_order_with_base_values_for_missing_axes():
    axes = GRID.axes(base())
    assert list(axes) == list(AXES)
    assert axes["window_s"] == [1.0] and axes["replicas"] == [4] and axes["policy"] == ["btb"]
    points = grid_points(axes)
    assert len(points) == 8
    assert points[0]["prefix_blocks"] == 64 and points[0]["warm_replicas"] == 1
    assert points[1]["warm_replicas"] == 4  # the last axis varies fastest
    assert points[-1]["prefix_blocks"] == 256 and points[-1]["threshold"] == 8
    assert SweepGrid(threshold=(2, 2, 3)).axes(base())["threshold"] == [2, 3]  # duplicates dropped


@pytest.mark.parametrize(
    "grid,key",
    [
        (SweepGrid(prefix_blocks=(0,)), "prefix_blocks"),
        (SweepGrid(threshold=(1.5,)), "threshold"),
        (SweepGrid(window_s=(0,)), "window_s"),
        (SweepGrid(replicas=(2000,)), "replicas"),
        (SweepGrid(nic_gbps=(-1,)), "nic_gbps"),
        (SweepGrid(fidelity=("exact",)), "fidelity"),
        (SweepGrid(policy=("fastest",)), "policy"),
    ],
)
def test_bad_axis_values_name_the_axis(grid, key):
    with pytest.raises(ConfigError) as err:
        SweepSpec(base=base(), grid=grid).validate()
    assert err.value.key == key


def test_bad_spec_settings_and_unrunnable_fleets_fail_before_simulating():
    with pytest.raises(ConfigError) as err:
        SweepSpec(base=base(), rank_by="p99").validate()
    assert err.value.key == "rank_by"
    with pytest.raises(ConfigError) as err:
        SweepSpec(base=base(), jobs=0).validate()
    assert err.value.key == "jobs"
    tiny = base(**{"cluster.gpus_per_replica": 1})  # 70B weights do not fit one H100
    with pytest.raises(ConfigError):
        SweepSpec(base=tiny).validate()
    assert parse_list("threshold", "2, 4,,8", int) == (2, 4, 8)
    with pytest.raises(ConfigError) as err:
        parse_list("window_s", "1,x", float)
    assert err.value.key == "window_s"


def _strip(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "timing"}


def test_results_do_not_depend_on_worker_count_or_scheduling():
    spec1 = SweepSpec(base=base(), grid=GRID, jobs=1)
    spec2 = SweepSpec(base=base(), grid=GRID, jobs=2)
    seen = []
    one = run_sweep(spec1, progress=seen.append)
    two = run_sweep(spec2)
    assert seen == [1] * 8
    assert json.dumps(_strip(one), sort_keys=True) == json.dumps(_strip(two), sort_keys=True)
    assert two["timing"]["jobs"] == 2
    # a different seed is a different experiment
    other = run_sweep(SweepSpec(base=base(seed=7), grid=GRID, jobs=1))
    assert _strip(other) != _strip(one)


def test_ranking_and_stable_keys():
    rep = run_sweep(SweepSpec(base=base(), grid=GRID, jobs=1, rank_by="p95"))
    assert list(rep) == ["btbctl_version", "seed", "rank_by", "trace", "cluster", "axes", "points", "results", "timing"]
    rows = rep["results"]
    assert [r["rank"] for r in rows] == list(range(1, 9))
    assert sorted(r["index"] for r in rows) == list(range(8))
    p95 = [r["ttft_s"]["p95"] for r in rows]
    assert p95 == sorted(p95)
    assert list(rows[0]) == [
        "rank",
        "index",
        "point",
        "ttft_s",
        "by_kind",
        "prefix_hit_ratio",
        "replications",
        "replicated_bytes",
        "wasted_replications",
        "time_to_warm_mean_s",
    ]
    assert set(rows[0]["point"]) == set(AXES)
    # M = 1 never copies; M = 4 on the published prefix copies
    by_point = {(r["point"]["prefix_blocks"], r["point"]["threshold"], r["point"]["warm_replicas"]): r for r in rows}
    assert all(r["replications"] == 0 for k, r in by_point.items() if k[2] == 1)
    assert by_point[(256, 2, 4)]["replications"] > 0


def test_heatmap_takes_the_best_over_other_axes():
    rep = run_sweep(SweepSpec(base=base(), grid=GRID, jobs=1))
    hm = heatmap(rep, "threshold", "prefix_blocks")
    assert hm["x"] == [2, 8] and hm["y"] == [64, 256] and hm["metric"] == "mean"
    for j, y in enumerate(hm["y"]):
        for i, x in enumerate(hm["x"]):
            cell = [
                r["ttft_s"]["mean"]
                for r in rep["results"]
                if r["point"]["threshold"] == x and r["point"]["prefix_blocks"] == y
            ]
            assert hm["values"][j][i] == min(cell)
    with pytest.raises(ConfigError):
        heatmap(rep, "threshold", "threshold")
    with pytest.raises(ConfigError):
        heatmap(rep, "colour", "threshold")


def test_cli_json_heatmap_and_errors(capsys):
    runner = CliRunner()
    args = [
        "sweep",
        "--bursts",
        "2",
        "--burst-size",
        "24",
        "--decoys",
        "3",
        "--spread-s",
        "1",
        "--prefix-blocks",
        "64,256",
        "--threshold",
        "2,8",
        "--policies",
        "btb,btb_plus",
        "-j",
        "1",
    ]
    res = runner.invoke(app, args + ["--format", "json", "--heatmap", "prefix_blocks,policy"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["points"] == 8 and rep["axes"]["policy"] == ["btb", "btb_plus"]
    assert rep["heatmap"]["x_axis"] == "prefix_blocks" and len(rep["heatmap"]["values"]) == 2
    res = runner.invoke(app, args + ["--top", "2", "--heatmap", "threshold,prefix_blocks"])
    assert res.exit_code == 0, res.output
    assert "TTFT by grid point" in res.stdout and "6 more" in res.stdout and "best TTFT mean" in res.stdout
    from btbctl.commands.app import main

    for bad, flag in (
        (["--threshold", "0"], "--threshold"),
        (["--heatmap", "threshold"], "--heatmap"),
        (["--rank-by", "p42"], "--rank-by"),
        (["--window-s", "a"], "--window-s"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["sweep", "--bursts", "1", *bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"btbctl: error: {flag}: ") and err.count("\n") == 1, err


@pytest.mark.slow  # out of the main suite's three minutes (the longest there)
@pytest.mark.ray
def test_ray_gives_the_same_json_as_the_process_pool(local_ray):
    runner = CliRunner()
    args = ["sweep", "--bursts", "2", "--burst-size", "24", "--decoys", "3", "--spread-s", "1"]
    args += ["--prefix-blocks", "64,256", "--threshold", "2,8", "--policies", "btb,btb_plus", "--format", "json"]
    pool = runner.invoke(app, args + ["-j", "2"])
    ray = runner.invoke(app, args + ["--ray"])
    assert pool.exit_code == 0, pool.output
    assert ray.exit_code == 0, ray.output
    one, two = json.loads(pool.stdout), json.loads(ray.stdout)
    assert one["timing"]["executor"] == "processes" and two["timing"]["executor"] == "ray"
    assert two["timing"]["jobs"] == 2  # the Ray's CPUs
    # everything but the timing, byte for byte as printed
    assert json.dumps(_strip(one), indent=2) == json.dumps(_strip(two), indent=2)
