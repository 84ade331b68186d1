"""PrefixCache: matching, pinning, LRU leaf-first eviction, ancestor closure."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.sim.cache import PrefixCache


def fill(cache: PrefixCache, chain, pinned=False):
    """Insert a chain the way the simulator does: commit pinned, then unpin (deepest first) unless kept."""
    cache.reserve_blocks(len(chain))
    for k, h in enumerate(chain):
        cache.commit_block(h, chain[k - 1] if k else None, pinned=True)
    if not pinned:
        cache.unpin(chain, len(chain))


def test_match_counts_leading_resident_blocks():
    c = PrefixCache(capacity_tokens=100 * 16, block_tokens=16)
    fill(c, ("a", "b", "c", "d"))
    assert c.match(("a", "b", "c", "d", "e")) == 4
    assert c.match(("a", "b", "x")) == 2
    assert c.match(("x",)) == 0
    assert c.match(()) == 0
    assert c.used_tokens == 4 * 16


def test_make_room_evicts_lru_leaves_first_and_refuses_when_pinned():
    c = PrefixCache(capacity_tokens=6 * 10, block_tokens=10)
    fill(c, ("a", "b", "c"))
    fill(c, ("x", "y", "z"))
    c.touch(("a", "b", "c"), 3)  # a-chain most recent
    assert c.make_room(20)
    # the x-chain lost its deepest blocks first; ancestor closure holds
    assert "z" not in c and "y" not in c and "x" in c
    assert c.match(("a", "b", "c")) == 3
    c.pin(("a", "b", "c"), 3)
    assert not c.make_room(60)  # would need pinned blocks
    assert c.match(("a", "b", "c")) == 3  # refused without evicting anything


def test_pinned_blocks_survive_and_unpin_returns_them_to_lru():
    c = PrefixCache(capacity_tokens=3 * 10, block_tokens=10)
    fill(c, ("a", "b"), pinned=True)
    fill(c, ("q",))
    assert not c.make_room(20)  # only one unpinned block
    assert c.make_room(10)
    assert "q" not in c and "a" in c and "b" in c
    c.unpin(("a", "b"), 2)
    assert c.make_room(30)
    assert len(c) == 0


def test_flush_drops_only_unpinned():
    c = PrefixCache(capacity_tokens=100, block_tokens=10)
    fill(c, ("a", "b"))
    fill(c, ("a2",), pinned=True)
    assert c.flush() == 2
    assert "a2" in c and "a" not in c


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 8), st.booleans()), min_size=1, max_size=60))
def test_ancestor_closure_under_random_workload(ops):
    """Whatever the sequence of inserts, pins and evictions, a resident block's parent is resident."""
    c = PrefixCache(capacity_tokens=24, block_tokens=1)
    pinned = []
    rng = random.Random(0)
    for root, depth, pin in ops:
        chain = tuple(f"{root}-{k}" for k in range(depth))
        m = c.match(chain)
        c.pin(chain, m)
        if c.make_room(depth - m):
            c.reserve_blocks(depth - m)
            for k in range(m, depth):
                c.commit_block(chain[k], chain[k - 1] if k else None, pinned=True)
            if pin:
                pinned.append(chain)
            else:
                c.unpin(chain, depth)
        else:
            c.unpin(chain, m)
        if pinned and rng.random() < 0.3:
            ch = pinned.pop(0)
            c.unpin(ch, len(ch))
        for p in c.parent.values():
            assert p is None or p in c.parent
        assert c.used_tokens <= c.capacity_tokens
