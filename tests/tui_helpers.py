"""Shared pieces of the dashboard tests: small deterministic simulations and a wait helper."""

from __future__ import annotations

import time
import unicodedata
from contextlib import asynccontextmanager

from textual import events

from btbctl.engine.config import ClusterConfig
from btbctl.engine.constants import BtbConstants
from btbctl.engine.dashboard.sim_source import SimSource
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.tui.app import build_app

#: A short Bursted window: 3 bursts of 200 requests over 20 s each, sharing 8,192-token prefixes (32 blocks of
#: 256 tokens), on 4 replicas of Llama-3.3-70B over 4 x H100 each.
SMALL = {
    "bursts": 3,
    "burst_size": 200,
    "first_burst_s": 2.0,
    "burst_period_s": 10.0,
    "jitter_s": 0.0,
    "spread_s": 20.0,
    "prefix_tokens": 8192,
    "suffix_tokens": 256,
    "decoys": 10,
    "decoy_start_s": 1.0,
    "decoy_end_s": 40.0,
}
SMALL_CONSTANTS = BtbConstants(prefix_blocks=32, threshold=2, window_s=1.0, replicas=4)


def small_source(*, paced: bool = False, speed: float = 1.0, policy: str = "btb", **overrides) -> SimSource:
    params = BurstedParams(**{**SMALL, **overrides})
    trace = generate_bursted(params, seed=7)
    return SimSource(trace, ClusterConfig(), SMALL_CONSTANTS, policy, seed=7, speed=speed, paced=paced, start_s=0.0)


async def wait_for(pilot, cond, timeout_s: float = 10.0, step_s: float = 0.02) -> float:
    """Pump the app until ``cond()`` holds; returns the seconds it took. Fails the test on timeout."""
    t0 = time.perf_counter()
    while not cond():
        if time.perf_counter() - t0 > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await pilot.pause(step_s)
    return time.perf_counter() - t0


async def press(pilot, *keys: str) -> None:
    """Send ``keys`` to the app as its terminal driver would, in order. Unlike ``pilot.press`` this does not wait
    for the process to look idle after each key (up to 2 s a key while a simulation or 20 Hz polling keeps the app
    busy): the caller waits for the effect it expects (:func:`wait_for`)."""
    app = pilot.app
    for key in keys:
        try:
            char: str | None = unicodedata.lookup(key.upper().replace("_", " "))
        except KeyError:
            char = key if len(key) == 1 else None
        ev = events.Key(key, char)
        ev.set_sender(app)
        app.post_message(ev)
    await pilot.pause(0.02)


@asynccontextmanager
async def running_app(source, size: tuple[int, int], poll_hz: float = 20):
    """The dashboard on ``source`` under a pilot at ``size``, once it has applied its first snapshot:
    yields ``(app, pilot)``."""
    app = build_app(source, poll_hz=poll_hz)
    async with app.run_test(size=size) as pilot:
        await wait_for(pilot, lambda: app.applied >= 1)
        yield app, pilot
