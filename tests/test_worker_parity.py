"""SGLang/OpenAI parity of the emulated worker: stop strings, n > 1, logprobs, max_model_len, one error shape."""

from __future__ import annotations

import json
import math

import pytest

from btbctl.engine.costmodel import model_preset
from btbctl.engine.errors import api_error_body
from btbctl.engine.worker.http.output import TOKEN_TEXT, Output
from test_worker_support import WorkerProc, start_workers


@pytest.fixture(scope="module")
def zw():
    procs = start_workers((("--model-path", "qwen3-8b", "--tp-size", "1", "--zero-delay", "--page-size", "64"), None))
    yield procs[0]
    for p in procs:
        p.stop()


def _events(lines: list[str]) -> list[dict]:
    return [e for e in (json.loads(x) for x in lines if x != "[DONE]") if e.get("choices")]


def test_output_cuts_at_the_first_stop_string():
    out = Output(8, ["tok tok", "zzz"])
    assert out.matched == "tok tok" and out.text(out.tokens) == " " and out.tokens == 2
    assert out.finish_reason == "stop" and out.sglang_finish() == {"type": "stop", "matched": "tok tok"}
    none = Output(8, ["\n"])
    assert none.matched is None and none.text(8) == TOKEN_TEXT * 8 and none.sglang_finish()["type"] == "length"


def test_stop_strings_on_every_route(zw: WorkerProc):
    st, r = zw.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 8, "stop": [" tok tok"]}})
    assert st == 200 and r["text"] == ""
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": " tok tok"}
    assert r["meta_info"]["completion_tokens"] == 2
    st, r = zw.post("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stop": "k t"})
    c = r["choices"][0]
    assert st == 200 and c["text"] == " to" and c["finish_reason"] == "stop" and c["matched_stop"] == "k t"
    assert r["usage"]["completion_tokens"] == 2
    st, r = zw.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    c = r["choices"][0]
    assert c["finish_reason"] == "length" and c["matched_stop"] is None
    ev = _events(zw.stream("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stop": ["k t"], "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in ev) == " to"
    assert ev[-1]["choices"][0]["finish_reason"] == "stop" and ev[-1]["choices"][0]["matched_stop"] == "k t"


def test_n_choices(zw: WorkerProc):
    st, r = zw.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3})
    assert st == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 9
    ev = _events(zw.stream("/v1/completions", {"prompt": "hi", "max_tokens": 3, "n": 2, "stream": True}))
    for i in (0, 1):
        assert "".join(e["choices"][0]["text"] for e in ev if e["choices"][0]["index"] == i) == TOKEN_TEXT * 3
    st, r = zw.post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert st == 200 and isinstance(r, list) and len(r) == 2 and all(a["text"] == TOKEN_TEXT * 2 for a in r)
    assert zw.post("/v1/completions", {"prompt": "hi", "n": 0})[0] == 400


def test_logprobs_shapes(zw: WorkerProc):
    st, r = zw.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "logprobs": 2})
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == [TOKEN_TEXT] * 3 and len(lp["token_logprobs"]) == 3
    assert all(-1 < x < 0 for x in lp["token_logprobs"]) and lp["text_offset"] == [0, 4, 8]
    assert all(len(t) == 2 and sum(math.exp(v) for v in t.values()) <= 1 for t in lp["top_logprobs"])
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
    st, r = zw.post("/v1/chat/completions", body)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and content[0]["token"] == TOKEN_TEXT and len(content[0]["top_logprobs"]) == 3
    st, again = zw.post("/v1/chat/completions", body)
    assert again["choices"][0]["logprobs"] == r["choices"][0]["logprobs"]  # deterministic
    st, r = zw.post(
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True, "top_logprobs_num": 2},
    )
    m = r["meta_info"]
    assert len(m["output_token_logprobs"]) == 2 and m["output_token_logprobs"][0][2] is None
    assert len(m["output_top_logprobs"][0]) == 2
    st, r = zw.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r["choices"][0]["logprobs"] is None


def test_models_reports_the_context_length(zw: WorkerProc):
    st, r = zw.get("/v1/models")
    assert r["data"][0]["max_model_len"] == model_preset("qwen3-8b").context_tokens == 40960


def test_worker_errors_have_the_gateway_shape(zw: WorkerProc):
    st, r = zw.post("/generate", {"sampling_params": {}})
    assert st == 400 and set(r) == {"error"} and set(r["error"]) == set(api_error_body(400, "x")["error"])
    assert r["error"]["code"] == 400 and r["error"]["type"] == "invalid_request_error"


def test_btb_info_reports_the_modelled_hbm_and_byte_scale(zw: WorkerProc):
    st, info = zw.get("/btb/info")
    m = model_preset("qwen3-8b")
    assert info["kv_bytes_scale"] == 65536 and info["weight_bytes"] == m.weight_bytes
    assert info["hbm_total_bytes"] > info["weight_bytes"]
