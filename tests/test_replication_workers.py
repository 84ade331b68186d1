"""Replication between worker processes over real TCP: a pushed prefix becomes warm on the target; a corrupted
block is refused; a source killed mid-copy leaves the target cold."""

from __future__ import annotations

import urllib.error

import pytest

from btbctl.engine import hashing
from test_worker_support import authorized_push, start_workers, wait_for

PAGE = 256
COMMON = ("--model-path", "llama-3.3-70b", "--time-scale", "50")


@pytest.fixture(scope="module")
def fleet():
    procs = start_workers(
        (COMMON, None),  # A: source
        (COMMON, None),  # B: target
        (COMMON, {"BTBCTL_REPLICATION_FAULT": "corrupt_wire=1"}),  # F: corrupts block 1 on the wire
        (COMMON, {"BTBCTL_REPLICATION_FAULT": "delay_s=0.02"}),  # S: slow sender (20 ms per block)
        (COMMON, None),  # T: a target that dies
    )
    yield dict(zip("ABFST", procs, strict=True))
    for p in procs:
        p.stop()


def _prefix(worker, n_blocks: int, seed: int) -> list[str]:
    ids = [(seed * 7 + i * 13) % 32000 for i in range(n_blocks * PAGE)]
    st, r = worker.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert st == 200
    chain = hashing.chain_hashes(ids, PAGE)
    assert worker.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == n_blocks
    return chain


def _copy(worker, cid):
    st, r = worker.get(f"/btb/copies/{cid}")
    return r if st == 200 else None


