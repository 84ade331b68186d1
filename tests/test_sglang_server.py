"""btbctl against real SGLang 0.5.23 servers on this CPU (pytest marker ``sglang_server``): a fleet of
examples/cluster-sglang-cpu.toml (two servers with the tiny model, one node agent as their HiCache L3 tier, the
gateway in replication mode ``l3``) brought up by ``btbctl up -d``, used by every test of the module in order, and
taken down at the end with nothing left running.

What this proves and what it cannot: the SGLang processes are stock (scheduler, radix cache, HiCache controller and
its L3 threads, HTTP server, metrics), apart from the test-only stand-in for the two CUDA-bound pieces
(tests/sglang_cpu/sglang_cpu_standin.py; the last test checks nothing else it replaces was called). No CUDA kernel
runs and no timing here says anything about a GPU. Run: ``scripts/sglang-venv.sh`` once, then
``$(scripts/sglang-venv.sh | tail -1) -m pytest -m sglang_server tests/test_sglang_server.py``.
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import pytest

from btbctl.sglang_l3.keys import page_keys
from launcher_helpers import http_json
from sglang_server import (
    PAGE,
    SglangFleet,
    check_standin_log,
    details,
    generate,
    ids,
    metrics_text,
    sglang_number,
    start,
    stop,
)

pytestmark = [pytest.mark.sglang_server, pytest.mark.timeout(900)]

#: The example's prefix length (btb.prefix_blocks x page size) and the bench prefix of these tests (4 x 256 tokens).
PREFIX_TOKENS = 1024
Y_TOKENS = 32 * 16


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> SglangFleet:
    f = start(tmp_path_factory.mktemp("sglang-fleet"))
    try:
        yield f
    finally:
        stop(f)


def _bench(fleet: SglangFleet, seed: int, n: int = 12, spread_s: float = 2.0) -> dict:
    return fleet.json(
        "bench",
        "--prompt",
        "ids",
        "--burst-size",
        str(n),
        "--prefix-blocks",
        "4",
        "--spread-s",
        str(spread_s),
        "--seed",
        str(seed),
        timeout=600,
    )


def _not_paying(fleet: SglangFleet) -> float:
    """The gateway's ``btb_copies_not_paying`` (copy targets btb_plus priced and left out for a recompute)."""
    for line in metrics_text(fleet.gateway).splitlines():
        if line.startswith("btb_copies_not_paying_total "):
            return float(line.split()[1])
    return 0.0


def _check_burst(fleet: SglangFleet, rep: dict, n: int, copy_or_recompute: bool = False) -> list[dict]:
    """0 errors, both workers served, every copy proved by storage tokens covering the prefix. The burst must make
    a copy, unless ``copy_or_recompute`` and the policy priced one and found a recompute sooner done."""
    assert (rep["ok"], rep["errors"]) == (n, 0), rep
    assert sorted(rep["by_worker"]) == sorted(fleet.workers), rep["by_worker"]
    fleet.settle()
    copies = [c for c in http_json(fleet.control + "/control/transfers")["transfers"] if c["mode"] == "l3"]
    mine = [c for c in rep["copies"] or [] if c["mode"] == "l3"] or copies
    if not mine and copy_or_recompute:
        assert _not_paying(fleet) > 0, "the burst made no copy and the policy priced none"
        return mine
    assert mine, "the burst made no copy"
    for c in mine:
        assert c["state"] == "done", c
        # covered: the hot prefix (btb: exactly Y = 32 pages; btb_plus: the deepest hot one, the 1,024 tokens)
        assert c["covered_tokens"] >= Y_TOKENS, c
        assert c["proof_storage_tokens"] is not None and c["proof_storage_tokens"] >= c["covered_tokens"], c
    # served from cache: SGLang's own cached_tokens over the prompt tokens it reported (never above 100%)
    assert rep["served_prompt_tokens"] > 0 and 0 < rep["cached_fraction"] <= 1.0, rep
    return mine


def test_up_of_an_all_sglang_l3_fleet_and_its_status(fleet):
    st = fleet.cli("status", "--format", "json")
    assert st.returncode == 0, st.stderr
    status = fleet.json("status")
    assert status["replication"] == "l3" and status["verdict"] == "up", status
    assert [w["replication"] for w in status["workers"]] == ["l3", "l3"]
    assert len(status["agents"]) == 1 and status["agents"][0]["alive"]
    for url in fleet.workers:  # real SGLang servers, with btbctl's backend as their L3 tier
        info = http_json(url + "/server_info")
        assert info["version"] == "0.5.23" and info["hicache_storage_backend"] == "dynamic", info["version"]
        assert '"class_name":"BtbL3Store"' in info["hicache_storage_backend_extra_config"]


