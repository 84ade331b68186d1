"""The emulated worker over real HTTP: SGLang and OpenAI shapes, streaming, truthful cached_tokens, metrics,
BTB routes, auth and bad input. Workers are real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from btbctl.engine import hashing
from btbctl.engine.gateway.sglang_metrics import parse_sglang_metrics
from test_worker_support import WorkerProc, start_workers

TOKEN = "s3cret-token"
PAGE = 256


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tok = tmp_path_factory.mktemp("tok") / "token"
    tok.write_text(TOKEN + "\n")
    procs = start_workers(
        (
            (
                "--model-path",
                "meta-llama/Llama-3.3-70B-Instruct",
                "--served-model-name",
                "llama-test",
                "--time-scale",
                "20",
                "--enable-metrics",
                "--btb-token-file",
                str(tok),
            ),
            None,
        ),
        (("--model-path", "qwen3-8b", "--tp-size", "1", "--zero-delay", "--page-size", "64"), None),
    )
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def w(workers) -> WorkerProc:
    return workers[0]


@pytest.fixture(scope="module")
def zw(workers) -> WorkerProc:
    return workers[1]


def _ids(n: int, seed: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7919) % 32000 for i in range(n)]


def test_generate_text_shape_and_counts(w):
    text = "The quick brown fox jumps over the lazy dog. " * 40
    st, r = w.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 5}, "rid": "req-1"})
    assert st == 200
    m = r["meta_info"]
    assert m["id"] == "req-1"
    assert m["prompt_tokens"] == len(hashing.text_to_tokens(text))
    assert m["completion_tokens"] == 5
    assert m["finish_reason"] == {"type": "length", "length": 5}
    # SGLang answers null when no prompt token was cached (output_streamer.py get_cached_tokens_details)
    assert m["cached_tokens"] == 0 and m["cached_tokens_details"] is None
    assert m["e2e_latency"] > 0
    assert isinstance(r["text"], str) and r["text"]


def test_cached_tokens_grow_on_same_prefix_input_ids(w):
    prefix = _ids(3 * PAGE, 1)
    st, r1 = w.post("/generate", {"input_ids": prefix + _ids(40, 2), "sampling_params": {"max_new_tokens": 2}})
    assert st == 200 and r1["meta_info"]["cached_tokens"] == 0
    st, r2 = w.post("/generate", {"input_ids": prefix + _ids(300, 3), "sampling_params": {"max_new_tokens": 2}})
    assert st == 200
    # the three shared full pages are reused; the other pages differ
    assert r2["meta_info"]["cached_tokens"] == 3 * PAGE
    assert r2["meta_info"]["cached_tokens_details"]["device"] == 3 * PAGE
    chain = hashing.chain_hashes(prefix, PAGE)
    st, m = w.post("/btb/match", {"chain": chain})
    assert st == 200 and m == {"cached_blocks": 3, "pending_blocks": 3}


def test_cold_prefill_takes_model_time_and_a_repeat_reuses_the_cache(w):
    ids = _ids(16 * PAGE, 4)  # 4096 tokens: ~0.3 s of 70B prefill on 4xH100, 15 ms at time scale 20
    st, cold = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    st, warm = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["meta_info"]["cached_tokens"] == 16 * PAGE - 1  # SGLang never caches the last prompt token
    assert cold["meta_info"]["e2e_latency"] > 0.01  # the worker waited out the prefill's model time


def test_loads_count_cached_blocks_no_request_uses_as_free(w):
    """``num_used_tokens`` as SGLang counts it: capacity - (free + evictable); a finished prompt's cached blocks are
    evictable, so an idle worker reports 0 used while it still holds them."""
    ids = _ids(16 * PAGE, 5)
    assert w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})[0] == 200
    one = w.get("/v1/loads")[1]["loads"][0]
    assert one["num_running_reqs"] == 0 and one["num_used_tokens"] == 0 and one["token_usage"] == 0.0
    again = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})[1]
    assert again["meta_info"]["cached_tokens"] == 16 * PAGE - 1  # the blocks were still there


@pytest.mark.speed
def test_a_cached_prompt_answers_faster(w):
    """A speed test (``pytest -m speed``): the cache's saving shows on the wall clock."""
    ids = _ids(16 * PAGE, 31)
    t0 = time.monotonic()
    st, cold = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    cold_s = time.monotonic() - t0
    t0 = time.monotonic()
    st, warm = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    warm_s = time.monotonic() - t0
    assert cold["meta_info"]["e2e_latency"] > 2 * warm["meta_info"]["e2e_latency"]
    assert cold_s > warm_s


