"""``btbctl bench``'s client: prompt synthesis, arrival timing, client TTFT, errors and per-worker counts against a
fake SGLang-compatible endpoint."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from btbctl.engine.errors import BtbctlError
from btbctl.engine.hashing import chain_hashes, text_to_tokens
from btbctl.engine.launcher.bench import (
    WORKER_HEADER,
    BenchOptions,
    PromptSynth,
    block_text,
    default_burst_trace,
    replay,
)
from btbctl.engine.trace.model import Request, Trace


def _req(rid, arrival, hashes, input_tokens=None, block=4, out=1, kind="burst"):
    n = input_tokens if input_tokens is not None else len(hashes) * block
    return Request(rid, arrival, n, out, tuple(hashes), kind)


def test_equal_hashes_give_equal_prompts_and_equal_chains():
    synth = PromptSynth(256)
    a = _req("a", 0, ["p0", "p1", "p2", "a3"], block=256)
    b = _req("b", 0, ["p0", "p1", "p2", "b3"], block=256)
    c = _req("c", 0, ["q0", "p1", "p2", "b3"], block=256)
    ta, tb, tc = synth.text(a), synth.text(b), synth.text(c)
    assert len(ta) == 4 * 1024 and ta.isascii() and ta.isprintable() and " " not in ta
    assert ta[: 3 * 1024] == tb[: 3 * 1024] and ta[3 * 1024 :] != tb[3 * 1024 :]
    assert PromptSynth(256).text(a) == ta  # deterministic across instances
    ha = chain_hashes(text_to_tokens(ta), 256)
    hb = chain_hashes(text_to_tokens(tb), 256)
    hc = chain_hashes(text_to_tokens(tc), 256)
    assert ha[:3] == hb[:3] and ha[3] != hb[3]
    assert not set(hc) & set(ha)  # chained: a different first block changes every hash
    # a page size that divides the trace's block size maps shared blocks to shared chains too
    assert chain_hashes(text_to_tokens(ta), 64)[:12] == chain_hashes(text_to_tokens(tb), 64)[:12]
    assert block_text("p0", 256) == ta[:1024]


def test_partial_blocks_and_missing_hashes():
    synth = PromptSynth(8)
    r = _req("r", 0, ["h0", "h1"], input_tokens=12)
    assert synth.text(r) == block_text("h0", 8) + block_text("h1", 8)[:16]
    bare1 = synth.text(_req("x", 0, [], input_tokens=20))
    bare2 = synth.text(_req("y", 0, [], input_tokens=20))
    assert len(bare1) == 80 and bare1 != bare2
    ids = synth.ids(r)
    assert len(ids) == 12 and all(0 <= t < 32000 for t in ids)
    assert synth.ids(r) == ids


class FakeEndpoint:
    """An SGLang-like ``POST /generate`` streaming endpoint on a background thread.

    The worker is chosen by the first 8 prompt characters (so equal prefixes go to one 'worker'); the first chunk
    comes after ``delay_s``; a request whose ``rid`` ends in ``-503`` gets HTTP 503, one ending in ``-drop`` loses
    its connection mid-stream.
    """

    def __init__(self, delay_s=0.2):
        self.delay_s = delay_s
        self.seen: list[dict] = []
        self.inflight = 0
        self.max_inflight = 0
        self.arrivals: list[float] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    async def generate(self, request):
        body = await request.json()
        self.arrivals.append(time.perf_counter())
        self.seen.append(body)
        rid = body["rid"]
        if rid.endswith("-503"):
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            worker = "http://w" + str(sum(map(ord, body["text"][:8])) % 3)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", WORKER_HEADER: worker})
            await resp.prepare(request)
            await asyncio.sleep(self.delay_s)
            if rid.endswith("-drop"):
                request.transport.close()
                return resp
            n = body["sampling_params"]["max_new_tokens"]
            for i in range(n):
                # a real server counts the prompt in its own tokens (10 here, not the trace's 32)
                chunk = {"text": "x" * (i + 1), "meta_info": {"id": rid, "cached_tokens": 7, "prompt_tokens": 10}}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.01)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def endpoint():
    ep = FakeEndpoint()
    yield ep
    ep.close()


def test_replay_measures_ttft_and_counts_workers_and_errors(endpoint):
    reqs = [_req(f"r{i}", i * 1.0, [f"p{i % 2}", f"s{i}"], block=16, out=3) for i in range(8)]
    reqs.append(_req("bad-503", 8.0, ["z"], block=16))
    reqs.append(_req("bad-drop", 8.0, ["z2"], block=16))
    trace = Trace(reqs, block_tokens=16, format="generated")
    seen = []
    rep = replay(trace, BenchOptions(endpoint.url, time_scale=20.0), on_result=seen.append)
    d = rep.as_dict()
    assert d["requests"] == 10 and d["ok"] == 8 and d["errors"] == 2
    assert sorted(r.request_id for r in seen) == sorted(r.request_id for r in reqs)  # one result each
    # a connection dropped mid-stream is a connection error or a truncated stream, depending on timing
    assert d["errors_by_status"] in ({"503": 1, "connection": 1}, {"503": 1, "stream": 1})
    bad = {r.request_id: r for r in rep.results if r.status != "ok"}
    assert bad["bad-503"].http_status == 503 and "overloaded" in bad["bad-503"].error
    assert d["ttft_s"]["p50"] >= 0.2  # the endpoint waits 0.2 s before its first chunk
    assert d["e2e_s"]["p50"] > d["ttft_s"]["p50"]
    assert sum(d["by_worker"].values()) == 8 and set(d["by_worker"]) <= {"http://w0", "http://w1", "http://w2"}
    assert d["cached_tokens"] == 8 * 7
    # served from cache: the server's cached tokens over the server's prompt tokens, never the trace's count
    assert d["prompt_tokens"] == 8 * 32 and d["served_prompt_tokens"] == 8 * 10
    assert d["cached_fraction"] == pytest.approx(0.7)
    # arrivals follow the trace at 1/20 of its pace: request i is due 0.05 i s into the replay, never sent before
    # that (1 ms: clock granularity), and the requests go out in trace order
    res = {r.request_id: r for r in rep.results}
    for i in range(8):
        assert res[f"r{i}"].scheduled_s == pytest.approx(0.05 * i)
        assert res[f"r{i}"].sent_s >= res[f"r{i}"].scheduled_s - 1e-3
    sent = [res[f"r{i}"].sent_s for i in range(8)]
    assert sent == sorted(sent)
    # equal trace prefixes arrived as equal text
    by_rid = {b["rid"]: b["text"] for b in endpoint.seen}
    assert by_rid["r0"][:64] == by_rid["r2"][:64] != by_rid["r1"][:64]
    assert len(by_rid["r0"]) == 4 * 32


@pytest.mark.speed
def test_replay_sends_each_request_on_time(endpoint):
    """A speed test (``pytest -m speed``): the replay's lateness and pacing on the wall clock."""
    reqs = [_req(f"r{i}", i * 1.0, [f"p{i % 2}", f"s{i}"], block=16, out=3) for i in range(8)]
    rep = replay(Trace(reqs, block_tokens=16, format="generated"), BenchOptions(endpoint.url, time_scale=20.0))
    assert rep.as_dict()["ttft_s"]["p50"] < 0.6
    for r in rep.results:
        assert 0 <= r.sent_s - r.scheduled_s < 0.03
    assert 0.3 < endpoint.arrivals[7] - endpoint.arrivals[0] < 0.45  # 8 s of trace in about 0.4 s


