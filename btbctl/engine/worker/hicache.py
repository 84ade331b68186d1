"""The emulated worker's HiCache: SGLang 0.5.23's hierarchical cache (device, host, L3) as the scheduler sees it.

Started with SGLang's HiCache flags (``--enable-hierarchical-cache``, ``--hicache-*``, ``--kv-cache-dtype``), the
emulated worker keeps three tiers of KV pages keyed by SGLang's own page keys
(:func:`btbctl.sglang_l3.keys.page_keys` of the prompt's token ids, so a page stored here has the key a real SGLang
worker gives it):

* **device**: the replica model's prefix cache (:mod:`btbctl.engine.sim.replica`), as without HiCache;
* **host**: an LRU of pages (:class:`HostTier`) of ``--hicache-size`` GB per TP rank (or ``--hicache-ratio`` x
  the device pool, default 2.0), bookkeeping only;
* **L3**: the node's ``btbctl agent``, through the same local protocol and namespace as SGLang's ``BtbL3Store``
  (:mod:`btbctl.sglang_l3.client`): real bytes, one page object per TP rank (``page_size x KV bytes per token /
  tp_size / kv_bytes_scale`` bytes, content derived from the page key so every read is verified).

What happens, following SGLang (``srt/managers/scheduler.py`` ``_prefetch_kvcache``, ``srt/mem_cache/
unified_radix_cache.py`` ``prefetch_from_storage`` / ``check_prefetch_progress``, ``write_backup_storage``):

* **Write-through.** Pages a prefill computes go to the host tier and on to L3 (``write_through``: at once;
  ``write_through_selective``: once a page was used twice; ``write_back``: when the device evicts it). The L3 writes
  run in a background thread (``sglang:backuped_tokens_total``).
* **Admission of a queued request.** Its prefix is matched on the device, then the host tier continues the
  match; if at least ``prefetch_threshold`` tokens (extra config, default 256) of the prompt's whole pages remain
  (SGLang's ``new_input_tokens``, up to prompt - 1 tokens), the L3 tier is asked for the leading run of those pages
  (``sglang:storage_prefetch_hit_tokens_total``) and the hit is read (``sglang:prefetched_tokens_total``), unless
  the prefetches in flight already hold half the host pool (SGLang's rate limit). Pages a request in flight on
  this worker is computing are not fetched: the request waits for them. Pages another request is still loading
  from L3 are fetched again, as SGLang's scheduler does (each request's prefetch is its own operation until the
  first load's pages are in the radix tree; measured on a real 0.5.23 server: 4 requests sent together for a
  2,048-token prefix held only in L3 read 8,192 tokens, one reporting ``storage`` and three ``device``); the
  request then waits for its own read and reuses the first load's pages (``device``).
* **Prefetch policy.** ``wait_complete``: the request is not admitted before its prefetch is complete. ``timeout``:
  it waits at most ``prefetch_timeout_base + prefetch_timeout_per_ki_token x hit pages x page_size / 1024`` model
  seconds (extra config, defaults 1.0 and 0.25) and gets the pages read by then. ``best_effort``: it is admitted at
  once without the prefetch's pages (on an idle worker SGLang's first admission poll comes before the read), which
  land in the host tier for later requests.
* **Agent restart.** The store's held connection to the agent is watched (:meth:`AgentClient.hold
  <btbctl.sglang_l3.client.AgentClient.hold>`): when the agent restarts, every rank says hello to the new one at once
  (the agent announces the worker again without waiting for traffic), and the pages the host tier held then are
  marked *unbacked* (one ``hicache_l3_unbacked`` line): the new agent's store is empty, and where SGLang would not
  write a backed-up page again, the next request that reuses such a page from the device or host tier writes it
  through (``write_through``, ``write_through_selective``), or its eviction from the device writes it back
  (``write_back``), as SGLang does for a page whose host copy is not marked backed up.
* **Timing** (model seconds, divided by ``--time-scale`` on the wall clock): L3 to host at
  :data:`L3_READ_BYTES_PER_S_PER_RANK` per TP rank, one read at a time per worker (SGLang's one
  ``prefetch_io_aux_func`` thread runs the prefetches in turn), host to device at the replica's PCIe bandwidth
  (cost model), for the real KV size of the pages. While pages load they count as arriving on the device
  (requests needing them wait, others go ahead), exactly like a pushed copy.
* **Answer.** ``meta_info.cached_tokens_details`` is SGLang's ``{"device", "host"}`` plus ``"storage"`` and
  ``"storage_backend"`` (``"BtbL3Store"``) with an L3 tier, or null when no token was cached
  (``output_streamer.py:102``); tokens are split as SGLang's ``split_cached_prefix_by_tier`` does (storage and host
  from their loads, the rest device).

Where the emulation ends: no real GPU/host copies (host-tier pages are bookkeeping), one worker's TP ranks are one
process, no storage re-poll after a miss (``--hicache-storage-prefetch-retry-*``: a page missing at admission is
recomputed), ``best_effort`` never catches a part of a read, no ``buffer_only`` host mode, no LoRA-derived extra
keys (a request's ``extra_key`` and ``cache_salt`` strings do seed its pages).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from btbctl.engine.costmodel import L3_READ_BYTES_PER_S_PER_RANK
from btbctl.engine.hashing import block_payload
from btbctl.engine.logfmt import log_event
from btbctl.engine.worker.config import MIN_BLOCK_BYTES, StorageSettings, WorkerConfig, check_settings
from btbctl.engine.worker.model import ModelDriver, NoRoom
from btbctl.sglang_l3.keys import Namespace

log = logging.getLogger("btbctl.worker")

#: SGLang's default host/device pool ratio in cache mode (``--hicache-ratio``, ``arg_groups/fields/memory.py``).
DEFAULT_HICACHE_RATIO = 2.0
#: Name SGLang reports as ``storage_backend``: the backend class's name (``output_streamer.py:89-100``).
STORAGE_BACKEND_NAME = "BtbL3Store"
#: ``sglang_version`` of the emulated workers' namespaces: their pages never mix with a real SGLang's.
EMULATED_SGLANG_VERSION = "btbctl-emulated"
#: Pages per L3 write or read call (SGLang's storage batches are 128 pages, ``hicache_storage.py:25``).
L3_BATCH_PAGES = 128
#: Selective write-through writes a page once it was used this often (SGLang ``write_through_selective``).
SELECTIVE_HITS = 2

_KV_DTYPES = {
    "bf16": "torch.bfloat16",
    "bfloat16": "torch.bfloat16",
    "fp8_e4m3": "torch.float8_e4m3fn",
    "fp8_e5m2": "torch.float8_e5m2",
}


def kv_dtype_name(cfg: WorkerConfig, dtype_bytes: float) -> str:
    """The host pool's dtype as SGLang names it (``torch.bfloat16`` ...): ``--kv-cache-dtype``, ``auto`` being the
    model's dtype."""
    d = cfg.kv_cache_dtype
    if d == "auto":
        return "torch.float8_e4m3fn" if dtype_bytes == 1 else "torch.bfloat16"
    return _KV_DTYPES.get(d, f"torch.{d}")


