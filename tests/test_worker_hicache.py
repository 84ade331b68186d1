"""The emulated worker's HiCache (``btbctl/engine/worker/hicache.py``) with a real ``btbctl agent`` as its L3 tier:
write-through after prefill, prefetch from L3 for a queued request (threshold, the three prefetch policies),
``cached_tokens_details`` as SGLang's ``/generate`` and OpenAI routes give it, the tokenizer endpoint, HiCache
metric names, and one-line refusals of flags the emulation cannot honour."""

from __future__ import annotations

import json
import threading
import time

import pytest

from agent_helpers import start_agent
from btbctl.engine.errors import ConfigError
from btbctl.engine.gateway.sglang_metrics import parse_sglang_metrics
from btbctl.engine.hashing import pack_text
from btbctl.engine.worker.config import make_config
from btbctl.sglang_l3.keys import page_keys
from test_worker_support import WorkerProc

PAGE = 64
PREFIX = list(range(1000, 1000 + PAGE * 8))  # 8 pages, 512 tokens


def _extra(sock: str, **more) -> str:
    return json.dumps(
        {
            "backend_name": "btb",
            "module_path": "btbctl.sglang_l3",
            "class_name": "BtbL3Store",
            "interface_v1": 1,
            "agent_socket": sock,
            **more,
        }
    )


def _flags(sock: str, policy: str = "wait_complete", **extra) -> list[str]:
    return [
        "--model-path",
        "llama-3.3-70b",
        "--page-size",
        str(PAGE),
        "--time-scale",
        "20",
        "--kv-bytes-scale",
        "256",
        "--enable-metrics",
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-prefetch-policy",
        policy,
        "--hicache-storage-backend-extra-config",
        _extra(sock, **extra),
    ]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    a = start_agent(tmp_path_factory.mktemp("hicache"), "node", arena_mib=32)
    yield a
    a.stop()


@pytest.fixture
def workers(agent):
    made: list[WorkerProc] = []

    def start(*flags: str) -> WorkerProc:
        w = WorkerProc(*flags)
        made.append(w)
        return w.wait_ready()

    yield start
    for w in made:
        w.stop()


def _gen(w: WorkerProc, ids: list[int], **body) -> dict:
    st, r = w.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, **body})
    assert st == 200, r
    return r["meta_info"]


def _wait_backup(w: WorkerProc, tokens: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, text = w.get("/metrics")
        for line in text.splitlines():
            if line.startswith("sglang:backuped_tokens_total{") and float(line.split()[-1]) >= tokens:
                return
        time.sleep(0.02)
    raise AssertionError(f"{tokens} tokens were not written through to L3")


def test_write_through_then_another_worker_loads_the_prefix_from_l3(agent, workers):
    a = workers(*_flags(agent.socket))
    b = workers(*_flags(agent.socket))
    m = _gen(a, PREFIX + [5])
    assert m["cached_tokens"] == 0 and m["cached_tokens_details"] is None  # SGLang's null: nothing cached
    _wait_backup(a, len(PREFIX))
    # the pages are in the node's store under SGLang's keys, one object per TP rank (tp 4)
    info = a.get("/server_info")[1]["btb"]["hicache"]
    assert len(info["namespaces"]) == 4 and info["page_bytes"] == PAGE * 327680 // 4 // 256
    keys = page_keys(PREFIX, PAGE)
    has = agent.call("POST", "/v1/has", {"keys": keys})[1]
    assert sorted(has["complete"]) == sorted(info["namespaces"])

    m = _gen(b, PREFIX + [7])  # prefix + one token, as a warm-up is
    assert m["cached_tokens"] == len(PREFIX)
    assert m["cached_tokens_details"] == {
        "device": 0,
        "host": 0,
        "storage": len(PREFIX),
        "storage_backend": "BtbL3Store",
    }
    m = _gen(b, PREFIX + [9])  # now resident on b's device
    assert m["cached_tokens_details"] == {"device": 512, "host": 0, "storage": 0, "storage_backend": "BtbL3Store"}
    _, text = b.get("/metrics")
    samples = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln[:1] != "#"}
    assert samples['sglang:cached_tokens_total{cache_source="storage",model_name="llama-3.3-70b"}'] == 512
    assert samples['sglang:cached_tokens_total{cache_source="device",model_name="llama-3.3-70b"}'] == 512
    for name in ("prefetched_tokens_total", "storage_prefetch_hit_tokens_total"):
        assert samples[f'sglang:{name}{{model_name="llama-3.3-70b",pp_rank="0",tp_rank="0"}}'] == 512
    assert samples['sglang:hicache_host_used_tokens{model_name="llama-3.3-70b",pp_rank="0",tp_rank="0"}'] == 512
    assert samples['sglang:hicache_host_total_tokens{model_name="llama-3.3-70b",pp_rank="0",tp_rank="0"}'] > 0
    # what the gateway reads of it: the L3 read went host -> device once (SGLang's load-back, pool kv)
    got = parse_sglang_metrics(text)
    assert got["load_back_tokens_total"] == 512 and got["storage_prefetched_tokens_total"] == 512
    assert got["host_tier_tokens"] == 512 and got["kv_cached_tokens"] >= 512  # the prefix stays cached

    # OpenAI routes report the breakdown only when asked (SGLang's sglext), streamed or not
    c = workers(*_flags(agent.socket))
    st, r = c.post(
        "/v1/completions",
        {"prompt": PREFIX + [11], "max_tokens": 1, "return_cached_tokens_details": True},
    )
    assert st == 200 and r["sglext"]["cached_tokens_details"]["storage"] == 512
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    body = {"prompt": PREFIX + [12], "max_tokens": 1, "stream": True, "return_cached_tokens_details": True}
    chunks = [json.loads(x) for x in c.stream("/v1/completions", body) if x != "[DONE]"]
    ext = [ch for ch in chunks if "sglext" in ch]
    assert len(ext) == 1 and ext[0]["choices"] == [] and ext[0]["sglext"]["cached_tokens_details"]["device"] == 512
    st, r = c.post("/v1/completions", {"prompt": PREFIX + [13], "max_tokens": 1})
    assert "sglext" not in r


