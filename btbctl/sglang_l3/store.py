"""``BtbL3Store``: a HiCache L3 storage backend that SGLang loads with ``--hicache-storage-backend dynamic``.

Loaded by SGLang 0.5.23's ``StorageBackendFactory._create_dynamic_backend``
(``srt/mem_cache/storage/backend_factory.py:134-171``: imports ``module_path``, checks ``issubclass(cls,
HiCacheStorage)``, calls ``cls(storage_config, kwargs)``). Flag::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{"backend_name": "btb",
      "module_path": "btbctl.sglang_l3", "class_name": "BtbL3Store", "interface_v1": 1,
      "agent_socket": "/run/btbctl/agent.sock", "timeout_s": 2.0}'

Extra-config keys read here (SGLang passes every key it does not consume, ``hybrid_cache_controller.py:378-438``):

* ``agent_socket``: the node agent's Unix socket (default ``$BTBCTL_AGENT_SOCKET`` or
  :data:`~btbctl.sglang_l3.config.DEFAULT_AGENT_SOCKET`);
* ``timeout_s``: bound of every call to the agent, seconds (default :data:`DEFAULT_TIMEOUT_S`);
* ``interface_v1``: SGLang's own switch to the zero-copy ``batch_get_v1``/``batch_set_v1`` path
  (``managers/cache_controller.py:651-667``); without it SGLang uses the generic ``batch_get``/``batch_set``.

Page bytes live in the node agent's arena (shared memory mapped here); this process only copies between SGLang's
host pool and the arena (``ctypes.memmove``, which releases the GIL) and exchanges small control frames with the
agent over the Unix socket. No network I/O happens in SGLang's process.

Layouts: whatever the host pool's ``get_page_buffer_meta`` describes (``layer_first``: 2 x layers buffers per page
for MHA, one per layer for MLA; ``page_first``/``page_first_direct``: K and V, or one for MLA;
``pool_host/mha.py:817-877``, ``pool_host/mla.py:1213-1330``); a v1 page object is those buffers concatenated.
The generic path stores the pool's flat data page (``get_data_page(i, flat=True)``, ``pool_host/mha.py:713-725``).
The two orders differ for ``layer_first``, so the interface is part of the namespace.

Agent restart: the connection said hello on at start-up is kept and watched (:meth:`AgentClient.hold
<btbctl.sglang_l3.client.AgentClient.hold>`), so a restarted agent learns this store's namespace and worker at once
and announces the worker again. What it cannot do through SGLang's storage-backend API: tell SGLang that the new
agent's store is empty. SGLang writes a page to L3 only when its host tier backs it up, and it keeps its pages
marked backed up, so the prefixes this worker computed before the restart stay out of the new agent until SGLang
evicts and recomputes them (the gateway then copies them from another holder or has them recomputed; see
``btbctl/engine/gateway/l3.py``). One log line says so at each restart.

Failure policy: nothing on the data path raises or blocks past ``timeout_s``. Any failure is a miss (``get``:
None/False; ``set``: False; ``exists``: 0) and is logged once per kind. Configuration errors (unknown keys, bad
values) raise ``ValueError`` with one line at construction, when SGLang starts.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from btbctl.sglang_l3.client import AgentClient, AgentUnavailable, memmove
from btbctl.sglang_l3.config import (
    AGENT_SOCKET_ENV,
    DEFAULT_AGENT_SOCKET,
    DEFAULT_TIMEOUT_S,
    OWN_KEYS,
    SGLANG_KEYS,
    parse_extra_config,
    worker_url_of,
)
from btbctl.sglang_l3.keys import Namespace

log = logging.getLogger("btbctl.sglang_l3")


def _sglang_version() -> str:
    try:
        from sglang.version import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001  # pragma: no cover - SGLang without its version module
        return "unknown"


class BtbL3Store(HiCacheStorage):
    """See the module docstring. Args as SGLang passes them: ``storage_config`` and a (positional, unused) dict."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.socket_path, self.timeout_s, self.interface_v1 = parse_extra_config(storage_config.extra_config)
        self.worker_url = worker_url_of(storage_config.extra_config or {})
        self.client: AgentClient | None = None
        self.namespace: Namespace | None = None
        self.ns_id: str | None = None
        self.page_bytes = 0
        self.page_size = 0
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()

    # -- setup ------------------------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        """SGLang hands over the host pool (``cache_controller.py:617``): derive the page size in bytes and the
        namespace, and prepare the agent client (the connection is made on first use)."""
        super().register_mem_pool_host(mem_pool_host)
        cfg = self.storage_config
        pool = mem_pool_host
        self.page_size = int(pool.page_size)
        if self.interface_v1:
            _, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
            self.page_bytes = int(sum(sizes))
        else:
            flat = pool.get_dummy_flat_data_page()
            self.page_bytes = int(flat.numel() * flat.element_size())
        mla = bool(cfg.is_mla_model)
        self.namespace = Namespace(
            model=cfg.model_name or "",
            tp_size=int(cfg.tp_size),
            tp_rank=None if mla else int(cfg.tp_rank),
            pp_size=int(cfg.pp_size),
            pp_rank=int(cfg.pp_rank),
            cp_size=int(getattr(cfg, "attn_cp_size", 1)),
            cp_rank=int(getattr(cfg, "attn_cp_rank", 0)),
            page_size=self.page_size,
            layout=str(pool.layout),
            kv_dtype=str(pool.dtype),
            page_bytes=self.page_bytes,
            interface="v1" if self.interface_v1 else "generic",
            sglang_version=_sglang_version(),
            mla=mla,
        )
        self.ns_id = self.namespace.ns_id
        self.client = AgentClient(self.socket_path, self.timeout_s, self.namespace.describe(), self.worker_url)
        try:  # hello now, on a connection kept open: the agent announces this worker to the gateway while connected
            self.client.hold(self._agent_restarted)
        except AgentUnavailable as e:
            log.info("btbctl L3 store: agent not reachable at start-up (%s); it connects on first use", e)
        log.info(
            "btbctl L3 store: namespace %s (%s), page %d bytes, agent %s",
            self.ns_id,
            self.namespace.describe(),
            self.page_bytes,
            self.socket_path,
        )

    def _agent_restarted(self, old_arena_id: str, new_arena_id: str) -> None:
        log.warning(
            "btbctl L3 store: the agent at %s restarted (arena %s -> %s) with an empty store; pages SGLang backed up "
            "before are not written to it again until SGLang evicts and recomputes them",
            self.socket_path,
            old_arena_id,
            new_arena_id,
        )

    def _warn_once(self, kind: str, message: str) -> None:
        with self._warn_lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning("btbctl L3 store: %s (further %s failures are not logged)", message, kind)

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, AgentUnavailable):
            self._warn_once(e.kind, str(e))
        else:
            self._warn_once(type(e).__name__, f"internal error {type(e).__name__}: {e}")

    # -- existence --------------------------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        """Length of the leading run of ``keys`` whose pages are ready in the node's store (0 on any failure)."""
        if not keys or self.client is None:
            return 0
        try:
            rep, _ = self.client.call({"op": "exists", "ns": self.ns_id, "keys": list(keys), "size": self.page_bytes})
            n = rep.get("n")
            return n if isinstance(n, int) and 0 <= n <= len(keys) else 0
        except Exception as e:  # noqa: BLE001 - the data path never raises: a failure is a miss
            self._fail(e)
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy path ---------------------------------------------------------------------------------------

    def _segments(self, keys: list[str], host_indices) -> list[list[tuple[int, int]]] | None:
        """Per page, its host buffers as ``(address, bytes)``, or None when they do not add up to a page."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        n = len(keys)
        if n == 0 or len(ptrs) % n or len(ptrs) != len(sizes):
            self._warn_once("layout", f"host pool gave {len(ptrs)} buffers for {n} pages; treated as a miss")
            return None
        per = len(ptrs) // n
        pages = [
            list(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True)) for i in range(n)
        ]
        if any(sum(s for _, s in p) != self.page_bytes for p in pages):
            self._warn_once("page_bytes", "host buffers do not add up to the namespace's page size; miss")
            return None
        return pages

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Copy the leading run of present pages into the host pool at ``host_indices`` (``len(keys) x page_size``
        token slots). Returns one bool per key; False from the first miss on."""
        out = [False] * len(keys)
        if not keys or self.client is None:
            return out
        lease = 0
        try:
            pages = self._segments(keys, host_indices)
            if pages is None:
                return out
            rep, conn = self.client.call({"op": "get", "ns": self.ns_id, "keys": list(keys), "size": self.page_bytes})
            offsets, lease = rep.get("offsets") or [], rep.get("lease") or 0
            base = conn.arena.base
            for i, off in enumerate(offsets[: len(keys)]):
                src = base + off
                for addr, size in pages[i]:
                    memmove(addr, src, size)
                    src += size
                out[i] = True
            return out
        except Exception as e:  # noqa: BLE001 - the data path never raises: a failure is a miss
            self._fail(e)
            return [False] * len(keys)
        finally:
            if lease:
                self.client.send({"op": "release", "lease": lease})

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        """Store the pages at ``host_indices`` under ``keys``. Returns one bool per key (True: stored, or already
        there)."""
        if not keys or self.client is None:
            return [False] * len(keys)
        try:
            pages = self._segments(keys, host_indices)
            if pages is None:
                return [False] * len(keys)
            return self._put(keys, lambda i, dst: _gather(pages[i], dst))
        except Exception as e:  # noqa: BLE001 - the data path never raises: a failure is a miss
            self._fail(e)
            return [False] * len(keys)

    def _put(self, keys: list[str], fill) -> list[bool]:
        rep, conn = self.client.call({"op": "put", "ns": self.ns_id, "keys": list(keys), "size": self.page_bytes})
        offsets, token = rep.get("offsets") or [], rep.get("token")
        base = conn.arena.base
        written = []
        for i in range(len(keys)):
            off = offsets[i] if i < len(offsets) else None
            if isinstance(off, int) and off >= 0:
                fill(i, base + off)
                written.append(True)
            else:
                written.append(False)
        if any(o is None for o in offsets):
            self._warn_once("store_full", "agent had no room for some pages (store full of pinned or pending pages)")
        rep, _ = self.client.call({"op": "commit", "token": token, "written": written})
        committed = rep.get("committed") or []
        return [bool(c) for c in committed] + [False] * (len(keys) - len(committed))

    # -- generic path -----------------------------------------------------------------------------------------

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Fill ``target_locations`` (flat host tensors of one page each) with the leading run of present pages;
        None for the rest."""
        n = len(keys)
        out: list = [None] * n
        if not n or self.client is None or target_locations is None:
            return out
        lease = 0
        try:
            targets = list(target_locations)
            if any(t.numel() * t.element_size() != self.page_bytes or not t.is_contiguous() for t in targets[:n]):
                self._warn_once("target_size", "generic get targets are not contiguous pages of the namespace's size")
                return out
            rep, conn = self.client.call({"op": "get", "ns": self.ns_id, "keys": list(keys), "size": self.page_bytes})
            offsets, lease = rep.get("offsets") or [], rep.get("lease") or 0
            for i, off in enumerate(offsets[:n]):
                memmove(targets[i].data_ptr(), conn.arena.base + off, self.page_bytes)
                out[i] = targets[i]
            return out
        except Exception as e:  # noqa: BLE001 - the data path never raises: a failure is a miss
            self._fail(e)
            return [None] * n
        finally:
            if lease:
                self.client.send({"op": "release", "lease": lease})

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        if target_location is None:
            return None
        return self.batch_get([key], [target_location])[0]

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store flat pages ``values`` under ``keys``; True only when every one is stored."""
        if not keys or values is None or self.client is None:
            return False
        try:
            vals = [v.contiguous() for v in values]
            if len(vals) != len(keys) or any(v.numel() * v.element_size() != self.page_bytes for v in vals):
                self._warn_once("value_size", "generic set values are not pages of the namespace's size")
                return False
            return all(self._put(keys, lambda i, dst: memmove(dst, vals[i].data_ptr(), self.page_bytes)))
        except Exception as e:  # noqa: BLE001 - the data path never raises: a failure is a miss
            self._fail(e)
            return False

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        return self.batch_set([key], [value] if value is not None else None)

    # -- misc -------------------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Not supported: the node's store is shared by every rank and worker of the node (use the agent)."""
        self._warn_once("clear", "clear() ignored: the node agent's store is shared; flush it through the agent")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def _gather(segments: list[tuple[int, int]], dst: int) -> None:
    for addr, size in segments:
        memmove(dst, addr, size)
        dst += size


__all__ = [
    "AGENT_SOCKET_ENV",
    "BtbL3Store",
    "DEFAULT_AGENT_SOCKET",
    "DEFAULT_TIMEOUT_S",
    "OWN_KEYS",
    "SGLANG_KEYS",
    "parse_extra_config",
]
