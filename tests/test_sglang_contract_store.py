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
pytest.importorskip(
    "sglang.srt.mem_cache.unified_radix_cache",
    reason="SGLang is not importable in this interpreter; run the contract tests with the python "
    "printed by scripts/sglang-venv.sh (pytest -m sglang)",
)

from agent_helpers import start_agent, wait_for  # noqa: E402
from btbctl.sglang_l3 import page_keys  # noqa: E402
from sglang_kit import CFG, Worker  # noqa: E402

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
    st, rec = src.call(
        "POST", "/v1/push", {"copy_id": copy_id, "keys": keys, "targets": [{"addr": dst.peer, "token": token}], **kw}
    )
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
        assert wb.host_bytes(seq) == expected[: len(expected) * 4 // PAGES]
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


def test_a_forged_page_is_refused_and_b_loads_only_the_pages_verified_before_it(agents, tmp_path):
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
        assert rec["state"] == "failed" and "xxh3_64 digest mismatch" in rec["error"]
        # the 5 pages ahead of the forged one verified and were committed as they came: B loads those, never the
        # forged page or any after it
        assert wb.prefetch(seq)[0] == 5 * CFG.page_size
        assert "event=copy_finished copy_id=c-forged" in node_b.log()
    finally:
        wf.close()
        wb.close()
        forger.stop()


def test_source_agent_killed_mid_copy_leaves_b_only_the_pages_that_verified(agents, tmp_path):
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
        st, _ = slow.call(
            "POST",
            "/v1/push",
            {"copy_id": "c-killed", "keys": keys, "targets": [{"addr": node_b.peer, "token": token}]},
        )
        assert st == 202
        wait_for(lambda: node_b.records("c-killed").get("target", {}).get("pages_done", 0) >= 2, 10, "2 pages in")
        slow.kill()
        rec = node_b.wait_final("c-killed", "target")
        assert rec["state"] == "failed" and rec["pages_done"] < PAGES
        assert wb.prefetch(seq)[0] == rec["pages_done"] * CFG.page_size < PAGES * CFG.page_size
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
    w = Worker(
        node.socket, policy="timeout", timeout_s=3.0, prefetch_timeout_base=0.2, prefetch_timeout_per_ki_token=0.0
    )
    try:
        hit, held = w.prefetch(seq)  # agent healthy: the prefetch completes within the budget
        assert hit == len(seq)
    finally:
        w.close()
    w = Worker(
        node.socket, policy="timeout", timeout_s=3.0, prefetch_timeout_base=0.2, prefetch_timeout_per_ki_token=0.0
    )
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


@pytest.mark.parametrize("interface_v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mla_pages_round_trip_through_two_agents_bit_exact(agents, layout, interface_v1):
    """MLA: SGLang's real ``MLATokenToKVPool`` (CPU) and ``MLATokenToKVPoolHost``; rank-replicated pages (no TP rank
    in the namespace) go A's host pool -> A's agent -> B's agent -> B's host pool through ``BtbL3Store``."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    from btbctl.sglang_l3 import BtbL3Store

    node_a, node_b = agents

    def pool_and_store(agent, tp_rank):
        dev = MLATokenToKVPool(
            size=256,
            page_size=16,
            dtype=torch.bfloat16,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            layer_num=3,
            device="cpu",
            enable_memory_saver=False,
        )
        host = MLATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            host_to_device_ratio=2.0,
            host_size=0,
            page_size=16,
            layout=layout,
            pin_memory=False,
            device_capacity_tokens=dev.size,
            start_layer=dev.start_layer,
            end_layer=dev.end_layer,
            target_layer_num=dev.layer_num,
            override_kv_cache_dim=dev.kv_cache_dim,
        )
        cfg = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=2,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=True,
            enable_storage_metrics=False,
            is_page_first_layout=layout == "page_first",
            model_name="mla",
            extra_config={"interface_v1": int(interface_v1), "agent_socket": agent.socket},
        )
        store = BtbL3Store(cfg, {})
        store.register_mem_pool_host(host)
        return host, store

    host_a, store_a = pool_and_store(node_a, 0)  # rank 0 writes MLA pages
    host_b, store_b = pool_and_store(node_b, 1)  # any rank reads them
    assert store_a.ns_id == store_b.ns_id and store_a.namespace.tp_rank is None
    seq = _seq(4)
    keys = page_keys(seq, 16)
    idx_a = host_a.alloc(64)
    host_a.kv_buffer.copy_(torch.randn(host_a.kv_buffer.shape).to(host_a.kv_buffer.dtype))

    def pages(host, idx):
        return b"".join(
            host.get_data_page(int(idx[i]), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for i in range(0, len(idx), 16)
        )

    if interface_v1:
        assert store_a.batch_set_v1(keys, idx_a) == [True] * 4
    else:
        assert store_a.batch_set(keys, [host_a.get_data_page(int(idx_a[i]), flat=True) for i in range(0, 64, 16)])
    assert _copy(node_a, node_b, f"c-mla-{layout}-{interface_v1}", keys, namespaces=[store_a.ns_id])["state"] == "done"
    idx_b = host_b.alloc(64)
    if interface_v1:
        assert store_b.batch_get_v1(keys, idx_b) == [True] * 4
    else:
        got = store_b.batch_get(keys, [host_b.get_dummy_flat_data_page() for _ in keys])
        assert all(t is not None for t in got)
        for i, t in enumerate(got):
            host_b.set_from_flat_data_page(int(idx_b[i * 16]), t)
    assert pages(host_b, idx_b) == pages(host_a, idx_a)
    store_a.close()
    store_b.close()
