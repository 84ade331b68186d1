"""The infersim model's run-based HBM/host cache against Infer-Sim's block-by-block OrderedDict LRU and host set:
the same matches, LRU order, host RAM and fleet counts after any mix of chains (shared prefixes, divergent tails,
repeated blocks, lists, reloads from host RAM), and the same per-request records for whole simulations."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from btbctl.engine.constants import BtbConstants
from btbctl.engine.policies import DEFAULT_POLICIES
from btbctl.engine.setups import setup_cluster
from btbctl.engine.sim import infersim
from btbctl.engine.sim.infersim import _Chains, _KvCache, _OutBlock
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.model import Request, Trace
from helpers import PlainInferSimKv


def _chain(family: int, length: int, fork: int, tag: int, repeat: bool) -> tuple[str, ...]:
    """Blocks ``f<family>:<j>`` up to ``fork``, then ones of its own (``t<tag>``); optionally a repeated block."""
    c = tuple(f"f{family}:{j}" if j < fork else f"f{family}t{tag}:{j}" for j in range(length))
    return c + c[:2] if repeat else c


_OPS = st.lists(
    st.tuples(
        st.integers(0, 3),  # family
        st.integers(0, 24),  # length
        st.integers(0, 24),  # fork position
        st.integers(0, 2),  # tail tag (few, so tails are shared too)
        st.sampled_from(["tuple", "tuple", "list", "repeat", "extra", "extra1"]),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.integers(1, 40))
def test_runs_match_the_block_by_block_lru(ops, budget):
    chains = _Chains()
    fast_fleet: dict[Hashable, int] = {}
    slow_fleet: dict[Hashable, int] = {}
    fast = _KvCache(budget, chains, fast_fleet)
    slow = PlainInferSimKv(budget, None, slow_fleet)
    seen: list[Sequence[Hashable]] = []
    for family, length, fork, tag, kind in ops:
        c: Sequence[Hashable] = _chain(family, length, fork, tag, kind == "repeat")
        if kind == "list":
            c = list(c)
        seen.append(c)
        for q in seen[-6:]:
            assert fast.match(q) == slow.match(q)
            assert fast.hbm_run(q) == slow.hbm_run(q)
            assert fast.match(tuple(q)[: len(q) // 2]) == slow.match(tuple(q)[: len(q) // 2])
        assert fast.match(c) == slow.match(c)  # asked just before the insert: must not be answered after it
        # output blocks: packed with a short newest run, or a run of their own
        extra = (_OutBlock(), _OutBlock()) if kind == "extra" else (_OutBlock(),) if kind == "extra1" else ()
        fast.insert(c, extra)
        slow.insert(c, extra)
        assert fast.match(c) == slow.match(c)
        assert list(fast.blocks()) == list(slow.hbm)
        assert set(fast.hwhere) == set(slow.hwhere)
        assert fast.size == len(slow.hbm)
        assert fast_fleet == slow_fleet


def test_a_reversed_and_a_shuffled_chain_take_the_slow_paths():
    rng = random.Random(5)
    base = tuple(f"b{j}" for j in range(30))
    fast = _KvCache(25, _Chains(), {})
    slow = PlainInferSimKv(25, None, {})
    for c in (base, base[::-1], base[3:17], tuple(rng.sample(base, 30)), base[:10], base[::-1][:12], base):
        assert fast.match(c) == slow.match(c)
        fast.insert(c)
        slow.insert(c)
        assert list(fast.blocks()) == list(slow.hbm) and set(fast.hwhere) == set(slow.hwhere)


def _synthetic(seed: int, n: int = 400, bt: int = 256) -> Trace:
    """Conversations extending their chains, shared system prefixes that diverge, one-offs (some repeating a
    block), mixed output lengths: the shapes the Bursted window lacks."""
    rng = random.Random(seed)
    reqs, convs, t = [], {}, 0.0
    for i in range(n):
        t += rng.expovariate(8.0)
        x = rng.random()
        if x < 0.5 and convs:
            k = rng.choice(list(convs))
            chain = convs[k] + tuple(f"c{k}t{i}b{j}" for j in range(rng.randint(1, 40)))
        elif x < 0.7:
            root = rng.randint(0, 4)
            chain = tuple(f"s{root}p{j}" for j in range(rng.randint(1, 300)))
            chain += tuple(f"q{i}b{j}" for j in range(rng.randint(0, 20)))
            k = i
        else:
            chain = tuple(f"n{i}b{j}" for j in range(rng.randint(0, 200)))
            if chain and rng.random() < 0.1:
                chain += chain[:3]
            k = i
        convs[k] = chain
        if len(convs) > 30:
            convs.pop(next(iter(convs)))
        inp = max(1, len(chain) * bt - rng.randint(0, bt - 1)) if chain else rng.randint(1, 5000)
        reqs.append(Request(f"r{i}", t, inp, rng.choice([1, 1, 5, 50, 400]), chain))
    return Trace(reqs, bt, "generated")


def _records(trace: Trace, policy: str, setup: str) -> list[tuple]:
    # straight to the infersim model: ``simulate`` refuses chains that repeat a block (not prefix-chained), and
    # the cache's block-by-block fallback for them is checked here all the same
    res = infersim.simulate_infersim(trace, policy, setup_cluster(setup), BtbConstants(), seed=42)
    return [dataclasses.astuple(r) for r in res.records] + [(res.replications, res.wasted_replications)]


@pytest.mark.parametrize(
    ("trace", "setup"),
    [
        pytest.param(
            lambda: generate_bursted(BurstedParams(bursts=3, burst_size=120, decoys=20), seed=11),
            "70b_h100x4",
            id="bursted",
        ),
        pytest.param(lambda: _synthetic(3), "70b_h100x4", id="synthetic-70b"),
        pytest.param(lambda: _synthetic(4), "glm52_h100x8", id="synthetic-glm52"),
    ],
)
def test_simulations_match_the_block_by_block_cache(trace, setup, monkeypatch):
    tr = trace()
    fast = {p: _records(tr, p, setup) for p in DEFAULT_POLICIES}
    monkeypatch.setattr(infersim, "_KvCache", PlainInferSimKv)
    slow = {p: _records(tr, p, setup) for p in DEFAULT_POLICIES}
    for p in DEFAULT_POLICIES:
        assert fast[p] == slow[p], p


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),  # prompt tokens
    st.integers(0, 12),  # blocks in the chain
    st.integers(0, 12),  # matched
    st.sets(st.integers(0, 11)),  # positions some replica holds
    st.sampled_from([1, 4, 16]),  # block tokens
)
def test_recomputed_tokens_count_block_by_block(inp, n, matched, held, bt):
    """Tokens past the local match whose block some replica holds: each block's share of the prompt, clipped."""
    blocks = tuple(f"b{k}" for k in range(n))
    sim = infersim.InferSimulator([], bt, None, setup_cluster("70b_h100x4"))
    sim.fleet_blocks.update((blocks[k], 1) for k in held if k < n)
    s = infersim._Seq(Request("r", 0.0, inp, 1, blocks), bt, 0)
    m = min(matched, n)
    plain = sum(max(0, min(bt, inp - k * bt)) for k in range(m, n) if blocks[k] in sim.fleet_blocks)
    assert sim.recomputed_tokens(s, m) == plain
