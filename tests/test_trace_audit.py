"""The trace audit: rates, token statistics and fan-out (checked against a brute-force reading of its definition)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.errors import ConfigError
from btbctl.engine.trace.audit import audit_trace, btb_verdict, max_in_window
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.model import Request, Trace
from btbctl.engine.trace.readers import read_trace

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MOONCAKE = DATA / "traces" / "mooncake_conversation_trace.jsonl"


def _trace(rows, block_tokens=16) -> Trace:
    """rows: (arrival_s, hashes[, kind])."""
    reqs = [
        Request(str(i), row[0], 10 + i, 1 + i, tuple(row[1]), *(row[2:] or ["background"]))
        for i, row in enumerate(rows)
    ]
    return Trace(reqs, block_tokens, "generated")


def _entry(report, k, t):
    [e] = [e for e in report["fan_out"] if e["k_blocks"] == k and e["window_s"] == t]
    return e


def test_keys_are_stable():
    r = audit_trace(_trace([(0.0, "ab"), (2.0, "ac")]))
    assert list(r) == [
        "requests",
        "span_s",
        "block_tokens",
        "rate_rps",
        "input_tokens",
        "output_tokens",
        "kinds",
        "event_min_requests",
        "fan_out",
    ]
    assert list(r["rate_rps"]) == ["mean", "peak_1s"]
    assert list(r["input_tokens"]) == list(r["output_tokens"]) == ["mean", "p50", "p95", "max"]
    assert [(e["k_blocks"], e["window_s"]) for e in r["fan_out"]] == [
        (k, t) for k in (1, 16, 64, 256) for t in (1.0, 10.0, 60.0)
    ]
    assert all(list(e) == ["k_blocks", "window_s", "max_requests", "events"] for e in r["fan_out"])


def test_fan_out_window_is_half_open_and_prefix_deep():
    rows = [
        (0.0, ["a", "a1", "a1x"]),
        (0.5, ["a", "a1", "a1y"]),
        (1.0, ["a", "a1"]),  # exactly 1 s after the first: outside [0, 1)
        (1.2, ["a", "a2", "a2x"]),
        (1.3, ["b"]),
    ]
    r = audit_trace(_trace(rows), ks=(1, 2, 3, 4), windows_s=(1.0, 2.0), event_min_requests=3)
    assert _entry(r, 1, 1.0)["max_requests"] == 3  # "a" at 0.5, 1.0, 1.2 ("b" is another prefix)
    assert _entry(r, 1, 2.0)["max_requests"] == 4
    assert _entry(r, 2, 1.0)["max_requests"] == 2  # a1 at 0.0 and 0.5 (1.0 is outside)
    assert _entry(r, 2, 2.0)["max_requests"] == 3
    assert _entry(r, 3, 1.0)["max_requests"] == 1  # every 3-block prefix is unique
    assert _entry(r, 4, 1.0) == {"k_blocks": 4, "window_s": 1.0, "max_requests": 0, "events": 0}
    assert _entry(r, 1, 2.0)["events"] == 1 and _entry(r, 2, 2.0)["events"] == 1 and _entry(r, 2, 1.0)["events"] == 0


def test_events_count_groups():
    rows = (
        [(t * 0.1, ["p"]) for t in range(10)]
        + [(5 + t * 0.1, ["q"]) for t in range(8)]
        + [(9 + t * 0.1, ["r"]) for t in range(7)]
    )
    r = audit_trace(_trace(rows), ks=(1,), windows_s=(1.0,))
    assert r["fan_out"] == [{"k_blocks": 1, "window_s": 1.0, "max_requests": 10, "events": 2}]
    r1 = audit_trace(_trace(rows + [(20.0, ["s"])]), ks=(1,), windows_s=(1.0,), event_min_requests=1)
    assert r1["fan_out"][0]["events"] == 4


def test_rates_tokens_and_kinds():
    rows = [(0.0, "a", "zeta"), (0.2, "b", "burst"), (0.9, "c", "decoy"), (1.1, "d", "burst"), (4.0, "e", "alpha")]
    r = audit_trace(_trace(rows), ks=(), windows_s=())
    assert r["requests"] == 5 and r["span_s"] == 4.0 and r["block_tokens"] == 16
    assert r["rate_rps"] == {"mean": 5 / 4.0, "peak_1s": 3}
    # input 10..14, output 1..5; nearest rank sorted[int(q n)]
    assert r["input_tokens"] == {"mean": 12.0, "p50": 12, "p95": 14, "max": 14}
    assert r["output_tokens"] == {"mean": 3.0, "p50": 3, "p95": 5, "max": 5}
    assert list(r["kinds"].items()) == [("burst", 2), ("decoy", 1), ("alpha", 1), ("zeta", 1)]
    assert r["fan_out"] == []


def test_empty_and_single_request_traces():
    r = audit_trace(Trace([], 256, "generated"))
    assert r["requests"] == 0 and r["rate_rps"] == {"mean": None, "peak_1s": 0}
    assert r["input_tokens"] == {"mean": None, "p50": None, "p95": None, "max": None}
    assert all(e["max_requests"] == 0 for e in r["fan_out"])
    r1 = audit_trace(_trace([(3.0, "ab")]), ks=(1, 2, 3))
    assert r1["rate_rps"]["mean"] is None and [e["max_requests"] for e in r1["fan_out"][::3]] == [1, 1, 0]


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"ks": (0,)}, "ks"),
        ({"ks": (1.5,)}, "ks"),
        ({"windows_s": (0.0,)}, "windows_s"),
        ({"windows_s": (float("inf"),)}, "windows_s"),
        ({"windows_s": ("1",)}, "windows_s"),
        ({"event_min_requests": 0}, "event_min_requests"),
    ],
)
def test_bad_arguments(kwargs, key):
    with pytest.raises(ConfigError) as ei:
        audit_trace(_trace([(0.0, "a")]), **kwargs)
    assert ei.value.key == key


def _brute_fan_out(trace: Trace, k: int, t: float, event_min: int) -> tuple[int, int]:
    groups: dict = {}
    for r in trace.requests:
        if len(r.block_hashes) >= k:
            groups.setdefault(r.block_hashes[:k], []).append(r.arrival_s)
    best, events = 0, 0
    for arrivals in groups.values():
        m = max(sum(1 for b in arrivals if a <= b < a + t) for a in arrivals)
        best = max(best, m)
        events += m >= event_min
    return best, events


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 40).map(lambda x: x / 4), st.lists(st.sampled_from("xy"), max_size=4)), max_size=30
    ),
    t=st.sampled_from([0.25, 1.0, 2.5, 10.0]),
    event_min=st.integers(1, 4),
)
def test_fan_out_matches_brute_force(rows, t, event_min):
    # prefix-chained hashes: the k-th hash names the whole k-block prefix
    trace = _trace([(a, ["".join(h[: i + 1]) for i in range(len(h))]) for a, h in rows])
    report = audit_trace(trace, ks=(1, 2, 3, 5), windows_s=(t,), event_min_requests=event_min)
    for e in report["fan_out"]:
        assert (e["max_requests"], e["events"]) == _brute_fan_out(trace, e["k_blocks"], t, event_min)
    arrivals = [r.arrival_s for r in trace.requests]
    assert report["rate_rps"]["peak_1s"] == max(
        [sum(1 for b in arrivals if a <= b < a + 1) for a in arrivals], default=0
    )


def test_max_in_window():
    assert max_in_window([], 1.0) == 0
    assert max_in_window([0.0, 0.0, 0.0], 0.5) == 3
    assert max_in_window([0.0, 1.0, 2.0, 2.5, 2.9], 1.0) == 3


def test_bursted_window_fan_out():
    p = BurstedParams(bursts=3, burst_size=120, decoys=10)
    r = audit_trace(generate_bursted(p, seed=2), ks=(256, 257), windows_s=(0.9, 1.4, 60.0))
    assert _entry(r, 256, 60.0) == {"k_blocks": 256, "window_s": 60.0, "max_requests": 120, "events": 3}
    # 120 requests over 60 s: one every 0.5 s (windows chosen off the 0.5 s grid: no ties at the edge)
    assert _entry(r, 256, 0.9)["max_requests"] == 2
    assert _entry(r, 256, 1.4)["max_requests"] == 3
    assert _entry(r, 257, 60.0)["max_requests"] == 1  # suffix blocks are unique
    adv = audit_trace(
        generate_bursted(BurstedParams.adversarial(bursts=3, burst_size=120, decoys=10), seed=2),
        ks=(256,),
        windows_s=(1.0,),
    )
    assert adv["fan_out"][0]["max_requests"] == 120


@pytest.mark.data
def test_mooncake_has_no_deep_bursts():
    if not MOONCAKE.exists():
        pytest.skip("public trace not present: mooncake_conversation_trace.jsonl (expected under ../shared/data)")
    r = audit_trace(read_trace(MOONCAKE))
    # REFERENCE.md s3: in the Mooncake traces the largest fan-out of >= 16 shared blocks within 10 s is 2
    assert _entry(r, 16, 10.0)["max_requests"] == 2
    assert _entry(r, 256, 60.0)["max_requests"] == 0  # no prompt reaches 256 blocks of 512 tokens
    assert r["requests"] == 12031 and r["block_tokens"] == 512


# -- the verdict: does BTB fire on this trace? ------------------------------------------------------------------


def test_verdict_fires_on_a_burst_and_names_the_constants():
    rows = [(0.1 * i, [1, 2, 3, 4]) for i in range(5)]
    v = btb_verdict(_trace(rows), prefix_blocks=4, threshold=2, window_s=1.0)
    assert v["fires"] and v["hot_prefixes"] == 1 and v["max_arrivals"] == 5
    assert v["reason"].startswith("BTB fires with prefix_blocks=4 threshold=2 window_s=1")


def test_verdict_says_why_not_and_which_prefix_blocks_would_fire():
    rows = [(0.1 * i, [1, 2, 3, 4 + i]) for i in range(5)]  # share 3 blocks, then differ
    v = btb_verdict(_trace(rows), prefix_blocks=8, threshold=2, window_s=1.0)
    assert not v["fires"] and v["requests_tracked"] == 0 and v["longest_blocks"] == 4
    assert "no request has 8 blocks" in v["reason"] and v["fires_with_prefix_blocks"] == 2
    assert "it would fire with prefix_blocks=2" in v["reason"]
    # deep enough, but spread out: at most one arrival of the prefix per window
    spread = [(5.0 * i, [1, 2]) for i in range(4)]
    v = btb_verdict(_trace(spread), prefix_blocks=2, threshold=2, window_s=1.0)
    assert not v["fires"] and v["max_arrivals"] == 1 and "at most 1 arrival of" in v["reason"]
    assert v["fires_with_prefix_blocks"] is None and "no shorter prefix_blocks fires either" in v["reason"]


def test_verdict_on_a_trace_without_hashes():
    v = btb_verdict(_trace([(0.0, []), (0.1, [])]), prefix_blocks=256, threshold=2, window_s=1.0)
    assert not v["fires"] and "no prefix hashes" in v["reason"]


@pytest.mark.data
def test_verdict_on_the_public_traces():
    """The Mooncake and Azure traces: BTB with its published constants never fires, and the verdict says why."""
    if not MOONCAKE.exists():
        pytest.skip(f"public traces not present ({MOONCAKE})")
    v = btb_verdict(read_trace(MOONCAKE), 256, 2, 1.0)
    assert not v["fires"] and "no request has 256 blocks" in v["reason"]
    azure = DATA / "traces" / "azure2023_conv.csv"
    if azure.exists():
        v = btb_verdict(read_trace(azure), 256, 2, 1.0)
        assert not v["fires"] and "no prefix hashes" in v["reason"]
