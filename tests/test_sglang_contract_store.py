"""Contract: SGLang's own HiCache machinery backs pages up into node A's ``btbctl agent`` through ``BtbL3Store``; A's
agent pushes them over TCP to node B's agent; SGLang's own ``prefetch_from_storage`` on worker B loads the prefix
and B's host-pool bytes equal A's. Runs only under a Python with SGLang (``scripts/sglang-venv.sh``).

Two real agent processes (two arenas) per test module; workers are SGLang's ``UnifiedRadixCache`` +
``HybridCacheController`` + host pool on the CPU (``tests/sglang_kit.py``)."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

pytestmark = pytest.mark.sglang
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache",
                    reason="SGLang is not importable in this interpreter; run the contract tests with the python "
                           "printed by scripts/sglang-venv.sh (pytest -m sglang)")

from agent_helpers import start_agent, wait_for  # noqa: E402
from sglang_kit import CFG, Worker  # noqa: E402

from btbctl.sglang_l3 import page_keys  # noqa: E402

PAGES = 10


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    a, b = start_agent(tmp, "node-a"), start_agent(tmp, "node-b")
    yield a, b
    a.stop()
    b.stop()


_seq_base = [1000]


def _seq(pages: int = PAGES) -> list[int]:
    rnd = random.Random(_seq_base[0])
    _seq_base[0] += 1
    return [rnd.randrange(1, 150_000) for _ in range(pages * CFG.page_size)]


def _copy(src, dst, copy_id: str, keys: list[str], **kw) -> dict:
    token = dst.expect(copy_id, keys)
    st, rec = src.call("POST", "/v1/push", {"copy_id": copy_id, "keys": keys,
                                           "targets": [{"addr": dst.peer, "token": token}], **kw})
    assert st == 202, rec
    return dst.wait_final(copy_id, "target")


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_prefix_backed_up_on_a_is_pushed_and_prefetched_bit_exact_on_b(agents, layout, interface_v1):
    node_a, node_b = agents
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    wa = Worker(node_a.socket, layout, interface_v1)
    wb = Worker(node_b.socket, layout, interface_v1)
    try:
        expected = wa.produce(seq, seed=len(keys))
        assert len(expected) == PAGES * wa.backend.page_bytes
        st, have = node_a.call("POST", "/v1/has", {"keys": keys, "namespaces": [wa.backend.ns_id]})
        assert have["complete"] == [wa.backend.ns_id]  # SGLang's backup thread stored every page on node A
        assert wb.prefetch(seq)[0] == 0  # B is cold before the copy
        rec = _copy(node_a, node_b, f"c-{layout}-{interface_v1}", keys, namespaces=[wa.backend.ns_id])
        assert rec["state"] == "done" and rec["pages_done"] == PAGES
        hit, _ = wb.prefetch(seq)
        assert hit == len(seq)
        assert wb.host_bytes(seq) == expected
    finally:
        wa.close()
        wb.close()


def test_missing_pages_load_only_the_leading_run(agents):
    node_a, node_b = agents
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    wa, wb = Worker(node_a.socket), Worker(node_b.socket)
    try:
        expected = wa.produce(seq, seed=7)
        rec = _copy(node_a, node_b, "c-partial", keys[:4], namespaces=[wa.backend.ns_id])
        assert rec["state"] == "done"
        hit, _ = wb.prefetch(seq)
        assert hit == 4 * CFG.page_size
        assert wb.host_bytes(seq) == expected[:len(expected) * 4 // PAGES]
    finally:
        wa.close()
        wb.close()


def test_pages_of_another_layout_or_interface_are_a_miss_not_wrong_kv(agents):
    node_a, node_b = agents
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    wa = Worker(node_a.socket, "layer_first", True)
    try:
        wa.produce(seq, seed=3)
        assert _copy(node_a, node_b, "c-layout", keys, namespaces=[wa.backend.ns_id])["state"] == "done"
    finally:
        wa.close()
    for layout, v1 in (("page_first", True), ("layer_first", False)):
        wb = Worker(node_b.socket, layout, v1)
        try:
            assert wb.prefetch(seq)[0] == 0
        finally:
            wb.close()


def test_a_forged_page_is_refused_and_b_stays_cold(agents, tmp_path):
    _, node_b = agents
    os.environ["BTBCTL_AGENT_FAULT"] = "corrupt_wire=5"
    try:
        forger = start_agent(tmp_path, "forger")
    finally:
        del os.environ["BTBCTL_AGENT_FAULT"]
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    wf, wb = Worker(forger.socket), Worker(node_b.socket)
    try:
        wf.produce(seq, seed=11)
        rec = _copy(forger, node_b, "c-forged", keys, namespaces=[wf.backend.ns_id])
        assert rec["state"] == "failed" and "xxh3_64 mismatch" in rec["error"]
        assert wb.prefetch(seq)[0] == 0  # nothing of the copy is served, not even the 5 good pages
        assert "event=copy_finished copy_id=c-forged" in node_b.log()
    finally:
        wf.close()
        wb.close()
        forger.stop()


def test_source_agent_killed_mid_copy_leaves_b_cold(agents, tmp_path):
    _, node_b = agents
    os.environ["BTBCTL_AGENT_FAULT"] = "delay_s=0.2"
    try:
        slow = start_agent(tmp_path, "dying")
    finally:
        del os.environ["BTBCTL_AGENT_FAULT"]
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    ws, wb = Worker(slow.socket), Worker(node_b.socket)
    try:
        ws.produce(seq, seed=5)
        token = node_b.expect("c-killed", keys)
        st, _ = slow.call("POST", "/v1/push", {"copy_id": "c-killed", "keys": keys,
                                               "targets": [{"addr": node_b.peer, "token": token}]})
        assert st == 202
        wait_for(lambda: node_b.records("c-killed").get("target", {}).get("pages_done", 0) >= 2, 10, "2 pages in")
        slow.kill()
        rec = node_b.wait_final("c-killed", "target")
        assert rec["state"] == "failed" and rec["pages_done"] < PAGES
        assert wb.prefetch(seq)[0] == 0
    finally:
        ws.close()
        wb.close()


def test_wait_complete_with_a_stalled_agent_is_bounded_by_the_store_timeout(tmp_path):
    node = start_agent(tmp_path, "stalled")
    seq = _seq()
    w0 = Worker(node.socket)
    try:
        w0.produce(seq, seed=1)
    finally:
        w0.close()
    w = Worker(node.socket, policy="wait_complete", timeout_s=0.5)
    try:
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            hit, held = w.prefetch(seq, timeout_s=10)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        assert hit == 0  # a miss, never a hang: the store's own bound ended the call
        assert held < 5.0
    finally:
        w.close()
        node.stop()


def test_timeout_policy_releases_the_request_within_sglangs_budget(tmp_path):
    node = start_agent(tmp_path, "slow-l3")
    seq = _seq()
    w0 = Worker(node.socket)
    try:
        w0.produce(seq, seed=2)
    finally:
        w0.close()
    # SGLang's budget: prefetch_timeout_base + pages x per-page share (hybrid_cache_controller.py:378-438)
    w = Worker(node.socket, policy="timeout", timeout_s=3.0, prefetch_timeout_base=0.2,
               prefetch_timeout_per_ki_token=0.0)
    try:
        hit, held = w.prefetch(seq)  # agent healthy: the prefetch completes within the budget
        assert hit == len(seq)
    finally:
        w.close()
    w = Worker(node.socket, policy="timeout", timeout_s=3.0, prefetch_timeout_base=0.2,
               prefetch_timeout_per_ki_token=0.0)
    try:
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            hit, held = w.prefetch(seq)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        assert hit == 0 and held < 2.5  # released at SGLang's deadline, before the store's own 3 s bound
    finally:
        w.close()
        node.stop()


def test_best_effort_never_holds_the_request(agents):
    node_a, _ = agents
    seq = _seq()
    wa = Worker(node_a.socket)
    try:
        wa.produce(seq, seed=9)
    finally:
        wa.close()
    w = Worker(node_a.socket, policy="best_effort")
    try:
        hit, held = w.prefetch(seq, first_poll_only=True)  # raises if the first poll holds the request
        assert hit % CFG.page_size == 0 and hit <= len(seq)
        time.sleep(0.2)
        if hit:
            assert w.host_bytes(seq)  # whatever landed is SGLang's to use; nothing waits for the rest
    finally:
        w.close()


def test_agent_restart_is_survived_by_the_store(tmp_path):
    node = start_agent(tmp_path, "restarts")
    seq = _seq()
    w = Worker(node.socket)
    try:
        w.produce(seq, seed=4)
        node.stop()
        w.prefetch(seq)  # agent gone: SGLang's prefetch goes on (the store answers misses, never raises)
        assert w.backend.batch_exists(page_keys(seq, CFG.page_size)) == 0  # agent gone: a miss
        node2 = start_agent(tmp_path, "restarts")
        try:
            time.sleep(1.1)  # the store's reconnect backoff
            assert w.backend.batch_exists(page_keys(seq, CFG.page_size)) == 0  # new, empty arena
        finally:
            node2.stop()
    finally:
        w.close()


def test_file_mode_agents_copy_sglangs_file_backend_pages_bit_exact(tmp_path):
    """Fallback: SGLang's stock ``file`` backend on node-local directories, the agents copying exactly the files the
    keys name."""
    dir_a, dir_b = tmp_path / "l3-a", tmp_path / "l3-b"
    dir_a.mkdir()
    dir_b.mkdir()
    fa = start_agent(tmp_path, "file-a", extra=["--file-dir", str(dir_a)])
    fb = start_agent(tmp_path, "file-b", extra=["--file-dir", str(dir_b)])
    seq = _seq()
    keys = page_keys(seq, CFG.page_size)
    wa, wb = Worker(None, file_dir=str(dir_a)), Worker(None, file_dir=str(dir_b))
    try:
        expected = wa.produce(seq, seed=21)
        st, have = fa.call("POST", "/v1/has", {"keys": keys})
        assert len(have["complete"]) == 1  # one rank's suffix, as SGLang named the files
        assert wb.prefetch(seq)[0] == 0
        rec = _copy(fa, fb, "c-file", keys, namespaces=have["complete"])
        assert rec["state"] == "done" and len(list(dir_b.iterdir())) == PAGES
        hit, _ = wb.prefetch(seq)
        assert hit == len(seq) and wb.host_bytes(seq) == expected
    finally:
        wa.close()
        wb.close()
        fa.stop()
        fb.stop()
