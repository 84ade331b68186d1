"""A hostile peer on the workers' transfer port, against real worker processes over real sockets: forged senders,
announce-and-stall, huge announcements, idle sockets and a reused copy id change nothing on the target; a copy the
gateway's way (expect at the target, push with the token) still makes the target warm."""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import struct

import pytest

from btbctl.engine import hashing
from btbctl.engine.replication.wire import ChannelError, FrameConn, page_digest
from btbctl.sglang_l3.frames import json_frame, page_frame_head
from test_worker_support import authorized_push, start_workers, wait_for

PAGE = 256
COMMON = ("--model-path", "llama-3.3-70b", "--time-scale", "50")


@pytest.fixture(scope="module")
def fleet():
    procs = start_workers(
        (COMMON, None),  # A: source
        (COMMON, {"BTBCTL_REPLICATION_FAULT": "delay_s=0.02"}),  # S: slow sender (20 ms per block)
        (COMMON, None),  # B: target under attack
    )
    yield dict(zip("ASB", procs, strict=True))
    for p in procs:
        p.stop()


def _ids(n_blocks: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 13) % 32000 for i in range(n_blocks * PAGE)]


def _prefix(worker, n_blocks: int, seed: int) -> list[str]:
    ids = _ids(n_blocks, seed)
    st, _ = worker.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert st == 200
    return hashing.chain_hashes(ids, PAGE)


def _copy(worker, cid):
    st, r = worker.get(f"/btb/copies/{cid}")
    return r if st == 200 else None


def _connect(worker) -> socket.socket:
    host, port = worker.transfer.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _v1_announce(worker, copy_id: str, chain: list[str], block_bytes: int) -> socket.socket:
    """The unauthenticated wire of old: a header announcing ``chain`` (what anyone on the network could send)."""
    s = _connect(worker)
    hdr = json.dumps({"copy_id": copy_id, "chain": chain, "block_bytes": block_bytes}).encode()
    s.sendall(struct.pack(">4sHHI", b"BTBK", 1, 0, len(hdr)) + hdr)
    return s


def _hello(worker, copy_id: str, blocks: int, block_bytes: int) -> socket.socket:
    s = _connect(worker)
    nonce = secrets.token_hex(16)
    s.sendall(
        json_frame(
            {"op": "hello", "v": 3, "copy_id": copy_id, "blocks": blocks, "block_bytes": block_bytes, "nonce": nonce}
        )
    )
    return s


def _reply(s: socket.socket) -> dict:
    """The target's next frame ({} when it hung up)."""
    try:
        return FrameConn(s, 10.0).recv_json()
    except ChannelError:
        return {}


def _forge_blocks(s: socket.socket, chain: list[str], block_bytes: int) -> None:
    """Every block, correct in content and digest: all a forger needs is the public hash."""
    for k, h in enumerate(chain):
        data = hashing.block_payload(h, block_bytes)
        s.sendall(page_frame_head(k, len(data), page_digest(data)) + data)


