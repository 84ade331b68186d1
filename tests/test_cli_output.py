"""Human output as an operator meets it: piped output is never broken at 80 columns, charts read without colour."""

from __future__ import annotations

import os
import subprocess
import sys

from btbctl.commands.dryrun import CHART_SERIES, ttft_chart
from btbctl.commands.output import PIPE_WIDTH, make_console
from btbctl.commands.sweep import HEAT_SHADES, heatmap_chart


def test_piped_console_does_not_wrap(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    con = make_console()  # under pytest stdout is not a terminal
    assert not con.is_terminal and con.width == PIPE_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100  # asked for


def test_piped_dry_run_lines_are_not_broken(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    long_dir = tmp_path / ("a-rather-long-folder-name-" * 3)
    long_dir.mkdir()
    trace = long_dir / "t.jsonl"
    gen = [sys.executable, "-c", "from btbctl.commands.app import main; main()"]
    subprocess.run(
        [*gen, "trace", "gen", "--out", str(trace), "--bursts", "1", "--burst-size", "20"], check=True, env=env
    )
    proc = subprocess.run(
        [*gen, "dry-run", "--trace", str(trace), "--policies", "btb"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    first = proc.stdout.splitlines()[0]
    assert first.startswith("trace: ") and str(trace) in first and len(first) > 80  # one line, not wrapped


def test_ttft_chart_has_a_glyph_per_percentile():
    r = {
        "results": [
            {"policy": "a", "ttft_s": {"p50": 1.0, "p95": 2.0, "p99": 4.0}},
            {"policy": "bb", "ttft_s": {"p50": 0.5, "p95": 1.0, "p99": 1.5}},
        ]
    }
    text = ttft_chart(r, width=60)
    plain = text.plain.splitlines()
    glyphs = [g for _, g, _ in CHART_SERIES]
    assert len(set(glyphs)) == 3 and all(g in plain[0] for g in glyphs)  # the legend
    assert len(plain) == 1 + 2 * 3 and max(len(ln) for ln in plain[1:]) <= 60
    for line, (q, g, _) in zip(plain[1:4], CHART_SERIES, strict=True):
        assert f" {q} " in line and g in line
    assert plain[3].count("█") > plain[2].count("▒") > plain[1].count("░")  # one scale
    assert {s.style for s in text.spans} >= {c for _, _, c in CHART_SERIES}  # and colours where shown


def test_heatmap_shades_by_value_with_a_legend():
    hm = {
        "metric": "mean",
        "x_axis": "threshold",
        "y_axis": "prefix_blocks",
        "x": [2, 4],
        "y": [64, 256],
        "values": [[1.0, 2.0], [3.0, None]],
    }
    plain = heatmap_chart(hm).plain.splitlines()
    best, worst = HEAT_SHADES[0][0], HEAT_SHADES[-1][0]
    assert best in plain[2] and "1.000" in plain[2] and worst in plain[3] and "-" in plain[3]
    assert plain[-1].startswith("shades: ") and "lower is better" in plain[-1]


def test_progress_lines_when_piped(capsys):
    from btbctl.commands.output import Output

    out = Output()
    with out.progress("running 20 simulations", 20, lines_when_piped=True) as advance:
        for _ in range(20):
            advance(1)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "running 20 simulations: 2/20 (10%)" and err[-1] == "running 20 simulations: 20/20 (100%)"
    assert len(err) == 10
    with out.progress("quiet by default", 5) as advance:
        advance(5)
    assert capsys.readouterr().err == ""


def test_replicate_says_the_modelled_kv_size_and_the_byte_scale():
    from btbctl.commands.steer import copy_size
    from btbctl.engine.wording import human_bytes

    assert human_bytes(1_342_177_280) == "1.34 GB" and human_bytes(20480) == "20.5 kB" and human_bytes(12) == "12 B"
    assert copy_size(20480, 1_342_177_280, 65536) == "1.34 GB modelled (20.5 kB moved, KV bytes scaled 1/65,536)"
    assert copy_size(20480, 1_342_177_280, 1) == "1.34 GB copied"
    assert copy_size(2_000_000, None, None) == "2 MB copied"
    # several copies: the sizes are of all of them together, and say so
    assert (
        copy_size(61440, 4_026_531_840, 65536, 3) == "4.03 GB modelled in all (61.4 kB moved, KV bytes scaled 1/65,536)"
    )


def test_counts_agree_with_their_nouns():
    from btbctl.engine.wording import plural

    assert plural(1, "request") == "1 request" and plural(0, "request") == "0 requests"
    assert plural(2, "copy", "copies") == "2 copies" and plural(1024, "worker") == "1,024 workers"


def _bench_result(**kw) -> dict:
    base = {
        "target": "http://127.0.0.1:30080",
        "endpoint": "generate",
        "requests": 1,
        "ok": 1,
        "errors": 0,
        "errors_by_status": {},
        "duration_s": 0.5,
        "ttft_s": dict.fromkeys(("mean", "p50", "p95", "p99", "max"), 0.01),
        "e2e_s": dict.fromkeys(("mean", "p50", "p95", "p99", "max"), 0.02),
        "by_worker": {"http://127.0.0.1:40001": 1},
        "copies": [
            {
                "copy_id": "0123456789ab",
                "source": "http://127.0.0.1:40001",
                "target": "http://127.0.0.1:40002",
                "state": "done",
                "bytes": 20480,
                "duration_s": 0.01,
                "proof_storage_tokens": None,
            }
        ],
    }
    return {**base, **kw}


def test_bench_names_workers_and_counts_in_the_singular(capsys):
    from btbctl.commands.bench import _render
    from btbctl.commands.output import Output

    names = {"http://127.0.0.1:40001": "worker-0", "http://127.0.0.1:40002": "worker-1"}
    _render(Output(), _bench_result(), names)
    text = capsys.readouterr().out
    assert text.startswith("1 request to http://127.0.0.1:30080 (generate): 1 ok, 0 errors"), text
    assert "worker-0" in text and "worker-1" in text and ":40001" not in text and ":40002" not in text
    assert "20.5 kB" in text and "20480" not in text  # sizes in decimal units, as everywhere else
    _render(Output(), _bench_result(requests=3, ok=2, errors=1, errors_by_status={"503": 1}), {})
    text = capsys.readouterr().out
    assert text.startswith("3 requests to ") and "2 ok, 1 error (503: 1)" in text
    assert "http://127.0.0.1:40001" in text  # no name known: the URL
