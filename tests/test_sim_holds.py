"""The fast paths of the prefix cache and the router tree against the plain models they replace.

* PrefixCache pins as holds on chain prefixes (a count per block of the holds ending there plus its pinned children)
  against per-block reference counts: the same pinned blocks and the same LRU order after every operation; and
  make_room, which reports its evictions after its loop, against a loop reporting each one as it goes.
* BlockPrefixTree's lazily settled per-tenant LRU against the eager one (every insert moves each block to the MRU
  end, deepest first): the same nodes, tenants, evictions and LRU order.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import pytest

from btbctl.engine.policies.cache_aware import BlockPrefixTree, _Node
from btbctl.engine.sim import cache as cache_mod
from btbctl.engine.sim.cache import PrefixCache


def _chained(path: list[int]) -> tuple[str, ...]:
    return tuple("/".join(map(str, path[: k + 1])) for k in range(len(path)))


class _RefCounts:
    """The per-block model: a pin adds one to every block of the prefix, an unpin takes one off, deepest first."""

    def __init__(self) -> None:
        self.refs: dict[str, int] = {}
        self.lru: OrderedDict[str, None] = OrderedDict()

    def pin(self, chain, n):
        for h in chain[:n]:
            r = self.refs.get(h, 0)
            if r == 0:
                self.lru.pop(h, None)
            self.refs[h] = r + 1

    def unpin(self, chain, n, resident):
        for h in chain[n - 1 :: -1] if n > 0 else ():
            r = self.refs.get(h, 0) - 1
            if r <= 0:
                self.refs.pop(h, None)
                if h in resident:
                    self.lru[h] = None
            else:
                self.refs[h] = r

    def commit(self, h, pinned):
        if pinned:
            r = self.refs.get(h, 0)
            if r == 0:
                self.lru.pop(h, None)
            self.refs[h] = r + 1
        elif h not in self.refs:
            self.lru[h] = None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("loop_below", [0, 10**9])
def test_holds_pin_the_blocks_per_block_counts_pin(seed, loop_below, monkeypatch):
    """Requests (pin the matched prefix, commit the rest, unpin all) and copies (pin a prefix, extend it, unpin)
    over prefix-chained hashes, with evictions: pinned set and LRU order equal the per-block counts' after every
    step."""
    monkeypatch.setattr(cache_mod, "_LOOP_BELOW", loop_below)
    rng = random.Random(seed)
    c = PrefixCache(capacity_tokens=120, block_tokens=1)
    ref = _RefCounts()
    live: list[tuple[tuple[str, ...], int]] = []  # holds: (chain, blocks held)
    last: tuple[str, ...] = ()  # the chain released last

    def check():
        # the logical state, read without settling a deferred release (reading c.refs or c.lru would settle it)
        refs, lru = set(c._refs), list(c._lru)
        if c._released is not None:
            chain, n = c._released
            refs -= set(chain[:n])
            lru += chain[n - 1 :: -1]
        assert refs == set(ref.refs)
        assert c.holds == dict(Counter(chain[0] for chain, _ in live))
        assert lru == [h for h in ref.lru if h in c.parent]
        assert c.evictable_tokens == len(lru) * c.block_tokens

    def resync_evictions():
        for h in [h for h in ref.lru if h not in c.parent]:
            del ref.lru[h]

    for _ in range(400):
        roll = rng.random()
        if live and roll < 0.4:
            chain, n = live.pop(rng.randrange(len(live)))
            c.unpin(chain, n)
            ref.unpin(chain, n, c.parent)
            last = chain
        elif live and roll < 0.5:
            i = rng.randrange(len(live))
            chain, n = live[i]
            stop = c.match(chain)
            if stop > n:  # a copy's source hold grows as the source commits
                c.pin(chain, stop)
                c.unpin(chain, n)
                ref.pin(chain[n:stop], stop - n)
                live[i] = (chain, stop)
        else:
            path = [rng.randrange(3) for _ in range(rng.randint(1, 30))]
            if last and rng.random() < 0.5:  # the prefix of a chain just released, maybe extended
                path = [int(x) for x in last[rng.randrange(len(last))].split("/")] + path[: rng.randint(0, 2)]
            chain = _chained(path)
            m = c.match(chain)
            twins = 2 if rng.random() < 0.3 else 1  # a twin computes the same blocks (the second commit finds them)
            for _ in range(twins):
                c.pin(chain, m)
                ref.pin(chain, m)
            if not c.make_room(twins * (len(chain) - m)):
                for _ in range(twins):
                    c.unpin(chain, m)
                    ref.unpin(chain, m, c.parent)
            else:
                resync_evictions()
                c.reserve_blocks(twins * (len(chain) - m))
                for _ in range(twins):
                    k = m
                    while k < len(chain):
                        stop = min(len(chain), k + rng.randint(1, 12))
                        if rng.random() < 0.5:
                            c.commit_run(chain, k, stop)
                        else:
                            for j in range(k, stop):
                                c.commit_block(chain[j], chain[j - 1] if j else None, pinned=True)
                        for j in range(k, stop):
                            ref.commit(chain[j], True)
                        k = stop
                    live.append((chain, len(chain)))
        check()
        for p in c.parent.values():
            assert p is None or p in c.parent
    for chain, n in live:
        c.unpin(chain, n)
    assert not c.refs and not c.holds


def _make_room_per_block(c: PrefixCache, tokens: int, evicted: list) -> bool:
    """make_room as a loop reporting each block as it goes (the reference)."""
    need = tokens - c.free_tokens
    if need <= 0:
        return True
    if need > c.evictable_tokens:
        return False
    evict = -(-need // c.block_tokens)
    while evict > 0:
        h, _ = c.lru.popitem(last=False)
        if c.children.get(h, 0):
            c.lru[h] = None
            continue
        p = c.parent.pop(h)
        c.refs.pop(h, None)
        if p is not None and p in c.children:
            c.children[p] -= 1
            if not c.children[p]:
                del c.children[p]
        c.evictions += 1
        evict -= 1
        evicted.append(h)
    return True


@pytest.mark.parametrize("seed", range(4))
def test_make_room_matches_the_per_block_loop(seed):
    def run(reference: bool):
        rng = random.Random(seed)
        evicted: list[str] = []
        c = PrefixCache(capacity_tokens=200, block_tokens=1, on_evict_run=evicted.extend)
        for _ in range(300):
            chain = _chained([rng.randrange(4) for _ in range(rng.randint(1, 40))])
            m = c.match(chain)
            c.pin(chain, m)
            need = len(chain) - m
            if _make_room_per_block(c, need, evicted) if reference else c.make_room(need):
                c.reserve_blocks(len(chain) - m)
                c.commit_run(chain, m, len(chain))
                c.unpin(chain, len(chain))
            else:
                c.unpin(chain, m)
            if rng.random() < 0.2:
                c.touch(chain, c.match(chain))
        return list(c.lru), dict(c.parent), dict(c.children), evicted, c.evictions

    assert run(False) == run(True)


class _EagerTree:
    """The router tree with an eagerly kept per-tenant LRU (every insert moves its blocks to the MRU end)."""

    def __init__(self, n: int, bound: int) -> None:
        self.nodes: dict[str, _Node] = {}
        self.lru = [OrderedDict() for _ in range(n)]
        self.bound = bound
        self.evicted = 0

    def insert(self, chain, r):
        lru = self.lru[r]
        for h in reversed(chain):
            node = self.nodes.get(h)
            if node is None:
                self.nodes[h] = _Node(r)
                lru[h] = None
            elif r in node.tenants:
                lru.move_to_end(h)
            else:
                node.tenants[r] = None
                lru[h] = None
        if len(lru) > 2 * self.bound:
            self.evict_tenant(r)

    def evict_tenant(self, r):
        lru = self.lru[r]
        while len(lru) > self.bound:
            h, _ = lru.popitem(last=False)
            node = self.nodes[h]
            del node.tenants[r]
            if not node.tenants:
                del self.nodes[h]
            self.evicted += 1


@pytest.mark.parametrize("seed", range(8))
def test_lazy_tree_lru_matches_the_eager_one(seed):
    rng = random.Random(seed)
    bound = rng.randint(2, 25)
    tree, ref = BlockPrefixTree(3, bound), _EagerTree(3, bound)
    for _ in range(500):
        chain = _chained([rng.randrange(3) for _ in range(rng.randint(1, 12))])
        r = rng.randrange(3)
        tree.insert(chain, r)
        ref.insert(chain, r)
        if rng.random() < 0.1:
            tree.evict()
            for t in range(3):
                ref.evict_tenant(t)
        assert tree.evicted_blocks == ref.evicted
        assert [tree.tenant_blocks(t) for t in range(3)] == [len(x) for x in ref.lru]
        assert {h: (n.creator, list(n.tenants)) for h, n in tree.nodes.items()} == {
            h: (n.creator, list(n.tenants)) for h, n in ref.nodes.items()
        }
    for t in range(3):
        assert list(tree._settle(t)) == list(ref.lru[t])
