"""Report: matrix loading and validation, a small matrix run (in process and in workers), Markdown content,
charts or their absence, the CLI."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from btbctl.commands.app import app
from btbctl.engine import report as rp
from btbctl.engine.errors import ConfigError
from ray_helpers import local_ray_fixture

local_ray = local_ray_fixture()

MATRIX = """
title = "small"
notes = "Bursts **hurt**."
setups = ["70b_h100x4", "qwen3_8b_h100x4"]
policies = ["cache_aware", "btb", "btb_plus"]
fidelities = ["infersim", "realistic"]

[btb]
prefix_blocks = 64

[[workloads]]
name = "b1"
description = "two bursts within 1 s"
[workloads.trace.generate]
bursts = 2
burst_size = 30
decoys = 3
spread_s = 1.0
prefix_tokens = 16384

[[workloads]]
name = "file"
description = "a trace file"
[workloads.trace]
path = "small.jsonl"
"""


@pytest.fixture()
def matrix_file(tmp_path):
    from btbctl.engine.trace.generate import BurstedParams, generate_bursted
    from btbctl.engine.trace.writer import write_btb_mixed

    trace = generate_bursted(
        BurstedParams(bursts=1, burst_size=20, decoys=2, spread_s=2.0, prefix_tokens=16384), seed=5
    )
    write_btb_mixed(trace, str(tmp_path / "small.jsonl"))
    path = tmp_path / "m.toml"
    path.write_text(MATRIX)
    return path


def test_matrix_loads_and_resolves_paths(matrix_file):
    m = rp.load_matrix(matrix_file)
    assert m.setups == ["70b_h100x4", "qwen3_8b_h100x4"] and m.btb.prefix_blocks == 64
    assert m.workloads[1].trace.path == str(matrix_file.parent / "small.jsonl")


@pytest.mark.parametrize(
    "edit,key",
    [
        (("70b_h100x4", "70b_a100x1"), "setups"),
        (('"btb_plus"]', '"btb_plus", "fastest"]'), "policies"),
        (('["infersim", "realistic"]', '["exact"]'), "fidelities"),
        (('name = "file"', 'name = "b1"'), "workloads"),
        (('title = "small"', 'title = "small"\ncolour = 3'), "colour"),
        (("spread_s = 1.0", "spread_s = -1.0"), "workloads.0.trace.generate.spread_s"),
    ],
)
def test_bad_matrices_name_the_key(tmp_path, matrix_file, edit, key):
    bad = tmp_path / "bad.toml"
    bad.write_text(MATRIX.replace(*edit))
    with pytest.raises(ConfigError) as err:
        rp.load_matrix(bad)
    assert err.value.key.startswith(key) and err.value.path == str(bad)


def test_missing_trace_file_and_bad_toml(tmp_path):
    (tmp_path / "m.toml").write_text(MATRIX)
    with pytest.raises(ConfigError) as err:
        rp.run_matrix(rp.load_matrix(tmp_path / "m.toml"), jobs=1)
    assert "no such trace file" in str(err.value)
    (tmp_path / "bad.toml").write_text('title = "x"\nseed = = 3\n')
    with pytest.raises(ConfigError) as err:
        rp.load_matrix(tmp_path / "bad.toml")
    assert "line 2" in str(err.value)


def test_small_matrix_run_markdown_and_determinism(matrix_file, tmp_path):
    m = rp.load_matrix(matrix_file)
    seen = []
    one = rp.run_matrix(m, progress=seen.append, jobs=1)
    two = rp.run_matrix(m, jobs=2)
    assert len(one["cells"]) == 2 * 2 * 2 * 3 == len(seen)
    assert list(one["cells"]) == list(two["cells"])  # order and values independent of workers
    c0 = one["cells"][0]
    assert (c0["setup"], c0["workload"], c0["fidelity"], c0["policy"]) == (
        "70b_h100x4",
        "b1",
        "infersim",
        "cache_aware",
    )
    assert set(c0) >= {
        "ttft_s",
        "by_kind",
        "replications",
        "replicated_bytes",
        "wasted_replications",
        "time_to_warm_s",
        "prefix_hit_ratio",
    }
    idx = {(c["setup"], c["workload"], c["fidelity"], c["policy"]): c for c in one["cells"]}
    btb = idx[("70b_h100x4", "b1", "realistic", "btb")]
    assert btb["replications"] > 0 and btb["time_to_warm_s"]["mean"] > 0
    assert 0 <= btb["wasted_replications"] <= btb["replications"]
    assert (
        one["workloads"][0]["prefill_demand"]["70b_h100x4"]
        > one["workloads"][0]["prefill_demand"]["qwen3_8b_h100x4"]
        > 0
    )
    cmp_ = rp.comparison(one, "70b_h100x4", "b1", "realistic")
    assert cmp_["best_other"]["mean"][0] == "cache_aware"  # the only non-BTB policy of this matrix
    assert cmp_["vs_cache_aware"]["mean"] == pytest.approx(
        (cmp_["mean"] - cmp_["cache_aware"]["mean"]) / cmp_["cache_aware"]["mean"]
    )

    md = rp.render_markdown(one, "btbctl report m.toml --out out")
    assert md.startswith("# small\n\nRegenerate with `btbctl report m.toml --out out`")
    assert md == rp.render_markdown(two, "btbctl report m.toml --out out")  # no timings in the Markdown
    assert "### 70b_h100x4 / b1 / realistic" in md and "### qwen3_8b_h100x4 / file / infersim" in md
    assert "| btb_plus |" in md and "wasted" in md and "warm mean" in md and "Published" in md
    assert "## Notes\n\nBursts **hurt**." in md and "| setup | b1 demand | backlog s | file demand |" in md
    assert all(c["drain_s"] >= 0 for c in one["cells"])
    assert "![" not in md


def test_write_report_with_and_without_charts(matrix_file, tmp_path, monkeypatch):
    one = rp.run_matrix(rp.load_matrix(matrix_file), jobs=1)
    out = tmp_path / "out"
    monkeypatch.setattr(rp, "charts_available", lambda: False)
    files = rp.write_report(one, str(out), "cmd")
    assert files["charts"] == [] and "btbctl[report]" in files["charts_skipped"]
    assert os.path.exists(files["markdown"]) and "![" not in open(files["markdown"]).read()
    monkeypatch.undo()
    if not rp.charts_available():
        pytest.skip("matplotlib is not installed")
    files = rp.write_report(one, str(out), "cmd")
    assert len(files["charts"]) == 4 and all(open(p, "rb").read(4) == b"\x89PNG" for p in files["charts"])
    md = open(files["markdown"]).read()
    assert "![TTFT mean and p95 by policy, 70b_h100x4, realistic](70b_h100x4-realistic.png)" in md


def test_cli_report(matrix_file, tmp_path):
    runner = CliRunner()
    out = tmp_path / "rep"
    res = runner.invoke(
        app, ["report", str(matrix_file), "--out", str(out), "-j", "1", "--no-charts", "--format", "json"]
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["cells"] == 24 and summary["charts"] == [] and summary["charts_skipped"] == "disabled"
    text = (out / "README.md").read_text()
    assert f"Regenerate with `btbctl report {matrix_file} --out {out}`" in text
    res = runner.invoke(app, ["report", str(tmp_path / "nope.toml")])
    assert res.exit_code != 0


@pytest.mark.slow  # out of the main suite's three minutes (the longest there)
@pytest.mark.ray
def test_ray_gives_the_same_report_as_the_process_pool(local_ray, matrix_file, tmp_path):
    m = rp.load_matrix(matrix_file)
    pool = rp.run_matrix(m, jobs=2)
    ray = rp.run_matrix(m, ray="local")
    assert pool["timing"]["executor"] == "processes" and ray["timing"]["executor"] == "ray"
    strip = lambda r: json.dumps({k: v for k, v in r.items() if k != "timing"}, indent=2)
    assert strip(pool) == strip(ray)
    # the command: the same Markdown, byte for byte, into the same folder
    runner = CliRunner()
    out = tmp_path / "rep"
    args = ["report", str(matrix_file), "--out", str(out), "--no-charts", "--format", "json"]
    res = runner.invoke(app, args + ["-j", "2"])
    assert res.exit_code == 0, res.output
    md_pool = (out / "README.md").read_bytes()
    res = runner.invoke(app, args + ["--ray"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["timing"]["executor"] == "ray"
    assert (out / "README.md").read_bytes() == md_pool