def test_generate_streaming_sse(w):
    events = w.stream(
        "/generate", {"text": "stream me " * 100, "sampling_params": {"max_new_tokens": 6}, "stream": True}
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    counts = [c["meta_info"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 6
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    # cumulative text, as SGLang's /generate streams it
    assert all(chunks[i + 1]["text"].startswith(chunks[i]["text"]) for i in range(len(chunks) - 1))


def test_openai_completions_and_chat(w):
    st, r = w.post("/v1/completions", {"model": "llama-test", "prompt": "Hello " * 200, "max_tokens": 3})
    assert st == 200 and r["object"] == "text_completion" and r["model"] == "llama-test"
    assert r["choices"][0]["finish_reason"] == "length"
    u = r["usage"]
    assert u["completion_tokens"] == 3 and u["total_tokens"] == u["prompt_tokens"] + 3
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    st, r = w.post("/v1/completions", {"prompt": "Hello " * 200, "max_tokens": 3})
    assert (
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
        == (len(hashing.text_to_tokens("Hello " * 200)) // PAGE) * PAGE
    )
    msgs = [{"role": "system", "content": "You label data. " * 80}, {"role": "user", "content": "item 1"}]
    st, r = w.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert st == 200 and r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    expect = len(hashing.text_to_tokens("".join(f"{m['role']}: {m['content']}\n" for m in msgs)))
    assert r["usage"]["prompt_tokens"] == expect
    events = w.stream(
        "/v1/chat/completions",
        {
            "messages": msgs[:1] + [{"role": "user", "content": "item 2"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]).count("tok") == 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_info_routes(w):
    assert w.get("/health")[0] == 200
    assert w.get("/health_generate")[0] == 200
    st, m = w.get("/v1/models")
    assert st == 200 and m["data"][0]["id"] == "llama-test"
    st, s = w.get("/server_info")
    assert s["served_model_name"] == "llama-test" and s["tp_size"] == 4 and s["page_size"] == PAGE
    assert s["btb"]["model_preset"] == "llama-3.3-70b" and s["btb"]["time_scale"] == 20
    assert w.get("/get_server_info")[1]["model_path"] == "meta-llama/Llama-3.3-70B-Instruct"
    assert w.get("/model_info")[1]["is_generation"] is True
    st, loads = w.get("/v1/loads")
    one = loads["loads"][0]
    for k in (
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "cache_hit_rate",
    ):
        assert k in one
    assert one["max_total_num_tokens"] > 100_000 and 0 <= one["token_usage"] <= 1


def test_metrics_names_and_labels(w):
    w.post("/generate", {"text": "metrics " * 50, "sampling_params": {"max_new_tokens": 3}})
    st, text = w.get("/metrics")
    assert st == 200
    for name in (
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
        "sglang:inter_token_latency_seconds_sum",
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:cache_hit_rate",
        "sglang:token_usage",
        "sglang:num_used_tokens",
        "sglang:max_total_num_tokens",
    ):
        assert name in text, name
    assert 'model_name="llama-test"' in text
    count = [ln for ln in text.splitlines() if ln.startswith("sglang:time_to_first_token_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


def test_metrics_count_a_cached_prefix_as_evictable_like_sglang(w):
    """SGLang's num_used_tokens counts running requests only; a finished request's prefix stays cached and shows
    as sglang:kv_evictable_tokens, which the gateway reads (the modelled numbers of the emulated worker)."""
    w.post("/generate", {"input_ids": _ids(2 * PAGE, 41), "sampling_params": {"max_new_tokens": 1}})
    st, text = w.get("/metrics")
    got = parse_sglang_metrics(text)
    assert got["running"] == got["waiting"] == got["kv_used_tokens"] == 0
    assert got["kv_cached_tokens"] >= 2 * PAGE and got["kv_capacity_tokens"] > 100_000
    assert "host_tier_tokens" not in got  # no HiCache here: nothing to report


def test_btb_info_and_prefixes(w):
    st, info = w.get("/btb/info")
    assert info["page_size"] == PAGE and info["kv_bytes_per_token"] == 327680
    assert info["block_bytes"] == PAGE * 327680 // 65536 and info["tp_size"] == 4 and info["gpu"] == "h100"
    assert info["transfer_addr"] == w.transfer
    ids = _ids(2 * PAGE, 9)
    w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    st, p = w.get("/btb/prefixes?limit=5")
    assert st == 200 and 1 <= len(p["prefixes"]) <= 5
    chain = hashing.chain_hashes(ids, PAGE)
    assert p["prefixes"][0] == {"hash": chain[-1], "blocks": 2}  # most recent first


def test_token_guards_push_and_flush(w):
    body = {"chain": ["ab"], "target": "127.0.0.1:9"}
    assert w.post("/btb/push", body)[0] == 401
    assert w.post("/btb/push", body, headers={"Authorization": "Bearer wrong"})[0] == 403
    assert w.post("/flush_cache")[0] == 401
    st, r = w.post("/btb/push", body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert st == 409 and "holds 0" in r["error"]["message"]


def test_bad_input_gets_4xx_and_worker_survives(w):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [
        ("POST", "/generate", b"{not json", 400),
        ("POST", "/generate", b"", 400),
        ("POST", "/generate", b"[1, 2]", 400),
        ("POST", "/generate", json.dumps({"sampling_params": {}}).encode(), 400),
        ("POST", "/generate", json.dumps({"text": "a", "input_ids": [1]}).encode(), 400),
        ("POST", "/generate", json.dumps({"input_ids": ["x"]}).encode(), 400),
        ("POST", "/generate", json.dumps({"input_ids": []}).encode(), 400),
        ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}).encode(), 400),
        ("POST", "/generate", json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 1 << 20}}).encode(), 400),
        ("POST", "/generate", json.dumps({"text": "a", "stream": "yes"}).encode(), 400),
        ("POST", "/generate", b"\xff\xfe", 400),
        ("POST", "/generate", b"[" * 100_000, 400),
        ("POST", "/generate", b'{"text": "\\ud800 lone surrogate"}', 400),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400),
        ("POST", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": 1e400}}', 400),
        ("POST", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": NaN}}', 400),
        ("POST", "/generate", b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}", 400),
        ("POST", "/v1/completions", json.dumps({"max_tokens": 3}).encode(), 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
        ("POST", "/v1/chat/completions", json.dumps({"messages": [{"content": "x"}]}).encode(), 400),
        ("POST", "/btb/match", json.dumps({"chain": "abc"}).encode(), 400),
        ("POST", "/btb/match", json.dumps({"chain": ["zz"]}).encode(), 400),
        ("GET", "/btb/prefixes?limit=abc", None, 400),
        ("GET", "/btb/copies/nope", None, 404),
        ("GET", "/no/such/route", None, 404),
        ("GET", "/generate", None, 405),
        ("DELETE", "/health", None, 405),
    ]
    for method, path, raw, want in cases:
        st, r = w.call(method, path, raw=raw)
        assert st == want, (method, path, raw, st, r)
        assert isinstance(r, dict) and r["error"]["code"] == want and "Traceback" not in r["error"]["message"], r
    for body, want in (
        ({"chain": ["ab"]}, 400),
        ({"chain": ["ab"], "target": "127.0.0.1; rm -rf /:1"}, 400),
        ({"chain": ["ab"], "target": "127.0.0.1:0"}, 400),
        ({"chain": ["ab"], "target": "127.0.0.1:1", "copy_id": "a b"}, 400),
        ({"chain": [], "target": "127.0.0.1:1"}, 400),
    ):
        st, r = w.post("/btb/push", body, headers=auth)
        assert st == want, (body, st, r)
    huge = b'{"text": "' + b"a" * (9 << 20) + b'"}'
    st, r = w.call("POST", "/generate", raw=huge)
    assert st == 413 and r["error"]["code"] == 413
    assert w.get("/health")[0] == 200
    st, r = w.post("/generate", {"text": "still alive", "sampling_params": {"max_new_tokens": 1}})
    assert st == 200


def test_zero_delay_keeps_cache_bookkeeping(zw):
    ids = _ids(64 * 256, 11)  # 16k tokens: over a second of 8B prefill on one H100 in model time
    st, r1 = zw.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}})
    assert st == 200 and r1["meta_info"]["cached_tokens"] == 0
    st, r2 = zw.post("/generate", {"input_ids": ids[: 32 * 256] + [5] * 10, "sampling_params": {"max_new_tokens": 1}})
    assert r2["meta_info"]["cached_tokens"] == 32 * 256  # page size 64 here: 128 full pages shared
    events = zw.stream("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 3}, "stream": True})
    assert events[-1] == "[DONE]" and json.loads(events[-2])["meta_info"]["completion_tokens"] == 3
    st, info = zw.get("/btb/info")
    assert info["zero_delay"] is True and info["page_size"] == 64


def test_flush_cache_empties_the_cache(tmp_path):
    (p,) = start_workers((("--model-path", "llama-3.1-8b", "--tp-size", "1", "--zero-delay"), None))
    try:
        ids = _ids(4 * PAGE, 12)
        p.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
        chain = hashing.chain_hashes(ids, PAGE)
        assert p.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == 4
        st, text = p.post("/flush_cache")
        assert st == 200 and "flushed" in text.lower()
        assert p.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == 0
        assert p.get("/metrics")[0] == 404  # metrics only with --enable-metrics
    finally:
        p.stop()


def test_sigterm_stops_gracefully():
    p = WorkerProc("--model-path", "qwen3-8b", "--tp-size", "1").wait_ready()
    try:
        os.killpg(p.proc.pid, signal.SIGTERM)
        assert p.proc.wait(10) == 0
    finally:
        p.stop()


@pytest.mark.speed
def test_zero_delay_answers_at_once(zw):
    """A speed test (``pytest -m speed``): a zero-delay worker does not wait out model time."""
    ids = _ids(64 * 256, 32)
    t0 = time.monotonic()
    st, r1 = zw.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}})
    assert st == 200 and time.monotonic() - t0 < 1.0