def test_a_burst_under_the_default_policy_and_btb_is_proved_by_storage_tokens(fleet):
    # btb_plus spreads a burst one holder cannot keep up with (it prices the work from what the servers took, here
    # on this CPU): 24 requests within a second. A copy trailing the source's prefill lands after it plus the
    # write-through and proof; on this CPU the other worker's own prefill of the 1,024 tokens is sooner done, and
    # btb_plus then recomputes there (rule 4): both workers serve either way, and a copy it makes is proved
    rep = _bench(fleet, seed=101, n=24, spread_s=1.0)
    _check_burst(fleet, rep, 24, copy_or_recompute=True)
    fleet.cli("tune", "policy=btb")
    try:
        rep = _bench(fleet, seed=102)
        _check_burst(fleet, rep, 12)
    finally:
        fleet.cli("tune", "policy=btb_plus")


def test_greedy_output_after_an_l3_load_equals_the_computed_one(fleet):
    a, b = fleet.workers
    prompt = ids(PREFIX_TOKENS + 8, seed=7)
    computed = generate(a, prompt, max_new_tokens=16)
    assert details(computed)["storage"] == 0
    # A's write-through reaches the node agent (B's L3 tier too); B has never seen the prompt: it loads it from L3
    deadline = time.monotonic() + 30
    while True:
        loaded = generate(b, prompt, max_new_tokens=16)
        if details(loaded)["storage"] >= PREFIX_TOKENS or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # pragma: no cover - the write-through was still on its way
    assert details(loaded)["storage"] >= PREFIX_TOKENS, loaded["meta_info"]
    assert loaded["output_ids"] == computed["output_ids"] and len(computed["output_ids"]) == 16


def _longest_prefix(fleet: SglangFleet, chain: list[str]) -> str:
    """The id of the longest prefix of ``chain`` the gateway tracks (``btbctl prefixes``)."""
    mine = [p for p in fleet.json("prefixes")["prefixes"] if p["id"] in set(chain)]
    return max(mine, key=lambda p: p["prefix_blocks"])["id"]


def _prefetched(url: str) -> float:
    return sglang_number(metrics_text(url), "sglang:prefetched_tokens_total")


