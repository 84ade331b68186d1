"""The gateway in front of real emulated workers (``python -m btbctl worker`` subprocesses on loopback)."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from btbctl.engine.gateway import GatewayConfig, serve_gateway
from emulated_procs import start_workers, stop_workers
from gateway_fakes import metric_value

PAGE = 16
PREFIX_BLOCKS = 8


async def _fleet(tmp_path, n: int, *extra: str):
    token_file = tmp_path / "worker.token"
    token_file.write_text("wtok\n")
    procs, urls = await start_workers(
        tmp_path, n, "--page-size", str(PAGE), "--btb-token-file", str(token_file), *extra
    )
    return procs, urls, str(token_file)


_stop = stop_workers


async def test_btb_replicates_between_real_workers(tmp_path):
    procs, urls, token_file = await _fleet(tmp_path, 3)
    gw = await serve_gateway(
        GatewayConfig(
            workers=urls,
            port=0,
            control_port=0,
            token="ctl",
            worker_token_file=token_file,
            poll_interval_s=0.02,
            policy="btb",
            constants={"prefix_blocks": PREFIX_BLOCKS, "threshold": 2, "window_s": 5.0, "replicas": 3},
        )
    )
    try:
        assert gw.page_size == PAGE and all(w.btb for w in gw.state.workers)
        prefix = "".join(f"line {i:04d} of a long shared system prompt\n" for i in range(30))
        async with aiohttp.ClientSession() as s:
            served = []
            for i in range(2):
                async with s.post(
                    gw.data_url + "/generate",
                    json={"text": prefix + f"question {i}", "sampling_params": {"max_new_tokens": 1}},
                ) as r:
                    assert r.status == 200, await r.text()
                    served.append(r.headers["X-BTB-Worker"])
                    meta = (await r.json())["meta_info"]
            assert served[0] == served[1] and meta["cached_tokens"] >= PREFIX_BLOCKS * PAGE
            for _ in range(300):
                if len(gw.state.transfers.recent) == 2 and not gw.state.transfers.active:
                    break
                await asyncio.sleep(0.02)
            states = [(t.state, t.error) for t in gw.state.transfers.recent]
            assert states == [("done", None), ("done", None)], states
            t = gw.state.transfers.recent[0]
            assert t.bytes_total > 0 and t.bytes_sent == t.bytes_total
            for copy in gw.state.transfers.recent:  # the targets really hold the prefix now
                url = gw.state.workers[copy.target].url
                async with s.post(url + "/btb/match", json={"chain": list(copy.chain)}) as r:
                    assert (await r.json())["cached_blocks"] == PREFIX_BLOCKS

            # the rest of the burst, arriving together, spreads over the three holders (least loaded first), each
            # reusing the copied prefix (one by one, every holder would be idle at each arrival and the tie-break
            # random: two of three could serve all nine)
            async def one(i: int) -> tuple[str, dict]:
                async with s.post(
                    gw.data_url + "/v1/completions", json={"prompt": prefix + f"question {i}", "max_tokens": 1}
                ) as r:
                    assert r.status == 200
                    return r.headers["X-BTB-Worker"], await r.json()

            answers = await asyncio.gather(*(one(i) for i in range(2, 11)))
            assert len({w for w, _ in answers}) == 3
            assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_BLOCKS * PAGE for _, a in answers)
            async with s.get(gw.control_url + "/control/fleet") as r:
                fleet = await r.json()
            assert all(w["replication"] and w["kv_capacity_tokens"] for w in fleet["workers"])
    finally:
        await gw.stop()
        await _stop(procs)


async def test_worker_killed_mid_burst_loses_no_request(tmp_path):
    procs, urls, _ = await _fleet(tmp_path, 3, "--time-scale", "1.0")
    gw = await serve_gateway(
        GatewayConfig(workers=urls, port=0, control_port=0, policy="round_robin", health_interval_s=0.2)
    )
    try:
        async with aiohttp.ClientSession() as s:

            async def one(i: int):
                stream = i % 2 == 0
                body = {"text": f"request {i} " * 40, "stream": stream, "sampling_params": {"max_new_tokens": 40}}
                async with s.post(gw.data_url + "/generate", json=body) as r:
                    raw = await r.read()
                    return r.status, stream, r.headers.get("X-BTB-Worker"), raw

            tasks = [asyncio.ensure_future(one(i)) for i in range(30)]
            await asyncio.sleep(0.3)
            procs[1].kill()
            results = await asyncio.gather(*tasks)
        victim = urls[1]
        broken = 0
        for status, stream, worker, raw in results:
            if not stream:
                assert status == 200, raw[:200]  # retried elsewhere or answered before the kill
                assert "text" in json.loads(raw)
                continue
            assert status == 200
            events = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
            if events[-1] == "data: [DONE]":
                continue
            # a stream the victim had started: one clear error event, never a second answer
            err = json.loads(events[-1][6:])["error"]
            assert err["type"] == "upstream_error" and worker == victim
            assert sum(1 for e in events if e.startswith('data: {"text"')) >= 1
            broken += 1
        assert not gw.state.workers[1].healthy
        m = gw.metrics.render().decode()
        assert metric_value(m, "btb_requests_total", status="stream_error") == broken
        assert metric_value(m, "btb_requests_total") == 30
        # the kill hit requests in flight: non-streamed ones were retried, none lost
        assert metric_value(m, "btb_retries_total") >= 1
    finally:
        await gw.stop()
        await _stop(procs)


async def test_gateway_command_prints_ready_and_stops_on_sigterm(tmp_path):
    procs, urls, _ = await _fleet(tmp_path, 1, "--zero-delay")
    token_file = tmp_path / "control.token"
    gw = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "btbctl",
        "gateway",
        "-w",
        urls[0],
        "--port",
        "0",
        "--control-port",
        "0",
        "--token-file",
        str(token_file),
        "--policy",
        "least_load",
        "--threshold",
        "3",
        stdout=asyncio.subprocess.PIPE,
        stderr=open(tmp_path / "gateway.log", "wb"),
    )
    try:
        line = (await asyncio.wait_for(gw.stdout.readline(), 20)).decode().split()
        assert line[0] == "ready" and line[2] == "control", line
        data, control = line[1], line[3]
        assert (token_file.stat().st_mode & 0o777) == 0o600
        token = token_file.read_text().strip()
        async with aiohttp.ClientSession() as s:
            async with s.post(data + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200 and r.headers["X-BTB-Worker"] == urls[0]
            async with s.get(control + "/control/constants") as r:
                c = await r.json()
                assert c["policy"] == "least_load" and c["constants"]["threshold"] == 3
            async with s.put(
                control + "/control/constants", json={"policy": "btb"}, headers={"Authorization": f"Bearer {token}"}
            ) as r:
                assert r.status == 200 and (await r.json())["policy"] == "btb"
        gw.terminate()
        assert await asyncio.wait_for(gw.wait(), 10) == 0
    finally:
        if gw.returncode is None:
            gw.kill()
            await gw.wait()
        await _stop(procs)


def test_gateway_command_reports_bad_settings_in_one_line(tmp_path):
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "btbctl", "gateway", "-w", "not-a-url"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 2 and r.stderr.startswith("btbctl: error: workers") and r.stderr.count("\n") == 1
    r = subprocess.run(
        [sys.executable, "-m", "btbctl", "gateway", "-w", "http://127.0.0.1:1", "--policy", "x"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "policy" in r.stderr and "btb" in r.stderr