def _model_times(w, seed: int) -> tuple[float, float, float, float]:
    """``(prefill e2e, model prefill s, decode e2e, model decode s)`` of an 8192-token prompt on ``w``, the model
    times divided by the worker's time scale (20)."""
    from btbctl.engine.config import ClusterConfig

    cost = ClusterConfig(model="llama-3.3-70b", gpu="h100", gpus_per_replica=4, replicas=1).replica_cost()
    ids = _ids(32 * PAGE, seed)  # 8192 tokens: one prefill chunk on an H100 (SGLang's default chunk)
    st, r = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    # decode: 40 more tokens cost about 40 decode steps of one sequence at its KV size
    st, r2 = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 41}})
    # prefix cached: almost all of the second request is decode
    return (
        r["meta_info"]["e2e_latency"],
        cost.prefill_time_s(32 * PAGE, 0) / 20,
        r2["meta_info"]["e2e_latency"],
        40 * cost.decode_step_time_s(1, 32 * PAGE + 20) / 20,
    )


def test_the_worker_never_answers_before_model_time_over_time_scale(w):
    e2e, prefill_s, decode, decode_s = _model_times(w, 21)
    assert e2e >= prefill_s * 0.9, (e2e, prefill_s)
    assert decode >= decode_s * 0.8, (decode, decode_s)


