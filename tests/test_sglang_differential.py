"""The emulated worker checked against a real SGLang 0.5.23 server (marker ``sglang_server``): the same request
sequence, sent to each with the same HiCache flags (page size 16, a 8,192-token device pool, 1 GB host tier per
rank, ``write_through``, ``wait_complete``, btbctl's ``BtbL3Store`` on its own node agent), gives the same
``cached_tokens``, the same ``cached_tokens_details`` split (device, host, storage) and the same L3 page keys
written.

The sequence: a cold prompt; the same again (device hit); one sharing its first half (partial overlap); after
``/flush_cache`` (device and host tiers emptied, L3 kept) the first again (prefetched from L3); then enough other
prompts to push it out of the 8,192-token device pool, and the first once more (back from the host tier).

Where the two must differ: timing (the emulated worker's comes from the cost model), the KV bytes (the emulation
moves scaled-down bytes under its own L3 namespace; keys are compared, not bytes) and the model's outputs.
"""

from __future__ import annotations

import json

import pytest

from btbctl.sglang_l3.keys import page_keys
from sglang_server import EXAMPLE, PAGE, SglangFleet, check_standin_log, details, generate, harness_env, ids, stop

pytestmark = [pytest.mark.sglang_server, pytest.mark.timeout(1200)]

#: The prompts (token ids of the tiny model's vocabulary), by role in the sequence.
A = ids(1024 + 8, seed=61)
HALF_A = A[:512] + ids(520, seed=62)
FILLERS = [ids(1024 + 8, seed=70 + i) for i in range(9)]
SEQUENCE = [
    ("cold", A),
    ("repeat", A),
    ("partial overlap", HALF_A),
    ("flush", None),
    ("from L3", A),
    *((f"filler {i}", f) for i, f in enumerate(FILLERS)),
    ("evicted from the device", A),
]


def _emulated_cluster(path) -> None:
    """The example's fleet with one emulated worker in place of two SGLang servers: the same HiCache flags, device
    pool and model shape (the ``tiny-llama`` preset; a host tier of 1 GB holds as many of its pages)."""
    text = EXAMPLE.read_text()
    head = text.split("[[workers]]", 1)[0]
    path.write_text(
        head
        + """[[workers]]
kind = "emulated"
name = "emu"
count = 1
model = "tiny-llama"
served_model_name = "tiny-llama"
tp_size = 1
gpu = "h100"
page_size = 16
chunked_prefill_size = 256
time_scale = 50.0
kv_bytes_scale = 64
extra_args = ["--max-total-tokens", "8192"]
ready_timeout_s = 60.0
"""
    )


def _real_cluster(path) -> None:
    here = f'"{EXAMPLE.parent}/sglang-cpu/'  # the example's paths are relative to its folder
    path.write_text(EXAMPLE.read_text().replace("count = 2", "count = 1").replace('"./sglang-cpu/', here))


def _run(fleet: SglangFleet) -> list[dict]:
    url = fleet.workers[0]
    out = []
    for name, prompt in SEQUENCE:
        if prompt is None:
            fleet.cli("flush")  # POST /flush_cache to the worker (with the token an emulated worker asks for)
            continue
        ans = generate(url, prompt)
        meta = ans["meta_info"]
        out.append({"step": name, "cached_tokens": meta["cached_tokens"], **details(ans)})
        if name == "cold":
            fleet.wait_written(page_keys(prompt, PAGE)[: len(prompt) // PAGE])
    return out


def _l3_runs(fleet: SglangFleet) -> dict[str, int]:
    """Leading run of each prompt's pages that the fleet's agent holds (any namespace)."""
    prompts = {"A": A, "half A": HALF_A, **{f"filler {i}": f for i, f in enumerate(FILLERS)}}
    return {name: fleet.agent_run(page_keys(p, PAGE)) for name, p in prompts.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-diff")
    harness_env(tmp / "probe.jsonl")  # skips where the harness is not built
    out = {}
    for kind, make in (("real", _real_cluster), ("emulated", _emulated_cluster)):
        cfg = tmp / f"{kind}.toml"
        make(cfg)
        from sglang_server import start

        f = start(tmp / kind, cfg)
        try:
            out[kind] = {"steps": _run(f), "l3": _l3_runs(f), "standin": f.standin_log}
        finally:
            stop(f)
    return out


def test_cached_tokens_and_their_split_are_the_emulated_workers_as_the_real_servers(results):
    real, emu = results["real"]["steps"], results["emulated"]["steps"]
    diffs = [(r["step"], r, e) for r, e in zip(real, emu, strict=True) if r != e]
    assert not diffs, json.dumps(diffs, indent=1)
    # and the sequence exercised every tier on the real server
    by = {r["step"]: r for r in real}
    assert by["cold"]["cached_tokens"] == 0
    assert by["repeat"]["device"] > 0 and by["partial overlap"]["device"] > 0
    assert by["from L3"]["storage"] > 0
    assert by["evicted from the device"]["host"] > 0


def test_the_same_l3_pages_are_written(results):
    assert results["real"]["l3"] == results["emulated"]["l3"]
    assert results["real"]["l3"]["A"] == len(A) // PAGE


def test_the_stand_in_replaced_only_what_the_facts_name(results):
    check_standin_log(results["real"]["standin"])
