"""The simulator's C-level passes (map/zip over dicts in the prefix caches) against the plain block-by-block loops
they replace: same states after the same operations, including chains that repeat a hash (which take the loop)."""

from __future__ import annotations

import random

import pytest

from btbctl.engine.sim import cache as cache_mod
from btbctl.engine.sim.cache import PrefixCache
from helpers import PlainInferSimKv


def _chain(rng: random.Random, root: str, n: int) -> tuple[str, ...]:
    return tuple(f"{root}{j}" for j in range(n))


def _ops(seed: int) -> list[tuple[str, tuple[str, ...], int]]:
    rng = random.Random(seed)
    roots = [f"r{i}:" for i in range(4)]
    ops = []
    for _ in range(300):
        chain = _chain(rng, rng.choice(roots), rng.randint(1, 40))
        if rng.random() < 0.05:
            chain = chain + chain[:3]  # a repeated hash
        ops.append((rng.choice(("pin", "unpin", "pin")), chain, rng.randint(0, len(chain))))
    return ops


def _run(ops, monkeypatch, loop_below: int) -> PrefixCache:
    monkeypatch.setattr(cache_mod, "_LOOP_BELOW", loop_below)
    c = PrefixCache(capacity_tokens=10**6, block_tokens=16)
    for root in ("r0:", "r1:", "r2:", "r3:"):
        prev = None
        for j in range(45):
            h = f"{root}{j}"
            c.reserve_blocks(1)
            c.commit_block(h, prev, pinned=False)
            prev = h
    for op, chain, n in ops:
        getattr(c, op)(chain, n)
    return c


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pin_unpin_passes_match_the_loop(seed, monkeypatch):
    ops = _ops(seed)
    fast = _run(ops, monkeypatch, 0)
    slow = _run(ops, monkeypatch, 10**9)
    assert fast.refs == slow.refs
    assert list(fast.lru) == list(slow.lru)


@pytest.mark.parametrize("seed", [1, 2])
def test_infersim_cache_passes_match_the_loop(seed):
    from types import SimpleNamespace

    from btbctl.engine.sim.infersim import InferSimReplica

    rng = random.Random(seed)
    sim = SimpleNamespace(fleet_blocks={})
    rep = InferSimReplica(0, SimpleNamespace(budget_blocks=60), sim)  # type: ignore[arg-type]
    ref = PlainInferSimKv(60, None, {})
    for i in range(400):
        root = f"p{rng.randint(0, 5)}:"
        chain = _chain(rng, root, rng.randint(1, 30)) + (f"u{i}",)
        if rng.random() < 0.05:
            chain = chain + chain[:2]
        assert rep.match(chain) == ref.match(chain)
        run = 0
        while run < len(chain) and chain[run] in ref.hbm:
            run += 1
        assert rep.hbm_run(chain) == run
        rep.insert(chain)
        ref.insert(chain)
        assert list(rep.hbm) == list(ref.hbm) and rep.host == set(ref.hwhere)
