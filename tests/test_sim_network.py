"""Network: full-duplex NICs with max-min fair sharing."""

import pytest

from btbctl.engine.sim.network import Copy, Network


def mk(cid, src, dst, total=100.0, avail=None):
    return Copy(
        cid=cid,
        src=src,
        dst=dst,
        chain=("h",),
        offset=0,
        bytes_per_block=total,
        started_s=0.0,
        total_bytes=total,
        avail_bytes=total if avail is None else avail,
    )


def test_one_copy_gets_the_whole_nic():
    net = Network(2, 10.0)
    net.active = [mk(1, 0, 1)]
    net.reallocate()
    assert net.active[0].rate == pytest.approx(10.0)


def test_two_copies_from_one_source_share_its_transmit_side():
    net = Network(3, 10.0)
    net.active = [mk(1, 0, 1), mk(2, 0, 2)]
    net.reallocate()
    assert [c.rate for c in net.active] == pytest.approx([5.0, 5.0])


def test_full_duplex_in_and_out_do_not_compete():
    net = Network(2, 10.0)
    net.active = [mk(1, 0, 1), mk(2, 1, 0)]
    net.reallocate()
    assert [c.rate for c in net.active] == pytest.approx([10.0, 10.0])


def test_max_min_fairness_gives_leftover_to_unconstrained_flow():
    # 0->2 and 1->2 share 2's receive side (5 each); 1->3 then gets 1's leftover transmit capacity (5)
    net = Network(4, 10.0)
    net.active = [mk(1, 0, 2), mk(2, 1, 2), mk(3, 1, 3)]
    net.reallocate()
    assert [c.rate for c in net.active] == pytest.approx([5.0, 5.0, 5.0])
    net.active = [mk(1, 0, 2), mk(3, 1, 3)]
    net.reallocate()
    assert [c.rate for c in net.active] == pytest.approx([10.0, 10.0])


def test_stalled_copy_does_not_take_bandwidth_and_advance_caps_at_available():
    net = Network(3, 10.0)
    a, b = mk(1, 0, 1, avail=0.0), mk(2, 0, 2)
    net.active = [a, b]
    net.reallocate()
    assert a.rate == 0.0 and b.rate == pytest.approx(10.0)
    a.avail_bytes = 30.0
    net.reallocate()
    net.advance(100.0)
    assert a.sent_bytes == pytest.approx(30.0) and a.stalled
    assert b.finished
