"""One bound on the whole cache-aware prefix tree (all workers together), in blocks and estimated bytes.

Unique long prompts spread over a fleet used to grow the tree up to the router's per-worker bound times the fleet
size (and twice that between evictions); now the whole tree stays under one bound, least recently used blocks going
first across workers, with the per-worker rule unchanged below it.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.policies import make_policy
from btbctl.engine.trace.model import Request

#: The default whole-tree bound, spelled out so the acceptance test below also runs on sources that lack the
#: constant (four times the router's per-worker 65,536 blocks).
DEFAULT_TREE_BLOCKS = 1 << 18


class _Loads:
    """A fleet view with loads only (unique prompts: nothing is ever cached or copied)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loads = [0] * n

    @property
    def n_replicas(self) -> int:
        return self.n

    def load(self, r: int) -> int:
        return self.loads[r]

    def cached_blocks(self, r, chain) -> int:
        return 0

    def pending_blocks(self, r, chain) -> int:
        return 0

    def copy_in_flight(self, r, chain) -> bool:
        return False

    def accepts_copies(self, r) -> bool:
        return True


def _tree(policy):
    return policy.tree if hasattr(policy, "tree") else policy.fallback.tree


@pytest.mark.parametrize("name", ["cache_aware", "btb"])
def test_unique_long_prompts_over_8_workers_stay_under_one_whole_tree_bound(name):
    # 4,500 unique 64-block prompts (288,000 blocks) over 8 workers, 64 in flight: the per-worker bound alone
    # (65,536 blocks each, trimmed at twice that) would keep all of them
    pol = make_policy(name, 8, random.Random(1), block_tokens=256)
    view = _Loads(8)
    rng = random.Random(2)
    flight: list[int] = []
    for i in range(4500):
        chain = tuple(rng.getrandbits(62) for _ in range(64))
        r = pol.route(Request(str(i), i * 0.01, 64 * 256, 8, chain), view, i * 0.01).replica
        view.loads[r] += 1
        flight.append(r)
        if len(flight) > 64:
            view.loads[flight.pop(0)] -= 1
    tree = _tree(pol)
    assert len(tree) <= DEFAULT_TREE_BLOCKS
    assert sum(tree.tenant_blocks(r) for r in range(8)) <= DEFAULT_TREE_BLOCKS
    assert len(tree) > DEFAULT_TREE_BLOCKS // 2  # bounded, not emptied
    # every worker got prompts and the bound is shared, not multiplied
    assert all(tree.tenant_blocks(r) > 0 for r in range(8))


def test_default_bounds_come_from_the_constants():
    from btbctl.engine.constants import CACHE_TREE_MAX_BLOCKS, CACHE_TREE_MAX_BYTES
    from btbctl.engine.gateway.config import GatewayConfig
    from btbctl.engine.policies.cache_aware import BlockPrefixTree, default_max_blocks_per_worker

    assert CACHE_TREE_MAX_BLOCKS == DEFAULT_TREE_BLOCKS == 4 * default_max_blocks_per_worker(256)
    tree = _tree(make_policy("btb", 4, random.Random(0)))
    assert (tree.max_blocks, tree.max_bytes) == (CACHE_TREE_MAX_BLOCKS, CACHE_TREE_MAX_BYTES)
    assert (BlockPrefixTree(2, 10).max_blocks, BlockPrefixTree(2, 10).max_bytes) == tree.bounds()
    cfg = GatewayConfig(workers=["http://a:1"])
    assert (cfg.cache_tree_max_blocks, cfg.cache_tree_max_bytes) == (CACHE_TREE_MAX_BLOCKS, CACHE_TREE_MAX_BYTES)


