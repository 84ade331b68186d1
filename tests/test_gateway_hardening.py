"""Gateway hardening: descriptor exhaustion, idle half-sent connections, big bodies, frozen workers.

The descriptor tests run the gateway in a child process under a lowered ``RLIMIT_NOFILE`` (scaled down from the
field report: 2,000 streams under ``ulimit -n 1024`` becomes 2 streams per descriptor here too), with fake workers
in this process. Nothing here asserts an absolute wall time: stalls are compared with a baseline taken in the same
run, and waits are bounded by the configured timeouts.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from btbctl.engine.gateway import GatewayConfig, serve_gateway
from gateway_fakes import GatewayEnv, metric_value, start_fleet, stop_fleet

CHILD = Path(__file__).with_name("gateway_child.py")
TEXT = "shared prefix " * 8


async def _child_gateway(tmp_path, nofile: int, **cfg):
    log = open(tmp_path / "gateway.log", "wb")
    config = {"port": 0, "control_port": 0, "token": "t", "health_interval_s": 0.2, **cfg}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILD.parent.parent), os.environ.get("PYTHONPATH", "")])}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(CHILD), str(nofile), json.dumps(config), stdout=asyncio.subprocess.PIPE, stderr=log, env=env
    )
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    assert line.startswith("ready "), (line, (tmp_path / "gateway.log").read_text())
    _, data_url, control_url = line.split()
    return proc, data_url, control_url


async def _end(proc) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()


async def _fleet_health(http, control_url: str) -> list[bool]:
    async with http.get(control_url + "/control/fleet") as r:
        return [w["healthy"] for w in (await r.json())["workers"]]


# -- 3. descriptors ---------------------------------------------------------------------------------------------


async def test_stream_burst_beyond_the_descriptor_limit_is_answered_and_blames_no_worker(tmp_path):
    nofile, n = 256, 512  # the field report's 2,000 streams under ulimit -n 1024, scaled
    fleet = await start_fleet(2, first_byte_delay_s=0.2, chunks=3, chunk_delay_s=0.05)
    proc, data_url, control_url = await _child_gateway(tmp_path, nofile, workers=[w.url for w in fleet])
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:

            async def one(i: int):
                try:
                    async with http.post(
                        data_url + "/generate",
                        json={"text": f"{i} {TEXT}", "stream": True},
                        timeout=aiohttp.ClientTimeout(total=60),
                    ) as r:
                        body = await r.read()
                        return r.status, r.headers.get("Retry-After"), body
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    return None, None, repr(e).encode()

            results = await asyncio.gather(*(one(i) for i in range(n)))
            statuses = [s for s, _, _ in results]
            unanswered = [b for s, _, b in results if s is None]
            assert not unanswered, (len(unanswered), unanswered[:3])
            assert set(statuses) <= {200, 503}, sorted(set(statuses))
            assert all(ra is not None and int(ra) >= 1 for s, ra, _ in results if s == 503)
            ok = [b for s, _, b in results if s == 200]
            assert ok and all(b.rstrip().endswith(b"data: [DONE]") for b in ok)
            assert all(await _fleet_health(http, control_url)), "a worker was blamed for the gateway's descriptors"
            async with http.get(data_url + "/metrics") as r:
                m = await r.text()
            assert metric_value(m, "btb_rejected_requests_total") == statuses.count(503)
        text = (tmp_path / "gateway.log").read_text()
        assert "marked unhealthy" not in text and "event=worker_down" not in text
        assert text.count("Traceback") <= 1, "repeated errors must be rate-limited, not logged each time"
    finally:
        await _end(proc)
        await stop_fleet(fleet)


@pytest.mark.slow  # out of the main suite's three minutes (the longest there)
async def test_idle_half_sent_connections_do_not_starve_real_clients(tmp_path):
    nofile, idle = 256, 600  # the field report's 20k idle connections, scaled past the descriptor limit
    fleet = await start_fleet(2)
    proc, data_url, control_url = await _child_gateway(tmp_path, nofile, workers=[w.url for w in fleet])
    host, port = data_url.rsplit("/", 1)[1].rsplit(":", 1)
    writers = []
    try:
        for _ in range(idle):  # each sends half a request head and then nothing
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 2)
            except (OSError, asyncio.TimeoutError):
                continue
            w.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            writers.append(w)
        await asyncio.sleep(1.0)  # they sit there, as the field's idle connections did
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as http:

            async def legit(i: int):
                """A well-behaved client: a 503 with Retry-After is retried after that many seconds."""
                for _ in range(15):
                    try:
                        async with http.post(
                            data_url + "/generate",
                            json={"text": f"{i} {TEXT}"},
                            timeout=aiohttp.ClientTimeout(total=20),
                        ) as r:
                            if r.status != 503 or "Retry-After" not in r.headers:
                                return r.status
                            wait = int(r.headers["Retry-After"])
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        return None
                    await asyncio.sleep(wait)
                return 503

            statuses = await asyncio.gather(*(legit(i) for i in range(36)))
            assert statuses.count(200) == 36, statuses
            assert all(await _fleet_health(http, control_url))
    finally:
        for w in writers:
            w.close()
        await _end(proc)
        await stop_fleet(fleet)


async def test_event_subscribers_are_capped():
    async with GatewayEnv(2, max_event_subscribers=2) as env:
        opened = [await env.http.get(env.control + "/control/events") for _ in range(2)]
        try:
            assert all(r.status == 200 for r in opened)
            async with env.http.get(env.control + "/control/events") as r:
                assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        finally:
            for r in opened:
                r.close()


async def test_local_descriptor_exhaustion_upstream_is_not_blamed_on_the_worker(monkeypatch):
    async with GatewayEnv(2, policy="round_robin") as env:
        loop = asyncio.get_running_loop()
        real_connect = loop.create_connection
        worker_ports = {int(w.url.rsplit(":", 1)[1]) for w in env.gw.state.workers}

        async def connect(factory, host=None, port=None, **kw):
            if port in worker_ports:  # the gateway's process is out of descriptors, the test client is not
                raise OSError(errno.EMFILE, "Too many open files")
            return await real_connect(factory, host, port, **kw)

        assert env.gw.upstream.open_connections == 0  # nothing forwarded yet: the request connects
        monkeypatch.setattr(loop, "create_connection", connect)
        async with env.http.post(env.url + "/generate", json={"text": TEXT}) as r:
            assert r.status == 503 and int(r.headers["Retry-After"]) >= 1
        assert all(w.healthy and w.failed == 0 for w in env.gw.state.workers)


# -- 4. bodies and prompt hashing -------------------------------------------------------------------------------


def test_gateway_body_limit_is_at_most_the_workers():
    from btbctl.engine.launcher.cluster import GatewaySection
    from btbctl.engine.worker.http.errors import MAX_BODY_BYTES

    assert GatewayConfig(workers=["http://h:1"]).max_body_bytes <= MAX_BODY_BYTES
    assert GatewaySection().max_body_bytes <= MAX_BODY_BYTES


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
async def test_a_big_prompt_is_hashed_off_the_event_loop(monkeypatch):
    from btbctl.engine.gateway import lifecycle

    seen: list[tuple[int, float, float]] = []  # (thread, start, end) of each hashing
    real = lifecycle.chain_from_packed

    def timed(data, page_size):
        t = time.perf_counter()
        out = real(data, page_size)
        seen.append((threading.get_ident(), t, time.perf_counter()))
        return out

    monkeypatch.setattr(lifecycle, "chain_from_packed", timed)
    async with GatewayEnv(
        2, page_size=1, max_chain_blocks=1 << 21, policy="round_robin", worker_kw={"hash_prompts": False}
    ) as env:
        loop_thread = threading.get_ident()
        big = json.dumps({"text": "x" * (6 << 20), "sampling_params": {"max_new_tokens": 1}}).encode()
        task = asyncio.create_task(env.post("/generate", big))
        probes: list[tuple[float, float]] = []  # (start, latency) of /health during the request
        while not task.done():
            t = time.perf_counter()
            async with env.http.get(env.url + "/health") as r:
                assert r.status == 200
            probes.append((t, time.perf_counter() - t))
        status, _ = await task
        assert status == 200
        tid, start, end = max(seen, key=lambda c: c[2] - c[1])
        assert tid != loop_thread, "a big prompt was hashed on the event loop"
        # /health kept answering while the prompt was hashed (relative to the hashing itself, no absolute bound)
        during = [lat for t, lat in probes if start <= t and t + lat <= end]
        assert during, f"no /health answer during {end - start:.2f} s of hashing: the event loop was blocked"


async def test_the_chain_is_bounded_to_its_leading_blocks():
    async with GatewayEnv(1, page_size=1, max_chain_blocks=64, worker_kw={"hash_prompts": False}) as env:
        status, _ = await env.post("/generate", {"input_ids": list(range(1000))})
        assert status == 200
        assert max(len(c) for c in [env.gw.state.chains.chain_of(h) for h in env.gw.state.chains.find("", 10)]) <= 64


async def test_a_prompt_over_the_token_limit_gets_413_before_hashing(monkeypatch):
    from btbctl.engine.gateway import lifecycle

    calls = []
    monkeypatch.setattr(lifecycle, "chain_from_packed", lambda d, p: calls.append(p) or ())
    async with GatewayEnv(2, page_size=1, max_prompt_tokens=1000) as env:
        status, ans = await env.post("/generate", {"input_ids": list(range(1001))})
        assert status == 413 and "1001" in ans["error"]["message"], ans
        assert not calls and all(not w.requests for w in env.fleet)


async def test_the_chain_index_learns_a_prompt_only_once_a_worker_answered_it():
    async with GatewayEnv(2, policy="round_robin", worker_kw={"fail": "500"}, max_retries=1) as env:
        status, _ = await env.post("/generate", {"text": TEXT})
        assert status == 502
        assert not env.gw.state.chains.find("", 10), "a failed request must not enter the chain index"
        for w in env.fleet:
            w.fail = None
        for w in env.gw.state.workers:
            w.healthy = True
        status, _ = await env.post("/generate", {"text": TEXT})
        assert status == 200 and env.gw.state.chains.find("", 10)


# -- 5. frozen workers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_silent_past_the_first_byte_timeout_is_left_for_another(stream):
    never = asyncio.Event()
    async with GatewayEnv(2, policy="round_robin", first_byte_timeout_s=0.5, health_interval_s=30) as env:
        env.fleet[0].first_byte_gate = never  # frozen, but its /health still answers
        answers = await asyncio.gather(
            *(env.post("/generate", {"text": f"{i} {TEXT}", "stream": stream}) for i in range(4))
        )
        assert [s for s, _ in answers] == [200] * 4
        assert env.fleet[0].requests, "round robin sent some requests to the frozen worker"
        assert len(env.fleet[1].requests) == 4  # each request reached the other worker exactly once


async def test_a_stream_idle_past_the_idle_timeout_ends_with_an_error_event():
    never = asyncio.Event()
    async with GatewayEnv(1, idle_timeout_s=0.5, worker_kw={"chunk_gate": never}) as env:
        async with env.http.post(env.url + "/generate", json={"text": TEXT, "stream": True}) as r:
            assert r.status == 200
            body = (await r.read()).decode()
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
        assert "error" in events[-1] and "idle" in events[-1]["error"]["message"]


@pytest.mark.slow  # out of the main suite's three minutes (the longest there)
async def test_requests_on_a_sigstopped_worker_are_rerouted_once_it_is_marked_unhealthy(tmp_path):
    from test_gateway_worker import _fleet, _stop

    procs, urls, token_file = await _fleet(tmp_path, 2)
    gw = await serve_gateway(
        GatewayConfig(
            workers=urls,
            port=0,
            control_port=0,
            token="t",
            policy="round_robin",
            health_interval_s=0.2,
            health_timeout_s=0.3,
            unhealthy_after=1,
            first_byte_timeout_s=60,  # far beyond the test: the health checks must do it
        )
    )
    try:
        procs[0].send_signal(signal.SIGSTOP)
        async with aiohttp.ClientSession() as s:

            async def one(i: int):
                t = time.perf_counter()
                async with s.post(
                    gw.data_url + "/generate",
                    json={"text": f"{i} {TEXT}", "stream": i % 2 == 0, "sampling_params": {"max_new_tokens": 2}},
                ) as r:
                    await r.read()
                    return r.status, r.headers.get("X-BTB-Worker"), time.perf_counter() - t

            answers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(6))), 30)
        assert [a[0] for a in answers] == [200] * 6, answers
        assert {a[1] for a in answers} == {urls[1]}
        assert not gw.state.workers[0].healthy
        assert metric_value(gw.metrics.render().decode(), "btb_retries_total") >= 1
    finally:
        procs[0].send_signal(signal.SIGCONT)
        await gw.stop()
        await _stop(procs)
