"""Trace readers: Mooncake JSONL, btb-mixed-trace-v1 JSONL, Azure 2023 CSV; format detection; every error path."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from btbctl.engine.errors import TraceFormatError
from btbctl.engine.trace.readers import (
    FORMATS,
    detect_format,
    read_azure,
    read_btb_mixed,
    read_mooncake,
    read_trace,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MOONCAKE = DATA / "traces" / "mooncake_conversation_trace.jsonl"
AZURE = DATA / "traces" / "azure2023_conv.csv"


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(content, str):
        content = content.encode("utf-8")
    p.write_bytes(content)
    return p


def _mc(ts, inp=1000, out=10, hashes=(1, 2)) -> str:
    return json.dumps({"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": list(hashes)})


def _bm(arrival, rid, inp=300, out=2, hashes=("a", "b"), **extra) -> str:
    row = {"arrival_s": arrival, "input_length": inp, "output_length": out, "hash_ids": list(hashes), "request_id": rid}
    row.update(extra)
    return json.dumps(row)


# --------------------------------------------------------------------------------------------------------------------
# Mooncake


def test_mooncake_fields_sorting_and_line_ids(tmp_path):
    p = _write(tmp_path, "m.jsonl", "\n".join([_mc(3000, hashes=(7, 8)), "", _mc(1500, 600, 0, (7,))]) + "\n")
    t = read_mooncake(p)
    assert t.format == "mooncake" and t.block_tokens == 512 and t.path == str(p)
    assert [r.request_id for r in t.requests] == ["3", "1"]  # sorted by arrival; ids are physical line numbers
    first, second = t.requests
    assert first.arrival_s == 1.5 and first.input_tokens == 600 and first.block_hashes == (7,)
    assert first.output_tokens == 1  # output 0 is stored as 1
    assert second.arrival_s == 3.0 and second.output_tokens == 10 and second.block_hashes == (7, 8)
    assert all(r.kind == "background" for r in t.requests)


def test_mooncake_accepts_float_timestamps(tmp_path):
    p = _write(tmp_path, "m.jsonl", _mc(1234.5) + "\n")
    assert read_trace(p).requests[0].arrival_s == pytest.approx(1.2345)


# --------------------------------------------------------------------------------------------------------------------
# btb-mixed-trace-v1


def test_btb_mixed_fields_labels_and_kind(tmp_path):
    lines = [
        _bm(2.5, "r1", trace_id="t9", source="art", metadata={"job_kind": "burst", "burst": 3}),
        _bm(0.25, 17, out=0),  # optional fields absent; int request id; output 0 -> 1
        _bm(1.0, "r3", metadata={}),
    ]
    t = read_btb_mixed(_write(tmp_path, "b.jsonl", "\n".join(lines)))
    assert t.format == "btb-mixed-trace-v1" and t.block_tokens == 256
    by_id = {r.request_id: r for r in t.requests}
    assert [r.request_id for r in t.requests] == ["17", "r3", "r1"]
    assert by_id["r1"].kind == "burst"
    assert by_id["r1"].labels == {"burst": 3, "trace_id": "t9", "source": "art"}
    assert by_id["r1"].block_hashes == ("a", "b")
    assert by_id["17"].kind == "background" and by_id["17"].labels is None and by_id["17"].output_tokens == 1
    assert by_id["r3"].labels is None


@pytest.mark.parametrize("key", ["block_tokens", "block_size"])
def test_btb_mixed_block_size_field(tmp_path, key):
    lines = [_bm(0, "a", **{key: 512}), _bm(1, "b"), _bm(2, "c", **{key: 512})]
    assert read_btb_mixed(_write(tmp_path, "b.jsonl", "\n".join(lines))).block_tokens == 512


def test_btb_mixed_equal_hashes_share_one_object(tmp_path):
    t = read_btb_mixed(_write(tmp_path, "b.jsonl", _bm(0, "a") + "\n" + _bm(1, "b")))
    assert t.requests[0].block_hashes[1] is t.requests[1].block_hashes[1]


@pytest.mark.parametrize(
    "rows,line,message",
    [
        # an id under two parents
        ([("a", "b"), ("c", "b")], 2, "hash_ids[1]: 'b' follows 'c' here but follows 'a' on line 1"),
        # a root id that followed another id before
        ([("a", "b"), ("b",)], 2, "hash_ids[0]: 'b' opens the chain here but follows 'a' on line 1"),
        # an id repeated within a row
        ([("a", "b", "a")], 1, "hash_ids[2]: 'a' follows 'b' here but opens the chain on line 1"),
    ],
)
def test_hash_ids_must_be_prefix_chained(tmp_path, rows, line, message):
    text = "\n".join(_bm(i, f"r{i}", hashes=h) for i, h in enumerate(rows))
    with pytest.raises(TraceFormatError) as e:
        read_btb_mixed(_write(tmp_path, "b.jsonl", text))
    assert f"b.jsonl:{line}: {message}; hash_ids must be prefix-chained" in str(e.value)
    mc = "\n".join(_mc(i, hashes=[ord(x) for x in h]) for i, h in enumerate(rows))
    with pytest.raises(TraceFormatError, match=f"m.jsonl:{line}: hash_ids"):
        read_mooncake(_write(tmp_path, "m.jsonl", mc))


def test_prefix_chained_rows_sharing_and_extending_prefixes_are_accepted(tmp_path):
    rows = [("a", "b"), ("a", "b", "c"), ("a", "d"), ("e",), ("a",)]
    t = read_btb_mixed(_write(tmp_path, "b.jsonl", "\n".join(_bm(i, f"r{i}", hashes=h) for i, h in enumerate(rows))))
    assert [r.block_hashes for r in t.requests] == rows


# --------------------------------------------------------------------------------------------------------------------
# Azure 2023


def test_azure_relative_arrivals_and_columns(tmp_path):
    text = (
        "GeneratedTokens,TIMESTAMP,ContextTokens,Extra\n"
        "5,2023-11-16 18:15:47.0000001,100,x\n"
        "0,2023-11-16 18:15:46.6805900,374,y\n"
        "\n"
        "7,2023-11-17 00:00:00,20,z\n"
    )
    t = read_azure(_write(tmp_path, "a.csv", text))
    assert t.format == "azure2023" and t.block_tokens == 512
    assert [r.request_id for r in t.requests] == ["3", "2", "5"]
    a, b, c = t.requests
    assert a.arrival_s == 0.0 and a.input_tokens == 374 and a.output_tokens == 1
    assert b.arrival_s == pytest.approx(0.3194101, abs=1e-9)
    assert c.arrival_s == pytest.approx((24 * 3600 - (18 * 3600 + 15 * 60 + 46.68059)), abs=1e-6)
    assert all(r.block_hashes == () for r in t.requests)


# --------------------------------------------------------------------------------------------------------------------
# detection, gzip, BOM


def test_detection_of_each_format(tmp_path):
    cases = {
        "mooncake": _mc(0),
        "btb-mixed-trace-v1": _bm(0, "a"),
        "azure2023": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2",
    }
    assert set(cases) == set(FORMATS)
    for fmt, text in cases.items():
        p = _write(tmp_path, f"{fmt}.txt", "\n\n" + text + "\n")
        assert read_trace(p).format == fmt
        assert read_trace(p, fmt).format == fmt
        assert detect_format("\n\n" + text) == fmt


def test_gzip_and_bom(tmp_path):
    p = tmp_path / "m.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(_mc(0) + "\n" + _mc(2000) + "\n")
    assert len(read_trace(p)) == 2
    q = _write(tmp_path, "bom.jsonl", "\ufeff" + _mc(0))
    assert read_trace(q).format == "mooncake"
    bad = _write(tmp_path, "bad.jsonl.gz", b"not gzip at all")
    with pytest.raises(TraceFormatError, match="gzip"):
        read_trace(bad)


# --------------------------------------------------------------------------------------------------------------------
# errors: each names the file and the 1-based line


ERROR_CASES = [
    # (id, content, fmt, line, message fragment)
    ("malformed-json", _mc(0) + "\n" + '{"timestamp": 1,', None, 2, "malformed JSON"),
    ("not-an-object", _mc(0) + "\n[1, 2]", None, 2, "expected a JSON object"),
    (
        "missing-timestamp",
        _mc(0) + "\n\n" + '{"input_length": 5, "output_length": 1, "hash_ids": []}',
        "mooncake",
        3,
        "missing field 'timestamp'",
    ),
    (
        "mooncake-missing-hash-ids",
        '{"timestamp": 0, "input_length": 5, "output_length": 1}',
        None,
        1,
        "missing field 'hash_ids'",
    ),
    ("missing-input", '{"timestamp": 0, "output_length": 1, "hash_ids": []}', None, 1, "missing field 'input_length'"),
    (
        "missing-hash-ids",
        _bm(0, "a") + "\n" + '{"arrival_s": 1, "input_length": 5, "output_length": 1, "request_id": "b"}',
        None,
        2,
        "missing field 'hash_ids'",
    ),
    (
        "missing-request-id",
        '{"arrival_s": 1, "input_length": 5, "output_length": 1, "hash_ids": []}',
        None,
        1,
        "missing field 'request_id'",
    ),
    ("string-timestamp", _mc("5"), None, 1, "timestamp: expected a number"),
    ("bool-input", _mc(0, inp=True), None, 1, "input_length: expected an integer"),
    ("float-output", _mc(0, out=2.5), None, 1, "output_length: expected an integer"),
    ("hash-ids-not-list", _mc(0).replace("[1, 2]", '"12"'), None, 1, "hash_ids: expected a list"),
    ("mooncake-string-hash", _mc(0, hashes=(1, "x")), None, 1, "hash_ids[1]: expected an integer"),
    ("btb-int-hash", _bm(0, "a", hashes=("a", 3)), None, 1, "hash_ids[1]: expected a string"),
    ("negative-input", _mc(0, inp=-4), None, 1, "input_length: must be >= 1"),
    ("zero-input", _bm(0, "a", inp=0), None, 1, "input_length: must be >= 1"),
    ("negative-output", _mc(0) + "\n" + _mc(1, out=-1), None, 2, "output_length: must be >= 0"),
    ("negative-timestamp", _mc(-1), None, 1, "timestamp: must be >= 0"),
    ("negative-arrival", _bm(-0.5, "a"), None, 1, "arrival_s: must be >= 0"),
    (
        "nan-arrival",
        '{"arrival_s": NaN, "input_length": 5, "output_length": 1, "hash_ids": [], "request_id": "a"}',
        None,
        1,
        "must be finite",
    ),
    ("huge-timestamp", _mc(10**400), None, 1, "out of range"),
    ("duplicate-request-id", _bm(0, "a") + "\n" + _bm(1, "a"), None, 2, "duplicate 'a' (first seen on line 1)"),
    ("empty-request-id", _bm(0, ""), None, 1, "request_id: must not be empty"),
    ("list-request-id", _bm(0, ["a"]), None, 1, "request_id: expected a string"),
    ("metadata-not-object", _bm(0, "a", metadata="burst"), None, 1, "metadata: expected an object"),
    ("job-kind-not-string", _bm(0, "a", metadata={"job_kind": 3}), None, 1, "metadata.job_kind"),
    (
        "block-size-differs",
        _bm(0, "a", block_tokens=256) + "\n" + _bm(1, "b", block_size=512),
        None,
        2,
        "differs from the block size 256 given on line 1",
    ),
    ("block-size-bad", _bm(0, "a", block_tokens=0), None, 1, "block_tokens: expected an integer >= 1"),
    ("deep-nesting", "{" + '"timestamp": ' + "[" * 100000 + "]" * 100000 + "}", "mooncake", 1, "malformed JSON"),
    ("empty-file", "", None, 1, "no requests"),
    ("blank-lines-only", "\n  \n\n", None, 1, "no requests"),
    ("empty-with-format", "\n\n", "mooncake", 3, "no requests"),
    ("unknown-format", "hello world\n", None, 1, "unknown trace format; valid formats: mooncake"),
    ("unknown-json-object", '{"foo": 1}', None, 1, "unknown trace format: a JSON object with keys 'foo'"),
    (
        "azure-missing-column",
        "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,3",
        "azure2023",
        1,
        "missing column 'GeneratedTokens'",
    ),
    ("azure-header-only", "TIMESTAMP,ContextTokens,GeneratedTokens\n", None, 2, "no requests"),
    (
        "azure-bad-timestamp",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,4\nyesterday,3,4",
        None,
        3,
        "TIMESTAMP: expected",
    ),
    ("azure-bad-date", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-30 18:15:46,3,4", None, 2, "TIMESTAMP"),
    ("azure-bad-hour", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-03 25:15:46,3,4", None, 2, "out of range"),
    (
        "azure-bad-int",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3.5,4",
        None,
        2,
        "ContextTokens: expected an integer",
    ),
    (
        "azure-zero-context",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,4",
        None,
        2,
        "ContextTokens: must be >= 1",
    ),
    (
        "azure-negative-generated",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,-4",
        None,
        2,
        "GeneratedTokens: must be >= 0",
    ),
    (
        "azure-short-row",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3",
        None,
        2,
        "expected 3 columns, got 2",
    ),
]


@pytest.mark.parametrize("content,fmt,line,fragment", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors_name_file_and_line(tmp_path, content, fmt, line, fragment):
    p = _write(tmp_path, "t.txt", content)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p, fmt)
    err = ei.value
    assert err.path == str(p) and err.line == line, str(err)
    assert fragment in str(err)
    assert str(err).startswith(f"{p}:{line}: ")
    assert "\n" not in str(err)


def test_non_utf8_names_the_line(tmp_path):
    p = _write(tmp_path, "t.jsonl", (_mc(0) + "\n" + _mc(1) + "\n").encode() + b'{"timestamp": \xff}\n')
    with pytest.raises(TraceFormatError, match="not UTF-8") as ei:
        read_trace(p)
    assert ei.value.line == 3


def test_file_problems(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(TraceFormatError, match="directory"):
        read_trace(tmp_path)
    p = _write(tmp_path, "m.jsonl", _mc(0))
    with pytest.raises(TraceFormatError, match=r"unknown trace format 'csv'.*azure2023"):
        read_trace(p, "csv")


def test_explicit_format_mismatch_is_a_missing_field(tmp_path):
    p = _write(tmp_path, "m.jsonl", _mc(0))
    with pytest.raises(TraceFormatError, match="missing field 'arrival_s'"):
        read_trace(p, "btb-mixed-trace-v1")


# --------------------------------------------------------------------------------------------------------------------
# fuzzing: nothing but TraceFormatError ever escapes


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _read_or_format_error(path: Path, fmt: str | None):
    try:
        t = read_trace(path, fmt)
    except TraceFormatError as e:
        err = str(e)
    else:
        err = None
    if err is not None:
        assert "\n" not in err and err.startswith(str(path))
        return None
    assert len(t) >= 1
    arrivals = [r.arrival_s for r in t.requests]
    assert arrivals == sorted(arrivals) and all(math.isfinite(a) and a >= 0 for a in arrivals)
    assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in t.requests)
    return t


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.binary(max_size=300), fmt=st.sampled_from((None,) + FORMATS))
def test_fuzz_random_bytes(fuzz_dir, data, fmt):
    p = fuzz_dir / "bytes.jsonl"
    p.write_bytes(data)
    _read_or_format_error(p, fmt)


_json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
)
_json_value = st.recursive(
    _json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
_FIELDS = [
    "timestamp",
    "arrival_s",
    "input_length",
    "output_length",
    "hash_ids",
    "request_id",
    "metadata",
    "trace_id",
    "source",
    "block_tokens",
    "block_size",
]
_field_value = st.one_of(
    _json_value,
    st.integers(-3, 5000),
    st.lists(st.integers(0, 9), max_size=4),
    st.lists(st.text(max_size=3), max_size=4),
    st.fixed_dictionaries({"job_kind": _json_value}),
)
_rows = st.lists(st.dictionaries(st.sampled_from(_FIELDS), _field_value, max_size=len(_FIELDS)), min_size=0, max_size=5)


@FUZZ
@given(rows=_rows, fmt=st.sampled_from((None,) + FORMATS))
def test_fuzz_random_json_rows(fuzz_dir, rows, fmt):
    p = fuzz_dir / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    _read_or_format_error(p, fmt)


@FUZZ
@given(lines=st.lists(st.lists(st.text(max_size=12), min_size=1, max_size=4), max_size=5))
def test_fuzz_random_csv(fuzz_dir, lines):
    p = fuzz_dir / "rows.csv"
    body = "\n".join(",".join(cells) for cells in lines)
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + body, encoding="utf-8")
    _read_or_format_error(p, "azure2023")


# --------------------------------------------------------------------------------------------------------------------
# the public traces in ../shared/data


def _need(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"public trace not present: {path.name} (expected under ../shared/data/traces)")


@pytest.mark.data
def test_real_mooncake():
    _need(MOONCAKE)
    t = read_trace(MOONCAKE)
    assert t.format == "mooncake" and len(t) == 12031 and t.block_tokens == 512
    assert t.span_s == pytest.approx(3536.999)
    assert t.requests[0].request_id == "1" and t.requests[0].block_hashes[:3] == (0, 1, 2)
    # one hash per started 512-token block in this file
    assert all(len(r.block_hashes) == -(-r.input_tokens // 512) for r in t.requests)


@pytest.mark.data
def test_real_azure():
    _need(AZURE)
    t = read_trace(AZURE)
    assert t.format == "azure2023" and len(t) == 19366
    assert t.requests[0].arrival_s == 0.0 and t.requests[0].input_tokens == 374
    # 2023-11-16 18:15:46.6805900 -> 19:14:08.4025270
    assert t.span_s == pytest.approx(58 * 60 + 21.721937, abs=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# the engine stays headless


def test_trace_modules_import_no_ui():
    code = (
        "import sys; import btbctl.engine.trace.readers, btbctl.engine.trace.writer, "
        "btbctl.engine.trace.generate, btbctl.engine.trace.audit; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'textual', 'click') "
        "or m.startswith(('btbctl.commands', 'btbctl.tui'))]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout.strip()
    assert out == "[]"


def test_simulate_refuses_chains_that_are_not_prefix_chained():
    from btbctl.engine.config import ClusterConfig
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.sim import simulate
    from btbctl.engine.trace.model import Request, Trace

    ok = [Request("q0", 0.0, 512, 1, ("a", "b")), Request("q1", 0.1, 768, 1, ("a", "b", "c"))]
    cluster = ClusterConfig(model="qwen3-8b", gpu="h100", gpus_per_replica=1, replicas=2)
    for fidelity in ("realistic", "infersim"):
        assert (
            len(simulate(Trace(list(ok), 256, "generated"), "btb", cluster, BtbConstants(), fidelity=fidelity).records)
            == 2
        )
        bad = Trace([*ok, Request("q2", 0.2, 512, 1, ("x", "b"))], 256, "generated")
        with pytest.raises(
            ConfigError, match=r"request 'q2': block_hashes\[1\] 'b' follows 'x' here but follows 'a' in request 'q0'"
        ):
            simulate(bad, "btb", cluster, BtbConstants(), fidelity=fidelity)
