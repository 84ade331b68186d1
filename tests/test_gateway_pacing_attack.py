"""Attacks on the gateway's pacing (``Route.pace``): each test pins a property the pacing must keep."""

from __future__ import annotations

import asyncio

from btbctl.engine.gateway.state import Transfer
from gateway_fakes import BURST_TEXT, GatewayEnv, until

ONE = {"sampling_params": {"max_new_tokens": 1}}  # a non-streamed answer whose end is its first token


async def test_paced_requests_that_waited_for_a_push_copy_are_not_held_forever():
    """Two requests for worker 0 (pace 1) wait for a planned push copy to be accepted (``_await_copy_accepted``):
    meanwhile they count as sent. When the copy is accepted, the first finds the second "sent" and is held; the
    second finds a queue and is held: nothing is at the worker, so no first token ever releases them."""
    async with GatewayEnv(2) as env:
        env.gw.lifecycle.pick = lambda req, excluded: (0, 1)
        w, fake = env.gw.state.workers[0], env.fleet[0]
        chain = tuple(fake.chain_of("/generate", {"text": BURST_TEXT}))
        pushed = asyncio.Event()
        t = Transfer(copy_id="c-test", key=chain[3], chain=chain[:4], source=1, target=0, pushed=pushed)
        env.gw.state.transfers.add(t)
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": BURST_TEXT + str(i), **ONE})) for i in range(2)]
        await until(lambda: w.prefilling == 2)
        pushed.set()  # the target accepted the copy: both go on to their turn
        try:
            await until(lambda: len(fake.requests) >= 1, timeout_s=2.0)  # fails: both held, none sent
        except AssertionError:
            raise AssertionError(f"none sent: paced={w.paced} sent_prefilling={w.sent_prefilling()}") from None
        finally:
            if not fake.requests:
                await _drain(tasks)
        answers = await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert [st for st, _ in answers] == [200, 200]
        assert (w.paced, w.prefilling, w.inflight) == (0, 0, 0)


