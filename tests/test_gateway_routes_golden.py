"""The gateway's routing decisions over a fixed-seed live scenario, checked against stored routes.

A real :class:`~btbctl.engine.gateway.server.Gateway` (never started: no sockets) on a clock the test moves runs a
burst and background traffic through its request lifecycle as the data plane does (``pick``, ``start``, ``sent``,
``first_byte``, ``answered``, ``end``), while the copies the policy orders progress (bytes, blocks the source has
computed) and end (``done`` or ``failed``) through the replicator, and a worker's ``/v1/loads`` report comes in.
Every decision (worker, pace, the copy plans) is recorded. A change that makes the decision cheaper (a cache of
prices kept between decisions, an incremental summary) must route every request of it the same: the decision
benchmark never starts a request, so it cannot show a price that went stale while requests ran.

Regenerate after an intended change of the routing rules with ``BTBCTL_UPDATE_GOLDEN=1 pytest
tests/test_gateway_routes_golden.py`` and explain the change in the commit message.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import os
import random
from pathlib import Path

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyOutcome, CopyState
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.gateway.server import Gateway
from btbctl.engine.trace.model import Request

GOLDEN = Path(__file__).parent / "golden" / "live_routes.json"
POLICIES = ("btb_plus", "btb", "cache_aware")
WORKERS = 6
PAGE = 16
CONSTANTS = BtbConstants(prefix_blocks=4, threshold=3, window_s=2.0, warm_replicas=3)


class _Clock:
    """The gateway's clock, moved by the scenario (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _prompts(rng: random.Random) -> list[tuple[tuple, int]]:
    """``(chain, input tokens)`` of each request: two bursts sharing a 16-block prefix (one of them sharing a
    deeper 32-block one too), conversations that grow turn by turn, and one-off prompts, interleaved."""
    out: list[tuple[tuple, int]] = []
    convs = [[f"c{k}:{j}" for j in range(6)] for k in range(3)]
    for i in range(220):
        r = rng.random()
        if 40 <= i < 120 and r < 0.7:  # burst A
            deep = 32 if rng.random() < 0.5 else 16
            chain = tuple(f"A:{j}" for j in range(deep)) + tuple(f"A{i}:{j}" for j in range(rng.randint(0, 3)))
        elif 130 <= i < 180 and r < 0.6:  # burst B
            chain = tuple(f"B:{j}" for j in range(16)) + tuple(f"B{i}:{j}" for j in range(rng.randint(1, 4)))
        elif r < 0.85:  # a conversation's next turn
            conv = convs[rng.randrange(len(convs))]
            conv.extend(f"{conv[0]}:{len(conv)}:{j}" for j in range(rng.randint(1, 3)))
            chain = tuple(conv)
        else:
            chain = tuple(f"o{i}:{j}" for j in range(rng.randint(1, 40)))
        out.append((chain, len(chain) * PAGE - rng.randrange(PAGE)))
    return out


def _gateway(policy: str, clock: _Clock) -> Gateway:
    urls = [f"http://127.0.0.1:{21000 + i}" for i in range(WORKERS)]
    cfg = GatewayConfig(workers=urls, policy=policy, page_size=PAGE, seed=5, token="x", constants=CONSTANTS)
    gw = Gateway(cfg, clock)  # type: ignore[arg-type]
    for w in gw.state.workers:
        w.healthy, w.health_error, w.btb = True, None, True
        w.info = {"page_size": PAGE, "transfer_addr": f"127.0.0.1:{31000 + w.index}", "capacity_tokens": 1 << 16}
        w.capacity_blocks = (1 << 16) // PAGE
    gw._settle_page_size()
    gw._install_policy(gw.policy, None)

    async def job(t, source_confirmed=False) -> None:  # the copy itself: driven by the scenario
        return None

    gw.replicator._job = job  # type: ignore[method-assign]
    return gw