def test_push_makes_the_target_warm(fleet):
    a, b = fleet["A"], fleet["B"]
    chain = _prefix(a, 6, 1)
    ids = [(1 * 7 + i * 13) % 32000 for i in range(6 * PAGE)]
    assert b.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == 0
    st, r = authorized_push(a, b, chain, "warm-1")
    assert st == 202 and r["copy_id"] == "warm-1" and r["blocks"] == 6
    block_bytes = a.get("/btb/info")[1]["block_bytes"]
    assert r["bytes"] == 6 * block_bytes
    src = wait_for(lambda: (c := _copy(a, "warm-1")) and c["state"] != "running" and c)
    assert src["state"] == "done" and src["role"] == "source" and src["error"] is None
    assert src["bytes_sent"] == src["bytes_total"] == 6 * block_bytes and src["blocks_verified"] == 6
    assert src["finished_s"] >= src["started_s"]
    dst = _copy(b, "warm-1")
    assert dst["role"] == "target" and dst["state"] == "done" and dst["blocks_verified"] == 6
    assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 6, "pending_blocks": 6}
    st, g = b.post("/generate", {"input_ids": ids + [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert g["meta_info"]["cached_tokens"] == 6 * PAGE
    assert any(c["copy_id"] == "warm-1" for c in b.get("/btb/copies")[1]["copies"])
    # the target can relay the arrived bytes onwards (they verify again at the next hop)
    st, r = authorized_push(b, a, chain[:3], "relay-1")
    assert st == 202
    assert wait_for(lambda: (c := _copy(b, "relay-1")) and c["state"] != "running" and c)["state"] == "done"


def test_push_of_a_chain_not_held_is_409(fleet):
    a, b = fleet["A"], fleet["B"]
    chain = _prefix(a, 2, 2)
    st, r = b.post("/btb/push", {"chain": chain, "target": a.transfer})
    assert st == 409


def test_corrupted_block_is_refused_and_target_stays_cold(fleet):
    f, b = fleet["F"], fleet["B"]
    chain = _prefix(f, 4, 3)
    st, r = authorized_push(f, b, chain, "corrupt-1")
    assert st == 202
    src = wait_for(lambda: (c := _copy(f, "corrupt-1")) and c["state"] != "running" and c)
    assert src["state"] == "failed" and "block 1" in src["error"] and "digest mismatch" in src["error"]
    dst = wait_for(lambda: (c := _copy(b, "corrupt-1")) and c["state"] != "running" and c)
    assert dst["state"] == "failed" and "block 1" in dst["error"]
    assert dst["blocks_verified"] == 1
    assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}


def test_target_killed_mid_copy_fails_the_source_side(fleet):
    s, t = fleet["S"], fleet["T"]
    chain = _prefix(s, 100, 5)
    st, r = authorized_push(s, t, chain, "tdies-1")
    assert st == 202
    wait_for(lambda: (c := _copy(s, "tdies-1")) and c["bytes_sent"] > 0)
    t.kill()
    src = wait_for(lambda: (c := _copy(s, "tdies-1")) and c["state"] != "running" and c)
    assert src["state"] == "failed" and "lost" in src["error"] and src["bytes_sent"] < src["bytes_total"]


def test_source_killed_mid_copy_leaves_target_cold(fleet):
    s, b = fleet["S"], fleet["B"]
    chain = _prefix(s, 150, 4)  # 150 blocks at 20 ms each: about 3 s of sending
    st, r = authorized_push(s, b, chain, "killed-1")
    assert st == 202
    wait_for(lambda: (c := _copy(b, "killed-1")) and c["blocks_verified"] >= 5)
    # while arriving, the blocks count as pending on the target but not as cached
    m = b.post("/btb/match", {"chain": chain})[1]
    assert m["cached_blocks"] == 0 and m["pending_blocks"] == 150
    s.kill()
    dst = wait_for(lambda: (c := _copy(b, "killed-1")) and c["state"] != "running" and c)
    assert dst["state"] == "failed" and "connection lost" in dst["error"]
    assert 5 <= dst["blocks_verified"] < 150
    assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}
    with pytest.raises(urllib.error.URLError):  # the source is gone: connection refused
        s.get("/btb/copies/killed-1", timeout=2)


# -- copies that trail the source's prefill ---------------------------------------------------------------------
# Real time (scale 1) with 256-token prefill chunks: every block of a prompt commits at the end of its own chunk,
# about 15 ms apart for Llama-3.3-70B on 4 x H100, so a 48-block prefill takes most of a second.
TRAILING = ("--model-path", "llama-3.3-70b", "--time-scale", "1", "--chunked-prefill-size", "256")
TRAIL_BLOCKS = 48


@pytest.fixture(scope="module")
def trailing():
    procs = start_workers((TRAILING, None), (TRAILING, None), (TRAILING, None))
    yield dict(zip(("src", "dst", "victim"), procs, strict=True))
    for p in procs:
        p.stop()


def _start_prefill(worker, seed: int, extra: int = 0):
    """Send a cold prompt of TRAIL_BLOCKS blocks (+ ``extra`` tokens) in a thread; returns (ids, chain, thread,
    result box). The chain shows as pending on ``worker`` once the request is queued there."""
    import threading

    ids = [(seed * 11 + i * 17) % 32000 for i in range(TRAIL_BLOCKS * PAGE + extra)]
    chain = hashing.chain_hashes(ids[: TRAIL_BLOCKS * PAGE], PAGE)
    box: dict = {}

    def go():
        try:
            box["answer"] = worker.post(
                "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, timeout=30
            )
        except OSError as e:  # the worker was killed under it
            box["answer"] = (None, repr(e))

    th = threading.Thread(target=go, daemon=True)
    th.start()
    wait_for(lambda: worker.post("/btb/match", {"chain": chain})[1]["pending_blocks"] == TRAIL_BLOCKS, timeout=5)
    return ids, chain, th, box


def test_push_from_a_prefilling_source_streams_blocks_and_warms_the_target_at_the_end(trailing):
    src, dst = trailing["src"], trailing["dst"]
    ids, chain, th, box = _start_prefill(src, 21)
    m = src.post("/btb/match", {"chain": chain})[1]
    assert m["cached_blocks"] < TRAIL_BLOCKS  # still computing when the push goes out
    st, r = authorized_push(src, dst, chain, "trail-1")
    assert st == 202 and r["blocks_available"] < TRAIL_BLOCKS
    # accepted: the target counts the blocks as arriving at once, and serves none of them as cached yet
    assert dst.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": TRAIL_BLOCKS}
    seen = []  # (blocks the source computed, blocks sent) while the copy is in flight
    while (c := _copy(src, "trail-1"))["state"] == "running":
        seen.append((c["blocks_available"], c["bytes_sent"]))
        warm = dst.post("/btb/match", {"chain": chain})[1]["cached_blocks"]
        tc = _copy(dst, "trail-1")
        assert warm in (0, TRAIL_BLOCKS)  # all or nothing
        if warm:  # committed only together with the target's record turning done, after the last block
            assert tc["state"] == "done" and tc["blocks_verified"] == TRAIL_BLOCKS
    block_bytes = r["bytes"] // TRAIL_BLOCKS
    # blocks went out part by part, trailing the source's chunks, before the source had all of them
    partial = [(a, s) for a, s in seen if 0 < s < r["bytes"]]
    assert partial and all(s <= a * block_bytes for a, s in partial)
    assert len({a for a, _ in seen}) >= 3
    assert c["state"] == "done" and c["blocks_verified"] == TRAIL_BLOCKS
    assert dst.post("/btb/match", {"chain": chain})[1] == {
        "cached_blocks": TRAIL_BLOCKS,
        "pending_blocks": TRAIL_BLOCKS,
    }
    th.join(10)
    assert box["answer"][0] == 200
    # the target finished no earlier than the source computed the last block
    assert _copy(dst, "trail-1")["finished_s"] >= c["started_s"]


def test_source_killed_while_prefilling_leaves_the_target_cold(trailing):
    victim, dst = trailing["victim"], trailing["dst"]
    ids, chain, th, box = _start_prefill(victim, 22)
    st, r = authorized_push(victim, dst, chain, "trail-killed")
    assert st == 202
    assert dst.post("/btb/match", {"chain": chain})[1]["pending_blocks"] == TRAIL_BLOCKS
    victim.kill()
    tc = wait_for(lambda: (c := _copy(dst, "trail-killed")) and c["state"] != "running" and c)
    assert tc["state"] == "failed" and "connection lost" in tc["error"]
    assert tc["blocks_verified"] < TRAIL_BLOCKS
    assert dst.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}
    # a later request of the prefix computes it there (nothing was left reserved or pending)
    st, g = dst.post(
        "/generate",
        {"input_ids": ids[: TRAIL_BLOCKS * PAGE] + [5], "sampling_params": {"max_new_tokens": 1}},
        timeout=30,
    )
    assert st == 200 and g["meta_info"]["cached_tokens"] == 0


def test_request_at_the_target_during_the_copy_waits_for_it(trailing):
    src, dst = trailing["src"], trailing["dst"]
    ids, chain, th, box = _start_prefill(src, 23, extra=10)
    st, r = authorized_push(src, dst, chain, "trail-wait")
    assert st == 202
    assert _copy(src, "trail-wait")["state"] == "running"  # the source is still computing
    prompt = ids[: TRAIL_BLOCKS * PAGE] + [7, 8, 9]
    st, g = dst.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}, timeout=30)
    assert st == 200
    assert g["meta_info"]["cached_tokens"] == TRAIL_BLOCKS * PAGE  # served from the copy, not recomputed
    c = _copy(src, "trail-wait")
    assert c["state"] == "done"
    th.join(10)
    assert box["answer"][0] == 200