def test_forged_sender_never_makes_a_prefix_cached(fleet):
    b = fleet["B"]
    bb = b.get("/btb/info")[1]["block_bytes"]
    ids = _ids(64, 101)
    chain = hashing.chain_hashes(ids, PAGE)
    # the old unauthenticated wire, 64 forged blocks
    s = _v1_announce(b, "forged-1", chain, bb)
    assert _reply(s).get("op") == "refuse"
    with contextlib.suppress(OSError):  # the target hung up
        _forge_blocks(s, chain, bb)
    s.close()
    # the current wire under a copy id the gateway really authorized (ids are public), with a guessed proof
    st, _ = b.post("/btb/expect", {"chain": chain, "copy_id": "forged-2", "token": secrets.token_hex(32)})
    s = _hello(b, "forged-2", len(chain), bb)
    ch = _reply(s)
    if ch.get("op") == "challenge":
        s.sendall(json_frame({"op": "auth", "mac": "0" * 64}))
        ans = _reply(s)
        assert ans.get("op") == "refuse" and "authentication failed" in ans["error"]
        with contextlib.suppress(OSError):  # the target hung up
            _forge_blocks(s, chain, bb)
    s.close()
    assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}
    st, g = b.post("/generate", {"input_ids": ids + [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert st == 200 and g["meta_info"]["cached_tokens"] == 0
    assert _copy(b, "forged-1") is None and _copy(b, "forged-2") is None


def test_announce_and_stall_reserves_nothing_and_holds_no_request(fleet):
    a, b = fleet["A"], fleet["B"]
    info = b.get("/btb/info")[1]
    bb = info["block_bytes"]
    warm = _prefix(b, 4, 102)  # a real prefix the target holds
    n = min(info["capacity_tokens"] // PAGE, 1 << 16)  # the whole KV cache
    ids = _ids(n, 103)
    chain = hashing.chain_hashes(ids, PAGE)
    stalls = [_v1_announce(b, "huge-1", chain, bb)]
    try:
        _reply(stalls[0])
        assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}
        # an expected copy (its id is public) announced by someone without the token, then silence
        b.post("/btb/expect", {"chain": chain[:8], "copy_id": "stall-2", "token": secrets.token_hex(32)})
        stalls.append(_hello(b, "stall-2", 8, bb))
        assert _reply(stalls[-1]).get("op") == "challenge"  # challenged, nothing reserved yet
        assert b.post("/btb/match", {"chain": chain})[1] == {"cached_blocks": 0, "pending_blocks": 0}
        assert b.post("/btb/match", {"chain": warm})[1]["cached_blocks"] == 4  # nothing evicted
        # a request for the announced prompt is not held waiting for blocks that never come
        st, g = b.post("/generate", {"input_ids": ids[: 2 * PAGE] + [7], "sampling_params": {"max_new_tokens": 1}})
        assert st == 200 and g["meta_info"]["cached_tokens"] == 0
        assert _copy(b, "huge-1") is None and _copy(b, "stall-2") is None
        # and a real copy goes through meanwhile
        real = _prefix(a, 3, 104)
        assert authorized_push(a, b, real, "real-under-stall")[0] == 202
        src = wait_for(lambda: (c := _copy(a, "real-under-stall")) and c["state"] != "running" and c)
        assert src["state"] == "done", src
    finally:
        for s in stalls:
            s.close()


def test_idle_connections_do_not_block_a_real_push(fleet):
    a, b = fleet["A"], fleet["B"]
    idle = [_connect(b) for _ in range(40)]
    try:
        chain = _prefix(a, 5, 105)
        st, r = authorized_push(a, b, chain, "past-idle-1")
        assert st == 202
        src = wait_for(lambda: (c := _copy(a, "past-idle-1")) and c["state"] != "running" and c)
        assert src["state"] == "done", src
        assert b.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == 5
    finally:
        for s in idle:
            s.close()


def test_duplicate_copy_id_does_not_fail_the_real_copy(fleet):
    s_, b = fleet["S"], fleet["B"]
    bb = b.get("/btb/info")[1]["block_bytes"]
    chain = _prefix(s_, 100, 106)  # 100 blocks at 20 ms each: about 2 s of sending
    st, r = authorized_push(s_, b, chain, "dup-1")
    assert st == 202
    wait_for(lambda: (c := _copy(b, "dup-1")) and c["blocks_verified"] >= 3)
    # a third party reuses the id (read from /btb/copies) on both wires
    intruders = [_v1_announce(b, "dup-1", chain, bb), _hello(b, "dup-1", len(chain), bb)]
    answers = [_reply(x) for x in intruders]
    for x in intruders:
        x.close()
    assert all(ans.get("op") != "auth_ok" for ans in answers)
    rec = _copy(b, "dup-1")
    assert rec["state"] == "running" and rec["error"] is None, rec
    assert b.post("/btb/match", {"chain": chain})[1]["pending_blocks"] == 100
    src = wait_for(lambda: (c := _copy(s_, "dup-1")) and c["state"] != "running" and c)
    assert src["state"] == "done", src
    assert _copy(b, "dup-1")["state"] == "done"
    assert b.post("/btb/match", {"chain": chain})[1]["cached_blocks"] == 100
