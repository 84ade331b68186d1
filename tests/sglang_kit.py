"""Real SGLang 0.5.23 HiCache workers on the CPU, for the contract tests (imported only where SGLang is).

A :class:`Worker` is SGLang's own ``UnifiedRadixCache`` + ``HybridCacheController`` + host KV pool, built with the
test kit SGLang ships (``sglang/test/kits/unified_radix_cache``: ``build_fixture`` and the storage fixtures' steps)
and initialised like a server with ``--enable-hierarchical-cache --hicache-storage-backend dynamic``. Three
test-only CPU shims (no GPU here):

1. the kit's device is ``cpu`` (``fixtures.get_device`` raises without an accelerator);
2. the host pool is built without pinned memory (CPU-only torch cannot pin);
3. the device->host copy of a backup (``MHATokenToKVPoolHost.backup_from_device_all_layer``, a CUDA kernel in
   SGLang) is a plain torch copy for the ``page_first`` and ``layer_first`` layouts.

Everything between the host pool and L3 (the backup and prefetch threads, the controller's batching, the storage
backend factory, key hashing, ``prefetch_from_storage`` and its policies) is SGLang's code, unchanged.
"""

from __future__ import annotations

import atexit
import json
import time
import unittest
from array import array

import sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler as _assembler
import sglang.test.kits.unified_radix_cache.fixtures as _fixtures
import torch
from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import build_fixture, match_prefix, node_host_value
from sglang.test.kits.unified_radix_cache.storage import UnifiedRadixCacheStorageFixtures

_fixtures.get_device = lambda: "cpu"
_orig_host_pool_cls = _assembler.get_mha_host_pool_cls


def _unpinned_host_pool_cls(device_pool):
    cls = _orig_host_pool_cls(device_pool)

    def make(*args, **kwargs):
        kwargs["pin_memory"] = False
        return cls(*args, **kwargs)

    return make


_assembler.get_mha_host_pool_cls = _unpinned_host_pool_cls


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    for layer in range(self.layer_num):
        k = device_pool.k_buffer[layer][device_indices]
        v = device_pool.v_buffer[layer][device_indices]
        if self.layout == "page_first":
            self.kv_buffer[0, host_indices, layer] = k
            self.kv_buffer[1, host_indices, layer] = v
        elif self.layout == "layer_first":
            self.kv_buffer[0, layer, host_indices] = k
            self.kv_buffer[1, layer, host_indices] = v
        else:  # pragma: no cover - the shim covers the layouts the tests use
            raise NotImplementedError(self.layout)


MHATokenToKVPoolHost.backup_from_device_all_layer = _backup_from_device_all_layer

#: The worker shape of the contract tests: 16-token pages, 4 layers, 2 KV heads of 64 dims, bf16 (4 KiB per token
#: per K or V: 2 x 4 x 2 x 64 x 2 = 2 KiB... per page 64 KiB).
CFG = CacheConfig(page_size=16, kv_size=1024, max_context_len=1024, num_layers=4)


