"""Pilot tests of the dashboard against a real fleet: emulated workers (subprocesses) behind an in-process
gateway, read and steered through its control API by ControlApiSource; updates through the gateway's event stream
and the polling fallback while the stream is down; and the source's reconnect."""

from __future__ import annotations

import asyncio
import math
import socket

import aiohttp
import pytest
from aiohttp import web
from textual.widgets import DataTable, Input, Static

from btbctl.engine.constants import BtbConstants
from btbctl.engine.control import schema
from btbctl.engine.control.client import ControlApiError
from btbctl.engine.dashboard.control_source import ControlApiSource, TtftTrail
from btbctl.engine.gateway import GatewayConfig, serve_gateway
from btbctl.tui.app import ReplicateScreen, build_app
from btbctl.tui.widgets.panels import ConstantsPanel
from emulated_procs import start_workers
from gateway_fakes import GatewayEnv
from tui_helpers import press, running_app, wait_for

PAGE = 16
PREFIX_BLOCKS = 8


def _text(w: Static) -> str:
    r = w.render()
    return getattr(r, "plain", None) or str(r)


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
async def test_dashboard_on_a_real_fleet(tmp_path):
    token_file = tmp_path / "worker.token"
    token_file.write_text("wtok\n")
    procs, urls = await start_workers(
        tmp_path, 3, "--page-size", str(PAGE), "--btb-token-file", str(token_file), "--enable-metrics"
    )
    gw = await serve_gateway(
        GatewayConfig(
            workers=urls,
            port=0,
            control_port=0,
            token="ctl",
            worker_token_file=str(token_file),
            poll_interval_s=0.05,
            health_interval_s=0.2,
            metrics_interval_s=0.2,
            policy="cache_aware",
            constants={"prefix_blocks": PREFIX_BLOCKS, "threshold": 2, "window_s": 30.0, "replicas": 1},
        )
    )
    try:
        prefix = "".join(f"line {i:04d} of a long shared system prompt\n" for i in range(30))
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.post(
                    gw.data_url + "/generate",
                    json={"text": prefix + f"question {i}", "sampling_params": {"max_new_tokens": 1}},
                ) as r:
                    assert r.status == 200, await r.text()
        app = build_app(ControlApiSource(gw.control_url, "ctl"), poll_hz=10)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.prefixes and app.snapshot.ttft)
            snap = app.snapshot
            assert snap.connected and [w.name for w in snap.workers] == ["w0", "w1", "w2"]
            assert all(w.healthy for w in snap.workers) and snap.policy == "cache_aware"
            row = snap.prefixes[0]
            assert row.arrivals_in_window == 3 and row.holders == 1 and row.prefix_tokens == PREFIX_BLOCKS * PAGE
            assert snap.gpu_note and snap.gpu_note.startswith("NVML unavailable") or snap.gpus
            # the holder's own KV: its cached prefix, from its model (emulated), labelled so; HBM counts it
            await wait_for(pilot, lambda: any(w.kv_cached_tokens for w in app.snapshot.workers))
            holder = next(w for w in app.snapshot.workers if w.kv_cached_tokens)
            assert holder.source == "modelled" and holder.kv_held_fraction and holder.kv_held_fraction > 0
            hbm = {g.name: g for g in app.snapshot.gpus if g.source == "model"}
            if hbm:  # emulated workers model their HBM: weights plus every KV token they hold
                others = [g.used_bytes for n, g in hbm.items() if n != holder.name]
                assert hbm[holder.name].used_bytes > max(others, default=0.0)
            # threshold: edited on screen, confirmed by the gateway
            await press(pilot, "e")  # the first field, prefix_blocks; tab: the next, threshold
            await wait_for(pilot, lambda: app.focused is app.query_one("#const-prefix_blocks"))
            await press(pilot, "tab")
            inp = app.query_one("#const-threshold", Input)
            await wait_for(pilot, lambda: inp.has_focus)
            inp.value = "4"
            await press(pilot, "enter")
            await wait_for(pilot, lambda: gw.constants.threshold == 4)
            await wait_for(pilot, lambda: "threshold = 4 confirmed" in app.query_one(ConstantsPanel).message)
            # refused by the gateway's own validation (window_s must be > 0): engine unchanged
            with pytest.raises(ControlApiError, match="window_s") as refused:
                await app.source.api.set_constants({"window_s": 0})
            assert refused.value.status == 400 and refused.value.key == "window_s"
            assert gw.constants.window_s == 30.0
            # replicate the selected prefix to one more worker: a transfer appears and completes
            table = app.query_one("#prefix-table", DataTable)
            table.focus()
            table.move_cursor(row=0)
            await press(pilot, "r")
            await wait_for(pilot, lambda: isinstance(app.screen, ReplicateScreen) and isinstance(app.focused, Input))
            app.screen.query_one(Input).value = "1"
            await press(pilot, "enter")
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeControlApi:
    """A control API on a real loopback socket whose answers are built from the schema models, with an event
    stream the test drives: :meth:`emit` sends an event, :meth:`break_stream` ends the open streams and refuses
    new ones (503) until ``refuse_stream`` is cleared."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.constants = BtbConstants(prefix_blocks=8, threshold=2, window_s=1.0, warm_replicas=2)
        self.policy = "btb"
        self.refuse_stream = False
        self.streams: list[asyncio.Queue] = []
        self.now_s = 0.0
        self.runner: web.AppRunner | None = None

    def _now(self) -> float:
        self.now_s += 0.25
        return self.now_s

    def fleet(self) -> schema.FleetAnswer:
        w = schema.FleetWorker(
            name="w0",
            url="http://a",
            healthy=True,
            error=None,
            load=0,
            prefilling=0,
            served=0,
            failed=0,
            running=1,
            waiting=2,
            kv_used_tokens=10,
            kv_capacity_tokens=100,
            kv_use=0.1,
            replication=True,
            replication_note="supported",
            held_blocks=0,
            model=None,
            gpu=None,
            tp_size=None,
            page_size=16,
            transfer_addr=None,
            last_health_s=None,
            ttft_ewma_s=None,
            hbm_used_bytes=5e9,
            hbm_total_bytes=80e9,
            gpu_util_pct=40,
        )
        return schema.FleetAnswer(
            now_s=self._now(),
            policy=self.policy,
            page_size=16,
            constants=self.constants,
            healthy=1,
            total=1,
            replication="supported on all workers",
            workers=[w],
        )

    def constants_answer(self) -> schema.ConstantsAnswer:
        return schema.ConstantsAnswer(
            policy=self.policy,
            policies=["btb"],
            constants=self.constants,
            page_size=16,
            prefix_tokens=self.constants.prefix_blocks * 16,
        )

    def answers(self) -> dict:
        c = self.constants
        now = self._now()
        empty = schema.TtftSummary(n=0, mean_s=None, p50_s=None, p95_s=None, p99_s=None, max_s=None)
        return {
            "/control/fleet": self.fleet(),
            "/control/prefixes": schema.PrefixesAnswer(
                now_s=now,
                window_s=c.window_s,
                threshold=c.threshold,
                prefix_blocks=c.prefix_blocks,
                prefix_tokens=c.prefix_blocks * 16,
                page_size=16,
                prefixes=[],
            ),
            "/control/transfers": schema.TransfersAnswer(
                now_s=now, in_flight=0, transfers=[], totals=schema.TransferTotals(done=0, failed=0, bytes=0)
            ),
            "/control/ttft": schema.TtftAnswer(now_s=now, window_s=120.0, step_s=1.0, series=[], summary=empty),
        }

    async def _read(self, request: web.Request) -> web.Response:
        return web.json_response(self.answers()[request.path].model_dump(mode="json"))

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if self.refuse_stream:
            return web.json_response({"error": {"message": "no stream today"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()
        self.streams.append(q)
        await resp.write(b": connected\n\n")
        for kind in ("fleet", "constants"):  # a new subscriber gets the picture at once, as from the gateway
            q.put_nowait((kind, {"constants": self.constants_answer, "fleet": self.fleet}[kind]()))
        try:
            while (item := await q.get()) is not None:
                kind, model = item
                await resp.write(f"event: {kind}\ndata: {model.model_dump_json()}\n\n".encode())
        finally:
            self.streams.remove(q)
        return resp

    def emit(self, kind: str) -> None:
        model = {"constants": self.constants_answer, "fleet": self.fleet}[kind]()
        for q in self.streams:
            q.put_nowait((kind, model))

    def break_stream(self) -> None:
        self.refuse_stream = True
        for q in self.streams:
            q.put_nowait(None)

    async def start(self) -> FakeControlApi:
        app = web.Application()
        for path in self.answers():
            app.router.add_get(path, self._read)
        app.router.add_get("/control/events", self._events)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self.break_stream()
        await self.runner.cleanup()


async def test_control_api_source_reconnects_after_the_fleet_restarts():
    port = _free_port()
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
        api = await FakeControlApi(port).start()
        now[0] = 3.0
        up = await src.snapshot()
        assert up.connected and up.message.startswith("reconnected") and up.feed == "poll"
        assert up.gpus[0].source == "worker" and up.gpus[0].util_pct == 40
        assert up.workers[0].queued == 2
        await api.stop()  # the fleet goes away: last rows kept, marked disconnected
        now[0] = 4.0
        lost = await src.snapshot()
        assert not lost.connected and lost.workers == up.workers and "retrying in 0.5 s" in lost.message
        api = await FakeControlApi(port).start()
        now[0] = 5.0
        back = await src.snapshot()
        assert back.connected and "reconnected" in back.message
        assert (await src.snapshot()).message.startswith("fleet http://127.0.0.1")
        assert src.polls == 3 and not src.streaming  # never started: no stream followed
        await api.stop()
    finally:
        await src.close()


async def test_a_change_arrives_through_the_gateways_event_stream_without_a_poll():
    async with GatewayEnv(2, policy="least_load") as env:
        src = ControlApiSource(env.control, "test-token", local_gpus=False)
        app = build_app(src, poll_hz=20)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.feed == "stream")
            assert src.streaming and _text(app.query_one("#status")).endswith("| live: event stream")
            polls, pushed = src.polls, app.pushed
            # another client retunes the fleet: the screen follows from the stream alone
            async with env.http.put(
                env.control + "/control/constants", json={"threshold": 5, "policy": "cache_aware"}, headers=env.auth()
            ) as r:
                assert r.status == 200
            await wait_for(pilot, lambda: app.query_one("#const-threshold", Input).value == "5")
            await wait_for(pilot, lambda: app.snapshot.policy == "cache_aware")
            assert app.pushed > pushed and src.events > 0
            await pilot.pause(0.3)  # six poll ticks at 20 Hz
            assert src.polls == polls  # nothing was polled while the stream was up


async def test_polling_takes_over_while_the_event_stream_is_down():
    api = await FakeControlApi(_free_port()).start()
    src = ControlApiSource(
        f"http://127.0.0.1:{api.port}", "t", local_gpus=False, reconnect_min_s=0.05, reconnect_max_s=0.2
    )
    status = lambda: _text(app.query_one("#status"))
    try:
        app = build_app(src, poll_hz=20)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.feed == "stream")
            polls = src.polls
            api.constants = api.constants.with_updates(threshold=5)
            api.emit("constants")
            await wait_for(pilot, lambda: app.snapshot.constants["threshold"] == 5)
            assert src.polls == polls and status().endswith("| live: event stream")
            # the stream breaks and cannot be reopened: polling takes over and the status line says so
            api.break_stream()
            await wait_for(pilot, lambda: app.snapshot.feed == "poll")
            assert not src.streaming and src.stream_error == "the gateway closed the event stream"
            await wait_for(pilot, lambda: "HTTP 503: no stream today" in (src.stream_error or ""))  # retried
            api.constants = api.constants.with_updates(threshold=6)  # no event: only a poll can see it
            await wait_for(pilot, lambda: app.snapshot.constants["threshold"] == 6)
            assert src.polls > polls and app.query_one("#const-threshold", Input).value == "6"
            assert "event stream down" in status() and status().endswith("| polling")
            # the stream is back: it takes over again and the polling stops
            api.refuse_stream = False
            await wait_for(pilot, lambda: src.streaming and app.snapshot.feed == "stream", 5)
            assert status().endswith("| live: event stream")
            polls = src.polls
            api.constants = api.constants.with_updates(threshold=7)
            api.emit("constants")
            await wait_for(pilot, lambda: app.snapshot.constants["threshold"] == 7)
            await pilot.pause(0.2)
            assert src.polls == polls
    finally:
        await api.stop()


async def test_dashboard_says_when_the_fleet_is_down():
    port = _free_port()
    src = ControlApiSource(f"http://127.0.0.1:{port}", None, local_gpus=False)
    async with running_app(src, (80, 24)) as (app, pilot):
        status = _text(app.query_one("#status"))
        assert status.startswith("DISCONNECTED: fleet unreachable at http://127.0.0.1:")
        assert app.query_one("#status").has_class("down")


def test_ttft_trail_from_stream_points():
    def bucket(t, n=1, p50=0.1):
        return schema.TtftBucket(t_s=t, n=n, p50_s=p50 if n else None, p95_s=p50 if n else None, rps=float(n))

    trail = TtftTrail(step_s=1.0, keep=5)
    trail.advance(10.0)  # nothing to extend yet
    assert trail.points == []
    trail.reset([bucket(1.0), bucket(2.0, 0)])
    assert [p.t_s for p in trail.points] == [1.0, 2.0] and math.isnan(trail.points[1].p50_s)
    trail.add(bucket(2.4, 3))  # the same second seen later: replaces
    trail.add(bucket(2.2, 9))  # older than the latest: ignored
    assert [(p.t_s, p.rps) for p in trail.points] == [(1.0, 1.0), (2.4, 3.0)]
    trail.add(bucket(3.5, 2))  # a bucket further: appended
    trail.advance(5.9)  # 4.5 ended a whole second before 5.9 without a ttft event: empty; 5.5 may still come
    assert [(p.t_s, p.rps) for p in trail.points] == [(1.0, 1.0), (2.4, 3.0), (3.5, 2.0), (4.5, 0.0)]
    trail.advance(9.0)  # keeps the latest 5
    assert [p.t_s for p in trail.points] == [3.5, 4.5, 5.5, 6.5, 7.5]
    trail.advance(100.0)  # a silence longer than the series: empty buckets up to a second before now
    assert [(p.t_s, p.rps) for p in trail.points] == [(95.0, 0.0), (96.0, 0.0), (97.0, 0.0), (98.0, 0.0), (99.0, 0.0)]


async def test_prewarm_from_the_dashboard_computes_once_and_copies():
    from btbctl.tui.app import PrewarmScreen

    text = "prewarm from the dashboard " * 6
    constants = {"prefix_blocks": 4, "threshold": 100, "window_s": 5.0, "replicas": 3}
    async with GatewayEnv(3, policy="round_robin", constants=constants) as env:
        app = build_app(ControlApiSource(env.control, "test-token"), poll_hz=10)
        async with app.run_test(size=(120, 36)) as pilot:
            await wait_for(pilot, lambda: app.snapshot is not None and app.snapshot.workers)
            await press(pilot, "w")
            await wait_for(pilot, lambda: isinstance(app.screen, PrewarmScreen) and isinstance(app.focused, Input))
            app.screen.query_one("#prewarm-n", Input).value = "0"
            app.focused.value = text
            await press(pilot, "enter")
            await pilot.pause(0.05)
            assert isinstance(app.screen, PrewarmScreen) and "n must be" in _text(
                app.screen.query_one("#prewarm-error")
            )
            app.screen.query_one("#prewarm-n", Input).value = "2"
            await press(pilot, "enter")
            chain = env.fleet[0].chain_of("/generate", {"text": text})
            await wait_for(pilot, lambda: sum(chain[-1] in w.held for w in env.fleet) == 3)
            said = lambda: [n.message for n in app._notifications]  # the toasts shown (textual's list)
            await wait_for(pilot, lambda: any(m.startswith("computed 41 tokens on w") for m in said()))
            assert any("copying " in m and " to " in m for m in said())
            assert sum(len(w.requests) for w in env.fleet) == 1  # computed once