def _blocks(prefix: str, n: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{k}" for k in range(n))


def test_the_least_recently_used_blocks_go_first_across_workers():
    from btbctl.engine.policies.cache_aware import BlockPrefixTree

    tree = BlockPrefixTree(2, 1000, max_blocks=16, max_bytes=1 << 40)
    tree.insert(_blocks("a", 8), 0)
    tree.insert(_blocks("b", 8), 1)
    tree.insert(_blocks("a", 8), 0)  # a is now more recent than b
    assert len(tree) == 16
    tree.insert(("c0",), 1)  # 17 > 16: down to 14 (7/8 of the bound), b's leaves first
    assert len(tree) == 14
    assert tree.match(_blocks("a", 8))[0] == 8
    assert tree.match(_blocks("b", 8))[0] == 5  # b7, b6, b5 gone, b0..b4 kept
    assert tree.match(("c0",))[0] == 1
    assert (tree.tenant_blocks(0), tree.tenant_blocks(1)) == (8, 6)
    assert tree.fleet_evicted_blocks == 3 and tree.evicted_blocks == 3
    assert tree.entries() == 14


def test_the_byte_bound_counts_every_worker_on_a_block():
    from btbctl.engine.policies.cache_aware import ENTRY_BYTES, NODE_BYTES, BlockPrefixTree

    cap = 1 << 20
    tree = BlockPrefixTree(8, 1 << 20, max_blocks=1 << 30, max_bytes=cap)
    for i in range(400):
        chain = _blocks(f"p{i}-", 16)
        for r in range(8):  # every block on all 8 workers: the bytes bind long before the block count
            tree.insert(chain, r)
            assert tree.estimated_bytes() <= cap
    assert tree.estimated_bytes() == len(tree) * NODE_BYTES + tree.entries() * ENTRY_BYTES
    assert tree.entries() == 8 * len(tree)
    assert len(tree) < cap // (NODE_BYTES + 8 * ENTRY_BYTES) + 1
    assert tree.fleet_evicted_blocks > 0


def test_hot_prompts_inserted_again_and_again_keep_bounded_state():
    from btbctl.engine.policies.cache_aware import SINCE_SLACK_BLOCKS, BlockPrefixTree

    tree = BlockPrefixTree(2, 1000)
    hot = _blocks("h", 64)
    for i in range(20000):
        tree.insert(hot, i % 2)
        assert tree._pending <= SINCE_SLACK_BLOCKS
    assert sum(map(len, tree._since)) + len(tree._fleet_since) <= SINCE_SLACK_BLOCKS // 64 * 2
    assert len(tree) == 64 and tree.entries() == 128


class _EagerFleetTree:
    """The plain model: every insert moves each block of the chain to the most recent end, deepest first, of its
    tenant's order and of the fleet's; the per-tenant rule as the router's; past the whole-tree bound, whole nodes
    go from the fleet order's least recent end until under 7/8 of it."""

    def __init__(self, n: int, per_tenant: int, max_blocks: int) -> None:
        self.nodes: dict[str, list[int]] = {}
        self.lru: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(n)]
        self.fleet: OrderedDict[str, None] = OrderedDict()
        self.per_tenant = per_tenant
        self.max_blocks = max_blocks

    def insert(self, chain, r):
        lru = self.lru[r]
        for h in reversed(chain):
            tenants = self.nodes.setdefault(h, [])
            if r not in tenants:
                tenants.append(r)
            lru[h] = None
            lru.move_to_end(h)
            self.fleet[h] = None
            self.fleet.move_to_end(h)
        if len(lru) > 2 * self.per_tenant:
            self.evict_tenant(r)
        if len(self.nodes) > self.max_blocks:
            low = self.max_blocks - self.max_blocks // 8
            while len(self.nodes) > low:
                h, _ = self.fleet.popitem(last=False)
                for t in self.nodes.pop(h):
                    del self.lru[t][h]

    def evict_tenant(self, r):
        lru = self.lru[r]
        while len(lru) > self.per_tenant:
            h, _ = lru.popitem(last=False)
            self.nodes[h].remove(r)
            if not self.nodes[h]:
                del self.nodes[h]
                del self.fleet[h]


def _chained(path: list[int]) -> tuple[str, ...]:
    return tuple("/".join(map(str, path[: k + 1])) for k in range(len(path)))


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.lists(st.integers(0, 2), min_size=1, max_size=10), st.integers(0, 2), st.booleans()),
        min_size=1,
        max_size=80,
    ),
    per_tenant=st.integers(1, 12),
    max_blocks=st.integers(1, 30),
)
def test_property_lazy_whole_tree_bound_matches_the_eager_model(ops, per_tenant, max_blocks):
    from btbctl.engine.policies.cache_aware import BlockPrefixTree

    tree = BlockPrefixTree(3, per_tenant, max_blocks=max_blocks, max_bytes=1 << 40)
    ref = _EagerFleetTree(3, per_tenant, max_blocks)
    for path, r, evict in ops:
        chain = _chained(path)
        tree.insert(chain, r)
        ref.insert(chain, r)
        if evict:
            tree.evict()
            for t in range(3):
                ref.evict_tenant(t)
        assert len(tree) <= max_blocks
        assert {h: sorted(n.tenants) for h, n in tree.nodes.items()} == {h: sorted(t) for h, t in ref.nodes.items()}
        assert [tree.tenant_blocks(t) for t in range(3)] == [len(x) for x in ref.lru]
        assert tree.entries() == sum(len(x) for x in ref.lru)
        c = _chained(path[:-1] + [0])
        assert tree.match(c) == tree.match_linear(c)  # still prefix-closed: the binary search is valid
    tree._settle_all()
    assert list(tree._fleet_lru) == list(ref.fleet)
    assert [list(x) for x in tree._lru] == [list(x) for x in ref.lru]


def test_bad_bounds_are_one_line_errors_naming_the_key():
    from btbctl.engine.config import validate
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.gateway.config import GatewayConfig
    from btbctl.engine.policies.cache_aware import CacheAware

    for key, bad in (("cache_tree_max_blocks", 0), ("cache_tree_max_bytes", 1000)):
        with pytest.raises(ConfigError) as e:
            validate(GatewayConfig, {"workers": ["http://a:1"], key: bad})
        assert key in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"cache_tree_max_blocks.*>= 1"):
        CacheAware(2, random.Random(0), tree_max_blocks=0)
    with pytest.raises(ConfigError, match=r"cache_tree_max_bytes.*1048576"):
        CacheAware(2, random.Random(0), tree_max_bytes=10)


async def test_the_gateway_applies_its_bound_and_exports_the_tree_size():
    from gateway_fakes import GatewayEnv, metric_value

    async with GatewayEnv(2, policy="cache_aware", cache_tree_max_blocks=3, page_size=4) as env:
        assert env.gw.policy.tree.bounds()[0] == 3
        m = await env.metrics()
        assert metric_value(m, "btb_cache_tree_blocks") == 0
        status, _ = await env.post("/generate", {"text": "long enough prompt " * 20})
        assert status == 200
        m = await env.metrics()
        assert 0 < metric_value(m, "btb_cache_tree_blocks") <= 3
        assert metric_value(m, "btb_cache_tree_bytes") == env.gw.policy.tree.estimated_bytes() > 0
        env.gw.set_policy("btb")  # the tree moves over with its bound
        assert env.gw.policy.fallback.tree.bounds()[0] == 3
        env.gw.set_policy("round_robin")
        m = await env.metrics()
        assert metric_value(m, "btb_cache_tree_blocks") == 0
