"""CopyStatus: a value (equal and hashed by its fields), built positionally as the views do."""

from __future__ import annotations

from btbctl.engine.copies import CopyState, CopyStatus


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