async def _drain(tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_non_streamed_answer_holds_its_pace_slot_only_until_its_first_token_not_its_whole_decode():
    """A non-streamed answer reaches the gateway whole, so the gateway ends its "prefill" only at the answer's
    end: with pace 1 a worker serves paced non-streamed requests one whole generation at a time (a decode batch
    of 1). Here the worker sends the headers and a first part of the body at once (prefill done) and the rest
    later (decode); the next paced request should not wait for the end of the decode."""
    from aiohttp import web

    decode = asyncio.Event()
    async with GatewayEnv(1) as env:
        fake = env.fleet[0]

        async def generate(request):  # a worker whose JSON answer is written in two parts
            body = await request.json()
            fake.requests.append((request.path, body))
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"text": "')
            await decode.wait()
            await resp.write(b'answer"}')
            await resp.write_eof()
            return resp

        fake.generate = generate  # bound on the app's router at start: patch the route instead
        for r in fake.runner.app.router.routes():
            if r.method == "POST" and r.resource.canonical == "/generate":
                r._handler = generate
        env.gw.lifecycle.pick = lambda req, excluded: (0, 1)
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": f"long answer {i}"})) for i in range(2)]
        try:
            try:
                await until(lambda: len(fake.requests) == 2, timeout_s=2.0)  # fails: the second waits for the decode
            except AssertionError:
                w = env.gw.state.workers[0]
                raise AssertionError(f"sent {len(fake.requests)}, paced={w.paced}, prefilling={w.prefilling}") from None
        finally:
            decode.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_request_released_in_the_same_tick_its_worker_goes_down_is_not_sent_there():
    """``_next_turns`` resolves a held request's future; if the worker is marked down (frozen) before that request
    runs again, ``worker_down`` finds the future done and leaves it: the request is then sent to the down worker
    and registers its first-byte waiter after ``worker_down`` ran, so it waits there up to
    ``first_byte_timeout_s`` (300 s by default) instead of going elsewhere."""
    gate = asyncio.Event()
    async with GatewayEnv(2, first_byte_timeout_s=30.0) as env:
        env.fleet[0].first_byte_gate = gate
        env.gw.lifecycle.pick = lambda req, excluded: (1, 0) if 0 in excluded else (0, 1)
        dp = env.gw.dataplane
        w0 = env.gw.state.workers[0]
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": "first", **ONE}))]
        await until(lambda: len(env.fleet[0].requests) == 1)
        tasks.append(asyncio.ensure_future(env.post("/generate", {"text": "second", **ONE})))
        await until(lambda: w0.paced == 1)
        original = dp._next_turns

        def release_then_down(idx: int) -> None:
            original(idx)
            if idx == 0 and w0.healthy:  # the health checker marks it down in the same tick
                env.gw.lifecycle.worker_down(w0, "test: frozen")
                dp.worker_down(0, "test: frozen")

        dp._next_turns = release_then_down
        gate.set()  # "first" gets its first byte: "second" is released, then worker 0 goes down
        env.fleet[0].first_byte_gate = asyncio.Event()  # worker 0 is frozen from now on
        try:
            try:
                await until(lambda: any(b["text"] == "second" for _, b in env.fleet[1].requests), timeout_s=2.0)
            except AssertionError:
                raise AssertionError(
                    f"worker 0 got {[b['text'] for _, b in env.fleet[0].requests]} while unhealthy={not w0.healthy}"
                ) from None
            assert [b["text"] for _, b in env.fleet[0].requests] == ["first"]
        finally:
            env.fleet[0].first_byte_gate.set()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_counters_return_to_zero_after_a_paced_storm_with_leavers_failures_and_a_worker_down():
    """A storm on two workers with pace 2: clients that leave while held, 4xx answers, a worker that fails with
    500s; every request that stays is answered once, and ``paced``, ``prefilling``, ``inflight`` end at 0."""
    async with GatewayEnv(3, worker_kw={"first_byte_delay_s": 0.02}) as env:
        env.gw.lifecycle.pick = lambda req, excluded: next(((i, 2) for i in (0, 1, 2) if i not in excluded), None)
        env.fleet[0].fail = "500"
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": f"storm {i}"})) for i in range(40)]
        await asyncio.sleep(0.03)
        for t in tasks[5:40:7]:
            t.cancel()
        env.fleet[1].fail = "400"
        await asyncio.sleep(0.05)
        env.fleet[1].fail = None
        answers = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20.0)
        kept = [a for a in answers if not isinstance(a, BaseException)]
        assert kept and all(st in (200, 400, 503) for st, _ in kept)  # 503: the retry budget (worker 0 fails all)
        ws = env.gw.state.workers
        await until(lambda: all((w.paced, w.prefilling, w.inflight) == (0, 0, 0) for w in ws), timeout_s=5.0)
        assert env.gw.dataplane.inflight == 0 and env.gw.dataplane.retrying == 0
        assert not any(env.gw.dataplane._paced.get(i) for i in range(3))


async def test_requests_held_for_a_worker_that_goes_down_are_routed_again_without_spending_the_retry_budget():
    """20 requests held at the gateway for worker 0 (never sent there) when it goes down: routing them again is no
    retry of work the fleet did, yet each takes a slot of the retry budget (10 here), and the rest are answered
    503 although worker 1 is idle."""
    gate = asyncio.Event()
    async with GatewayEnv(2) as env:
        env.fleet[0].first_byte_gate = gate
        env.gw.lifecycle.pick = lambda req, excluded: (1, 0) if 0 in excluded else (0, 1)
        w0 = env.gw.state.workers[0]
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": "sent", **ONE}))]
        await until(lambda: len(env.fleet[0].requests) == 1)
        tasks += [asyncio.ensure_future(env.post("/generate", {"text": f"held {i}", **ONE})) for i in range(20)]
        await until(lambda: w0.paced == 20)
        env.gw.dataplane.worker_down(0, "test: the worker froze")
        try:
            answers = await asyncio.wait_for(asyncio.gather(*tasks[1:]), 10.0)
            assert [st for st, _ in answers] == [200] * 20
        finally:
            gate.set()
            await asyncio.gather(*tasks, return_exceptions=True)
