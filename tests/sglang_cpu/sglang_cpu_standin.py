"""Test-only stand-in for the CUDA-bound pieces that keep SGLang 0.5.23 from serving on a CPU.

Never imported by btbctl. The harness (``scripts/sglang-venv.sh``) writes a one-line ``.pth`` file into its SGLang
venv that imports this module and calls :func:`install` only when the environment variable ``BTBCTL_SGLANG_CPU_STANDIN``
names this folder; without it the venv is stock SGLang. It replaces exactly these, nothing else:

1. **``sgl_kernel``** (the PyPI kernel wheels are CUDA-only, there is no sdist): a module holding the
   :data:`KERNEL_NAMES` SGLang imports at import time with ``SGLANG_USE_CPU_ENGINE=1``. Each raises when called: on
   a CPU without AMX, SGLang never calls its CPU kernels. Any other name (a new import after an upgrade) is an
   ``ImportError``, so an upgrade is re-checked here instead of passing silently.
2. **The host KV pool is built unpinned** (``MHATokenToKVPoolHost(pin_memory=True)`` calls ``cudaHostRegister``).
3. **The device<->host (L1<->L2) copies** ``MHATokenToKVPoolHost.load_to_device_per_layer`` and
   ``backup_from_device_all_layer`` (``sgl_kernel.kvcacheio`` kernels, imported only on GPUs) become index copies
   between the device pool's per-layer K/V buffers and the host buffer, for ``layer_first`` (``host[layer][idx]``)
   and ``page_first`` (``host[idx, layer]``).

Everything else (scheduler, radix cache, HiCache controller, the L2<->L3 prefetch and backup threads, the storage
backend factory, the HTTP server, metrics) is SGLang's code as released.

Every replaced function logs its first call in each process: one line on stderr (the worker's log) and, when
``BTBCTL_SGLANG_CPU_STANDIN_LOG`` names a file, one JSON line ``{"pid", "name", "kind"}`` appended to it. ``kind`` is
``copy`` (the device<->host copies), ``pool`` (the unpinned host pool) or ``kernel`` (an ``sgl_kernel`` function:
never expected; the real-server tests fail on one).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import types

ENV = "BTBCTL_SGLANG_CPU_STANDIN"
LOG_ENV = "BTBCTL_SGLANG_CPU_STANDIN_LOG"
#: The SGLang release these replacements were checked against (the harness pins it).
SGLANG_VERSION = "0.5.23"
#: The names SGLang 0.5.23 imports from ``sgl_kernel`` with ``SGLANG_USE_CPU_ENGINE=1`` (observed: every name
#: asked for while a server starts and serves).
KERNEL_NAMES = (
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
#: The module whose class gets the unpinned pool and the CPU copies.
HOST_POOL_MODULE = "sglang.srt.mem_cache.pool_host.mha"

_seen: set[str] = set()
_lock = threading.Lock()


def _record(name: str, kind: str) -> None:
    """Log the first call of replaced function ``name`` in this process."""
    with _lock:
        if name in _seen:
            return
        _seen.add(name)
    print(f"sglang-cpu-standin: first call of replaced {name} ({kind})", file=sys.stderr, flush=True)
    path = os.environ.get(LOG_ENV)
    if path:
        line = json.dumps({"pid": os.getpid(), "name": name, "kind": kind}) + "\n"
        with open(path, "a") as f:
            f.write(line)


def _kernel_stub(name: str):
    def stub(*args, **kwargs):
        _record(f"sgl_kernel.{name}", "kernel")
        raise NotImplementedError(f"sgl_kernel.{name} is a CPU stand-in: no sgl_kernel wheel exists for CPUs")

    stub.__name__ = stub.__qualname__ = name
    return stub


def _kernel_module() -> types.ModuleType:
    m = types.ModuleType("sgl_kernel", "CPU stand-in for sgl_kernel (tests only; see sglang_cpu_standin)")
    for name in KERNEL_NAMES:
        setattr(m, name, _kernel_stub(name))
    return m


# -- the host pool ------------------------------------------------------------------------------------------------


def _patch_host_pool(mod: types.ModuleType) -> None:
    cls = mod.MHATokenToKVPoolHost
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        _record("MHATokenToKVPoolHost.__init__ (pin_memory=False)", "pool")
        if len(args) > 5:  # buffer_info, ratio, size, page_size, layout, pin_memory, ...
            args = (*args[:5], False, *args[6:])
        else:
            kwargs["pin_memory"] = False
        init(self, *args, **kwargs)

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        _record("MHATokenToKVPoolHost.load_to_device_per_layer", "copy")
        if not is_draft and not 0 <= layer_id < self.target_layer_num:
            return
        dk, dv = self.device_k_buffers[layer_id], self.device_v_buffers[layer_id]
        hi, di = host_indices.to(self.kv_buffer.device), device_indices.to(dk.device)
        if self.layout == "layer_first":
            dk[di] = self.kv_buffer[0, layer_id, hi].to(dk.device)
            dv[di] = self.kv_buffer[1, layer_id, hi].to(dv.device)
        elif self.layout == "page_first":
            dk[di] = self.kv_buffer[0, hi, layer_id].to(dk.device)
            dv[di] = self.kv_buffer[1, hi, layer_id].to(dv.device)
        else:
            raise NotImplementedError(f"the CPU stand-in copies layer_first and page_first, not {self.layout}")

    def backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
        _record("MHATokenToKVPoolHost.backup_from_device_all_layer", "copy")
        hi = host_indices.to(self.kv_buffer.device)
        for layer in range(self.layer_num):
            dk, dv = self.device_k_buffers[layer], self.device_v_buffers[layer]
            di = device_indices.to(dk.device)
            if self.layout == "layer_first":
                self.kv_buffer[0, layer, hi] = dk[di].to(self.kv_buffer.device)
                self.kv_buffer[1, layer, hi] = dv[di].to(self.kv_buffer.device)
            elif self.layout == "page_first":
                self.kv_buffer[0, hi, layer] = dk[di].to(self.kv_buffer.device)
                self.kv_buffer[1, hi, layer] = dv[di].to(self.kv_buffer.device)
            else:
                raise NotImplementedError(f"the CPU stand-in copies layer_first and page_first, not {self.layout}")

    cls.__init__ = __init__
    cls.load_to_device_per_layer = load_to_device_per_layer
    cls.backup_from_device_all_layer = backup_from_device_all_layer


# -- import hooks -------------------------------------------------------------------------------------------------


class _PatchingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then patches the module."""

    def __init__(self, loader, patch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel":
            return importlib.machinery.ModuleSpec(fullname, self)
        if fullname == HOST_POOL_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _patch_host_pool)
            return spec
        return None

    def create_module(self, spec):
        return _kernel_module()

    def exec_module(self, module):
        pass


def install() -> None:
    """Install the stand-in in this process (idempotent; before anything imports SGLang)."""
    if getattr(sys, "_btbctl_sglang_cpu_standin", False):
        return
    sys._btbctl_sglang_cpu_standin = True  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _Finder())