async def _scenario(policy: str) -> list:
    rng = random.Random(11)
    clock = _Clock()
    gw = _gateway(policy, clock)
    life, state = gw.lifecycle, gw.state
    routes: list = []
    events: list[tuple[float, int, str, object]] = []  # (time, tie, kind, attempt or transfer)
    tie = 0
    seen_copies: set[str] = set()
    for i, (chain, tokens) in enumerate(_prompts(rng)):
        clock.now += rng.expovariate(40.0)
        while events and events[0][0] <= clock.now:  # what happened before this arrival, in time order
            at, _, kind, obj = heapq.heappop(events)
            now, clock.now = clock.now, at
            if kind == "first_byte":
                life.first_byte(obj, at)  # type: ignore[arg-type]
            elif kind == "end":
                life.answered(obj, "200")  # type: ignore[arg-type]
                life.end(obj)  # type: ignore[arg-type]
            elif kind == "progress":
                t = obj
                if t.active:  # type: ignore[attr-defined]
                    t.started_s = t.started_s if t.started_s is not None else at  # type: ignore[attr-defined]
                    t.blocks_available = len(t.chain)  # type: ignore[attr-defined]
                    t.bytes_sent = t.bytes_total // 2  # type: ignore[attr-defined]
            elif kind == "copy_end":
                t = obj
                if t.active:  # type: ignore[attr-defined]
                    ok = rng.random() < 0.8
                    gw.replicator._finish(
                        t,  # type: ignore[arg-type]
                        CopyState.DONE if ok else CopyState.FAILED,
                        "copy_done" if ok else "copy_failed",
                        None if ok else "scenario",
                        outcome=CopyOutcome.DONE if ok else CopyOutcome.FAILED,
                    )
            clock.now = now
        if i == 150:  # a worker's loads report: other requests wait there, its KV is nearly full
            state.workers[2].new_loads({"max_tokens": 4096, "used_tokens": 4000, "waiting": 3})
        req = Request(str(i), clock.now, tokens, rng.randint(1, 40), chain)
        pick = life.pick(req, ())
        assert pick is not None
        idx, pace = pick
        plans = []  # the copies this decision ordered
        for t in state.transfers.all():
            if t.copy_id not in seen_copies:
                seen_copies.add(t.copy_id)
                plans.append([t.source, t.target, len(t.chain), t.state.value])
        routes.append([i, idx, pace, plans])
        for t in state.transfers.all():
            if t.active and t.bytes_total == 0:
                t.bytes_total = len(t.chain) * PAGE * 1024
                t.blocks_available = 0
                heapq.heappush(events, (clock.now + rng.uniform(0.01, 0.05), tie := tie + 1, "progress", t))
                heapq.heappush(events, (clock.now + rng.uniform(0.06, 0.3), tie := tie + 1, "copy_end", t))
        a = life.start(req, idx, pace, early=True)
        life.sent(a)
        prefill_s = 0.002 * (1 + len(chain) - min(len(chain), state.workers[idx].held_blocks(chain)))
        heapq.heappush(events, (clock.now + prefill_s * rng.uniform(0.8, 1.5), tie := tie + 1, "first_byte", a))
        heapq.heappush(events, (clock.now + prefill_s + rng.uniform(0.05, 0.6), tie := tie + 1, "end", a))
    await asyncio.sleep(0)
    return routes


def compute() -> dict:
    return {p: asyncio.run(_scenario(p)) for p in POLICIES}


def test_live_routes_match_golden() -> None:
    got = json.loads(json.dumps(compute()))
    if os.environ.get("BTBCTL_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, separators=(",", ":")).replace("],[", "],\n[") + "\n")
    want = json.loads(GOLDEN.read_text())
    for policy in POLICIES:
        diff = [(g, w) for g, w in zip(got[policy], want[policy], strict=True) if g != w]
        assert not diff, f"{policy}: {len(diff)} decisions differ, first (got, stored): {diff[0]}"


def test_the_scenario_exercises_copies_pacing_and_spread() -> None:
    """Guards the stored routes against a scenario that tests nothing: btb_plus copies, paces and spreads the
    bursts; the policies do not all route alike."""
    want = json.loads(GOLDEN.read_text())
    plus = want["btb_plus"]
    assert sum(len(r[3]) for r in plus) >= 3  # copies ordered
    assert any(r[2] > 0 for r in plus)  # paced routes
    assert len({r[1] for r in plus[40:120]}) >= 3  # burst A spread over several workers
    assert sum(len(r[3]) for r in want["btb"]) >= 1
    assert [r[1] for r in plus] != [r[1] for r in want["cache_aware"]]
