"""Benchmarks of the node agent's data paths, each as a ratio against a baseline measured in the same run.

1. ``copy``: agent-to-agent page copy over loopback TCP (two ``btbctl agent`` processes; from the push request to
   the target's commit, with authentication, per-page xxh3_64 and the commit) against a plain socket moving the same
   bytes between two processes (connect, ``sendall``, ``recv_into``). Rounds alternate the two.
   Target: ratio (plain time / agent time) >= 0.8.
2. ``store``: ``BtbL3Store.batch_set_v1`` then ``batch_get_v1`` of ``--pages`` pages of ``--page-mib`` MiB between a
   host buffer and the agent's arena, against a bare ``ctypes.memmove`` of the same bytes between two buffers.
   Needs SGLang importable (run it with the python of ``scripts/sglang-venv.sh``). Target: ratio >= 0.5.

    python benchmarks/bench_agent.py copy --pages 64 --page-mib 2 --rounds 5
    ~/.cache/btbctl/venv-sglang-0.5.23/bin/python benchmarks/bench_agent.py store --pages 64 --page-mib 2

Prints one line per measurement and a summary with GB/s (1e9 bytes/s) and ratios; ``--format json`` for JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


# -- plain socket baseline ----------------------------------------------------------------------------------------


def _receiver(port_q, done_q, nbytes: int) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port_q.put(s.getsockname()[1])
    buf = bytearray(nbytes)
    view = memoryview(buf)
    while True:
        c, _ = s.accept()
        got = 0
        while got < nbytes:
            k = c.recv_into(view[got:])
            if k == 0:
                break
            got += k
        done_q.put(time.time())
        c.close()


def _sender(port: int, nbytes: int, go_q, page_bytes: int) -> None:
    data = bytearray(os.urandom(page_bytes)) * (nbytes // page_bytes)
    view = memoryview(data)
    while True:
        if go_q.get() is None:
            return
        c = socket.create_connection(("127.0.0.1", port))
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for off in range(0, nbytes, page_bytes):
            c.sendall(view[off : off + page_bytes])
        c.close()


def bench_copy(pages: int, page_bytes: int, rounds: int) -> dict:
    from agent_helpers import start_agent
    from btbctl.sglang_l3.client import AgentClient
    from btbctl.sglang_l3.keys import Namespace, page_keys

    nbytes = pages * page_bytes
    ctx = mp.get_context("fork")
    port_q, done_q, go_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    rx = ctx.Process(target=_receiver, args=(port_q, done_q, nbytes), daemon=True)
    rx.start()
    tx = ctx.Process(target=_sender, args=(port_q.get(), nbytes, go_q, page_bytes), daemon=True)
    tx.start()
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    arena_mib = (nbytes >> 20) * (rounds + 2) + 64
    a = start_agent(tmp, "bench-a", arena_mib=arena_mib)
    b = start_agent(tmp, "bench-b", arena_mib=arena_mib)
    ns = Namespace("bench", 1, 0, 1, 0, 1, 0, 64, "page_first", "torch.bfloat16", page_bytes, "v1", "bench")
    c = AgentClient(a.socket, 10.0, ns.describe())
    plain, agent = [], []
    try:
        for r in range(rounds + 1):  # round 0 warms both paths up and is not counted
            keys = page_keys(list(range(r * 1_000_000, r * 1_000_000 + pages * 64)), 64)
            rep, conn = c.call({"op": "put", "ns": ns.ns_id, "keys": keys, "size": page_bytes})
            for off in rep["offsets"]:
                conn.arena.view[off : off + page_bytes] = os.urandom(64) * (page_bytes // 64)
            c.call({"op": "commit", "token": rep["token"], "written": [True] * pages})
            t0 = time.time()
            go_q.put(1)
            t_plain = done_q.get() - t0
            token = b.expect(f"bench{r}", keys)
            t0 = time.time()
            st, _ = a.call(
                "POST",
                "/v1/push",
                {"copy_id": f"bench{r}", "keys": keys, "targets": [{"addr": b.peer, "token": token}]},
            )
            assert st == 202
            rec = b.wait_final(f"bench{r}", "target", 120)
            assert rec["state"] == "done", rec
            t_agent = rec["finished_s"] - t0
            if r:
                plain.append(t_plain)
                agent.append(t_agent)
                print(
                    f"copy round {r}: plain {nbytes / t_plain / 1e9:.2f} GB/s, agent {nbytes / t_agent / 1e9:.2f} GB/s",
                    file=sys.stderr,
                )
            st, _ = b.call("POST", "/v1/unpin", {"keys": keys})
    finally:
        go_q.put(None)
        c.close()
        a.stop()
        b.stop()
        rx.terminate()
    tp, ta = statistics.median(plain), statistics.median(agent)
    # rounds interleave the two, so each round's pair shared the machine's load: the median of per-round ratios
    # is the figure; the ratio of medians is printed too
    pair = statistics.median(p / a for p, a in zip(plain, agent, strict=True))
    return {
        "bench": "copy",
        "bytes": nbytes,
        "pages": pages,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "plain_gbps": nbytes / tp / 1e9,
        "agent_gbps": nbytes / ta / 1e9,
        "ratio": pair,
        "ratio_of_medians": tp / ta,
        "target": 0.8,
    }


# -- store vs memmove ---------------------------------------------------------------------------------------------


class _Pool:
    """A host pool shaped like SGLang's page_first MHA pool: per page a K and a V buffer of half a page each."""

    def __init__(self, pages: int, page_bytes: int) -> None:
        import numpy as np

        self.page_size = 64
        self.layout = "page_first"
        self.dtype = "torch.bfloat16"
        self.half = page_bytes // 2
        self.k = np.frombuffer(os.urandom(pages * self.half), dtype=np.uint8).copy()
        self.v = np.frombuffer(os.urandom(pages * self.half), dtype=np.uint8).copy()
        self.pages = pages

    def get_page_buffer_meta(self, indices):
        idx = [int(i) for i in indices][:: self.page_size]
        kb, vb = self.k.ctypes.data, self.v.ctypes.data
        ptrs, sizes = [], []
        for i in idx:
            p = i // self.page_size
            ptrs += [kb + p * self.half, vb + p * self.half]
            sizes += [self.half, self.half]
        return ptrs, sizes