@pytest.mark.speed
def test_wall_latency_is_model_time_over_time_scale(w):
    """A speed test (``pytest -m speed``): and not much later either."""
    e2e, prefill_s, decode, decode_s = _model_times(w, 33)
    assert prefill_s * 0.9 <= e2e <= prefill_s * 1.5 + 0.02, (e2e, prefill_s)
    assert decode_s * 0.8 <= decode <= decode_s * 1.5 + 0.03, (decode, decode_s)


def _stream_60_tokens(w, seed: int) -> list[tuple[float, dict]]:
    ids = _ids(8 * PAGE, seed)
    w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})  # warm the prefix
    timed = w.stream_timed("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 60}, "stream": True})
    assert timed[-1][1] == "[DONE]"
    return [(t, json.loads(p)) for t, p in timed[:-1]]


def test_streamed_tokens_are_spread_until_the_finish(w):
    chunks = _stream_60_tokens(w, 22)
    assert len(chunks) >= 20  # not all at once at the end
    counts = [c["meta_info"]["completion_tokens"] for _, c in chunks]
    assert counts == sorted(counts) and counts[-1] == 60
    assert chunks[-1][0] - chunks[0][0] > 0.03  # ~59 decode steps of ~15 ms model time at time scale 20


@pytest.mark.speed
def test_the_middle_token_streams_near_the_middle_of_the_decode(w):
    """A speed test (``pytest -m speed``): tokens stream at the decode's pace, not in bursts."""
    chunks = _stream_60_tokens(w, 34)
    first_t, last_t = chunks[0][0], chunks[-1][0]
    mid = [t for t, c in chunks if c["meta_info"]["completion_tokens"] == 30]
    span = last_t - first_t
    if mid:
        assert 0.2 * span < mid[0] - first_t < 0.8 * span


def test_a_stream_whose_client_goes_away_is_aborted(w):
    """SGLang aborts a request whose connection closed; so does the emulated worker (the slot and KV are freed)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(w.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    body = json.dumps({"text": "walk away " * 50, "sampling_params": {"max_new_tokens": 100000}, "stream": True})
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")  # first token arrived: the request is decoding
    assert w.get("/v1/loads")[1]["loads"][0]["num_running_reqs"] >= 1
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 10
    running = None
    while time.monotonic() < deadline:
        running = w.get("/v1/loads")[1]["loads"][0]["num_running_reqs"]
        if running == 0:
            break
        time.sleep(0.1)
    assert running == 0