def test_max_requests_and_concurrency(endpoint):
    reqs = [_req(f"r{i}", 0.0, [f"h{i}"], block=8) for i in range(12)]
    trace = Trace(reqs, block_tokens=8, format="generated")
    rep = replay(trace, BenchOptions(endpoint.url, max_requests=6, concurrency=2))
    d = rep.as_dict()
    assert d["requests"] == 6 and d["ok"] == 6
    assert endpoint.max_inflight <= 2
    assert d["late_s_max"] > 0.3  # the last pair waited for two rounds of 0.2 s


def test_unreachable_target_gives_connection_errors_not_exceptions():
    from btbctl.engine.launcher.fleet import free_port

    trace = Trace([_req("a", 0, ["h"], block=8), _req("b", 0, ["h"], block=8)], block_tokens=8, format="generated")
    d = replay(trace, BenchOptions(f"http://127.0.0.1:{free_port()}")).as_dict()
    assert d["requests"] == 2 and d["errors"] == 2 and d["errors_by_status"] == {"connection": 2}
    assert d["ttft_s"]["p95"] is None


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"target": "localhost:1"}, "--target"),
        ({"time_scale": 0}, "--time-scale"),
        ({"max_requests": 0}, "--max-requests"),
        ({"concurrency": 0}, "--concurrency"),
        ({"endpoint": "chat"}, "--endpoint"),
    ],
)
def test_bad_options(kw, msg):
    opts = BenchOptions(**{"target": "http://127.0.0.1:1", **kw})
    with pytest.raises(BtbctlError, match=msg):
        opts.check()


def test_default_burst_trace_shape():
    t = default_burst_trace(burst_size=10, prefix_blocks=4)
    assert len(t) == 10 and t.block_tokens == 256
    assert {r.block_hashes[:4] for r in t.requests} == {t.requests[0].block_hashes[:4]}
    assert len({r.block_hashes[4] for r in t.requests}) == 10
    assert t.span_s < 1.0 and all(r.input_tokens == 5 * 256 for r in t.requests)


def test_bench_cli_against_any_endpoint(endpoint, tmp_path):
    """`btbctl bench --target` works without a fleet: stable JSON keys, a table, per-request lines."""
    import subprocess
    import sys

    from btbctl.engine.trace.writer import write_btb_mixed

    trace = default_burst_trace(burst_size=6, prefix_blocks=2)
    write_btb_mixed(trace, tmp_path / "t.jsonl")
    base = [
        sys.executable,
        "-m",
        "btbctl",
        "bench",
        "--target",
        endpoint.url,
        "--trace",
        str(tmp_path / "t.jsonl"),
        "--run-dir",
        str(tmp_path / "no-fleet"),
        "--time-scale",
        "4",
    ]
    proc = subprocess.run(
        base + ["--format", "json", "--requests-out", str(tmp_path / "r.jsonl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert {"requests", "errors", "ttft_s", "by_worker"} <= set(d)
    assert set(d["ttft_s"]) >= {"mean", "p50", "p95", "p99"}
    assert d["requests"] == 6 and d["errors"] == 0 and sum(d["by_worker"].values()) == 6
    assert d["by_worker_source"] == "header"
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(x)["status"] == "ok" for x in lines)
    proc = subprocess.run(base + ["--max-requests", "3"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "3 requests to" in proc.stdout and "TTFT" in proc.stdout and "http://w" in proc.stdout
    assert "replaying 3 requests" in proc.stderr
    bad = subprocess.run(base + ["--time-scale", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "btbctl: error: --time-scale must be a number > 0, got 0.0"
