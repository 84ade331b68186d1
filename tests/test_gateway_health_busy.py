"""Health that tells busy from dead: a slow ``/health`` degrades a worker that is answering, it does not remove it;
with no healthy worker the gateway keeps sending to the ones that answer; a frozen or refusing worker is still
marked down and its requests move. ``benchmarks/bench_slow_health.py`` measures the first case at full size."""

from __future__ import annotations

import asyncio

import aiohttp

from btbctl.engine.gateway.health import HealthProber
from btbctl.engine.gateway.state import FleetState
from gateway_fakes import FakeWorker, GatewayEnv, until

TEXT = "slow health check " * 6
#: probes every 0.1 s with a 0.1 s timeout: a 0.3 s /health is slow, as 3 s is for the 1 s / 2 s defaults
FAST = {"health_interval_s": 0.1, "health_timeout_s": 0.1, "progress_window_s": 1.0}


async def _post(env: GatewayEnv, i: int, stream: bool) -> int:
    status, body = await env.post("/generate", {"text": f"{i} {TEXT}", "stream": stream})
    if stream and status == 200:  # a complete stream, not one cut by an error event
        assert "[DONE]" in body and "upstream_error" not in body, body
    return status


async def test_slow_health_on_every_worker_does_not_turn_a_working_fleet_into_errors():
    kw = {"first_byte_delay_s": 0.02, "chunks": 4, "chunk_delay_s": 0.02}
    async with GatewayEnv(4, policy="round_robin", worker_kw=kw, **FAST) as env:
        ws = env.gw.state.workers
        assert all(w.healthy for w in ws)
        for f in env.fleet:
            f.health_delay_s = 0.3  # beyond health_timeout_s; generation unaffected

        async def one(i: int) -> int:
            await asyncio.sleep(i * 0.01)  # 200 requests over 2 s
            return await _post(env, i, i % 2 == 0)

        statuses = await asyncio.gather(*(one(i) for i in range(200)))
        assert statuses == [200] * 200, {s: statuses.count(s) for s in set(statuses)}
        assert sum(len(f.requests) for f in env.fleet) == 200  # none sent twice
        assert all(w.healthy and w.degraded for w in ws), [(w.healthy, w.degraded, w.health_error) for w in ws]
        await asyncio.sleep(0.5)  # idle now: their late /health answers are the signs of life
        assert all(w.healthy and w.degraded for w in ws)
        for f in env.fleet:
            f.health_delay_s = 0.0
        await until(lambda: all(w.healthy and w.degraded is None for w in ws))


async def test_with_no_healthy_worker_the_gateway_sends_to_the_ones_answering():
    async with GatewayEnv(2, policy="round_robin", worker_kw={"health_delay_s": 0.3}, **FAST) as env:
        ws = env.gw.state.workers
        assert not any(w.healthy for w in ws)  # their startup check timed out
        async with env.http.get(env.url + "/health") as r:  # a load balancer in front keeps sending
            assert r.status == 200 and (await r.json())["status"] == "degraded"
        async with env.http.get(env.url + "/v1/models") as r:
            assert r.status == 200
        statuses = [await _post(env, i, i % 2 == 0) for i in range(10)]
        assert statuses == [200] * 10
        assert sum(len(f.requests) for f in env.fleet) == 10
        await until(lambda: all(w.healthy and w.degraded for w in ws))  # back, degraded: answering, slow /health


async def test_a_worker_that_answered_then_froze_is_marked_down_and_its_waiting_requests_move():
    never = asyncio.Event()
    cfg = {**FAST, "progress_window_s": 0.5}
    async with GatewayEnv(2, policy="round_robin", first_byte_timeout_s=30, **cfg) as env:
        for i in range(4):
            assert await _post(env, i, False) == 200
        frozen = env.fleet[0]
        frozen.first_byte_gate = never  # no first byte, and /health never in time: a frozen process
        frozen.health_delay_s = 60
        statuses = await asyncio.wait_for(asyncio.gather(*(_post(env, 10 + i, i % 2 == 0) for i in range(6))), 10)
        assert statuses == [200] * 6
        assert not env.gw.state.workers[0].healthy
        assert len(frozen.requests) == 2 + 3 and len(env.fleet[1].requests) == 2 + 6  # each answered once


async def test_the_prober_degrades_a_slow_worker_with_signs_of_life_and_downs_a_silent_or_refusing_one():
    fake = await FakeWorker(health_delay_s=30).start()
    now = [100.0]
    state = FleetState([fake.url], clock=lambda: now[0])  # type: ignore[arg-type]
    w = state.workers[0]
    w.healthy, w.btb = True, True
    calls: list[str] = []
    try:
        async with aiohttp.ClientSession() as s:
            p = HealthProber(
                state.workers,
                lambda: s,
                lambda: now[0],
                interval_s=1.0,
                timeout_s=0.05,
                unhealthy_after=2,
                on_down=lambda w, r: calls.append("down"),
                on_info=lambda w, i: None,
                on_up=lambda w: calls.append("up"),
                on_loads=lambda w, x: None,
                on_degraded=lambda w, r: calls.append("degraded"),
                progress_window_s=5.0,
            )
            w.last_progress_s = 97.0  # 3 s ago: within the window
            for _ in range(3):
                await p.probe(w)
            assert calls == ["degraded"] * 3 and w.failure_kind == "slow"
            now[0] = 103.0  # 6 s after its last sign of life: silent
            await p.probe(w)
            assert calls[-1] == "down"

            calls.clear()
            await fake.kill()
            w.consecutive_failures = 0
            w.last_progress_s = now[0]  # just answered, but now refuses connections
            await p.probe(w)
            await p.probe(w)
            assert calls == ["down"] and w.failure_kind == "refused"
            await p.stop()
    finally:
        await fake.kill()


def test_the_fallback_takes_the_workers_answering_or_only_slow_never_refusing_ones():
    now = [50.0]
    state = FleetState([f"http://127.0.0.1:{9000 + i}" for i in range(4)], clock=lambda: now[0])  # type: ignore[arg-type]
    state.progress_window_s = 5.0
    a, b, c, d = state.workers
    a.failure_kind, a.last_progress_s = "error", 48.0  # an error answer, but answering: in
    b.failure_kind, b.last_progress_s = "refused", 49.0  # refused connections: out
    c.failure_kind = "slow"  # /health times out, nothing in flight: in (one request finds out)
    d.failure_kind = "error"  # an error answer and no sign of life: out
    assert [w.index for w in state.fallback([])] == [0, 2]
    c.inflight = 1  # one request there already
    assert [w.index for w in state.fallback([])] == [0]
    assert state.fallback([0]) == []
    now[0] = 60.0  # a's sign of life is 12 s old
    assert state.fallback([]) == []
