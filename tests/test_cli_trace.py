"""``btbctl trace gen`` and ``btbctl trace audit``: outputs, JSON shapes and one-line errors with exit status 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from btbctl.commands.app import app
from btbctl.engine.trace.generate import BurstedParams
from btbctl.engine.trace.readers import FORMATS, read_trace
from helpers import run_cli as run

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MOONCAKE = DATA / "traces" / "mooncake_conversation_trace.jsonl"

SMALL = ["--bursts", "2", "--burst-size", "20", "--decoys", "3", "--prefix-tokens", "4096"]


def _mooncake_file(tmp_path: Path, n: int = 5) -> Path:
    p = tmp_path / "base.jsonl"
    p.write_text(
        "".join(
            json.dumps({"timestamp": 1000 * i, "input_length": 1000, "output_length": 5, "hash_ids": [0, 100 + i]})
            + "\n"
            for i in range(n)
        )
    )
    return p


# --------------------------------------------------------------------------------------------------------------------
# gen


def test_gen_writes_a_readable_trace_and_one_summary_line(capsys, tmp_path):
    out = tmp_path / "w.jsonl"
    code, stdout, stderr = run(capsys, "trace", "gen", "--out", str(out), *SMALL, "--seed", "3")
    assert code == 0, stderr
    assert stdout == ""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "wrote 43 requests" in lines[0] and str(out) in lines[0]
    t = read_trace(out)
    assert len(t) == 43 and t.format == "btb-mixed-trace-v1"
    assert all(r.input_tokens == 4096 + 256 for r in t.requests)


def test_gen_json_summary(capsys, tmp_path):
    out = tmp_path / "w.jsonl"
    code, stdout, _ = run(capsys, "trace", "gen", "-o", str(out), *SMALL, "--spread-s", "1", "--format", "json")
    assert code == 0
    summary = json.loads(stdout)
    assert list(summary) == ["path", "format", "requests", "span_s", "block_tokens", "kinds", "seed", "base", "params"]
    assert summary["requests"] == 43 and summary["kinds"] == {"burst": 40, "decoy": 3}
    assert summary["params"]["spread_s"] == 1.0 and summary["seed"] == 42 and summary["base"] is None
    assert set(summary["params"]) == {f.name for f in dataclasses.fields(BurstedParams)}


def test_gen_same_seed_same_bytes(capsys, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert run(capsys, "trace", "gen", "--out", str(a), *SMALL)[0] == 0
    assert run(capsys, "trace", "gen", "--out", str(b), *SMALL)[0] == 0
    assert a.read_bytes() == b.read_bytes()


def test_gen_overlay_on_base(capsys, tmp_path):
    base = _mooncake_file(tmp_path)
    out = tmp_path / "ov.jsonl"
    code, stdout, stderr = run(
        capsys,
        "trace",
        "gen",
        "--out",
        str(out),
        *SMALL,
        "--base",
        str(base),
        "--base-format",
        "mooncake",
        "--format",
        "json",
    )
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["block_tokens"] == 512 and summary["requests"] == 48
    assert summary["base"] == {"path": str(base), "format": "mooncake", "requests": 5}
    assert read_trace(out).block_tokens == 512


def test_gen_defaults_match_bursted_params():
    cmd = typer.main.get_command(app).commands["trace"].commands["gen"]
    defaults = {p.name: p.default for p in cmd.params}
    for f in dataclasses.fields(BurstedParams):
        assert defaults[f.name] == f.default, f.name


def test_gen_bad_params_exit_2(capsys, tmp_path):
    code, stdout, stderr = run(capsys, "trace", "gen", "--out", str(tmp_path / "x.jsonl"), "--burst-size", "0")
    assert code == 2 and stdout == ""
    assert stderr.strip() == "btbctl: error: burst_size: must be >= 1, got 0"
    assert not (tmp_path / "x.jsonl").exists()


def test_gen_bad_base_exit_2(capsys, tmp_path):
    base = tmp_path / "base.jsonl"
    base.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    code, _, stderr = run(capsys, "trace", "gen", "--out", str(tmp_path / "x.jsonl"), "--base", str(base))
    assert code == 2 and stderr.startswith(f"btbctl: error: {base}:2: malformed JSON")


# --------------------------------------------------------------------------------------------------------------------
# audit


def test_audit_json(capsys, tmp_path):
    out = tmp_path / "w.jsonl"
    run(capsys, "trace", "gen", "--out", str(out), *SMALL)
    code, stdout, _ = run(
        capsys, "trace", "audit", str(out), "--format", "json", "-k", "16", "-k", "17", "--window-s", "60"
    )
    assert code == 0
    report = json.loads(stdout)
    assert report["path"] == str(out) and report["format"] == "btb-mixed-trace-v1" and report["requests"] == 43
    assert report["fan_out"] == [
        {"k_blocks": 16, "window_s": 60.0, "max_requests": 20, "events": 2},
        {"k_blocks": 17, "window_s": 60.0, "max_requests": 1, "events": 0},
    ]


def test_audit_human_tables(capsys, tmp_path):
    base = _mooncake_file(tmp_path)
    code, stdout, _ = run(capsys, "trace", "audit", str(base), "--trace-format", "mooncake")
    assert code == 0
    assert "requests" in stdout and "fan-out" in stdout and "t = 10 s" in stdout and "(mooncake)" in stdout
    assert "verdict: BTB " in stdout


def test_audit_verdict_follows_the_constants(capsys, tmp_path):
    out = tmp_path / "w.jsonl"
    run(capsys, "trace", "gen", "--out", str(out), *SMALL)
    json_args = ("trace", "audit", str(out), "--format", "json", "--btb-window-s", "60")
    code, stdout, _ = run(capsys, *json_args, "--prefix-blocks", "16")
    assert code == 0
    v = json.loads(stdout)["verdict"]
    assert v["fires"] and (v["prefix_blocks"], v["threshold"], v["window_s"]) == (16, 2, 60.0)
    code, stdout, _ = run(capsys, *json_args, "--prefix-blocks", "17")
    v = json.loads(stdout)["verdict"]
    assert not v["fires"] and v["fires_with_prefix_blocks"] == 16
    code, _, stderr = run(capsys, "trace", "audit", str(out), "--threshold", "0")
    assert code == 2 and "threshold" in stderr


def test_help_names_every_format(capsys):
    code, stdout, _ = run(capsys, "trace", "audit", "--help")
    assert code == 0
    flat = " ".join(stdout.replace("│", " ").split())
    for fmt in FORMATS:
        assert fmt in flat


ERRORS = [
    (
        "malformed",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": \n',
        2,
        "malformed JSON",
    ),
    (
        "missing",
        '{"arrival_s": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n',
        1,
        "missing field 'request_id'",
    ),
    (
        "negative",
        '\n{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}\n',
        2,
        "input_length: must be >= 1",
    ),
    ("empty", "", 1, "no requests"),
    ("unknown", "id,size\n1,2\n", 1, "unknown trace format; valid formats: mooncake"),
]


@pytest.mark.parametrize("content,line,fragment", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_audit_errors_are_one_line_exit_2(capsys, tmp_path, content, line, fragment):
    p = tmp_path / "t.jsonl"
    p.write_text(content)
    code, stdout, stderr = run(capsys, "trace", "audit", str(p))
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith(f"btbctl: error: {p}:{line}: ") and fragment in stderr


def test_audit_unknown_format_name(capsys, tmp_path):
    p = _mooncake_file(tmp_path)
    code, _, stderr = run(capsys, "trace", "audit", str(p), "--trace-format", "parquet")
    assert code == 2 and "unknown trace format 'parquet'" in stderr and "btb-mixed-trace-v1" in stderr


def test_subprocess_error_funnel(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    res = subprocess.run(
        [sys.executable, "-m", "btbctl", "trace", "audit", str(p)], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr == f"btbctl: error: {p}:1: missing field 'hash_ids'\n"


def test_cli_import_does_not_load_trace_engine():
    code = (
        "import sys, btbctl.commands.app; print(sorted(m for m in sys.modules if m.startswith('btbctl.engine.trace.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, timeout=60
    ).stdout.strip()
    assert out == "[]"


@pytest.mark.data
def test_audit_real_mooncake(capsys):
    if not MOONCAKE.exists():
        pytest.skip("public trace not present: mooncake_conversation_trace.jsonl (expected under ../shared/data)")
    code, stdout, _ = run(capsys, "trace", "audit", str(MOONCAKE), "--format", "json", "-k", "16", "-t", "10")
    assert code == 0
    assert json.loads(stdout)["fan_out"] == [{"k_blocks": 16, "window_s": 10.0, "max_requests": 2, "events": 0}]