def bench_store(pages: int, page_bytes: int, rounds: int) -> dict:
    try:
        import torch
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        from btbctl.sglang_l3.store import BtbL3Store
    except ImportError as e:
        return {
            "bench": "store",
            "skipped": f"SGLang not importable here ({e}); use the python of scripts/sglang-venv.sh",
        }
    import numpy as np

    from agent_helpers import start_agent
    from btbctl.sglang_l3.keys import page_keys

    nbytes = pages * page_bytes
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    agent = start_agent(tmp, "bench-store", arena_mib=(nbytes >> 20) * (rounds + 2) + 64)
    cfg = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config={"interface_v1": 1, "agent_socket": agent.socket},
    )
    store = BtbL3Store(cfg, {})
    pool = _Pool(pages, page_bytes)
    store.register_mem_pool_host(pool)
    dst = np.empty(nbytes, dtype=np.uint8)
    host_indices = torch.arange(pages * pool.page_size)
    set_t, get_t, mm_t = [], [], []
    try:
        for r in range(rounds + 1):
            keys = page_keys(list(range(r * 1_000_000, r * 1_000_000 + pages * 64)), 64)
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
            t0 = time.perf_counter()
            off = dst.ctypes.data
            for p, s in zip(ptrs, sizes, strict=True):
                ctypes.memmove(off, p, s)
                off += s
            t_mm = time.perf_counter() - t0
            t0 = time.perf_counter()
            ok = store.batch_set_v1(keys, host_indices)
            t_set = time.perf_counter() - t0
            assert all(ok), ok
            pool.k[:] = 0
            t0 = time.perf_counter()
            ok = store.batch_get_v1(keys, host_indices)
            t_get = time.perf_counter() - t0
            assert all(ok)
            assert bytes(pool.k[:16]) == bytes(dst[:16])
            if not r:
                time.sleep(1.0)  # the store maps the arena in the background after its first call
            if r:
                mm_t.append(t_mm)
                set_t.append(t_set)
                get_t.append(t_get)
                print(
                    f"store round {r}: memmove {nbytes / t_mm / 1e9:.2f} GB/s, set {nbytes / t_set / 1e9:.2f} GB/s, "
                    f"get {nbytes / t_get / 1e9:.2f} GB/s",
                    file=sys.stderr,
                )
    finally:
        store.close()
        agent.stop()
    tm, ts, tg = statistics.median(mm_t), statistics.median(set_t), statistics.median(get_t)
    return {
        "bench": "store",
        "bytes": nbytes,
        "pages": pages,
        "page_bytes": page_bytes,
        "rounds": rounds,
        "memmove_gbps": nbytes / tm / 1e9,
        "set_gbps": nbytes / ts / 1e9,
        "get_gbps": nbytes / tg / 1e9,
        "set_ratio": statistics.median(m / x for m, x in zip(mm_t, set_t, strict=True)),
        "get_ratio": statistics.median(m / x for m, x in zip(mm_t, get_t, strict=True)),
        "target": 0.5,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["copy", "store", "all"])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-mib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--format", choices=["text", "json"], default="text")
    a = ap.parse_args()
    page_bytes = int(a.page_mib * (1 << 20))
    out = []
    if a.which in ("copy", "all"):
        out.append(bench_copy(a.pages, page_bytes, a.rounds))
    if a.which in ("store", "all"):
        out.append(bench_store(a.pages, page_bytes, a.rounds))
    if a.format == "json":
        print(json.dumps(out, indent=1))
        return
    for r in out:
        if "skipped" in r:
            print(f"{r['bench']}: skipped: {r['skipped']}")
        elif r["bench"] == "copy":
            print(
                f"copy {r['bytes'] / 2**20:.0f} MiB ({r['pages']} x {r['page_bytes'] / 2**20:g} MiB), median of "
                f"{r['rounds']}: plain socket {r['plain_gbps']:.2f} GB/s, agent {r['agent_gbps']:.2f} GB/s, "
                f"ratio {r['ratio']:.2f} (median of per-round ratios; of medians {r['ratio_of_medians']:.2f}; "
                f"target >= {r['target']})"
            )
        else:
            print(
                f"store {r['bytes'] / 2**20:.0f} MiB ({r['pages']} x {r['page_bytes'] / 2**20:g} MiB), median of "
                f"{r['rounds']}: memmove {r['memmove_gbps']:.2f} GB/s, set_v1 {r['set_gbps']:.2f} GB/s "
                f"(ratio {r['set_ratio']:.2f}), get_v1 {r['get_gbps']:.2f} GB/s (ratio {r['get_ratio']:.2f}) "
                f"(target >= {r['target']})"
            )


if __name__ == "__main__":
    main()
