"""Pilot tests of the dashboard against a real fleet: emulated workers (subprocesses) behind an in-process
gateway, read and steered through its control API by ControlApiSource; and the source's reconnect."""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import aiohttp
import pytest
from aiohttp import web
from textual.widgets import DataTable, Input, Static

from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway import GatewayConfig, serve_gateway
from btbctl.engine.dashboard.control_source import ControlApiSource
from btbctl.tui.app import ReplicateScreen, build_app
from tui_helpers import running_app, wait_for

PAGE = 16
PREFIX_BLOCKS = 8


async def _start_worker(tmp_path, i: int, token_file: str):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "btbctl", "worker", "--model-path", "llama-3.3-70b", "--port", "0",
        "--transfer-port", "0", "--page-size", str(PAGE), "--btb-token-file", token_file,
        stdout=asyncio.subprocess.PIPE, stderr=open(tmp_path / f"w{i}.log", "wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
    assert line.startswith("ready "), line
    return proc, line.split()[1]


def _text(w: Static) -> str:
    r = w.render()
    return getattr(r, "plain", None) or str(r)


def test_dashboard_on_a_real_fleet(tmp_path):
    async def body():
        token_file = tmp_path / "worker.token"
        token_file.write_text("wtok\n")
        started = await asyncio.gather(*(_start_worker(tmp_path, i, str(token_file)) for i in range(3)))
        procs, urls = [p for p, _ in started], [u for _, u in started]
        gw = await serve_gateway(GatewayConfig(
            workers=urls, port=0, control_port=0, token="ctl", worker_token_file=str(token_file),
            poll_interval_s=0.05, health_interval_s=0.2, policy="cache_aware",
            constants={"prefix_blocks": PREFIX_BLOCKS, "threshold": 2, "window_s": 30.0, "replicas": 1}))
        try:
            prefix = "".join(f"line {i:04d} of a long shared system prompt\n" for i in range(30))
            async with aiohttp.ClientSession() as s:
                for i in range(3):
                    async with s.post(gw.data_url + "/generate", json={
                            "text": prefix + f"question {i}", "sampling_params": {"max_new_tokens": 1}}) as r:
                        assert r.status == 200, await r.text()
            app = build_app(ControlApiSource(gw.control_url, "ctl"), poll_hz=10)
            async with app.run_test(size=(120, 36)) as pilot:
                await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.prefixes
                               and app.snapshot.ttft)
                snap = app.snapshot
                assert snap.connected and [w.name for w in snap.workers] == ["w0", "w1", "w2"]
                assert all(w.healthy for w in snap.workers) and snap.policy == "cache_aware"
                row = snap.prefixes[0]
                assert row.arrivals_in_window == 3 and row.holders == 1 and row.prefix_tokens == PREFIX_BLOCKS * PAGE
                assert snap.gpu_note and snap.gpu_note.startswith("NVML unavailable") or snap.gpus
                # threshold: edited on screen, confirmed by the gateway
                await pilot.press("e")
                inp = app.query_one("#const-threshold", Input)
                inp.value = "4"
                await pilot.press("enter")
                await wait_for(pilot, lambda: gw.constants.threshold == 4)
                await wait_for(pilot, lambda: "threshold = 4 confirmed" in _text(app.query_one("#const-status")))
                # refused by the gateway's own validation (window_s must be > 0): engine unchanged
                src = app.source
                with pytest.raises(ConfigError, match="window_s"):
                    await src._write("PUT", "/control/constants", {"window_s": 0})
                assert gw.constants.window_s == 30.0
                # replicate the selected prefix to one more worker: a transfer appears and completes
                table = app.query_one("#prefix-table", DataTable)
                table.focus()
                table.move_cursor(row=0)
                await pilot.press("r")
                await wait_for(pilot, lambda: isinstance(app.screen, ReplicateScreen))
                app.screen.query_one(Input).value = "1"
                await pilot.press("enter")
                await wait_for(pilot, lambda: any(t.state == "done" for t in app.snapshot.transfers), 20)
                t = app.snapshot.transfers[0]
                assert t.prefix_id.startswith(row.prefix_id[:8]) and t.bytes_sent == t.bytes_total > 0
                assert t.source in ("w0", "w1", "w2") and t.target in ("w0", "w1", "w2") and t.source != t.target
                await wait_for(pilot, lambda: app.snapshot.prefixes[0].holders == 2)
                # a killed worker shows as unhealthy
                procs[2].kill()
                await wait_for(pilot, lambda: not app.snapshot.workers[2].healthy, 20)
                await pilot.pause(0.1)
                assert "DOWN" in app.export_screenshot()  # the worker row as painted
                assert "1 down" in str(app.query_one("#p2").border_subtitle)
        finally:
            await gw.stop()
            for p in procs:
                if p.returncode is None:
                    p.terminate()
                await p.wait()

    asyncio.run(asyncio.wait_for(body(), 60))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_control_api_source_reconnects_after_the_fleet_restarts():
    async def body():
        port = _free_port()
        state = {"constants": {"prefix_blocks": 8, "threshold": 2, "window_s": 1.0, "replicas": 2}}

        async def fleet(_):
            return web.json_response({"now_s": 1.0, "policy": "btb", "constants": state["constants"], "workers": [
                {"name": "w0", "url": "http://a", "healthy": True, "running": 1, "waiting": 2,
                 "kv_used_tokens": 10, "kv_capacity_tokens": 100, "hbm_used_bytes": 5e9, "hbm_total_bytes": 80e9,
                 "gpu_util_pct": 40}]})

        async def listing(key):
            async def h(_):
                return web.json_response({key: []})
            return h

        async def start():
            app = web.Application()
            app.router.add_get("/control/fleet", fleet)
            app.router.add_get("/control/prefixes", await listing("prefixes"))
            app.router.add_get("/control/transfers", await listing("transfers"))
            app.router.add_get("/control/ttft", await listing("series"))
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        now = [0.0]
        src = ControlApiSource(f"http://127.0.0.1:{port}", "t", clock=lambda: now[0])
        try:
            down = await src.snapshot()
            assert not down.connected and "fleet unreachable" in down.message and "retrying in 0.5 s" in down.message
            again = await src.snapshot()  # inside the backoff: no new attempt
            assert again is down and src.failures == 1
            now[0] = 1.0
            down2 = await src.snapshot()
            assert src.failures == 2 and "retrying in 1.0 s" in down2.message
            runner = await start()
            now[0] = 3.0
            up = await src.snapshot()
            assert up.connected and up.message.startswith("reconnected")
            assert up.gpus[0].source == "worker" and up.gpus[0].util_pct == 40
            assert up.workers[0].queued == 2
            await runner.cleanup()  # the fleet goes away: last rows kept, marked disconnected
            now[0] = 4.0
            lost = await src.snapshot()
            assert not lost.connected and lost.workers == up.workers and "retrying in 0.5 s" in lost.message
            runner = await start()
            now[0] = 5.0
            back = await src.snapshot()
            assert back.connected and "reconnected" in back.message
            assert (await src.snapshot()).message.startswith("fleet http://127.0.0.1")
            await runner.cleanup()
        finally:
            await src.close()

    asyncio.run(asyncio.wait_for(body(), 30))


def test_dashboard_says_when_the_fleet_is_down():
    async def body():
        port = _free_port()
        src = ControlApiSource(f"http://127.0.0.1:{port}", None, local_gpus=False)
        async with running_app(src, (80, 24)) as (app, pilot):
            status = _text(app.query_one("#status"))
            assert status.startswith("DISCONNECTED: fleet unreachable at http://127.0.0.1:")
            assert app.query_one("#status").has_class("down")

    asyncio.run(asyncio.wait_for(body(), 30))
