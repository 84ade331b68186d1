"""``btbctl dry-run`` end to end on a small generated trace, plus its config loading and error funnel."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from btbctl.engine.dryrun import REQUEST_KEYS, DryRunConfig, GenerateSection, load_dryrun_config, run_dry_run
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies import DEFAULT_POLICIES, POLICIES
from btbctl.engine.trace.generate import BurstedParams
from helpers import run_cli as run

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
#: One burst of 40 requests plus 4 decoys: 44 requests, fast to simulate under every policy.
SMALL = ["--bursts", "1", "--burst-size", "40", "--decoys", "4"]
SMALL_REQUESTS = 44
TOP_KEYS = ["btbctl_version", "fidelity", "seed", "trace", "cluster", "constants", "results", "timing"]


pytestmark = pytest.mark.usefixtures("cli_env")  # fixed terminal width (tests/conftest.py)


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("btbctl: error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, "dry-run", *SMALL, "--format", "json", *argv)
    assert code == 0, err
    return json.loads(out)


def run_config(capsys, tmp_path, name: str, text: str) -> tuple[Path, int, str]:
    """Write ``text`` to ``tmp_path / name`` and run ``dry-run -c`` on it; return (the file, exit code, stderr)."""
    cfg = tmp_path / name
    cfg.write_text(text)
    code, _, err = run(capsys, "dry-run", "-c", str(cfg))
    return cfg, code, err


# -- errors: exit 2, one line, no traceback -----------------------------------------------------------------------


def test_unknown_model_preset(capsys):
    code, out, err = run(capsys, "dry-run", *SMALL, "--model", "llama-9")
    line = assert_one_line_error(code, err, "--model", "'llama-9'", "llama-3.3-70b", "qwen3-8b")
    assert out == ""
    assert line.startswith("btbctl: error: --model: unknown preset")


def test_unknown_gpu_preset(capsys):
    code, _, err = run(capsys, "dry-run", *SMALL, "--gpu", "tpu-v5")
    assert_one_line_error(code, err, "--gpu", "'tpu-v5'", "h100", "b300")


def test_unknown_policy_lists_valid_ones(capsys):
    code, _, err = run(capsys, "dry-run", *SMALL, "--policies", "least_load,fastest")
    assert_one_line_error(code, err, "--policies", "'fastest'", *POLICIES)


def test_model_that_does_not_fit(capsys):
    code, _, err = run(capsys, "dry-run", *SMALL, "--gpus-per-replica", "1")
    assert_one_line_error(code, err, "--gpus-per-replica", "llama-3.3-70b", "h100")


def test_model_that_does_not_fit_from_config_names_file(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "small.toml", '[cluster]\nmodel = "dense-1t"\ngpus_per_replica = 4\n')
    assert_one_line_error(code, err, str(cfg), "cluster.gpus_per_replica", "dense-1t")


def test_bad_toml_key_names_file_key_and_valid_keys(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "typo.toml", 'seed = 7\n\n[cluster]\nmodle = "qwen3-8b"\n')
    line = assert_one_line_error(code, err, str(cfg), "cluster.modle", "valid keys:")
    for key in ("model", "gpu", "gpus_per_replica", "replicas", "nic_gbps"):
        assert key in line.split("valid keys:")[1]


def test_bad_top_level_toml_key(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "typo.toml", 'polices = ["btb"]\n')
    assert_one_line_error(code, err, str(cfg), "polices", "valid keys:", "policies")


def test_bad_toml_value_names_dotted_key(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "value.toml", "[btb]\nthreshold = 0\n")
    assert_one_line_error(code, err, str(cfg), "btb.threshold", "greater than or equal to 1")


def test_toml_syntax_error_names_file_and_line(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "broken.toml", "seed = 1\n[cluster]\nmodel = \n")
    assert_one_line_error(code, err, str(cfg), "line 3", "invalid TOML")


def test_missing_config_file(capsys, tmp_path):
    code, _, err = run(capsys, "dry-run", "-c", str(tmp_path / "nope.toml"))
    assert_one_line_error(code, err, "nope.toml", "cannot read config")


def test_missing_trace_file(capsys, tmp_path):
    code, _, err = run(capsys, "dry-run", "--trace", str(tmp_path / "none.jsonl"))
    assert_one_line_error(code, err, "--trace", "none.jsonl")


def test_unknown_fidelity(capsys):
    code, _, err = run(capsys, "dry-run", *SMALL, "--fidelity", "exact")
    assert_one_line_error(code, err, "--fidelity", "realistic", "infersim")


def test_infersim_fidelity_runs(capsys):
    code, out, err = run(
        capsys, "dry-run", *SMALL, "--policies", "cache_aware", "--format", "json", "--fidelity", "infersim"
    )
    assert code == 0, err
    assert json.loads(out)["fidelity"] == "infersim"


def test_generator_cross_field_rule(capsys, tmp_path):
    cfg, code, err = run_config(capsys, tmp_path, "gen.toml", "[trace.generate]\nfirst_burst_s = 1.0\njitter_s = 2.0\n")
    assert_one_line_error(code, err, str(cfg), "trace.generate.jitter_s")


def test_unwritable_requests_out(capsys, tmp_path):
    code, _, err = run(
        capsys, "dry-run", *SMALL, "--policies", "btb", "--requests-out", str(tmp_path / "no-such-dir" / "r.jsonl")
    )
    assert_one_line_error(code, err, "--requests-out", "no-such-dir")


def test_error_funnel_in_a_real_process(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BTBCTL_DEBUG"}
    cmd = [sys.executable, "-m", "btbctl", "dry-run", "--model", "gpt-17"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("btbctl: error: --model: unknown preset 'gpt-17'")
    assert len(proc.stderr.strip().splitlines()) == 1
    debug = subprocess.run(cmd, capture_output=True, text=True, env={**env, "BTBCTL_DEBUG": "1"}, cwd=REPO, timeout=60)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr and "ConfigError" in debug.stderr


# -- JSON report ----------------------------------------------------------------------------------------------------


def test_json_report_has_exactly_the_schema(capsys):
    r = run_json(capsys)
    assert list(r) == TOP_KEYS
    assert list(r["trace"]) == ["path", "format", "requests", "span_s", "block_tokens"]
    assert list(r["cluster"]) == ["model", "gpu", "gpus_per_replica", "replicas", "nic_gbps"]
    assert list(r["constants"]) == ["prefix_blocks", "threshold", "window_s", "warm_replicas"]
    assert list(r["timing"]) == ["wall_s", "requests_per_s"]
    assert r["trace"] == {
        "path": None,
        "format": "generated",
        "requests": SMALL_REQUESTS,
        "span_s": r["trace"]["span_s"],
        "block_tokens": 256,
    }
    assert r["trace"]["span_s"] > 0
    assert r["cluster"] == {
        "model": "llama-3.3-70b",
        "gpu": "h100",
        "gpus_per_replica": 4,
        "replicas": 4,
        "nic_gbps": 400.0,
    }
    assert r["constants"] == {"prefix_blocks": 256, "threshold": 2, "window_s": 1.0, "warm_replicas": 4}
    assert r["fidelity"] == "realistic" and r["seed"] == 42
    assert [s["policy"] for s in r["results"]] == list(DEFAULT_POLICIES)
    for s in r["results"]:
        assert list(s) == [
            "policy",
            "requests",
            "ttft_s",
            "by_kind",
            "prefix_hit_ratio",
            "replications",
            "replicated_bytes",
            "recomputed_prefix_tokens",
        ]
        assert list(s["ttft_s"]) == ["mean", "p50", "p95", "p99", "max"]
        assert s["requests"] == SMALL_REQUESTS
        assert set(s["by_kind"]) == {"burst", "decoy"}
        assert s["by_kind"]["burst"]["requests"] == 40
        t = s["ttft_s"]
        assert 0 < t["p50"] <= t["p95"] <= t["p99"] <= t["max"]
    assert r["timing"]["wall_s"] > 0


def test_floats_are_rounded_to_six_significant_digits(capsys):
    r = run_json(capsys)

    def floats(o):
        if isinstance(o, float):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from floats(v)
        elif isinstance(o, list):
            for v in o:
                yield from floats(v)

    body = {k: v for k, v in r.items() if k != "timing"}
    values = list(floats(body))
    assert values
    for x in values:
        assert float(f"{x:.6g}") == x


def test_policy_order_and_flags_are_reported(capsys):
    r = run_json(
        capsys,
        "--policies",
        "btb, round_robin",
        "--model",
        "qwen3-8b",
        "--gpu",
        "h200",
        "--gpus-per-replica",
        "1",
        "--replicas",
        "3",
        "--nic-gbps",
        "200",
        "--prefix-blocks",
        "128",
        "--threshold",
        "3",
        "--window-s",
        "0.5",
        "--btb-replicas",
        "2",
        "--seed",
        "7",
    )
    assert [s["policy"] for s in r["results"]] == ["btb", "round_robin"]
    assert r["cluster"] == {"model": "qwen3-8b", "gpu": "h200", "gpus_per_replica": 1, "replicas": 3, "nic_gbps": 200.0}
    assert r["constants"] == {"prefix_blocks": 128, "threshold": 3, "window_s": 0.5, "warm_replicas": 2}
    assert r["seed"] == 7


def test_same_inputs_give_identical_json_except_timing(capsys):
    code1, out1, _ = run(capsys, "dry-run", *SMALL, "--spread-s", "1", "--format", "json")
    code2, out2, _ = run(capsys, "dry-run", *SMALL, "--spread-s", "1", "--format", "json")
    assert code1 == code2 == 0
    a, b = json.loads(out1), json.loads(out2)
    a.pop("timing"), b.pop("timing")
    assert json.dumps(a) == json.dumps(b)
    # and the inputs matter: another seed moves the decoys
    other = run_json(capsys, "--spread-s", "1", "--seed", "43")
    other.pop("timing")
    assert json.dumps(other) != json.dumps(a)


def test_requests_out_has_one_line_per_request_per_policy(capsys, tmp_path):
    path = tmp_path / "requests.jsonl"
    r = run_json(capsys, "--policies", "least_load,cache_aware,btb", "--requests-out", str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 * SMALL_REQUESTS
    assert all(list(row) == list(REQUEST_KEYS) for row in rows)
    by_policy: dict[str, list[dict]] = {}
    for row in rows:
        by_policy.setdefault(row["policy"], []).append(row)
    assert list(by_policy) == ["least_load", "cache_aware", "btb"]
    for policy, prows in by_policy.items():
        assert len({row["request_id"] for row in prows}) == SMALL_REQUESTS
        assert all(0 <= row["replica"] < 4 and row["ttft_s"] > 0 for row in prows)
        assert sum(row["kind"] == "burst" for row in prows) == 40
        summary = next(s for s in r["results"] if s["policy"] == policy)
        assert max(row["ttft_s"] for row in prows) == pytest.approx(summary["ttft_s"]["max"], rel=1e-5)


def test_spread_s_1_is_the_adversarial_variant(capsys):
    slow = run_json(capsys, "--policies", "cache_aware")
    fast = run_json(capsys, "--policies", "cache_aware", "--spread-s", "1")
    # 40 requests within 1 s instead of 60 s: the same work queues up
    assert fast["results"][0]["ttft_s"]["mean"] > slow["results"][0]["ttft_s"]["mean"]


# -- human output ---------------------------------------------------------------------------------------------------


def test_human_output_has_header_tables_and_chart(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, "dry-run", *SMALL)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("trace: generated Bursted window")
    for needle in (
        "fleet: 4 x llama-3.3-70b on 4 x h100",
        "prefix_blocks=256",
        "fidelity: realistic",
        "TTFT by policy",
        "TTFT by request kind",
        "TTFT per policy, seconds",
    ):
        assert needle in out, needle
    for policy in DEFAULT_POLICIES:
        assert any(line.startswith(policy + " ") for line in lines), policy
    assert max(len(line) for line in lines) <= 80


# -- config files ---------------------------------------------------------------------------------------------------


def test_flags_override_config_values(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'seed = 5\npolicies = ["btb"]\n[cluster]\nreplicas = 2\nmodel = "qwen3-8b"\ngpus_per_replica = 1\n'
        "[trace.generate]\nbursts = 1\nburst_size = 20\ndecoys = 2\n"
    )
    code, out, err = run(capsys, "dry-run", "-c", str(cfg), "--replicas", "3", "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert r["cluster"]["replicas"] == 3 and r["cluster"]["model"] == "qwen3-8b"
    assert r["seed"] == 5 and [s["policy"] for s in r["results"]] == ["btb"]
    assert r["trace"]["requests"] == 22
    # a flag for the generator merges with the file's generate section
    code, out, err = run(capsys, "dry-run", "-c", str(cfg), "--burst-size", "10", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["trace"]["requests"] == 12


def _write_mooncake(path: Path, n: int = 30) -> None:
    rows = [
        {"timestamp": 100 * i, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3 + (i % 3)]}
        for i in range(n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_relative_trace_path_resolves_against_config_folder(capsys, tmp_path, monkeypatch):
    trace = tmp_path / "proj" / "traces" / "tiny.jsonl"
    _write_mooncake(trace)
    cfg = tmp_path / "proj" / "configs" / "tiny.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text(
        'policies = ["least_load", "cache_aware"]\n[trace]\npath = "../traces/tiny.jsonl"\n'
        'format = "mooncake"\n[btb]\nprefix_blocks = 2\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(capsys, "dry-run", "-c", str(cfg), "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert Path(r["trace"]["path"]).resolve() == trace.resolve()
    assert r["trace"]["format"] == "mooncake"
    assert r["trace"]["requests"] == 30 and r["trace"]["block_tokens"] == 512
    assert r["trace"]["span_s"] == pytest.approx(2.9)
    assert all(s["by_kind"].keys() == {"background"} for s in r["results"])
    # --trace on the command line is relative to the current directory and replaces the file's path
    _write_mooncake(elsewhere / "local.jsonl", n=12)
    code, out, err = run(capsys, "dry-run", "-c", str(cfg), "--trace", "local.jsonl", "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert r["trace"]["path"] == "local.jsonl" and r["trace"]["requests"] == 12


def test_overlay_adds_generated_window_to_a_file(tmp_path):
    trace = tmp_path / "base.jsonl"
    _write_mooncake(trace, n=10)
    cfg_file = tmp_path / "overlay.toml"
    cfg_file.write_text(
        'policies = ["btb"]\n[trace]\npath = "base.jsonl"\noverlay = true\n'
        "[trace.generate]\nbursts = 1\nburst_size = 8\ndecoys = 1\nprefix_tokens = 4096\n"
    )
    cfg = load_dryrun_config(cfg_file)
    r = run_dry_run(cfg)
    assert r["trace"]["format"] == "mooncake+generated"
    assert r["trace"]["requests"] == 10 + 9
    assert r["trace"]["block_tokens"] == 512


def test_generate_section_with_a_path_needs_overlay(tmp_path):
    cfg_file = tmp_path / "both.toml"
    cfg_file.write_text('[trace]\npath = "x.jsonl"\n[trace.generate]\nspread_s = 1.0\n')
    with pytest.raises(ConfigError, match="overlay") as ei:
        load_dryrun_config(cfg_file)
    assert str(cfg_file) in str(ei.value)


def test_generate_section_mirrors_bursted_params():
    fields = {f.name: f.default for f in dataclasses.fields(BurstedParams)}
    assert list(GenerateSection.model_fields) == list(fields)
    assert GenerateSection().model_dump() == fields
    assert GenerateSection().params() == BurstedParams()
    for name, info in GenerateSection.model_fields.items():
        assert info.description, f"trace.generate.{name} has no docstring"


def test_every_config_field_has_a_docstring():
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.dryrun import TraceSource

    for model in (DryRunConfig, TraceSource, BtbConstants, GenerateSection):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name}"


def test_progress_reports_every_simulated_request(tmp_path):
    cfg = DryRunConfig().with_overrides(
        {
            "trace.generate.bursts": 1,
            "trace.generate.burst_size": 10,
            "trace.generate.decoys": 2,
            "policies": ["round_robin", "btb"],
        }
    )
    seen: list[int] = []
    run_dry_run(cfg, progress=seen.append)
    assert sum(seen) == 2 * 12


def test_bad_cluster_fails_before_any_simulation(monkeypatch):
    import btbctl.engine.sim as sim

    def must_not_run(*a, **k):
        raise AssertionError("simulated before checking the cluster")

    monkeypatch.setattr(sim, "simulate", must_not_run)
    cfg = DryRunConfig().model_copy(
        update={"cluster": DryRunConfig().cluster.model_copy(update={"gpus_per_replica": 1})}
    )
    with pytest.raises(ConfigError, match=r"cluster\.gpus_per_replica"):
        run_dry_run(cfg)


# -- examples -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dryrun-default.toml", "dryrun-adversarial-1s.toml", "dryrun-mooncake.toml"])
def test_example_configs_load(name):
    cfg = load_dryrun_config(EXAMPLES / name)
    assert cfg.policies
    if name == "dryrun-default.toml":
        assert cfg.model_dump() == DryRunConfig().model_dump()
    if name == "dryrun-adversarial-1s.toml":
        assert cfg.trace.generate.spread_s == 1.0
    if name == "dryrun-mooncake.toml":
        assert Path(cfg.trace.path) == (EXAMPLES / "traces" / "mooncake_conversation_trace.jsonl")
        assert cfg.trace.format == "mooncake"


def test_examples_readme_lists_every_example():
    text = (EXAMPLES / "README.md").read_text()
    tomls = sorted(EXAMPLES.glob("*.toml"))
    assert tomls
    for toml in tomls:
        if toml.name.startswith("cluster-"):
            command = "btbctl up -d -c"
        elif toml.name.endswith("-matrix.toml"):  # experiment matrices for `btbctl report`
            command = "btbctl report"
        else:
            command = "btbctl dry-run -c"
        assert f"{command} examples/{toml.name}" in text, toml.name


SHARED_MOONCAKE = REPO.parent / "shared" / "data" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.data
@pytest.mark.skipif(not SHARED_MOONCAKE.is_file(), reason="public Mooncake trace not in ../shared/data/traces")
def test_mooncake_example_on_the_public_trace(capsys):
    code, out, err = run(
        capsys,
        "dry-run",
        "-c",
        str(EXAMPLES / "dryrun-mooncake.toml"),
        "--trace",
        str(SHARED_MOONCAKE),
        "--policies",
        "round_robin,cache_aware",
        "--format",
        "json",
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["trace"]["format"] == "mooncake" and r["trace"]["requests"] == 12031
    assert r["trace"]["block_tokens"] == 512 and r["cluster"]["replicas"] == 8
    rr, ca = r["results"]
    # the trace reuses prefixes across requests, so routing by prefix finds more of them in cache
    assert 0 < rr["prefix_hit_ratio"] < ca["prefix_hit_ratio"]


def test_cli_import_leaves_the_engine_for_later():
    probe = (
        "import sys, btbctl.commands.app; "
        "print(sorted(m for m in ('btbctl.engine.sim', 'btbctl.engine.dryrun', 'btbctl.engine.policies', "
        "'plotext') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_shows_defaults_and_the_two_replica_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run(capsys, "dry-run", "--help")
    assert code == 0
    for needle in (
        "--config",
        "--warm-replicas",
        "--btb-replicas",
        "--replicas",
        "--spread-s",
        "--requests-out",
        "(default: 4)",
        "not the fleet size",
    ):
        assert needle in out, needle


def test_fabric_preset_sets_the_nic_rate(capsys):
    from btbctl.engine.costmodel import FABRICS

    r = run_json(capsys, "--policies", "least_load", "--fabric", "tcp")
    assert r["cluster"]["nic_gbps"] * 1e9 / 8 * r["cluster"]["gpus_per_replica"] == pytest.approx(FABRICS["tcp"])
    code, _, err = run(capsys, "dry-run", *SMALL, "--fabric", "carrier-pigeon")
    assert_one_line_error(code, err, "--fabric", "unknown fabric", "rdma-8x400g")
    code, _, err = run(capsys, "dry-run", *SMALL, "--fabric", "tcp", "--nic-gbps", "100")
    assert_one_line_error(code, err, "--fabric", "not both")


def test_a_note_says_when_the_btb_detector_never_fired(capsys):
    code, out, err = run(capsys, "dry-run", *SMALL, "--spread-s", "600", "--policies", "least_load,btb")
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "btb made no copy" in notes[0] and "never fired" in notes[0]
    code, out, err = run(capsys, "dry-run", *SMALL, "--spread-s", "1", "--policies", "least_load,btb")
    assert code == 0 and "never fired" not in out
