"""Gateway data plane against fake workers on loopback: routing, streaming, TTFT, retries, bad input."""

from __future__ import annotations

import asyncio
import json

import pytest

from btbctl.engine.policies import POLICIES
from gateway_fakes import GatewayEnv, metric_value, until

TEXT = "shared prefix " * 8  # 112 bytes = 28 pseudo-tokens = 7 blocks of 4 tokens


@pytest.mark.parametrize("policy", list(POLICIES))
async def test_every_policy_routes_and_counts(policy):
    async with GatewayEnv(3, policy=policy) as env:
        assert env.gw.page_size == 4  # taken from the workers' /btb/info
        answers = []
        for i in range(6):
            status, ans = await env.post("/generate", {"text": f"{i} {TEXT}"})
            assert status == 200, ans
            answers.append(ans["text"])
        assert sum(len(w.requests) for w in env.fleet) == 6
        assert all(a.startswith("answer ") for a in answers)
        m = await env.metrics()
        assert metric_value(m, "btb_requests_total", policy=policy, status="200") == 6
        if policy == "round_robin":
            assert [len(w.requests) for w in env.fleet] == [2, 2, 2]
        assert all(w.inflight == 0 and w.prefilling == 0 and not w.pending for w in env.gw.state.workers)


async def test_cache_aware_sticks_to_the_first_holder_and_openai_routes_forward():
    async with GatewayEnv(3, policy="cache_aware") as env:
        for _ in range(4):
            status, _ = await env.post("/v1/completions", {"prompt": TEXT, "max_tokens": 1})
            assert status == 200
        counts = sorted(len(w.requests) for w in env.fleet)
        assert counts == [0, 0, 4]
        status, _ = await env.post("/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}]})
        assert status == 200
        path, sent = next(r for w in env.fleet for r in w.requests if r[0] == "/v1/chat/completions")
        assert sent["messages"][0]["content"] == TEXT  # the body is forwarded unchanged
        async with env.http.get(env.url + "/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake"
        async with env.http.get(env.url + "/health") as r:
            assert r.status == 200 and (await r.json())["healthy"] == 3


async def test_streaming_is_passed_through_chunk_by_chunk_and_ttft_is_measured():
    rest = asyncio.Event()  # the worker holds the stream after its first chunk until this is set
    async with GatewayEnv(
        2, policy="round_robin", worker_kw={"first_byte_delay_s": 0.15, "chunks": 4, "chunk_gate": rest}
    ) as env:
        lines = []
        ttft_at_first_chunk = None
        async with env.http.post(env.url + "/generate", json={"text": TEXT, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                if line.startswith(b"data:"):
                    lines.append(line.strip())
                    if len(lines) == 1:
                        # the first chunk reached the client while the worker still holds the rest: chunks are
                        # passed through as they come, and TTFT is taken at the first one, not at the end
                        assert not rest.is_set()
                        ttft_at_first_chunk = metric_value(await env.metrics(), "btb_ttft_seconds_count")
                        rest.set()
        assert lines[-1] == b"data: [DONE]" and len(lines) == 5
        assert ttft_at_first_chunk == 1
        m = await env.metrics()
        assert metric_value(m, "btb_ttft_seconds_count") == 1
        ttft = metric_value(m, "btb_ttft_seconds_sum")
        assert ttft >= 0.14  # it includes the worker's 0.15 s before its first byte
        status, series = await env.get_control("/control/ttft?window_s=10&step_s=1")
        assert status == 200 and series["summary"]["n"] == 1
        assert series["summary"]["p50_s"] == pytest.approx(ttft)


@pytest.mark.parametrize("mode", ["abort_before", "500"])
async def test_failure_before_first_byte_is_retried_elsewhere_once(mode):
    async with GatewayEnv(3, policy="round_robin", max_retries=2, health_interval_s=60.0) as env:
        # no health probe within the test: a probe of the 500-answering worker would find /health fine and mark it
        # healthy again before the check below
        bad = env.fleet[0]
        bad.fail = mode
        results = await asyncio.gather(
            *(env.post("/generate", {"text": f"{i} {TEXT}", "stream": s}) for i in range(6) for s in (False, True))
        )
        assert all(st == 200 for st, _ in results), results
        served = sum(len(w.requests) for w in env.fleet[1:])
        assert served == 12  # every request answered exactly once by a good worker
        assert len(bad.requests) >= 1
        w0 = env.gw.state.workers[0]
        assert not w0.healthy and w0.health_error
        m = await env.metrics()
        assert metric_value(m, "btb_retries_total") == len(bad.requests)
        assert metric_value(m, "btb_requests_total", status="200") == 12


async def test_retries_are_bounded_by_the_retry_budget_and_never_duplicate_an_answer():
    """Two of three workers fail every request (HTTP 500) while the third holds its answers; 30 requests at once.
    Before: every failed request was sent again (a retry storm: the surviving worker got the failed ones' whole
    queue). Expected: at most max(retry_budget_min, retry_budget_percent of the requests in flight) retries at once;
    the others are answered 503 with Retry-After; every request is answered once."""
    gate = asyncio.Event()
    cfg = {"retry_budget_percent": 10.0, "retry_budget_min": 2, "health_interval_s": 60.0}
    async with GatewayEnv(3, policy="round_robin", max_retries=2, **cfg) as env:
        env.fleet[0].fail = env.fleet[1].fail = "500"
        good = env.fleet[2]
        good.first_byte_gate = gate
        tasks = [asyncio.ensure_future(env.post("/generate", {"text": f"{i} {TEXT}"})) for i in range(30)]
        await until(lambda: sum(t.done() for t in tasks) + len(good.requests) >= 30)
        gate.set()
        results = await asyncio.gather(*tasks)
        codes = [st for st, _ in results]
        assert set(codes) <= {200, 503}, codes
        seen: dict[str, set[int]] = {}  # request text -> workers that got it
        for k, w in enumerate(env.fleet):
            for _, body in w.requests:
                seen.setdefault(body["text"], set()).add(k)
        at_good = [t for t, ws in seen.items() if 2 in ws]
        assert codes.count(200) == len(at_good) == len(good.requests)  # each answered once, by the good worker
        retried = [t for t in at_good if seen[t] & {0, 1}]
        assert 1 <= len(retried) <= 3, seen  # max(2, 10% of 30) at once, and these stayed in flight there
        assert codes.count(503) == sum(1 for ws in seen.values() if 2 not in ws)
        m = await env.metrics()
        assert metric_value(m, "btb_retries_denied_total") == codes.count(503)


async def test_failure_after_first_byte_ends_the_stream_with_an_error_and_is_not_retried():
    async with GatewayEnv(2, policy="round_robin", worker_kw={"chunks": 5, "chunk_delay_s": 0.01}) as env:
        env.fleet[0].fail = "abort_after_first"
        async with env.http.post(env.url + "/generate", json={"text": TEXT, "stream": True}) as r:
            assert r.status == 200
            raw = await r.read()
        events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
        assert events[0]["text"] == "chunk0"
        assert events[-1]["error"]["type"] == "upstream_error"
        assert b"[DONE]" not in raw
        assert [len(w.requests) for w in env.fleet] == [1, 0]  # never sent twice
        assert not env.gw.state.workers[0].healthy
        m = await env.metrics()
        assert metric_value(m, "btb_requests_total", status="stream_error") == 1
        assert metric_value(m, "btb_retries_total") == 0


async def test_no_healthy_worker_gives_503_and_exhausted_retries_502():
    async with GatewayEnv(2, policy="least_load", max_retries=1, health_interval_s=5.0) as env:
        for w in env.fleet:
            w.fail = "500"
        status, ans = await env.post("/generate", {"text": TEXT})
        assert status == 502 and len(ans["error"]["attempts"]) == 2
        status, ans = await env.post("/generate", {"text": TEXT})
        assert status == 503 and ans["error"]["message"] == "no healthy worker"
        async with env.http.get(env.url + "/health") as r:
            assert r.status == 503


async def test_killed_worker_mid_burst_loses_nothing_and_is_marked_unhealthy():
    first_byte = asyncio.Event()  # the workers hold every first byte until this is set
    async with GatewayEnv(
        3, policy="round_robin", worker_kw={"first_byte_gate": first_byte, "chunks": 3, "chunk_delay_s": 0.05}
    ) as env:
        victim = env.fleet[1]

        async def one(i):
            return await env.post("/generate", {"text": f"{i} {TEXT}", "stream": i % 2 == 0})

        tasks = [asyncio.ensure_future(one(i)) for i in range(30)]
        for _ in range(500):  # all 30 reach a worker; none has a first byte yet
            if sum(len(w.requests) for w in env.fleet) == 30:
                break
            await asyncio.sleep(0.01)
        assert [len(w.requests) for w in env.fleet] == [10, 10, 10]
        await victim.kill()
        first_byte.set()
        results = await asyncio.gather(*tasks)
        assert all(st == 200 for st, _ in results), [r for r in results if r[0] != 200]
        for _, ans in results:  # exactly one answer each; streams complete
            if isinstance(ans, str):
                assert ans.rstrip().endswith("data: [DONE]") and "error" not in ans
        assert not env.gw.state.workers[1].healthy
        # requests the victim had taken were retried; the survivors answered all 30
        assert sum(len(w.requests) for w in (env.fleet[0], env.fleet[2])) == 30
        await asyncio.sleep(0.5)  # the health checker keeps it down
        status, fleet = await env.get_control("/control/fleet")
        assert [w["healthy"] for w in fleet["workers"]] == [True, False, True]


async def test_bad_input_gets_4xx_and_the_gateway_keeps_serving():
    async with GatewayEnv(2, max_body_bytes=8192) as env:
        cases = [
            ("/generate", b"{not json", 400, "malformed JSON"),
            ("/generate", b"[1, 2]", 400, "object"),
            ("/generate", b"{}", 400, "'text' or 'input_ids'"),
            ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
            ("/v1/chat/completions", b'{"model": "x"}', 400, "messages"),
            ("/generate", b"\xff\xfe\x00", 400, "malformed JSON"),
            ("/generate", b"[" * 3000 + b"]" * 3000, 400, "malformed JSON"),
            ("/generate", json.dumps({"text": "x" * 16384}).encode(), 413, "exceeds"),
        ]
        for path, data, want, word in cases:
            async with env.http.post(env.url + path, data=data) as r:
                assert r.status == want, (path, data[:20])
                ans = await r.json()
                assert word in ans["error"]["message"]
        async with env.http.get(env.url + "/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "not_found"
        async with env.http.get(env.url + "/generate") as r:
            assert r.status == 405

        # a chunked body (no Content-Length) over the limit is refused too
        async def gen():
            for _ in range(8):
                yield b"x" * 2048

        async with env.http.post(env.url + "/generate", data=gen()) as r:
            assert r.status == 413
        assert sum(len(w.requests) for w in env.fleet) == 0
        status, _ = await env.post("/generate", {"text": TEXT})
        assert status == 200


async def test_health_checker_marks_down_and_revives_with_an_empty_record():
    async with GatewayEnv(2, policy="round_robin", health_interval_s=0.05, unhealthy_after=2) as env:
        await env.post("/generate", {"text": TEXT})
        w0 = env.gw.state.workers[0]
        assert w0.holdings
        env.fleet[0].health_status = 503
        for _ in range(100):
            if not w0.healthy:
                break
            await asyncio.sleep(0.02)
        assert not w0.healthy and "503" in w0.health_error and not w0.holdings
        for _ in range(4):  # while it is down everything goes to the other one
            assert (await env.post("/generate", {"text": TEXT}))[0] == 200
        assert len(env.fleet[0].requests) == 1 and len(env.fleet[1].requests) == 4
        env.fleet[0].health_status = 200
        for _ in range(100):
            if w0.healthy:
                break
            await asyncio.sleep(0.02)
        assert w0.healthy and w0.health_error is None
        m = await env.metrics()
        assert metric_value(m, "btb_worker_healthy", worker="w0") == 1
