"""The Bursted generator, the overlay on a base trace and the btb-mixed-trace-v1 writer (round trips)."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.trace.generate import ADVERSARIAL_SPREAD_S, BurstedParams, generate_bursted
from btbctl.engine.trace.model import Request, Trace
from btbctl.engine.trace.readers import read_btb_mixed, read_trace
from btbctl.engine.trace.writer import write_btb_mixed

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
MOONCAKE = DATA / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.fixture(scope="module")
def window() -> Trace:
    return generate_bursted(BurstedParams(), seed=42)


def _by_burst(trace: Trace) -> dict[int, list[Request]]:
    out: dict[int, list[Request]] = defaultdict(list)
    for r in trace.requests:
        if r.kind == "burst":
            out[r.labels["burst"]].append(r)
    return out


# --------------------------------------------------------------------------------------------------------------------
# the default window (REFERENCE.md s3)


def test_default_window_shape(window):
    assert len(window) == 4120 and window.block_tokens == 256 and window.format == "generated"
    assert Counter(r.kind for r in window.requests) == {"burst": 4000, "decoy": 120}
    assert all(r.input_tokens == 65536 + 256 and r.output_tokens == 1 for r in window.requests)
    assert all(len(r.block_hashes) == 257 for r in window.requests)
    arrivals = [r.arrival_s for r in window.requests]
    assert arrivals == sorted(arrivals)
    assert all(round(a, 6) == a for a in arrivals)
    assert 330 < window.span_s < 365
    assert len({r.request_id for r in window.requests}) == 4120
    assert window.meta["seed"] == 42 and window.meta["params"]["burst_size"] == 500


def test_bursts_share_exactly_their_prefix(window):
    bursts = _by_burst(window)
    assert sorted(bursts) == list(range(8)) and all(len(v) == 500 for v in bursts.values())
    prefixes = set()
    for k, reqs in bursts.items():
        heads = {r.block_hashes[:256] for r in reqs}
        assert len(heads) == 1  # one shared 256-block prefix per burst
        assert len({r.block_hashes[256] for r in reqs}) == 500  # unique suffix block per request
        prefixes.add(heads.pop())
        starts = sorted(r.arrival_s for r in reqs)
        nominal = 20.0 + 40.0 * k
        assert nominal - 2.0 <= starts[0] <= nominal + 2.0
        gaps = [b - a for a, b in pairwise(starts)]
        assert all(abs(g - 60.0 / 500) < 2e-6 for g in gaps)  # evenly spread over 60 s
    # no block hash is shared between bursts
    flat = [h for p in prefixes for h in p]
    assert len(set(flat)) == len(flat)


def test_decoys_share_nothing(window):
    decoys = [r for r in window.requests if r.kind == "decoy"]
    everyone_else = {h for r in window.requests if r.kind != "decoy" for h in r.block_hashes}
    seen = set()
    for r in decoys:
        assert 14.0 <= r.arrival_s <= 340.0
        assert not (set(r.block_hashes) & everyone_else) and not (set(r.block_hashes) & seen)
        seen.update(r.block_hashes)


def test_deterministic_for_a_seed(window):
    again = generate_bursted(BurstedParams(), seed=42)
    assert again.requests == window.requests
    other = generate_bursted(BurstedParams(), seed=7)
    assert [r.arrival_s for r in other.requests] != [r.arrival_s for r in window.requests]


def test_adversarial_variant_packs_each_burst_into_one_second():
    p = BurstedParams.adversarial(bursts=3, burst_size=50, decoys=0)
    assert p.spread_s == ADVERSARIAL_SPREAD_S == 1.0
    for reqs in _by_burst(generate_bursted(p, seed=1)).values():
        a = [r.arrival_s for r in reqs]
        assert max(a) - min(a) < 1.0


def test_partial_blocks_are_unique_to_the_request():
    p = BurstedParams(bursts=1, burst_size=3, decoys=0, prefix_tokens=1000, suffix_tokens=256, block_tokens=256)
    reqs = generate_bursted(p).requests
    # 1256 tokens -> 5 blocks; the first 3 (768 tokens) are fully inside the shared prefix
    assert all(len(r.block_hashes) == 5 for r in reqs)
    assert len({r.block_hashes[:3] for r in reqs}) == 1
    assert len({r.block_hashes[3] for r in reqs}) == 3


def test_background_traffic():
    p = BurstedParams(
        bursts=1,
        burst_size=10,
        decoys=0,
        background_rps=20.0,
        background_end_s=30.0,
        background_input_min_tokens=100,
        background_input_max_tokens=700,
        background_output_tokens=9,
    )
    t = generate_bursted(p, seed=3)
    bg = [r for r in t.requests if r.kind == "background"]
    assert 400 < len(bg) < 800  # Poisson with mean 600
    assert all(0 <= r.arrival_s < 30.0 and 100 <= r.input_tokens <= 700 and r.output_tokens == 9 for r in bg)
    assert all(len(r.block_hashes) == -(-r.input_tokens // 256) for r in bg)
    hashes = [h for r in bg for h in r.block_hashes]
    assert len(set(hashes)) == len(hashes)
    assert not any(r.kind == "background" for r in generate_bursted(BurstedParams(bursts=1, decoys=0)).requests)


def test_offset_shifts_every_arrival():
    p = BurstedParams(bursts=2, burst_size=5, decoys=3)
    base = generate_bursted(p, seed=5)
    shifted = generate_bursted(dataclasses.replace(p, offset_s=1000.0), seed=5)
    assert [round(r.arrival_s + 1000.0, 6) for r in base.requests] == [r.arrival_s for r in shifted.requests]


@pytest.mark.parametrize(
    "field,value",
    [
        ("bursts", -1),
        ("burst_size", 0),
        ("prefix_tokens", 0),
        ("suffix_tokens", -1),
        ("output_tokens", 0),
        ("decoys", -2),
        ("block_tokens", 0),
        ("spread_s", -1.0),
        ("jitter_s", 25.0),
        ("decoy_end_s", 10.0),
        ("background_rps", -0.1),
        ("background_input_max_tokens", 100),
        ("background_end_s", -5.0),
        ("first_burst_s", float("nan")),
        ("bursts", 2.5),
        ("burst_size", True),
        ("offset_s", "3"),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        BurstedParams(**{field: value})
    assert ei.value.key == field and str(ei.value).startswith(f"{field}: ")


def test_seed_must_be_an_integer():
    with pytest.raises(ConfigError, match="seed"):
        generate_bursted(BurstedParams(bursts=1, decoys=0), seed="42")


# --------------------------------------------------------------------------------------------------------------------
# overlay on a base trace


def _mooncake_like(n: int = 30) -> Trace:
    reqs = [Request(str(i + 1), float(i), 1500, 20, (0, 1000 + i, 2000 + i)) for i in range(n)]
    return Trace(reqs, 512, "mooncake", "base.jsonl")


def test_overlay_uses_the_base_block_size_and_keeps_base_requests():
    base = _mooncake_like()
    p = BurstedParams(bursts=2, burst_size=20, decoys=5)  # block_tokens 256 is overridden by the base's 512
    t = generate_bursted(p, seed=9, base=base)
    assert t.block_tokens == 512 and len(t) == 30 + 45
    kept = [r for r in t.requests if r.kind == "background"]
    assert all(a is b for a, b in zip(kept, base.requests, strict=True))
    gen = [r for r in t.requests if r.kind != "background"]
    # 65,792 tokens at 512 per block: 128 shared blocks + 1 partial block unique to the request
    assert all(len(r.block_hashes) == 129 for r in gen)
    assert len({r.block_hashes[:128] for r in gen if r.kind == "burst"}) == 2
    assert t.meta["base"] == {"path": "base.jsonl", "format": "mooncake", "requests": 30}


def test_overlay_on_a_same_seed_window_never_collides():
    p = BurstedParams(bursts=2, burst_size=10, decoys=4)
    first = generate_bursted(p, seed=11)
    both = generate_bursted(p, seed=11, base=first)
    assert len(both) == 2 * len(first)
    assert len({r.request_id for r in both.requests}) == len(both)
    first_hashes = {h for r in first.requests for h in r.block_hashes}
    new = [r for r in both.requests if not any(r is f for f in first.requests)]
    assert len(new) == len(first)
    assert not any(h in first_hashes for r in new for h in r.block_hashes)
    # the two windows' bursts stay separate prefixes: 4 distinct 256-block prefixes
    assert len({r.block_hashes[:256] for r in both.requests if r.kind == "burst"}) == 4


@pytest.mark.data
def test_overlay_on_real_mooncake(tmp_path):
    if not MOONCAKE.exists():
        pytest.skip("public trace not present: mooncake_conversation_trace.jsonl (expected under ../shared/data)")
    base = read_trace(MOONCAKE)
    t = generate_bursted(BurstedParams(), seed=42, base=base)
    assert len(t) == 12031 + 4120 and t.block_tokens == 512
    out = tmp_path / "overlay.jsonl"
    write_btb_mixed(t, out)
    back = read_btb_mixed(out)
    assert back.block_tokens == 512 and len(back) == len(t)
    # int hashes become their decimal strings; sharing structure is unchanged
    assert [tuple(map(str, r.block_hashes)) for r in t.requests] == [r.block_hashes for r in back.requests]


# --------------------------------------------------------------------------------------------------------------------
# writer round trips


def test_write_read_round_trip_is_exact(tmp_path, window):
    out = tmp_path / "w.jsonl"
    assert write_btb_mixed(window, out) == 4120
    back = read_trace(out)
    assert back.format == "btb-mixed-trace-v1" and back.block_tokens == 256
    assert back.requests == window.requests
    row = json.loads(out.read_text().splitlines()[0])
    assert list(row) == [
        "arrival_s",
        "input_length",
        "output_length",
        "hash_ids",
        "request_id",
        "trace_id",
        "source",
        "metadata",
    ]
    assert row["source"] == "synthetic" and row["metadata"]["job_kind"] in ("burst", "decoy")
    assert not (tmp_path / "w.jsonl.tmp").exists()


def test_round_trip_gzip_and_block_size(tmp_path):
    t = generate_bursted(BurstedParams(bursts=2, burst_size=5, decoys=2, block_tokens=512), seed=4)
    out = tmp_path / "w.jsonl.gz"
    write_btb_mixed(t, out)
    with gzip.open(out, "rt") as f:
        assert json.loads(f.readline())["block_tokens"] == 512
    back = read_trace(out)
    assert back.block_tokens == 512 and back.requests == t.requests


def test_write_failure_is_a_user_error(tmp_path):
    t = generate_bursted(BurstedParams(bursts=1, burst_size=2, decoys=0))
    target = tmp_path / "missing-dir" / "w.jsonl"
    with pytest.raises(BtbctlError, match="cannot write"):
        write_btb_mixed(t, target)
    assert not target.parent.exists()


def _chained(parts: list[str]) -> tuple[str, ...]:
    """Prefix-chained hash ids from arbitrary labels: id k names labels 0..k (a JSON list: no two splits collide)."""
    return tuple(json.dumps(parts[: k + 1]) for k in range(len(parts)))


_label_values = st.one_of(st.integers(-5, 5), st.text(max_size=4), st.booleans(), st.none())
_requests = st.lists(
    st.builds(
        lambda rid, arrival, inp, out, labels_of_blocks, kind, labels: Request(
            rid, arrival, inp, out, _chained(labels_of_blocks), kind, labels or None
        ),
        st.just(""),
        st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False),
        st.integers(1, 10**6),
        st.integers(1, 10**4),
        st.lists(st.text(min_size=1, max_size=6), max_size=6),
        st.sampled_from(["burst", "decoy", "background", "custom kind"]),
        st.dictionaries(st.sampled_from(["trace_id", "source", "burst", "note"]), _label_values, max_size=3),
    ),
    min_size=1,
    max_size=8,
)


@pytest.fixture(scope="module")
def rt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("roundtrip")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=_requests, block_tokens=st.sampled_from([256, 512, 16]), gz=st.booleans())
def test_round_trip_property(rt_dir, reqs, block_tokens, gz):
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
    t = Trace(reqs, block_tokens, "generated")
    out = rt_dir / ("p.jsonl.gz" if gz else "p.jsonl")
    write_btb_mixed(t, out)
    back = read_btb_mixed(out)
    assert back.block_tokens == block_tokens
    assert back.requests == t.requests
