"""A real SGLang worker's own numbers in the fleet view: the parser of SGLang's Prometheus text, the gateway's
scraper, the control API's worker rows, the dashboard's snapshot and the CLI's ``status`` / ``prefixes``, against
the answers a real SGLang 0.5.23 server gave (tests/data/sglang-0.5.23: two CPU workers after a 16-request burst,
so the cache holds prefixes while no request runs)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from btbctl.engine.control import schema
from btbctl.engine.dashboard.control_source import ControlApiSource
from btbctl.engine.gateway import GatewayConfig, serve_gateway
from btbctl.engine.gateway.health import summarize_loads
from btbctl.engine.gateway.reports import worker_numbers
from btbctl.engine.gateway.sglang_metrics import MetricsScraper, parse_sglang_metrics, summarize_server_info
from btbctl.engine.gateway.state import WorkerState
from btbctl.engine.launcher.rundir import ProcessRecord, RunDir, RunState, process_start_time
from gateway_fakes import SGLANG_RECORDED, RecordedSglang, until
from helpers import run_cli

METRICS = (SGLANG_RECORDED / "metrics.txt").read_text(encoding="utf-8")
LOADS = json.loads((SGLANG_RECORDED / "v1-loads.json").read_text(encoding="utf-8"))
SERVER_INFO = json.loads((SGLANG_RECORDED / "server_info.json").read_text(encoding="utf-8"))

#: What the recorded server reported: no request running, 5,648 of its 8,192 KV tokens holding cached prefixes,
#: the same 5,648 tokens in its host tier, 768 tokens found in and read from L3, 4,608 written to L3, 512 loaded
#: back to the device.
RECORDED = {
    "running": 0,
    "waiting": 0,
    "kv_used_tokens": 0,
    "kv_cached_tokens": 5648,
    "kv_capacity_tokens": 8192,
    "host_tier_tokens": 5648,
    "host_tier_capacity_tokens": 3906256,
    "storage_hit_tokens_total": 768,
    "storage_prefetched_tokens_total": 768,
    "storage_backup_tokens_total": 4608,
    "load_back_tokens_total": 512,
}


def _lines(name: str) -> list[str]:
    return [ln for ln in METRICS.splitlines() if ln.startswith(name + "{")]


# -- the parser ---------------------------------------------------------------------------------------------------


def test_the_recorded_metrics_parse_to_the_servers_numbers():
    assert parse_sglang_metrics(METRICS) == RECORDED
    # what /v1/loads says of the same server: nothing in use, the cached prefix is not in it
    assert summarize_loads(LOADS) == {
        "running": 0,
        "waiting": 0,
        "used_tokens": 0,
        "max_tokens": 8192,
        "token_usage": 0.0,
    }


def test_ranks_of_one_data_parallel_group_count_once_groups_add_up():
    (evict,) = _lines("sglang:kv_evictable_tokens")
    (cap,) = _lines("sglang:max_total_num_tokens")
    (backup,) = _lines("sglang:backuped_tokens_total")
    rank1 = [ln.replace('tp_rank="0"', 'tp_rank="1"') for ln in (evict, cap, backup)]
    text = "\n".join([evict, cap, backup, *rank1]) + "\n"
    # plain TP 2 (both ranks report, --enable-metrics-for-all-schedulers): one pool, counted once
    tp2 = parse_sglang_metrics(text, attn_tp_size=2)
    assert (tp2["kv_cached_tokens"], tp2["kv_capacity_tokens"]) == (5648, 8192)
    # the L3 counter carries dp_rank: two TP ranks of DP group 0 report the same logical count
    assert tp2["storage_backup_tokens_total"] == 4608
    # DP attention, attention-TP 1: each tp_rank is its own pool, and they add up
    dp2 = parse_sglang_metrics(text, attn_tp_size=1)
    assert (dp2["kv_cached_tokens"], dp2["kv_capacity_tokens"]) == (2 * 5648, 2 * 8192)
    # two DP groups of the L3 counter add up
    other_dp = backup.replace('dp_rank="0"', 'dp_rank="1"').replace("4608.0", "100.0")
    assert parse_sglang_metrics(backup + "\n" + other_dp + "\n")["storage_backup_tokens_total"] == 4708


def test_load_back_counts_the_kv_pool_only():
    (kv,) = _lines("sglang:load_back_tokens_total")
    swa = kv.replace('pool="kv"', 'pool="swa"').replace("512.0", "9999.0")
    assert parse_sglang_metrics(kv + "\n" + swa + "\n")["load_back_tokens_total"] == 512
    assert "load_back_tokens_total" not in parse_sglang_metrics(swa + "\n")


def test_what_is_not_sglang_metrics_gives_nothing_and_bad_values_are_ignored():
    assert parse_sglang_metrics("<html><body>502 Bad Gateway</body></html>") == {}
    assert parse_sglang_metrics("") == {}
    assert parse_sglang_metrics("# HELP x\nother_metric 3\n") == {}
    nan = 'sglang:kv_evictable_tokens{tp_rank="0"} NaN\nsglang:max_total_num_tokens{tp_rank="0"} -5\n'
    assert parse_sglang_metrics(nan) == {}
    with pytest.raises(ValueError, match="Invalid"):
        parse_sglang_metrics('sglang:kv_evictable_tokens{tp_rank="0" 12\n')
    # a server without HiCache: the host and L3 fields are absent, not zero
    no_hicache = "\n".join(ln for ln in METRICS.splitlines() if "hicache" not in ln and "storage" not in ln)
    got = parse_sglang_metrics(no_hicache)
    assert got["kv_cached_tokens"] == 5648 and "host_tier_tokens" not in got


def test_server_info_says_how_ranks_group_and_whether_metrics_are_on():
    assert summarize_server_info(SERVER_INFO) == {
        "emulated": False,
        "enable_metrics": True,
        "attn_tp_size": 1,
        "version": "0.5.23",
    }
    assert summarize_server_info({**SERVER_INFO, "tp_size": 8})["attn_tp_size"] == 8
    dp = {**SERVER_INFO, "tp_size": 8, "dp_size": 4, "enable_dp_attention": True}
    assert summarize_server_info(dp)["attn_tp_size"] == 2
    assert summarize_server_info({"btb": {"emulated": True}, "enable_metrics": False})["emulated"] is True
    assert summarize_server_info("nope") == {} and summarize_server_info([]) == {}


# -- the worker rows ----------------------------------------------------------------------------------------------


def _worker(**kw) -> WorkerState:
    w = WorkerState(0, "http://w", "w0", healthy=True)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def test_worker_numbers_count_the_cached_prefix_and_say_whose_they_are():
    w = _worker(loads=summarize_loads(LOADS), metrics=parse_sglang_metrics(METRICS), metrics_s=3.0)
    got = worker_numbers(w)
    assert set(got) == set(schema.WORKER_NUMBERS)
    assert got["metrics_source"] == "sglang_metrics" and got["metrics_note"] is None and got["last_metrics_s"] == 3.0
    assert (got["kv_used_tokens"], got["kv_cached_tokens"], got["kv_capacity_tokens"]) == (0, 5648, 8192)
    assert got["kv_use"] == pytest.approx(5648 / 8192)  # was 0.0: SGLang's token_usage counts running requests only
    assert {k: got[k] for k in RECORDED} == RECORDED
    # /v1/loads is fresher (every health round): it wins for what both report; the sum never passes the capacity
    busy = _worker(loads={**summarize_loads(LOADS), "running": 3, "used_tokens": 4000}, metrics=dict(RECORDED))
    got = worker_numbers(busy)
    assert (got["running"], got["kv_used_tokens"], got["kv_use"]) == (3, 4000, 1.0)
    # no /v1/loads answer: the /metrics numbers stand in
    assert worker_numbers(_worker(metrics=dict(RECORDED)))["kv_capacity_tokens"] == 8192
    # only /v1/loads: no cache numbers, said so
    loads_only = worker_numbers(_worker(loads=summarize_loads(LOADS), metrics_note="/metrics answered HTTP 404"))
    assert loads_only["metrics_source"] == "sglang_loads" and loads_only["kv_cached_tokens"] is None
    assert loads_only["kv_use"] == 0.0 and loads_only["metrics_note"] == "/metrics answered HTTP 404"
    # btbctl's emulated worker serves SGLang's names from its cost model: modelled, however it was found out
    assert worker_numbers(_worker(metrics=dict(RECORDED), server_info={"emulated": True}))["metrics_source"] == (
        "modelled"
    )
    assert worker_numbers(_worker(loads={"running": 0}, info={"page_size": 16}))["metrics_source"] == "modelled"
    assert worker_numbers(_worker())["metrics_source"] is None


# -- the scraper --------------------------------------------------------------------------------------------------


async def _scrape(fake: RecordedSglang, **kw) -> WorkerState:
    import aiohttp

    w = _worker(url=fake.url)
    changed = []
    async with aiohttp.ClientSession() as session:
        s = MetricsScraper([w], lambda: session, lambda: 7.0, interval_s=60, on_change=changed.append, **kw)
        await s.scrape_all()
    assert changed == [w]
    return w


async def test_the_scraper_reads_server_info_once_and_bounds_every_read():
    fake = await RecordedSglang().start()
    try:
        w = await _scrape(fake, timeout_s=2.0)
        assert w.metrics == RECORDED and w.metrics_note is None and w.metrics_s == 7.0
        assert w.server_info["version"] == "0.5.23"
        big = await _scrape(fake, timeout_s=2.0, max_bytes=10_000)  # the recorded text is about 95 kB
        assert big.metrics is None and big.metrics_note.startswith("/metrics failed: BodyTooLarge")
        # a server that gzips although asked for the plain body: decompressed, within the same bound
        fake.metrics_gzip = True
        assert (await _scrape(fake, timeout_s=2.0)).metrics == RECORDED
        bomb = await _scrape(fake, timeout_s=2.0, max_bytes=30_000)  # about 10 kB gzipped, 95 kB plain
        assert bomb.metrics is None and bomb.metrics_note.startswith("/metrics failed: BodyTooLarge")
        fake.metrics_gzip = None
        fake.metrics_delay_s = 1.0
        slow = await _scrape(fake, timeout_s=0.2)
        assert slow.metrics is None and "TimeoutError" in slow.metrics_note
        fake.metrics_delay_s = 0.0
        fake.enable_metrics = False
        asked = fake.hits.get("/metrics", 0)
        off = await _scrape(fake, timeout_s=2.0)
        assert off.metrics is None and off.metrics_note == "metrics off: the worker runs without --enable-metrics"
        assert fake.hits.get("/metrics", 0) == asked  # not even asked
        down = _worker(url=fake.url, healthy=False)
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await MetricsScraper(
                [down], lambda: session, lambda: 0.0, interval_s=1, timeout_s=1, on_change=print
            ).scrape_all()
        assert down.server_info is None and down.metrics is None  # an unhealthy worker is left alone
    finally:
        await fake.stop()


# -- through a gateway: the control API, the dashboard, the CLI ---------------------------------------------------


async def _gateway(urls: list[str], **kw):
    cfg = {
        "port": 0,
        "control_port": 0,
        "token": "t",
        "health_interval_s": 0.1,
        "metrics_interval_s": 0.1,
        "replication": "none",
    }
    cfg.update(kw)
    return await serve_gateway(GatewayConfig(workers=urls, **cfg))


async def _fleet(gw) -> schema.FleetAnswer:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.get(gw.control_url + "/control/fleet") as r:
        return schema.FleetAnswer.model_validate(await r.json())


async def test_a_real_sglang_workers_cached_prefix_shows_in_the_fleet_view():
    fake = await RecordedSglang().start()
    gw = await _gateway([fake.url])
    try:
        await until(lambda: gw.state.workers[0].metrics is not None)
        (w,) = (await _fleet(gw)).workers
        assert w.healthy and w.metrics_source == "sglang_metrics" and w.metrics_note is None
        assert (w.running, w.waiting, w.kv_used_tokens, w.kv_cached_tokens, w.kv_capacity_tokens) == (
            0,
            0,
            0,
            5648,
            8192,
        )
        assert w.kv_use == pytest.approx(5648 / 8192)  # not 0 %: the cache holds a prefix
        assert w.model_dump(include=set(RECORDED)) == RECORDED
        assert w.last_metrics_s is not None and fake.hits["/server_info"] == 1
        # the dashboard's snapshot, as the TUI gets it
        src = ControlApiSource(gw.control_url, "t", stream=False, local_gpus=False)
        try:
            snap = await src.snapshot()
        finally:
            await src.close()
        (row,) = snap.workers
        assert (row.kv_used_tokens, row.kv_cached_tokens, row.kv_capacity_tokens) == (0, 5648, 8192)
        assert row.kv_held_fraction == pytest.approx(5648 / 8192) and row.source == "sglang_metrics"
        assert (row.host_tier_tokens, row.storage_hit_tokens_total, row.load_back_tokens_total) == (5648, 768, 512)
    finally:
        await gw.stop()
        await fake.stop()


async def test_a_bad_or_missing_metrics_never_marks_a_worker_down():
    fakes = [
        await RecordedSglang(metrics_status=404).start(),
        await RecordedSglang(metrics_body=b"<html>oops</html>").start(),
        await RecordedSglang(metrics_delay_s=5.0).start(),
        await RecordedSglang(enable_metrics=False).start(),
    ]
    gw = await _gateway([f.url for f in fakes], health_timeout_s=0.3)
    try:
        await until(lambda: all(w.metrics_note for w in gw.state.workers), timeout_s=5)
        await asyncio.sleep(0.5)  # a few more rounds
        fleet = await _fleet(gw)
        assert fleet.healthy == 4
        notes = [w.metrics_note for w in fleet.workers]
        assert notes[0] == "/metrics answered HTTP 404"
        assert notes[1] == "/metrics has none of SGLang's KV or queue metrics"
        assert notes[2].startswith("/metrics failed: TimeoutError")
        assert notes[3] == "metrics off: the worker runs without --enable-metrics"
        for w in fleet.workers:  # /v1/loads still counts; the rest is unknown, not 0
            assert w.metrics_source == "sglang_loads" and w.kv_capacity_tokens == 8192 and w.kv_use == 0.0
            assert w.kv_cached_tokens is None and w.host_tier_tokens is None
        assert "/metrics" not in fakes[3].hits and fakes[0].hits["/server_info"] == 1
    finally:
        await gw.stop()
        for f in fakes:
            await f.stop()


def _record(name: str, role: str, url: str, pid: int) -> ProcessRecord:
    """A record of the sleeping stand-in process ``pid`` (its own session): ``status`` reads it as running."""
    kind = "sglang" if role == "worker" else role
    return ProcessRecord(name, role, kind, pid, pid, process_start_time(pid), ["python"], "log", url=url)


async def test_status_and_prefixes_show_each_workers_own_numbers(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    fakes = [await RecordedSglang().start(), await RecordedSglang(metrics_status=404).start()]
    gw = await _gateway([f.url for f in fakes])
    # the processes the run directory records: one sleeping child (its own process group) stands in for all
    stand_in = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(120)", start_new_session=True
    )
    pid = stand_in.pid
    try:
        await until(lambda: all(w.metrics or w.metrics_note for w in gw.state.workers))
        rd = RunDir(tmp_path / "run")
        rd.prepare()
        rd.save(
            RunState(
                run_dir=str(rd.path),
                created_at=1.0,
                detached=True,
                replication="none",
                gateway_url=gw.data_url,
                control_url=gw.control_url,
                processes=[
                    _record("cpu-0", "worker", fakes[0].url, pid),
                    _record("cpu-1", "worker", fakes[1].url, pid),
                    _record("gateway", "gateway", gw.data_url, pid),
                ],
                complete=True,
            )
        )
        run = str(rd.path)
        code, out, err = await asyncio.to_thread(run_cli, capsys, "status", "--run-dir", run, "--format", "json")
        assert code == 0, err
        a, b = json.loads(out)["workers"]
        assert {k: a[k] for k in RECORDED} == RECORDED and a["metrics_source"] == "sglang_metrics"
        assert a["kv_use"] == pytest.approx(5648 / 8192)
        assert b["metrics_source"] == "sglang_loads" and b["kv_cached_tokens"] is None
        assert b["metrics_note"] == "/metrics answered HTTP 404"
        code, out, err = await asyncio.to_thread(run_cli, capsys, "status", "--run-dir", run)
        assert code == 0, err
        line_a = next(ln for ln in out.splitlines() if ln.startswith("cpu-0"))
        line_b = next(ln for ln in out.splitlines() if ln.startswith("cpu-1"))
        assert "0+5648/8192" in line_a and "sglang /metrics" in line_a
        assert "0/8192" in line_b and "sglang /v1/loads" in line_b and "/metrics answered HTTP 404" in line_b
        # on an 80-column terminal the worker's own numbers give way: names and URLs are never cut
        monkeypatch.setenv("COLUMNS", "80")
        code, out, err = await asyncio.to_thread(run_cli, capsys, "status", "--run-dir", run)
        line_a = next(ln for ln in out.splitlines() if ln.startswith("cpu-0"))
        assert code == 0 and fakes[0].url in line_a and "5648" not in line_a
        monkeypatch.setenv("COLUMNS", "200")

        code, out, err = await asyncio.to_thread(run_cli, capsys, "prefixes", "--run-dir", run, "--format", "json")
        assert code == 0, err
        res = json.loads(out)
        assert res["prefixes"] == [] and [w["name"] for w in res["workers"]] == ["w0", "w1"]
        assert {k: res["workers"][0][k] for k in RECORDED} == RECORDED
        assert res["workers"][1]["storage_hit_tokens_total"] is None
        code, out, err = await asyncio.to_thread(run_cli, capsys, "prefixes", "--run-dir", run)
        assert code == 0, err
        row = next(ln for ln in out.splitlines() if ln.startswith("w0 "))
        assert row.split() == ["w0", "0+5648/8192", "5648", "768", "768", "4608", "512", "sglang", "/metrics"]
        assert next(ln for ln in out.splitlines() if ln.startswith("w1 ")).split()[2:7] == ["-"] * 5
    finally:
        stand_in.kill()
        await stand_in.wait()
        await gw.stop()
        for f in fakes:
            await f.stop()


# -- the dashboard's fleet panel ----------------------------------------------------------------------------------


async def test_the_fleet_panel_shows_the_cached_prefix_the_host_tier_and_where_numbers_come_from():
    import io

    from rich.console import Console
    from textual.app import App
    from textual.widgets import Static

    from btbctl.engine.dashboard import FleetSnapshot, WorkerRow
    from btbctl.tui.widgets.panels import FleetPanel, sources_note

    real = WorkerRow(
        "w0",
        True,
        0,
        0,
        0,
        8192,
        source="sglang_metrics",
        **{
            k: v for k, v in RECORDED.items() if k not in ("running", "waiting", "kv_used_tokens", "kv_capacity_tokens")
        },
    )
    plain = WorkerRow("w1", True, 2, 1, 30, 100, source="sglang_loads", metrics_note="/metrics answered HTTP 404")
    snap = FleetSnapshot(now_s=1.0, connected=True, message="", workers=(real, plain))

    def shown(panel: FleetPanel) -> dict[str, list[str]]:
        console = Console(width=panel.size.width, record=True, file=io.StringIO())
        console.print(panel.query_one("#fleet-body", Static).content)
        return {ln.split()[0]: ln.split() for ln in console.export_text().splitlines() if ln.strip()}

    for width in (38, 90):

        class One(App):
            CSS = f"FleetPanel {{ width: {width}; height: 10; }}"

            def compose(self):
                yield FleetPanel()

        app = One()
        async with app.run_test(size=(100, 12)) as pilot:
            panel = app.query_one(FleetPanel)
            panel.update_snapshot(snap)
            await pilot.pause()
            rows = shown(panel)
            # 69 % of the KV cache holds the cached prefix (shaded), none of it running requests; host tier 5.5k
            assert rows["w0"][:7] == ["w0", "up", "0", "0", "▓▓▓▓░░", "69%", "6k"]
            assert rows["w1"][:7] == ["w1", "up", "2", "1", "██░░░░", "30%", "-"]
            if width >= 64:
                assert rows["w0"][7:] == ["768", "768", "4k", "sglang"] and rows["w1"][7:] == ["-", "-", "-", "loads"]
            else:
                assert len(rows["w0"]) == 7
            assert panel.border_subtitle == "2 workers, 1 sglang, 1 loads"
    assert sources_note((real, real)) == "via sglang" and sources_note(()) == ""