def test_threshold_policies_and_tiers(agent, workers):
    ids = list(range(50_000, 50_000 + PAGE * 8))
    src = workers(*_flags(agent.socket))
    _gen(src, ids + [1])
    _wait_backup(src, len(ids))

    # fewer new tokens than prefetch_threshold: no L3 query at all, the prefix is recomputed
    high = workers(*_flags(agent.socket, prefetch_threshold=1024))
    assert _gen(high, ids + [2])["cached_tokens"] == 0

    # timeout with a budget of about 1 ms of model time: only the pages read by then (one 64-token page here)
    tight = workers(*_flags(agent.socket, "timeout", prefetch_timeout_base=0.001, prefetch_timeout_per_ki_token=0))
    m = _gen(tight, ids + [3])
    assert m["cached_tokens_details"]["storage"] == PAGE

    # best_effort: admitted at once without the read (computed here); the read still lands in the host tier
    be = workers(*_flags(agent.socket, "best_effort"))
    assert _gen(be, ids + [4])["cached_tokens"] == 0
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        text = be.get("/metrics")[1]
        got = {ln.split("{")[0]: float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("sglang:")}
        if got.get("sglang:prefetched_tokens_total") == 512 and got["sglang:hicache_host_used_tokens"] >= 512:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"best_effort read did not land in the host tier: {got}")