class HostTier:
    """The host pool: an LRU of page keys holding at most ``capacity_pages``."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = max(0, capacity_pages)
        self.pages: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    def add(self, keys: Sequence[str]) -> list[str]:
        """Insert (or refresh) ``keys``, deepest last; returns the pages that were new here."""
        new = []
        for k in keys:
            if k in self.pages:
                self.pages.move_to_end(k)
            else:
                self.pages[k] = None
                new.append(k)
        while len(self.pages) > self.capacity_pages:
            self.pages.popitem(last=False)
        return new

    def run(self, chain: Sequence[str], start: int, stop: int) -> int:
        """Length of the run of ``chain[start:stop]`` held here (refreshing them)."""
        n = 0
        for k in range(start, stop):
            if chain[k] not in self.pages:
                break
            self.pages.move_to_end(chain[k])
            n += 1
        return n

    def clear(self) -> None:
        self.pages.clear()


class L3Tier:
    """The node agent as this worker's ranks see it: one :class:`~btbctl.sglang_l3.client.AgentClient` and one
    namespace per TP rank. Blocking calls (run them in a thread); failures are misses, logged once per kind."""

    def __init__(self, settings: StorageSettings, namespaces: list[Namespace]) -> None:
        from btbctl.sglang_l3.client import AgentClient

        self.settings = settings
        self.namespaces = namespaces
        self.page_bytes = namespaces[0].page_bytes
        self.clients = [
            AgentClient(settings.agent_socket, settings.timeout_s, ns.describe(), settings.worker_url)
            for ns in namespaces
        ]
        self.ns_ids = [ns.ns_id for ns in namespaces]
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        #: called with the new arena id when a rank's client finds the agent restarted (from that client's thread)
        self.on_new_arena: Callable[[str], None] | None = None

    def _arena_changed(self, old_arena_id: str, new_arena_id: str) -> None:
        cb = self.on_new_arena
        if cb is not None:
            cb(new_arena_id)

    def _fail(self, kind: str, e: BaseException) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        log.warning("emulated L3 tier: %s failed: %s (further %s failures are not logged)", kind, e, kind)

    def payload(self, rank: int, key: str) -> bytes:
        """The bytes of page ``key`` of TP rank ``rank`` (derived from the namespace and the key)."""
        return block_payload(f"{self.ns_ids[rank]}.{key}", self.page_bytes)

    def _each_rank(self, op: str, keys: list[str], per_rank, *, stop_at_none: bool = True) -> int:
        """``per_rank(rank, client, n)`` on every rank in turn, ``n`` the leading run all ranks before it have;
        returns the run every rank has (SGLang takes the minimum over ranks), 0 when an agent is unavailable
        (logged as ``op``). ``stop_at_none``: stop at the first rank with none."""
        from btbctl.sglang_l3.client import AgentUnavailable

        n = len(keys)
        for rank, c in enumerate(self.clients):
            try:
                n = min(n, per_rank(rank, c, n))
            except AgentUnavailable as e:
                self._fail(op, e)
                return 0
            if stop_at_none and n == 0:
                return 0
        return n

    def register(self) -> None:
        """Say hello to the agent for every rank, so it knows this worker's namespaces from the start (as SGLang's
        ``BtbL3Store`` does when SGLang registers its host pool at start-up), not only after the first write; each
        rank's connection stays open and says hello again to a restarted agent (:attr:`on_new_arena`)."""
        from btbctl.sglang_l3.client import AgentUnavailable

        for c in self.clients:
            try:
                # open for the worker's life: the agent announces this worker while it is connected
                c.hold(self._arena_changed)
            except AgentUnavailable as e:
                self._fail("hello", e)

    def exists(self, keys: list[str]) -> int:
        """Leading run of ``keys`` held by every rank."""

        def held(rank: int, c, n: int) -> int:
            got = 0
            for i in range(0, n, L3_BATCH_PAGES):
                batch = keys[i : i + L3_BATCH_PAGES]
                rep, _ = c.call({"op": "exists", "ns": self.ns_ids[rank], "keys": batch, "size": self.page_bytes})
                k = rep.get("n")
                k = k if isinstance(k, int) and 0 <= k <= len(batch) else 0
                got += k
                if k < len(batch):
                    break
            return got

        return self._each_rank("exists", keys, held)

    def read(self, keys: list[str]) -> int:
        """Read the leading run of ``keys`` from every rank and check each page's bytes; returns how many pages
        read and verified on every rank."""

        def verified(rank: int, c, n: int) -> int:
            good = 0
            while good < n:
                batch = keys[good : min(n, good + L3_BATCH_PAGES)]
                rep, conn = c.call({"op": "get", "ns": self.ns_ids[rank], "keys": batch, "size": self.page_bytes})
                offsets, lease = rep.get("offsets") or [], rep.get("lease") or 0
                ok = 0
                try:
                    view = conn.arena.view
                    for j, off in enumerate(offsets[: len(batch)]):
                        if bytes(view[off : off + self.page_bytes]) != self.payload(rank, batch[j]):
                            self._fail("verify", RuntimeError(f"page {batch[j]} of rank {rank} has wrong bytes"))
                            break
                        ok += 1
                finally:
                    if lease:
                        c.send({"op": "release", "lease": lease})
                good += ok
                if ok < len(batch):
                    break
            return good

        return self._each_rank("get", keys, verified)

    def write(self, keys: list[str]) -> int:
        """Store ``keys`` on every rank (pages already held are kept); returns how many are held on every rank."""

        def stored(rank: int, c, n: int) -> int:
            count = 0
            for i in range(0, len(keys), L3_BATCH_PAGES):
                batch = keys[i : i + L3_BATCH_PAGES]
                rep, conn = c.call({"op": "put", "ns": self.ns_ids[rank], "keys": batch, "size": self.page_bytes})
                offsets, token = rep.get("offsets") or [], rep.get("token")
                view = conn.arena.view
                written = []
                for j, key in enumerate(batch):
                    off = offsets[j] if j < len(offsets) else None
                    if isinstance(off, int) and off >= 0:
                        view[off : off + self.page_bytes] = self.payload(rank, key)
                        written.append(True)
                    else:
                        written.append(off == -1)
                rep, _ = c.call({"op": "commit", "token": token, "written": written})
                count += sum(1 for x in rep.get("committed") or [] if x)
            return count

        return self._each_rank("put", keys, stored, stop_at_none=False)

    def close(self) -> None:
        for c in self.clients:
            c.close()