class _Kit(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    """SGLang's storage fixture steps, used outside a unittest run."""

    cfg = CFG

    def runTest(self) -> None:  # pragma: no cover - never run
        pass


def backend_config(socket: str, interface_v1: bool, **extra) -> dict:
    return {
        "backend_name": "btb",
        "module_path": "btbctl.sglang_l3",
        "class_name": "BtbL3Store",
        "interface_v1": int(interface_v1),
        "agent_socket": socket,
        "prefetch_threshold": 1,
        **extra,
    }


class Worker:
    """One SGLang HiCache worker (tree, controller, host pool) whose L3 is ``BtbL3Store`` on ``socket``."""

    def __init__(
        self,
        socket: str | None,
        layout: str = "page_first",
        interface_v1: bool = True,
        policy: str = "wait_complete",
        model: str = "",
        file_dir: str | None = None,
        **extra,
    ) -> None:
        """With ``file_dir``, the L3 backend is SGLang's stock ``file`` backend on that directory instead."""
        self.kit = _Kit()
        kit = self.kit
        self.cache, self.alloc, self.rtp = build_fixture(CFG)
        po = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        po.__enter__()
        kit.addCleanup(po.__exit__, None, None, None)
        args = ServerArgs(
            model_path="dummy",
            served_model_name=model or None,
            page_size=CFG.page_size,
            hicache_io_backend="kernel",
            hicache_mem_layout=layout,
            hicache_write_policy="write_through",
            hicache_storage_backend="file" if file_dir else "dynamic",
            hicache_storage_backend_extra_config=json.dumps(
                {"prefetch_threshold": 1, **extra} if file_dir else backend_config(socket, interface_v1, **extra)
            ),
            hicache_storage_prefetch_policy=policy,
        )
        set_global_server_args_for_scheduler(args)
        cache = self.cache
        if file_dir:
            with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(file_dir):
                cache.init_hicache(args, cache.cache_init_params)
        else:
            cache.init_hicache(args, cache.cache_init_params)
        atexit.unregister(cache.shutdown)
        kit.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        cc = cache.cache_controller
        cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
        kit.addCleanup(cc._stop_storage_threads)
        self.cc = cc
        self.backend = cc.storage_backend
        self._rid = 0

    @property
    def host_pool(self):
        return self.cc.storage_host_pool

    def close(self) -> None:
        self.kit.doCleanups()

    def produce(self, seq: list[int], seed: int = 0) -> bytes:
        """Insert ``seq``, fill its device KV with random values, back it up to the host pool and write it through to
        L3 (SGLang's own backup path). Returns the host-pool bytes of its pages."""
        kit, cache = self.kit, self.cache
        kit._insert(cache, self.alloc, self.rtp, seq)
        leaf = match_prefix(cache, seq).last_device_node
        idx = cache.path_device_indices(leaf)
        dev = self.alloc.get_kvcache()
        g = torch.Generator().manual_seed(seed)
        for layer in range(CFG.num_layers):
            for buf in (dev.k_buffer[layer], dev.v_buffer[layer]):
                buf[idx] = torch.randn(len(idx), CFG.head_num, CFG.head_dim, generator=g).to(buf.dtype)
        kit._backup_node(cache, leaf)
        kit._write_path_to_l3(cache, leaf)
        kit._flush_l3_backups(cache)
        return self.host_bytes(seq)

    def host_bytes(self, seq: list[int]) -> bytes:
        """Bytes of the host-pool pages holding ``seq``'s prefix (flat data pages, in order)."""
        cache = self.cache
        node = match_prefix(cache, seq).last_host_node
        chain = self.kit._path_chain(cache, node)
        out = []
        for n in chain:
            hv = node_host_value(cache, n, ComponentType.FULL)
            for i in range(0, len(hv), CFG.page_size):
                page = self.host_pool.get_data_page(int(hv[i]), flat=True)
                out.append(page.contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(out)

    def prefetch(self, seq: list[int], timeout_s: float = 20.0, first_poll_only: bool = False) -> tuple[int, float]:
        """SGLang's ``prefetch_from_storage`` for ``seq``, pumped like the scheduler until
        ``check_prefetch_progress`` lets the request go. Returns (host hit length in tokens, seconds the request
        was held)."""
        cache = self.cache
        self._rid += 1
        handle = CacheRequestHandle(f"r{self._rid}", 0)
        t0 = time.monotonic()
        cache.prefetch_from_storage(handle, cache.root_node_handle(), array("q", seq), None, None)
        end = t0 + timeout_s
        while True:
            cache.check_hicache_events()
            if cache.check_prefetch_progress(handle):
                break
            if first_poll_only or time.monotonic() > end:
                raise AssertionError("prefetch still holding the request")
            time.sleep(0.005)
        held = time.monotonic() - t0
        cache.check_hicache_events()
        return match_prefix(cache, seq).host_hit_length, held


__all__ = ["CFG", "Worker", "backend_config"]