def test_requests_that_arrive_while_a_load_from_l3_runs_read_the_pages_again_and_reuse_the_first_load(agent, workers):
    """As a real SGLang 0.5.23 server does (tests/test_sglang_differential.py): every one of 4 requests sent
    together for a prefix held only in L3 reads it (SGLang prefetches per request, one read at a time per worker),
    the first to be admitted reports ``storage`` and the others the pages that load put on the device."""
    ids = list(range(70_000, 70_000 + PAGE * 8))
    flags = _flags(agent.socket)
    flags[flags.index("--time-scale") + 1] = "0.05"  # a load of the prefix takes ~80 ms of wall time
    src = workers(*_flags(agent.socket))
    _gen(src, ids + [1])
    _wait_backup(src, len(ids))
    w = workers(*flags)
    go = threading.Barrier(4)
    metas: list[dict] = [{}] * 4

    def one(i: int) -> None:
        go.wait()
        metas[i] = _gen(w, ids + [10 + i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    splits = sorted((m["cached_tokens_details"]["device"], m["cached_tokens_details"]["storage"]) for m in metas)
    assert splits == [(0, 512), (512, 0), (512, 0), (512, 0)], metas
    got = parse_sglang_metrics(w.get("/metrics")[1])
    assert got["storage_prefetched_tokens_total"] == 4 * 512  # read four times
    assert got["load_back_tokens_total"] == 512  # onto the device once


def test_host_tier_serves_what_the_device_evicted(agent, workers):
    """A device of about 1,600 tokens (``--mem-fraction-static``) holds three 512-token prefixes; a fourth evicts
    pages of the first, which the next request finds in the host tier (written through after its prefill)."""
    w = workers(*_flags(agent.socket), "--mem-fraction-static", "0.4429")
    prefixes = [list(range(200_000 + k * 10_000, 200_000 + k * 10_000 + PAGE * 8)) for k in range(4)]
    for p in prefixes:
        _gen(w, p + [1])
    d = _gen(w, prefixes[0] + [2])["cached_tokens_details"]
    # eviction takes leaves first: the tail of the prefix left the device, the host tier has it
    assert d["host"] >= PAGE and d["device"] + d["host"] == 512 and d["storage"] == 0, d
    assert parse_sglang_metrics(w.get("/metrics")[1])["load_back_tokens_total"] == d["host"]


def test_tokenizer_endpoint_and_text_prompts_hash_to_sglang_page_keys(agent, workers):
    w = workers(*_flags(agent.socket))
    text = "x" * (4 * PAGE * 5)
    for path in ("/tokenize", "/v1/tokenize"):
        st, r = w.post(path, {"prompt": text})
        assert st == 200 and r["count"] == PAGE * 5 and len(r["tokens"]) == PAGE * 5
    st, r = w.post("/v1/tokenize", {"prompt": ["ab", "abcdefgh"]})
    assert r["count"] == [1, 2]
    st, chat = w.post("/v1/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == [int.from_bytes(pack_text("user: hi\n")[i : i + 4], "little") for i in range(0, 12, 4)]
    st, err = w.post("/v1/tokenize", {"prompt": "a", "messages": []})
    assert st == 400 and "Exactly one" in err["error"]["message"]
    # text and input_ids of the same tokens land on the same pages
    tokens = w.post("/v1/tokenize", {"prompt": text})[1]["tokens"]
    _gen(w, tokens + [1])
    st, r2 = w.post("/generate", {"text": text + "abcd", "sampling_params": {"max_new_tokens": 1}})
    assert r2["meta_info"]["cached_tokens"] == PAGE * 5


def test_cache_salt_seeds_the_pages(agent, workers):
    ids = list(range(7_000, 7_000 + PAGE * 6))
    a = workers(*_flags(agent.socket))
    b = workers(*_flags(agent.socket))
    _gen(a, ids + [1], cache_salt="tenant-a")
    _wait_backup(a, len(ids))
    assert agent.call("POST", "/v1/has", {"keys": page_keys(ids, PAGE, cache_salt="tenant-a")})[1]["complete"]
    assert _gen(b, ids + [2])["cached_tokens"] == 0  # unsalted keys: a miss
    assert _gen(b, ids + [3], cache_salt="tenant-a")["cached_tokens_details"]["storage"] == len(ids)


@pytest.mark.parametrize(
    "flags, key, words",
    [
        ({"hicache_storage_backend": "dynamic"}, "hicache_storage_backend", "needs --enable-hierarchical-cache"),
        (
            {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"},
            "hicache_storage_backend",
            "btbctl's node agent",
        ),
        (
            {
                "enable_hierarchical_cache": True,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": '{"module_path": "x", "class_name": "Y"}',
            },
            "hicache_storage_backend_extra_config",
            "module_path/class_name",
        ),
        (
            {
                "enable_hierarchical_cache": True,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": "{not json",
            },
            "hicache_storage_backend_extra_config",
            "not a JSON object",
        ),
        (
            {
                "enable_hierarchical_cache": True,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": _extra("/x.sock", prefetch_threshold=-1),
            },
            "hicache_storage_backend_extra_config",
            "prefetch_threshold",
        ),
        (
            {
                "enable_hierarchical_cache": True,
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": _extra("/x.sock", bogus=1),
            },
            "hicache_storage_backend_extra_config",
            "unknown extra-config key 'bogus'",
        ),
    ],
)
def test_flags_the_emulation_cannot_honour_are_one_line_errors(flags, key, words):
    with pytest.raises(ConfigError) as err:
        make_config(model_path="llama-3.3-70b", **flags)
    assert err.value.key == key and words in str(err.value) and "\n" not in str(err.value)


def test_a_restarted_agent_gets_the_workers_hello_at_once_and_reused_pages_written_again(tmp_path, workers):
    """The agent dies and a new one starts on the same socket with an empty store: the worker's ranks say hello to it
    without waiting for traffic, and the next request reusing the prefix from the device writes its pages through
    again (SGLang would not: its host tier keeps them marked backed up; see btbctl/sglang_l3/store.py)."""
    from agent_helpers import wait_for

    old = start_agent(tmp_path, "node", arena_mib=32)
    try:
        a = workers(*_flags(old.socket))
        _gen(a, PREFIX + [5])
        _wait_backup(a, len(PREFIX))
        nss = a.get("/server_info")[1]["btb"]["hicache"]["namespaces"]
        keys = page_keys(PREFIX, PAGE)
        assert sorted(old.call("POST", "/v1/has", {"keys": keys})[1]["complete"]) == sorted(nss)
    finally:
        old.kill()
    new = start_agent(tmp_path, "node", arena_mib=32)
    try:
        # no request yet: the ranks' held connections said hello again, so the new agent knows their namespaces
        wait_for(lambda: sorted(new.call("GET", "/v1/info")[1]["namespaces"]) == sorted(nss), what="hello again")
        assert new.call("POST", "/v1/has", {"keys": keys})[1]["complete"] == []  # its store is empty
        m = _gen(a, PREFIX + [7])  # a device hit: nothing computed ...
        assert m["cached_tokens_details"]["device"] == len(PREFIX)
        # ... and still written through to the new agent, whose store did not hold the pages
        wait_for(
            lambda: sorted(new.call("POST", "/v1/has", {"keys": keys})[1]["complete"]) == sorted(nss),
            what="the prefix written through again",
        )
    finally:
        new.stop()