@dataclass
class Admission:
    """How one request's prefix is served: pages already on the device, loaded from the host tier, loaded from L3
    (``storage_pages``), and the L3 hit its prefetch found (``hit_pages``)."""

    device_pages: int = 0
    host_pages: int = 0
    storage_pages: int = 0
    hit_pages: int = 0

    def details(self, cached_tokens: int, page_size: int, storage: bool) -> dict | None:
        """SGLang's ``cached_tokens_details`` for ``cached_tokens`` cached prompt tokens (null when none)."""
        if cached_tokens <= 0:
            return None
        storage_t = min(self.storage_pages * page_size, cached_tokens)
        host_t = min(self.host_pages * page_size, cached_tokens - storage_t)
        out: dict = {"device": cached_tokens - host_t - storage_t, "host": host_t}
        if storage:
            out["storage"] = storage_t
            out["storage_backend"] = STORAGE_BACKEND_NAME
        return out


class HiCache:
    """One emulated worker's HiCache (see the module docstring).

    Args:
        cfg: the worker's settings (HiCache flags included).
        model: its model driver (the device tier; load and write-through hooks are attached here).
        metrics: its :class:`~btbctl.engine.worker.metrics.WorkerMetrics` (HiCache counters), or None.
    """

    def __init__(self, cfg: WorkerConfig, model: ModelDriver, metrics=None) -> None:
        self.cfg = cfg
        self.model = model
        self.metrics = metrics
        self.page_size = cfg.page_size
        self.settings = check_settings(cfg)
        cost = model.cost
        tp = cfg.tp_size
        self.kv_bytes_per_token = cost.model.kv_bytes_per_token  # the whole replica (all ranks)
        per_rank = self.kv_bytes_per_token / tp
        if cfg.hicache_size > 0:
            host_tokens = int(cfg.hicache_size * 1e9 // per_rank)
        else:
            host_tokens = int(model.capacity_tokens * (cfg.hicache_ratio or DEFAULT_HICACHE_RATIO))
        self.host = HostTier(host_tokens // self.page_size)
        self.host_capacity_tokens = self.host.capacity_pages * self.page_size
        self.pcie_bytes_per_s = cost.pcie_bytes_per_s
        self.l3_bytes_per_s = L3_READ_BYTES_PER_S_PER_RANK * tp
        self.l3: L3Tier | None = None
        if self.settings is not None:
            page_bytes = max(MIN_BLOCK_BYTES, int(self.page_size * per_rank // cfg.kv_bytes_scale))
            nss = [
                Namespace(
                    model=cfg.served_name,
                    tp_size=tp,
                    tp_rank=r,
                    pp_size=1,
                    pp_rank=0,
                    cp_size=1,
                    cp_rank=0,
                    page_size=self.page_size,
                    layout=cfg.hicache_mem_layout,
                    kv_dtype=kv_dtype_name(cfg, cost.model.dtype_bytes),
                    page_bytes=page_bytes,
                    interface="v1" if self.settings.interface_v1 else "generic",
                    sglang_version=EMULATED_SGLANG_VERSION,
                )
                for r in range(tp)
            ]
            self.l3 = L3Tier(self.settings, nss)
            self.l3.on_new_arena = self._agent_restarted
            threading.Thread(target=self.l3.register, name="btbctl-hicache-hello", daemon=True).start()
        #: the agent's arena a rank last found new (set from the store's threads), and the one the marks follow
        self._new_arena: str | None = None
        self._marked_arena: str | None = None
        #: host-tier pages the agent (restarted since they were backed up) does not hold: written again on reuse
        self._unbacked: set[str] = set()
        self.prefetch_occupied_tokens = 0
        #: page key -> loads from L3 in flight here that carry it (a request needing one fetches it again)
        self._l3_loading: dict[str, int] = {}
        #: model time at which this worker's one L3 read thread is free
        self._l3_free_at_s = 0.0
        self._hits: dict[str, int] = {}
        self._writes: list[list[str]] = []
        self._write_wake = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._loads: set[asyncio.TimerHandle] = set()
        model.on_computed.append(self._computed)
        if cfg.hicache_write_policy == "write_back":
            model.on_evict.append(self._evicted)

    # -- reads ------------------------------------------------------------------------------------------------

    @property
    def storage(self) -> bool:
        """Whether an L3 tier is configured."""
        return self.l3 is not None

    @property
    def host_used_tokens(self) -> int:
        return len(self.host) * self.page_size

    def describe(self) -> dict:
        """The settings as ``/server_info`` reports them."""
        s = self.settings
        return {
            "host_capacity_tokens": self.host_capacity_tokens,
            "write_policy": self.cfg.hicache_write_policy,
            "mem_layout": self.cfg.hicache_mem_layout,
            "storage_backend": self.cfg.hicache_storage_backend,
            "prefetch_policy": self.cfg.hicache_storage_prefetch_policy,
            "prefetch_threshold": s.prefetch_threshold if s else None,
            "agent_socket": s.agent_socket if s else None,
            "namespaces": [ns.ns_id for ns in self.l3.namespaces] if self.l3 else [],
            "page_bytes": self.l3.page_bytes if self.l3 else None,
        }

    # -- admission --------------------------------------------------------------------------------------------

    def _load_s(self, pages: int) -> float:
        """Model seconds to move ``pages`` pages host to device (the replica's PCIe bandwidth)."""
        return pages * self.page_size * self.kv_bytes_per_token / self.pcie_bytes_per_s

    def _l3_s(self, pages: int) -> float:
        """Model seconds to read ``pages`` pages from L3 to host (:data:`L3_READ_BYTES_PER_S_PER_RANK` per rank)."""
        return pages * self.page_size * self.kv_bytes_per_token / self.l3_bytes_per_s

    def _l3_read_s(self, pages: int) -> float:
        """Model seconds from now until a read of ``pages`` pages from L3 ends on this worker's one read thread,
        which it then holds until that time (reads queue behind each other)."""
        now = self.model.model_now()
        start = max(now, self._l3_free_at_s)
        self._l3_free_at_s = start + self._l3_s(pages)
        return self._l3_free_at_s - now

    def _mark_loading(self, keys: Sequence[str], add: bool) -> None:
        for k in keys:
            n = self._l3_loading.get(k, 0) + (1 if add else -1)
            if n > 0:
                self._l3_loading[k] = n
            else:
                self._l3_loading.pop(k, None)

    async def admit(self, chain: Sequence[str], prompt_tokens: int) -> Admission:
        """Match ``chain`` (the prompt's page keys) on the device, host and L3 tiers and start loading what the
        request will reuse, before it is submitted to the model (see the module docstring). Call
        ``model.submit`` right after, without awaiting in between."""
        model = self.model
        ps = self.page_size
        max_pages = min(len(chain), max(0, prompt_tokens - 1) // ps)
        adm = Admission()
        self._take_restart()
        if max_pages == 0:
            return adm
        read = 0
        start = -1
        s = self.settings
        l3 = self.l3
        if l3 is not None and s is not None:
            d = model.cached_blocks(chain[:max_pages])
            h = self.host.run(chain, d, max_pages)
            start = d + h
            # being computed here: the request waits for it; being loaded from L3 by another request: fetched again
            again = start < max_pages and chain[start] in self._l3_loading
            busy = not again and model.pending_blocks(chain[:max_pages]) > start
            if not busy and (max_pages - start) * ps >= s.prefetch_threshold:
                if self.prefetch_occupied_tokens >= self.host_capacity_tokens // 2:
                    log.info(
                        "prefetch declined: %d tokens in flight (half the host pool)", self.prefetch_occupied_tokens
                    )
                else:
                    keys = list(chain[start:max_pages])
                    reserve = len(keys) * ps
                    self.prefetch_occupied_tokens += reserve
                    try:
                        hit, read = await asyncio.to_thread(self._fetch, keys)
                    finally:
                        self.prefetch_occupied_tokens -= reserve
                    adm.hit_pages = hit
                    if self.metrics is not None:
                        self.metrics.storage_hit_tokens.inc(hit * ps)
                        self.metrics.prefetched_tokens.inc(read * ps)
                    # another request's load of these pages may have begun while the agent answered
                    again = again or chain[start] in self._l3_loading
                    if again and read:
                        # its own read, in turn after the load in flight; the pages it then finds are that load's
                        wait_s = self._l3_read_s(read)
                        if not model.zero:
                            await asyncio.sleep(wait_s / model.scale)
        # the state may have moved while the agent answered: match again, synchronously from here to submit
        d = model.cached_blocks(chain[:max_pages])
        h = self.host.run(chain, d, max_pages)
        if self._unbacked and self.cfg.hicache_write_policy != "write_back":
            self._rewrite([str(k) for k in chain[: d + h]])
        sp = 0
        if read and start >= 0:
            sp = max(0, min(start + read, max_pages) - (d + h)) if start <= d + h else 0
        policy = self.cfg.hicache_storage_prefetch_policy
        wait_s = 0.0
        if sp and policy == "best_effort":
            # admitted before the read lands: the pages go to the host tier for later requests
            pages = list(chain[d + h : d + h + sp])
            self._mark_loading(pages, True)

            def to_host(pages=pages) -> None:
                self._mark_loading(pages, False)
                self.host.add(pages)

            self._later(self._load_s(sp) + self._l3_read_s(sp), to_host)
            sp = 0
        elif sp and policy == "timeout":
            budget = s.prefetch_timeout_base + s.prefetch_timeout_per_ki_token * adm.hit_pages * ps / 1024
            per_page = self._l3_s(1)
            done = min(sp, int(budget / per_page)) if per_page > 0 else sp
            if done < sp:
                wait_s = budget
            sp = done
        adm.device_pages, adm.host_pages, adm.storage_pages = d, h, sp
        n = h + sp
        if n:
            try:
                inc = model.begin_copy(tuple(chain[: d + n]))
            except NoRoom:  # the device is full of running requests: the request computes the pages
                adm.host_pages = adm.storage_pages = 0
                return adm
            load = self._load_s(h + sp) + (self._l3_read_s(sp) if sp else 0.0)
            from_l3 = list(chain[d + h : d + n])
            self._mark_loading(from_l3, True)
            self.host.add(list(chain[d + h : d + n]))
            if self.metrics is not None:
                self.metrics.load_back_tokens.inc(n * ps)

            def landed(inc=inc, from_l3=from_l3) -> None:
                self._mark_loading(from_l3, False)
                model.end_copy(inc, True)

            self._later(max(load, wait_s), landed)
        return adm

    def _fetch(self, keys: list[str]) -> tuple[int, int]:
        assert self.l3 is not None
        hit = self.l3.exists(keys)
        return hit, (self.l3.read(keys[:hit]) if hit else 0)

    def _later(self, model_s: float, fn) -> None:
        """Run ``fn`` after ``model_s`` model seconds (at once, but after the current call, in zero-delay mode)."""
        loop = asyncio.get_running_loop()
        delay = 0.0 if self.model.zero else model_s / self.model.scale
        handle: asyncio.TimerHandle | None = None

        def run() -> None:
            self._loads.discard(handle)  # type: ignore[arg-type]
            fn()

        handle = loop.call_later(delay, run)
        self._loads.add(handle)

    # -- write-through ----------------------------------------------------------------------------------------

    def _computed(self, chain: Sequence, start: int, stop: int) -> None:
        """A prefill committed ``chain[start:stop]`` on the device."""
        policy = self.cfg.hicache_write_policy
        if policy == "write_back":
            return
        keys = [str(k) for k in chain[start:stop]]
        if policy == "write_through_selective":
            keep = []
            for k in keys:
                c = self._hits.get(k, 0) + 1
                self._hits[k] = c
                if c == SELECTIVE_HITS:
                    keep.append(k)
            keys = keep
        self._backup(keys)

    def _evicted(self, key) -> None:
        self._take_restart()
        k = str(key)
        if key not in self.host or k in self._unbacked:
            self._unbacked.discard(k)
            self._backup([k])

    # -- agent restart ----------------------------------------------------------------------------------------

    def _agent_restarted(self, arena_id: str) -> None:
        """A rank's store found the agent restarted (new arena ``arena_id``; any thread): the marks follow at the
        next admission or eviction, on the event loop (:meth:`_take_restart`)."""
        self._new_arena = arena_id

    def _take_restart(self) -> None:
        """Mark the host tier's pages unbacked once per new arena (see the module docstring); one
        ``hicache_l3_unbacked`` line."""
        arena = self._new_arena
        if arena is None or arena == self._marked_arena:
            return
        self._marked_arena = arena
        self._unbacked = set(self.host.pages)
        log_event(
            log,
            "hicache_l3_unbacked",
            logging.WARNING,
            worker=self.settings.worker_url if self.settings else None,
            arena=arena,
            pages=len(self._unbacked),
            write_policy=self.cfg.hicache_write_policy,
        )

    def _rewrite(self, keys: list[str]) -> None:
        """Write ``keys`` (pages a request reuses from the device or host tier) through again where unbacked."""
        again = [k for k in keys if k in self._unbacked]
        if again:
            self._unbacked.difference_update(again)
            self._backup(again)

    def _backup(self, keys: list[str]) -> None:
        if not keys:
            return
        self.host.add(keys)
        if self.l3 is None:
            return
        with self._write_wake:
            self._writes.append(keys)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="btbctl-hicache-backup", daemon=True)
                self._writer.start()
            self._write_wake.notify()

    def _write_loop(self) -> None:
        assert self.l3 is not None
        while True:
            with self._write_wake:
                while not self._writes and not self._closed:
                    self._write_wake.wait()
                if self._closed:
                    return
                keys = [k for batch in self._writes for k in batch]
                self._writes.clear()
            n = self.l3.write(keys)
            if self.metrics is not None and n:
                self.metrics.backuped_tokens.inc(n * self.page_size)

    def pending_writes(self) -> int:
        """Pages queued for L3 and not written yet."""
        with self._write_wake:
            return sum(len(b) for b in self._writes)

    # -- lifecycle --------------------------------------------------------------------------------------------

    def flush(self) -> None:
        """SGLang's ``/flush_cache`` empties the host tier too (L3 is left alone)."""
        self.host.clear()
        self._hits.clear()
        self._unbacked.clear()

    def close(self) -> None:
        for h in list(self._loads):
            h.cancel()
        self._loads.clear()
        with self._write_wake:
            self._closed = True
            self._write_wake.notify_all()
        if self.l3 is not None:
            self.l3.close()


__all__ = [
    "Admission",
    "DEFAULT_HICACHE_RATIO",
    "HiCache",
    "HostTier",
    "L3Tier",
    "STORAGE_BACKEND_NAME",
    "StorageSettings",
    "check_settings",
    "kv_dtype_name",
]