def _together(url: str, prefix: list[int], n: int) -> list[dict]:
    """``n`` requests of ``prefix`` + their own 8 tokens, sent at the same instant; their cached-token splits."""
    go = threading.Barrier(n)
    out: list[dict] = [{}] * n

    def one(i: int) -> None:
        go.wait()
        out[i] = details(generate(url, prefix + ids(8, seed=900 + i)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_warm_up_reads_the_prefix_from_l3_once_and_the_burst_after_it_finds_it_on_the_device(fleet):
    """Why the gateway holds a copy's target until the warm-up's proof: requests sent together to a server whose
    L3 alone holds the prefix each prefetch it (SGLang 0.5.23 reads it once per request, one read at a time; the
    emulated worker does the same), while after one warm-up every request finds it on the device."""
    a, b = fleet.workers
    n = 4
    for seed, warm_up in ((131, True), (137, False)):  # seeds no other test of the module uses
        prefix = ids(2 * PREFIX_TOKENS, seed=seed)
        generate(a, prefix + [1])
        fleet.wait_written(page_keys(prefix, PAGE))
        before = _prefetched(b)
        if warm_up:
            assert details(generate(b, prefix + [2]))["storage"] == len(prefix)
        splits = _together(b, prefix, n)
        read = _prefetched(b) - before
        assert all(s["device"] + s["storage"] >= len(prefix) for s in splits), splits  # nobody recomputed it
        if warm_up:
            assert read == len(prefix) and all(s["device"] >= len(prefix) for s in splits), (read, splits)
        else:
            assert sum(s["storage"] > 0 for s in splits) >= 1 and len(prefix) <= read <= n * len(prefix), (
                read,
                splits,
            )


def test_replicate_by_hand_proves_the_copy(fleet):
    prompt = ids(PREFIX_TOKENS + 8, seed=11)
    generate(fleet.gateway, prompt)
    chain = set(page_keys(prompt, PAGE))
    mine = [p for p in fleet.json("prefixes")["prefixes"] if p["id"] in chain]
    assert mine and all(len(p["holders"]) == 1 for p in mine), mine
    pid = max(mine, key=lambda p: p["prefix_blocks"])["id"]
    proc = fleet.cli("replicate", "--prefix", pid, "-n", "1")
    assert proc.returncode == 0
    out = proc.stdout + proc.stderr
    assert "proved" in out or "done" in out, out
    rec = http_json(fleet.control + f"/control/replications/{pid}")
    done = [c for c in rec["copies"] if c["state"] == "done"]
    assert done and done[-1]["proof_storage_tokens"] >= done[-1]["covered_tokens"], rec


def test_a_target_that_computed_the_prefix_itself_is_never_reported_as_a_copy(fleet):
    prompt = ids(PREFIX_TOKENS + 8, seed=23)
    generate(fleet.gateway, prompt)  # one worker computes it, as the gateway records
    chain = page_keys(prompt, PAGE)
    pid = _longest_prefix(fleet, chain)
    rec = http_json(fleet.control + f"/control/replications/{pid}")
    other = next(u for u in fleet.workers if u not in [h.rstrip("/") for h in rec["holders"]])
    # the other worker computes it too, behind the gateway's back: its device holds it, not by any copy
    generate(other, prompt)
    fleet.cli("replicate", "--prefix", pid, "-n", "1", check=False)
    fleet.settle()
    rec = http_json(fleet.control + f"/control/replications/{pid}")
    copies = [c for c in rec["copies"] if c["target"].rstrip("/") == other]
    assert copies and copies[0]["outcome"] == "computed" and copies[0]["state"] == "failed", copies
    assert copies[0]["proof"]["storage"] < copies[0]["covered_tokens"], copies
    # the target does hold it (its own computation): it is a holder, not excluded
    assert other in [h.rstrip("/") for h in rec["holders"]], rec


def test_the_proof_script_proves_a_copy(fleet):
    proc = fleet.cli_script("scripts/sglang-l3-proof.py", "--prefix-tokens", "1024", "--seed", "5", "--format", "json")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_status_prefixes_the_control_api_and_the_dashboard_show_sglangs_own_numbers(fleet):
    import asyncio
    import dataclasses

    from btbctl.engine.dashboard.control_source import ControlApiSource
    from sglang_server import sglang_number

    # what each SGLang server says itself (summed over its series), after the traffic of the tests above
    own = {url: metrics_text(url) for url in fleet.workers}
    cached = {url: sglang_number(text, "sglang:kv_evictable_tokens") for url, text in own.items()}
    backup = {url: sglang_number(text, "sglang:backuped_tokens_total") for url, text in own.items()}
    assert all(v > 0 for v in cached.values()) and all(v > 0 for v in backup.values()), (cached, backup)
    time.sleep(3.0)  # the gateway reads /metrics every 2 s
    rows = {w["url"].rstrip("/"): w for w in http_json(fleet.control + "/control/fleet")["workers"]}
    status = {w["url"].rstrip("/"): w for w in fleet.json("status")["workers"]}
    prefixes = {w["url"].rstrip("/"): w for w in fleet.json("prefixes")["workers"]}
    snap = asyncio.run(_snapshot(ControlApiSource(fleet.control, stream=False, local_gpus=False)))
    names = {w["url"].rstrip("/"): w["name"] for w in fleet.status["workers"]}
    dash = {w.name: dataclasses.asdict(w) for w in snap.workers}
    for url in fleet.workers:
        board = dict(dash[names[url]], metrics_source=dash[names[url]]["source"])
        for view in (rows[url], status[url], prefixes[url], board):
            assert view["metrics_source"] == "sglang_metrics", view
            # SGLang's own numbers, not the gateway's guesses: what the server's /metrics said (counters may have
            # moved on meanwhile, never back)
            assert view["kv_cached_tokens"] is not None and view["kv_capacity_tokens"] == 8192, view
            assert view["storage_backup_tokens_total"] >= backup[url] > 0, view
        assert rows[url]["kv_use"] > 0, rows[url]


async def _snapshot(src):
    try:
        return await src.snapshot()
    finally:
        await src.close()


def test_a_restarted_agent_gets_both_servers_back_and_a_prefix_they_kept_is_not_waited_for(fleet):
    """SGLang's stores say hello to a restarted agent at once (it announces both servers again without a request),
    but SGLang keeps the pages it backed up before marked so and never writes them to the new, empty agent: a copy
    of such a prefix fails at once with the reason, instead of waiting ``l3_source_wait_s`` for pages that cannot
    come; a prefix computed after the restart is copied and proved as before."""
    import json

    from btbctl.engine.launcher.rundir import RunDir

    before = ids(PREFIX_TOKENS + 8, seed=29)
    generate(fleet.gateway, before)
    chain = page_keys(before, PAGE)
    fleet.wait_written(chain[: PREFIX_TOKENS // PAGE])
    pid = _longest_prefix(fleet, chain)
    fleet.cli("restart", "agent-local", "--grace-s", "1")
    token = RunDir(fleet.run_dir).token_path.read_text().strip()
    req = urllib.request.Request(fleet.control + "/control/agents", headers={"Authorization": f"Bearer {token}"})
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(req, timeout=10) as r:
            agents = json.loads(r.read())["agents"]
        if len(agents) == 1 and len(agents[0]["workers"]) == 2:
            break
        assert time.monotonic() < deadline, agents
        time.sleep(0.2)

    proc = fleet.cli("replicate", "--prefix", pid, "-n", "1", "--timeout-s", "20", "--format", "json", check=False)
    rep = json.loads(proc.stdout)
    assert proc.returncode == 1 and rep["status"] == "failed", (rep, proc.stderr)
    assert "it restarted after the source computed the prefix" in rep["copies"][0]["error"], rep

    after = ids(PREFIX_TOKENS + 8, seed=31)
    generate(fleet.gateway, after)
    chain = page_keys(after, PAGE)
    fleet.wait_written(chain[: PREFIX_TOKENS // PAGE])
    pid = _longest_prefix(fleet, chain)
    fleet.cli("replicate", "--prefix", pid, "-n", "1")
    rec = http_json(fleet.control + f"/control/replications/{pid}")
    done = [c for c in rec["copies"] if c["state"] == "done"]
    assert done and done[-1]["proof_storage_tokens"] >= done[-1]["covered_tokens"], rec


def test_the_agent_killed_mid_copy_fails_the_copy_and_sglang_keeps_serving(fleet):
    """Last but one: the node agent is gone afterwards."""
    b = fleet.workers[1]
    # the published rule copies as soon as the detector fires; a 3,200-token prefix (13 chunks of prefill on this
    # CPU) keeps the copy waiting for the source's write-through long enough to kill the agent in the middle
    fleet.cli("tune", "policy=btb", "prefix_blocks=200")
    long_prompt = ids(4096, seed=13)
    answers: list[dict] = []

    def send() -> None:
        answers.append(generate(fleet.gateway, long_prompt))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for th in threads:  # two arrivals within the window: the detector fires, a copy trails the source's prefill
        th.start()
        time.sleep(0.2)
    deadline = time.monotonic() + 30
    while http_json(fleet.control + "/control/transfers")["in_flight"] == 0:
        assert time.monotonic() < deadline, "no copy started"
        time.sleep(0.02)
    fleet.signal("agent-local", signal.SIGKILL)
    for th in threads:
        th.join(180)
    # every request answered once, SGLang keeps serving without its L3 tier (a store call is a miss)
    assert len(answers) == 2 and all(x["meta_info"]["completion_tokens"] == 1 for x in answers), answers
    assert generate(b, ids(PREFIX_TOKENS, seed=17))["meta_info"]["completion_tokens"] == 1
    tr = fleet.settle()
    l3 = [c for c in tr["transfers"] if c["mode"] == "l3"]
    assert any(c["state"] == "failed" and "agent" in (c["error"] or "") for c in l3), l3
    # no target counted warm without its proof
    for c in l3:
        if c["state"] == "done":
            assert c["proof_storage_tokens"] >= c["covered_tokens"], c
    assert fleet.cli("status", check=False).returncode == 1  # degraded: the agent is down


def test_the_stand_in_replaced_only_what_the_facts_name(fleet):
    lines = check_standin_log(fleet.standin_log)
    names = {x["name"] for x in lines}
    # it was in use: every server built its host pool unpinned and copied device<->host through it
    assert "MHATokenToKVPoolHost.__init__ (pin_memory=False)" in names
    assert "MHATokenToKVPoolHost.backup_from_device_all_layer" in names
    assert "MHATokenToKVPoolHost.load_to_device_per_layer" in names
    assert len({x["pid"] for x in lines if x["kind"] == "pool"}) >= 2, lines
