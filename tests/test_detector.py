"""BurstDetector: the X-in-Z rule on Y-block prefixes, activation, bounded memory, live retune."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.constants import BtbConstants
from btbctl.engine.detector import BurstDetector, Detection
from btbctl.engine.errors import ConfigError


def chain(prefix: str, y: int, suffix: str | None = None) -> tuple:
    """A prefix-chained hash chain: ``y`` blocks of ``prefix`` then one unique block."""
    blocks = tuple(f"{prefix}:{i}" for i in range(y))
    return blocks + ((f"{prefix}:{suffix}",) if suffix is not None else ())


C = BtbConstants(prefix_blocks=4, threshold=2, window_s=1.0, replicas=3)


def test_exactly_threshold_arrivals_inside_the_window_fire():
    d = BurstDetector(C)
    assert d.observe(chain("a", 4, "s0"), 10.0) is None
    det = d.observe(chain("a", 4, "s1"), 10.999)
    assert isinstance(det, Detection)
    assert det.fired and det.arrivals_in_window == 2 and det.now_s == 10.999
    assert det.key == "a:3"
    assert det.prefix == chain("a", 4)
    assert d.stats()["fires"] == 1


def test_an_arrival_exactly_one_window_old_is_outside_it():
    d = BurstDetector(C)
    assert d.observe(chain("a", 4, "s0"), 10.0) is None
    # the window is (now - Z, now]: 10.0 is not inside (10.0, 11.0]
    assert d.observe(chain("a", 4, "s1"), 11.0) is None
    assert d.stats()["fires"] == 0


def test_arrivals_spaced_wider_than_the_window_never_fire():
    d = BurstDetector(C)
    for i in range(200):
        assert d.observe(chain("a", 4, f"s{i}"), i * 1.01) is None
    assert d.stats()["fires"] == 0
    assert not d.is_active("a:3", 200 * 1.01)


def test_prompts_shorter_than_y_blocks_never_trigger_and_are_not_tracked():
    d = BurstDetector(C)
    for i in range(50):
        assert d.observe(chain("a", 3), i * 0.01) is None
    assert d.stats() == {"fires": 0, "tracked": 0, "observed": 0, "dropped": 0}
    assert d.heat(1.0) == []


def test_threshold_three_needs_three_inside_the_window():
    d = BurstDetector(C.with_updates(threshold=3))
    assert d.observe(chain("a", 4, "1"), 0.0) is None
    assert d.observe(chain("a", 4, "2"), 0.5) is None
    det = d.observe(chain("a", 4, "3"), 0.9)
    assert det is not None and det.fired and det.arrivals_in_window == 3


def test_threshold_one_fires_on_the_first_arrival():
    d = BurstDetector(C.with_updates(threshold=1))
    det = d.observe(chain("a", 4), 0.0)
    assert det is not None and det.fired and det.arrivals_in_window == 1


def test_the_key_is_the_hash_of_block_y_so_suffixes_do_not_matter():
    d = BurstDetector(C)
    d.observe(("x0", "x1", "x2", "x3", "u1", "u2"), 0.0)
    det = d.observe(("x0", "x1", "x2", "x3"), 0.1)
    assert det is not None and det.key == "x3" and det.prefix == ("x0", "x1", "x2", "x3")
    # a different 4th block is a different prefix, even with equal first three blocks
    assert d.observe(("x0", "x1", "x2", "y3"), 0.2) is None


def test_one_fire_per_activation_and_a_gap_of_a_window_ends_it():
    d = BurstDetector(C)
    d.observe(chain("a", 4, "0"), 0.0)
    fires = [d.observe(chain("a", 4, str(i)), i * 0.12) for i in range(1, 500)]
    assert all(f is not None for f in fires)
    assert [f.fired for f in fires].count(True) == 1 and fires[0].fired
    last = 499 * 0.12
    assert d.is_active("a:3", last)
    assert d.is_active("a:3", last + 0.99)
    assert not d.is_active("a:3", last + 1.0)
    # after the gap: one arrival is not enough, the second within a window fires a new activation
    assert d.observe(chain("a", 4, "late1"), last + 5.0) is None
    assert not d.is_active("a:3", last + 5.0)
    det = d.observe(chain("a", 4, "late2"), last + 5.5)
    assert det is not None and det.fired
    assert d.stats()["fires"] == 2


def test_activity_persists_with_gaps_under_the_window_even_if_the_count_drops():
    d = BurstDetector(C.with_updates(threshold=3))
    for t in (0.0, 0.1, 0.2):
        det = d.observe(chain("a", 4), t)
    assert det is not None and det.fired
    # one arrival every 0.9 s: only 2 in any window, but never a whole-window gap
    for k in range(1, 10):
        det = d.observe(chain("a", 4), 0.2 + 0.9 * k)
        assert det is not None and not det.fired and det.arrivals_in_window == 2
    assert d.stats()["fires"] == 1


def test_memory_is_bounded_by_max_tracked_under_100k_distinct_prefixes():
    d = BurstDetector(C.with_updates(prefix_blocks=1), max_tracked=64)
    for i in range(100_000):
        d.observe((i,), i * 1e-6)
        if i % 997 == 0:
            assert len(d) <= 64
    s = d.stats()
    assert s["tracked"] == 64 and s["dropped"] == 100_000 - 64
    # the most recent ones are the ones kept
    assert {h.key for h in d.heat(0.1, top=64)} == set(range(100_000 - 64, 100_000))


def test_prefixes_unseen_for_the_retention_time_are_dropped():
    d = BurstDetector(C, retention_s=30.0)
    d.observe(chain("a", 4), 0.0)
    d.observe(chain("b", 4), 29.0)
    assert len(d) == 2
    d.observe(chain("c", 4), 30.5)
    assert len(d) == 2 and d.prefix_of("a:3") is None and d.arrivals_in_window("a:3", 30.5) == 0
    d.observe(chain("c", 4), 70.0)
    assert len(d) == 1


def test_per_key_timestamps_keep_only_the_window():
    d = BurstDetector(C)
    for i in range(1000):
        d.observe(chain("a", 4), i * 0.01)
    assert d.arrivals_in_window("a:3", 9.99) == 100  # (9.99 - 1.0, 9.99] holds 100 arrivals at 10 ms spacing
    (row,) = d.heat(9.99)
    assert row.total_arrivals == 1000
    # arrivals older than the window are forgotten: none are left to count in an earlier window
    assert d.arrivals_in_window("a:3", 5.0) == 0


def test_live_retune_of_threshold_and_window():
    d = BurstDetector(C)
    d.set_constants(C.with_updates(threshold=3))
    d.observe(chain("a", 4), 0.0)
    assert d.observe(chain("a", 4), 0.1) is None
    assert d.observe(chain("a", 4), 0.2).fired
    d.set_constants(C.with_updates(threshold=2, window_s=0.05))
    assert d.observe(chain("b", 4), 1.0) is None
    assert d.observe(chain("b", 4), 1.06) is None  # 60 ms apart: outside the new 50 ms window
    assert d.observe(chain("b", 4), 1.09).fired


def test_retuning_prefix_blocks_drops_state_and_rekeys():
    d = BurstDetector(C)
    d.observe(chain("a", 6), 0.0)
    assert d.observe(chain("a", 6), 0.1).key == "a:3"
    d.set_constants(C.with_updates(prefix_blocks=6))
    assert len(d) == 0 and not d.is_active("a:3", 0.1)
    assert d.observe(chain("a", 6), 0.2) is None
    det = d.observe(chain("a", 6), 0.3)
    assert det.key == "a:5" and len(det.prefix) == 6
    assert d.observe(chain("b", 4), 0.4) is None  # now too short
    # a retune that keeps Y keeps the state
    d.set_constants(C.with_updates(prefix_blocks=6, replicas=4))
    assert d.is_active("a:5", 0.3)


def test_heat_ranks_by_arrivals_in_the_window():
    d = BurstDetector(C)
    for i in range(5):
        d.observe(chain("hot", 4, str(i)), 10.0 + i * 0.1)
    d.observe(chain("warm", 4), 10.2)
    d.observe(chain("warm", 4), 10.3)
    d.observe(chain("cold", 4), 5.0)
    rows = d.heat(10.45, top=2)
    assert [r.key for r in rows] == ["hot:3", "warm:3"]
    hot = rows[0]
    assert (hot.prefix_blocks, hot.arrivals_in_window, hot.total_arrivals) == (4, 5, 5)
    assert (hot.first_seen_s, hot.last_seen_s, hot.hot, hot.fires) == (10.0, 10.4, True, 1)
    assert d.heat(10.45, top=0) == []
    later = {r.key: r for r in d.heat(11.35, top=10)}
    # window (10.35, 11.35]: hot's last arrival (10.4) is in it, warm's (10.3) is not
    assert later["hot:3"].arrivals_in_window == 1 and later["warm:3"].arrivals_in_window == 0
    assert later["hot:3"].hot and not later["warm:3"].hot and not later["cold:3"].hot


def test_bad_arguments_raise_config_errors():
    with pytest.raises(ConfigError):
        BurstDetector(C, max_tracked=0)
    with pytest.raises(ConfigError):
        BurstDetector(C, retention_s=0)


arrivals = st.lists(
    st.tuples(st.integers(min_value=0, max_value=4), st.integers(min_value=0, max_value=300)),
    min_size=1,
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(arrivals=arrivals, threshold=st.integers(1, 4), window_ms=st.integers(1, 120), max_tracked=st.integers(1, 6))
def test_property_fires_iff_threshold_arrivals_in_a_window(arrivals, threshold, window_ms, max_tracked):
    """A fire only ever happens with at least X arrivals in the trailing window; X arrivals in the window always
    make the prefix hot; the reported count is exact; tracked prefixes never exceed the cap.

    The reference model keeps every arrival, minus the history of a prefix the cap made the detector forget (an
    LRU of the same size), which is the only way the detector may undercount.
    """
    window_s = window_ms / 100.0
    d = BurstDetector(
        BtbConstants(prefix_blocks=2, threshold=threshold, window_s=window_s),
        max_tracked=max_tracked,
        retention_s=1000.0,
    )
    model: OrderedDict[int, list[float]] = OrderedDict()
    for key, t_cs in sorted(arrivals, key=lambda a: a[1]):
        t = t_cs / 100.0
        det = d.observe((f"p{key}", key), t)
        if key in model:
            model.move_to_end(key)
        else:
            model[key] = []
        model[key].append(t)
        while len(model) > max_tracked:
            model.popitem(last=False)
        in_window = sum(1 for x in model[key] if t - window_s < x <= t)
        if det is not None:
            assert det.arrivals_in_window == in_window
            if det.fired:
                assert in_window >= threshold
        if in_window >= threshold:
            assert det is not None
        assert len(d) <= max_tracked


def test_last_arrival_says_whether_any_prefix_has_arrivals_in_the_window():
    d = BurstDetector(BtbConstants(prefix_blocks=2, threshold=3, window_s=1.0))
    assert d.last_arrival_s() is None
    d.observe(["a", "b", "c"], 1.0)
    d.observe(["x", "y"], 2.5)
    d.observe(["a", "b"], 2.0)  # a little out of order
    d.observe(["short"], 9.0)  # shorter than prefix_blocks: not tracked
    assert d.last_arrival_s() == 2.5
    for now in (2.6, 3.4, 3.6, 30.0):
        in_window = any(h.arrivals_in_window > 0 for h in d.heat(now, 10))
        assert in_window == (d.last_arrival_s() > now - 1.0), now
    d.reset()
    assert d.last_arrival_s() is None


# -- declared bursts ----------------------------------------------------------------------------------------------


def test_a_declared_burst_counts_as_that_many_arrivals():
    d = BurstDetector(BtbConstants(prefix_blocks=4, threshold=5, window_s=1.0, replicas=3))
    det = d.observe(chain("a", 4, "s0"), 10.0, arrivals=5)
    assert det is not None and det.fired and det.arrivals_in_window == 5
    assert d.arrivals_in_window(det.key, 10.5) == 5 and d.heat(10.5)[0].total_arrivals == 5
    assert d.arrivals_in_window(det.key, 11.0) == 0  # they all arrived at 10.0: out of the window together
    assert d.observe(chain("b", 4, "s0"), 10.0, arrivals=4) is None  # 4 < threshold: not hot
    assert d.observe(chain("c", 3), 10.0, arrivals=50) is None and len(d) == 2  # too short: never tracked


def test_declared_bursts_are_bounded_per_client_within_the_window():
    from btbctl.engine.detector import DeclaredBursts

    b = DeclaredBursts(10)
    assert b.grant("10.0.0.1", 4, 0.0, 1.0) == (4, False)
    assert b.grant("10.0.0.1", 9, 0.5, 1.0) == (6, True)  # 10 per window: 6 left; the first refusal is logged
    assert b.grant("10.0.0.1", 3, 0.9, 1.0) == (0, False)  # refused again in the same window: not logged again
    assert b.grant("10.0.0.2", 10, 0.9, 1.0) == (10, False)  # another client has its own bound
    assert b.grant("10.0.0.1", 3, 1.0, 1.0) == (3, False)  # the grant of 0.0 left the window (0.0, 1.0]
    assert b.grant("10.0.0.1", 20, 1.6, 1.0) == (7, True)  # only the 3 of 1.0 within (0.6, 1.6]; a new window logs
    assert b.grant("10.0.0.1", 0, 1.6, 1.0) == (0, False)
    assert DeclaredBursts(0).grant("x", 5, 0.0, 1.0) == (0, True)  # 0: the header is off
    with pytest.raises(ConfigError, match="declared_requests_max"):
        DeclaredBursts(-1)


def test_declared_bursts_track_a_bounded_number_of_clients():
    from btbctl.engine.detector import DeclaredBursts

    b = DeclaredBursts(2, max_clients=3)
    for i in range(10):
        assert b.grant(f"c{i}", 2, float(i) / 100, 1.0) == (2, False)
    assert len(b._grants) == 3 and len(b._refused_at) <= 3


def test_arrivals_folded_from_another_gateway_count_but_never_fire_alone():
    d = BurstDetector(C)
    d.fold("a:3", 10.0)
    assert d.stats() == {"fires": 0, "tracked": 1, "observed": 0, "dropped": 0}
    assert d.arrivals_in_window("a:3", 10.5) == 1 and d.prefix_of("a:3") is None
    det = d.observe(chain("a", 4, "s1"), 10.5)  # the fleet's second arrival: fires here, with the local chain
    assert det is not None and det.fired and det.arrivals_in_window == 2 and det.prefix == chain("a", 4)


def test_folded_arrivals_leave_the_window_and_keep_an_activation_alive():
    d = BurstDetector(C)
    d.fold("a:3", 10.0)
    assert d.observe(chain("a", 4, "s1"), 11.0) is None  # the folded one is one window old: outside
    assert d.observe(chain("a", 4, "s2"), 11.5).fired
    d.fold("a:3", 12.2)  # the burst goes on at the other gateway only
    d.fold("a:3", 12.9)
    assert d.is_active("a:3", 13.5)
    det = d.observe(chain("a", 4, "s3"), 13.6)
    assert det is not None and not det.fired and d.stats()["fires"] == 1


def test_a_detection_reads_its_fields_and_shows_the_prefix_by_length():
    det = BurstDetector(BtbConstants(prefix_blocks=2, threshold=1, window_s=1.0)).observe(("a", "b", "c"), 5.0)
    assert det is not None
    assert (det.key, det.prefix, det.arrivals_in_window, det.fired, det.now_s) == ("b", ("a", "b"), 1, True, 5.0)
    assert repr(det) == "Detection(key='b', prefix=<2 blocks>, arrivals_in_window=1, fired=True, now_s=5.0)"
