"""Pacing (``Route.pace``, btb_plus's rule 6) on the gateway's request path: a request routed with pace ``k`` leaves
the gateway only while fewer than ``k`` of the gateway's requests at its worker wait for a first token; the held
ones go in arrival order as first tokens come back, and a worker going down sends them elsewhere, each once."""

from __future__ import annotations

import asyncio

from gateway_fakes import GatewayEnv, metric_value

ONE = {"sampling_params": {"max_new_tokens": 1}}  # a non-streamed answer whose end is its first token


async def _until(cond, what: str, tries: int = 3000) -> None:
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def _send_in_order(env: GatewayEnv, texts: list[str]) -> list[asyncio.Future]:
    """Post each of ``texts`` once the gateway admitted the previous one (so their arrival order is the list's)."""
    tasks = []
    w = env.gw.state.workers
    for i, text in enumerate(texts):
        tasks.append(asyncio.ensure_future(env.post("/generate", {"text": text, **ONE})))
        await _until(lambda i=i: sum(x.prefilling for x in w) == i + 1, f"request {i} admitted")
    return tasks


async def test_a_paced_worker_gets_at_most_pace_requests_before_a_first_token_and_the_rest_in_order():
    gate = asyncio.Event()
    async with GatewayEnv(2, worker_kw={"first_byte_gate": gate}) as env:
        env.gw.lifecycle.pick = lambda req, excluded: (0, 2)  # every request to worker 0, at most 2 there at a time
        w, fake = env.gw.state.workers[0], env.fleet[0]
        tasks = await _send_in_order(env, [f"paced {i}" for i in range(6)])
        await _until(lambda: len(fake.requests) == 2 and w.paced == 4, "2 sent, 4 held")
        await asyncio.sleep(0.1)
        assert len(fake.requests) == 2 and w.paced == 4 and w.sent_prefilling() == 2
        text = await env.metrics()  # an operator sees them held
        assert metric_value(text, "btb_held_requests", worker=w.name, reason="paced") == 4
        gate.set()
        assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 6
        sent = [body["text"] for _, body in fake.requests]
        assert sorted(sent) == [f"paced {i}" for i in range(6)]  # each once
        assert set(sent[:2]) == {"paced 0", "paced 1"}  # the held ones never went ahead of earlier ones
        assert not env.fleet[1].requests
        assert (w.paced, w.prefilling, w.inflight) == (0, 0, 0)


async def test_pace_one_sends_a_burst_one_at_a_time_in_arrival_order():
    gate = asyncio.Event()
    async with GatewayEnv(1, worker_kw={"first_byte_gate": gate}) as env:
        env.gw.lifecycle.pick = lambda req, excluded: (0, 1)
        texts = [f"one by one {i}" for i in range(5)]
        tasks = await _send_in_order(env, texts)
        await _until(lambda: env.gw.state.workers[0].paced == 4, "4 held")
        gate.set()
        assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 5
        assert [body["text"] for _, body in env.fleet[0].requests] == texts


async def test_unpaced_requests_are_not_held():
    gate = asyncio.Event()
    async with GatewayEnv(1, worker_kw={"first_byte_gate": gate}) as env:
        env.gw.lifecycle.pick = lambda req, excluded: (0, 0)
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": f"at once {i}", **ONE})) for i in range(5)]
        await _until(lambda: len(env.fleet[0].requests) == 5, "all 5 at the worker")
        assert env.gw.state.workers[0].paced == 0
        gate.set()
        assert [st for st, _ in await asyncio.gather(*tasks)] == [200] * 5


async def test_requests_held_for_a_worker_that_goes_down_go_elsewhere_once():
    gate = asyncio.Event()
    async with GatewayEnv(2) as env:
        env.fleet[0].first_byte_gate = gate
        env.gw.lifecycle.pick = lambda req, excluded: (1, 0) if 0 in excluded else (0, 1)
        texts = [f"held {i}" for i in range(4)]
        tasks = await _send_in_order(env, texts)
        w0 = env.gw.state.workers[0]
        await _until(lambda: len(env.fleet[0].requests) == 1 and w0.paced == 3, "1 sent, 3 held")
        # a frozen worker: the one sent there (no first byte yet) and the three held for it all go to worker 1
        env.gw.dataplane.worker_down(0, "test: the worker froze")
        answers = await asyncio.gather(*tasks)
        assert [st for st, _ in answers] == [200] * 4
        assert w0.paced == 0
        assert sorted(b["text"] for _, b in env.fleet[1].requests) == texts  # each once
        assert [b["text"] for _, b in env.fleet[0].requests] == ["held 0"]  # the held ones never went there
        gate.set()


async def test_a_client_that_leaves_while_held_is_never_sent():
    gate = asyncio.Event()
    async with GatewayEnv(1, worker_kw={"first_byte_gate": gate}) as env:
        env.gw.lifecycle.pick = lambda req, excluded: (0, 1)
        tasks = await _send_in_order(env, ["first", "leaves", "third"])
        w = env.gw.state.workers[0]
        await _until(lambda: w.paced == 2, "2 held")
        tasks[1].cancel()  # the client closes its connection
        await asyncio.sleep(0.1)
        gate.set()
        assert [st for st, _ in await asyncio.gather(tasks[0], tasks[2])] == [200, 200]
        assert [b["text"] for _, b in env.fleet[0].requests] == ["first", "third"]
        await _until(lambda: (w.paced, w.prefilling, w.inflight) == (0, 0, 0), "nothing left counted")


async def test_a_held_request_goes_at_its_deadline_or_when_a_first_token_frees_its_turn():
    async with GatewayEnv(1) as env:
        dp, w = env.gw.dataplane, env.gw.state.workers[0]
        loop = asyncio.get_running_loop()
        w.awaiting_first = 1  # one of the gateway's requests is at the worker without its first token
        assert await dp._turn(0, w, 1, loop.time() - 1.0) is None  # past its deadline: it goes anyway
        assert w.paced == 0 and not dp._paced[0]
        held = asyncio.ensure_future(dp._turn(0, w, 1, loop.time() + 60.0))
        await _until(lambda: w.paced == 1, "held")
        assert not held.done()
        w.awaiting_first = 0  # that request got its first token
        dp._next_turns(0)
        assert await held is None and w.paced == 0


async def test_a_first_token_lets_exactly_one_held_request_go():
    """A held request let go counts as sent at once (before its task runs), so one first token at a worker with
    pace 2 lets one request go, not the whole queue."""
    async with GatewayEnv(1) as env:
        dp, w = env.gw.dataplane, env.gw.state.workers[0]
        loop = asyncio.get_running_loop()
        w.awaiting_first = 2
        held = [asyncio.ensure_future(dp._turn(0, w, 2, loop.time() + 60.0)) for _ in range(4)]
        await _until(lambda: w.paced == 4, "4 held")
        w.awaiting_first = 1  # one first token
        dp._next_turns(0)
        assert (w.paced, w.released) == (3, 1)
        dp._next_turns(0)  # a second event before the released task ran: nothing more to let go
        assert (w.paced, w.released) == (3, 1)
        await _until(lambda: held[0].done(), "the first held one went")
        assert held[0].result() is None and w.released == 0 and not any(t.done() for t in held[1:])
        w.awaiting_first = 0
        dp._next_turns(0)
        assert (w.paced, w.released) == (1, 2)  # pace 2: two more go, one still held
        for t in held[1:]:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        assert (w.paced, w.released) == (0, 0)
