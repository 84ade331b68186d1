"""CopyStatus: a value (equal and hashed by its fields), built positionally as the views do; it and Detection pickle
and copy in both builds."""

from __future__ import annotations

import copy
import pickle

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyState, CopyStatus
from btbctl.engine.detector import BurstDetector


def test_a_copy_status_is_a_value_with_defaults_and_a_state():
    a = CopyStatus(1, 100.0, 10.0, 100.0, 5.0)
    assert (a.path_bytes_per_s, a.after_s) == (0.0, 0.0)
    assert a == CopyStatus(1, 100.0, 10.0, 100.0, 5.0, 0.0, 0.0) and hash(a) == hash(
        CopyStatus(1, 100.0, 10.0, 100.0, 5.0)
    )
    assert a != CopyStatus(1, 100.0, 11.0, 100.0, 5.0) and a != (1, 100.0, 10.0, 100.0, 5.0, 0.0, 0.0)
    assert a.state is CopyState.RUNNING and CopyStatus(1, 100.0, 0.0, 0.0, 0.0).state is CopyState.STALLED
    assert repr(a) == (
        "CopyStatus(source=1, total_bytes=100.0, sent_bytes=10.0, available_bytes=100.0, rate_bytes_per_s=5.0, "
        "path_bytes_per_s=0.0, after_s=0.0)"
    )


def test_a_copy_status_and_a_detection_survive_pickle_and_copy():
    a = CopyStatus(2, 100.0, 10.0, 50.0, 0.0, 3.0, 0.25)
    for b in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert b == a and b.state is a.state
    det = BurstDetector(BtbConstants(prefix_blocks=1, threshold=1, window_s=1.0)).observe(("k",), 2.0)
    assert det is not None
    for d in (pickle.loads(pickle.dumps(det)), copy.copy(det)):
        assert (d.key, d.prefix, d.arrivals_in_window, d.fired, d.now_s) == ("k", ("k",), 1, True, 2.0)
