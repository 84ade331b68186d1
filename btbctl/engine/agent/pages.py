"""The agent's page store: a shared-memory arena with a byte budget, LRU eviction, pins, leases and pending copies.

Objects are named ``<namespace id>.<page key>`` (:func:`btbctl.sglang_l3.keys.object_key`) and hold one page's bytes
at an offset of the arena. An object is either

* **ready**: served to local stores and peers, evictable in LRU order unless pinned (a timed pin from the control
  API, or a copy sending it), leased (a local store is copying it out) or both;
* **pending**: room reserved for a page being written (by a local store's ``put``, or by an inbound copy). Pending
  objects belong to their owner, are never served and never evicted; they become ready at the owner's commit
  (a copy commits all its pages at once, only after every one arrived and verified) or are freed at its abort.

The arena is a memfd (:func:`os.memfd_create`) of ``arena_bytes``; the local stores map it (the fd travels over the
agent's Unix socket). Extents are aligned to :data:`ALIGN_BYTES`. The allocator is meant for one page size per
node (one model): freed extents are reused by objects of the same size; a bump pointer covers the rest.

Every method is thread-safe (one lock): the local socket server runs in threads, the peer and control servers in
an asyncio loop. Evictions are reported through ``on_event`` (one call per eviction batch).
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field

import xxhash

from btbctl.engine.copies import ORIGIN_WRITE

#: Alignment of every extent, bytes (the OS page: one-sided RDMA writes and memmove like page-aligned buffers).
ALIGN_BYTES = 4096
#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14, ``include/uapi/asm-generic/mman-common.h``): fill the page tables
#: without touching the contents, so it may run while pages are written.
MADV_POPULATE_WRITE = 23


class NoRoom(Exception):
    """Not enough unpinned room in the arena; the message says how much was asked and what is held."""


@dataclass(eq=False)
class Obj:
    """One page object. ``offset``/``size`` in bytes; ``digest`` is its xxh3_64 once known (computed on first send
    or verified on arrival); ``origin`` its provenance (:func:`write_origin` or :func:`copy_origin`); ``retired``:
    replaced by a newer copy of the page while pinned or leased (its extent is freed when the last holder lets
    go)."""

    name: str
    offset: int
    size: int
    ready: bool = False
    pins: int = 0
    leases: int = 0
    digest: int | None = None
    owner: str | None = None
    origin: str = ORIGIN_WRITE
    retired: bool = False


class ExtentAllocator:
    """Extents of an arena of ``capacity`` bytes: same-size reuse of freed extents plus a bump pointer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.top = 0
        self.used = 0
        self.free_by_size: dict[int, list[int]] = {}
        self.free_by_end: dict[int, tuple[int, int]] = {}

    @staticmethod
    def rounded(size: int) -> int:
        """Bytes of arena a page of ``size`` bytes takes (rounded up to :data:`ALIGN_BYTES`)."""
        return (size + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES

    def copy(self) -> ExtentAllocator:
        """An independent copy (to plan allocations and evictions before doing them)."""
        a = ExtentAllocator(self.capacity)
        a.top, a.used = self.top, self.used
        a.free_by_size = {n: list(offs) for n, offs in self.free_by_size.items()}
        a.free_by_end = dict(self.free_by_end)
        return a

    def alloc(self, size: int) -> int | None:
        n = self.rounded(size)
        lst = self.free_by_size.get(n)
        if lst:
            off = lst.pop()
            del self.free_by_end[off + n]
            self.used += n
            return off
        if self.top + n <= self.capacity:
            off = self.top
            self.top += n
            self.used += n
            return off
        return None

    def free(self, offset: int, size: int) -> None:
        n = self.rounded(size)
        self.used -= n
        if offset + n == self.top:
            self.top = offset
            # fold free extents that now end at the top back into the bump region
            while self.top in self.free_by_end:
                off, sz = self.free_by_end.pop(self.top)
                self.free_by_size[sz].remove(off)
                self.top = off
            return
        self.free_by_size.setdefault(n, []).append(offset)
        self.free_by_end[offset + n] = (offset, n)


def aligned_bytes(sizes: Iterable[int]) -> int:
    """Bytes of arena pages of these sizes (bytes each) take: each rounded up to :data:`ALIGN_BYTES`."""
    return sum(ExtentAllocator.rounded(s) for s in sizes)


@dataclass
class _Reservation:
    owner: str
    objs: list[Obj | None]
    created_s: float = field(default_factory=time.monotonic)


class PageStore:
    """Args:
        arena_bytes: the byte budget (size of the shared-memory arena), > 0.
        on_event: ``on_event(event, fields)`` for evictions (one call per batch).
        allocate: allocate the whole arena up front (``posix_fallocate``): received pages then land in memory
            that exists, instead of faulting every page in on first touch.

    Raises:
        OSError: the memfd cannot be created or sized.
    """

    def __init__(
        self, arena_bytes: int, on_event: Callable[[str, dict], None] | None = None, allocate: bool = True
    ) -> None:
        if arena_bytes < ALIGN_BYTES:
            raise ValueError(f"arena_bytes must be >= {ALIGN_BYTES}")
        self.arena_bytes = arena_bytes
        self.arena_id = secrets.token_hex(8)
        self.fd = os.memfd_create("btbctl-agent-arena", getattr(os, "MFD_CLOEXEC", 1))
        os.ftruncate(self.fd, arena_bytes)
        if allocate:
            # commit the budget now (a clear error at start instead of SIGBUS mid-copy when memory runs out)
            os.posix_fallocate(self.fd, 0, arena_bytes)
        self.mm = mmap.mmap(self.fd, arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.mm)
        self.lock = threading.RLock()
        self.alloc = ExtentAllocator(arena_bytes)
        self.ready: OrderedDict[str, Obj] = OrderedDict()  # LRU order, oldest first
        self.timed_pins: dict[str, float] = {}  # name -> monotonic expiry
        self.leases: dict[int, list[Obj]] = {}
        self.lease_owner: dict[int, str] = {}
        self.reservations: dict[str, _Reservation] = {}  # token -> reservation
        self.namespaces: dict[str, dict] = {}
        self.seen_namespaces: set[str] = set()  # namespace ids of pages committed here
        self.on_event = on_event or (lambda event, fields: None)
        self._ids = itertools.count(1)
        self.evictions = 0
        self.evicted_bytes = 0
        self._to_hash: list[Obj] = []
        self._hash_wake = threading.Condition(self.lock)
        #: notified whenever pages become ready (a streaming copy waits on it for the pages it trails)
        self.landed = threading.Condition(self.lock)
        self._hasher: threading.Thread | None = None
        self._closed = False
        self._stopping = False

    def populate(self) -> float:
        """Map every arena page into this process (``MADV_POPULATE_WRITE``; safe while pages are being written).
        Returns the seconds it took (0 where the kernel lacks it)."""
        t0 = time.monotonic()
        try:
            self.mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            return 0.0
        return time.monotonic() - t0

    # -- accounting -------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Arena use: ``arena_bytes``, ``used_bytes`` (ready + pending), ``ready_pages``, ``ready_bytes``,
        ``pending_bytes``, ``pinned_pages``, ``evictions``."""
        with self.lock:
            ready_bytes = sum(o.size for o in self.ready.values())
            pending = sum(o.size for r in self.reservations.values() for o in r.objs if o is not None)
            return {
                "arena_bytes": self.arena_bytes,
                "used_bytes": self.alloc.used,
                "ready_pages": len(self.ready),
                "ready_bytes": ready_bytes,
                "pending_bytes": pending,
                "pinned_pages": sum(1 for o in self.ready.values() if self._held(o, time.monotonic())),
                "evictions": self.evictions,
            }

    def _held(self, o: Obj, now: float) -> bool:
        if o.pins or o.leases:
            return True
        exp = self.timed_pins.get(o.name)
        if exp is None:
            return False
        if exp <= now:
            del self.timed_pins[o.name]
            return False
        return True

    def _alloc(self, size: int, evicted: list[Obj]) -> int:
        off = self.alloc.alloc(size)
        if off is not None:
            return off
        now = time.monotonic()
        for name in list(self.ready):
            o = self.ready[name]
            if self._held(o, now):
                continue
            del self.ready[name]
            self.alloc.free(o.offset, o.size)
            evicted.append(o)
            off = self.alloc.alloc(size)
            if off is not None:
                return off
        raise NoRoom(
            f"no room for {size} bytes: {self.alloc.used} of {self.arena_bytes} bytes held by pinned, "
            "leased or pending pages"
        )

    def _report_evictions(self, evicted: list[Obj], reason: str) -> None:
        if evicted:
            nbytes = sum(o.size for o in evicted)
            self.evictions += len(evicted)
            self.evicted_bytes += nbytes
            self.on_event("evicted", {"pages": len(evicted), "bytes": nbytes, "reason": reason})

    # -- names ------------------------------------------------------------------------------------------------

    @staticmethod
    def valid_name(name: str) -> bool:
        """Whether ``name`` may name a page here (any string of 1..256 characters in the arena)."""
        return isinstance(name, str) and 1 <= len(name) <= 256

    @staticmethod
    def name_of(ns: str, key: str) -> str:
        """The object name of page ``key`` in namespace ``ns``."""
        return f"{ns}.{key}"

    @staticmethod
    def key_of(name: str) -> str:
        """The page key an object name carries."""
        return name.rpartition(".")[2]

    # -- namespaces -------------------------------------------------------------------------------------------

    def register_namespace(self, ns_id: str, desc: dict) -> None:
        with self.lock:
            self.namespaces[ns_id] = desc

    # -- reads ------------------------------------------------------------------------------------------------

    def leading_ready(self, names: Sequence[str], size: int | None = None) -> int:
        """Length of the leading run of ``names`` that are ready (and ``size`` bytes each, when given)."""
        with self.lock:
            n = 0
            for name in names:
                o = self.ready.get(name)
                if o is None or (size is not None and o.size != size):
                    break
                n += 1
            return n

    def lease(self, names: Sequence[str], size: int, owner: str) -> tuple[list[int], int]:
        """Lease the leading run of ready ``names`` of ``size`` bytes for reading. Returns their offsets and a lease
        id for :meth:`release` (0 when nothing was leased). Leased pages are not evicted."""
        with self.lock:
            objs: list[Obj] = []
            for name in names:
                o = self.ready.get(name)
                if o is None or o.size != size:
                    break
                o.leases += 1
                self.ready.move_to_end(name)
                objs.append(o)
            if not objs:
                return [], 0
            lid = next(self._ids)
            self.leases[lid] = objs
            self.lease_owner[lid] = owner
            return [o.offset for o in objs], lid

    def release(self, lease_id: int) -> None:
        """End a lease (unknown ids are ignored)."""
        with self.lock:
            for o in self.leases.pop(lease_id, ()):
                o.leases -= 1
                self._free_retired(o)
            self.lease_owner.pop(lease_id, None)

    def pin_ready(self, names: Sequence[str]) -> list[Obj | None]:
        """Pin each ready name (for a copy sending it); None for names not ready. Undo with :meth:`unpin_objs`."""
        with self.lock:
            out: list[Obj | None] = []
            for name in names:
                o = self.ready.get(name)
                if o is not None:
                    o.pins += 1
                    self.ready.move_to_end(name)
                out.append(o)
            return out

    def unpin_objs(self, objs: Iterable[Obj | None]) -> None:
        with self.lock:
            for o in objs:
                if o is not None and o.pins > 0:
                    o.pins -= 1
                    self._free_retired(o)

    def _free_retired(self, o: Obj) -> None:
        """Free a replaced object's extent once nothing holds it (lock held)."""
        if o.retired and o.pins == 0 and o.leases == 0:
            o.retired = False  # freed once
            self.alloc.free(o.offset, o.size)

    def provenance(self, names: Sequence[str]) -> list[str | None]:
        """Per name, the provenance of the ready page (None: not ready here)."""
        with self.lock:
            return [o.origin if (o := self.ready.get(n)) is not None else None for n in names]

    def pin_for(self, names: Sequence[str], ttl_s: float) -> int:
        """Timed pins (hot prefixes): the named pages are not evicted for ``ttl_s`` seconds. Returns how many of
        them are ready now (a pin also holds a page that arrives later within the ttl)."""
        with self.lock:
            exp = time.monotonic() + ttl_s
            for name in names:
                self.timed_pins[name] = max(exp, self.timed_pins.get(name, 0.0))
            return sum(1 for name in names if name in self.ready)

    def unpin(self, names: Sequence[str]) -> None:
        with self.lock:
            for name in names:
                self.timed_pins.pop(name, None)

    def digest_of(self, o: Obj) -> int:
        """xxh3_64 of a ready or pending object's bytes (cached once the object is ready)."""
        if o.digest is not None:
            return o.digest
        d = xxhash.xxh3_64_intdigest(self.view[o.offset : o.offset + o.size])
        if o.ready:
            o.digest = d
        return d

    # -- writes -----------------------------------------------------------------------------------------------

    def reserve(
        self, names: Sequence[str], sizes: Sequence[int], owner: str, *, all_or_none: bool, skip_ready: bool = True
    ) -> tuple[str, list[int | None]]:
        """Reserve room for pages ``names`` (``sizes[i]`` bytes each), pending under ``owner``.

        Returns a token for :meth:`commit`/:meth:`abort` and per name the offset to write at, ``-1`` when the page is
        already ready (``skip_ready``) or None when there was no room (only without ``all_or_none``).

        Raises:
            NoRoom: ``all_or_none`` and the pages do not all fit (nothing is reserved then).
        """
        with self.lock:
            todo = [(i, size) for i, (name, size) in enumerate(zip(names, sizes, strict=True))]
            keep: set[str] = set()  # pages reported as held here: never evicted to make room for the others
            if skip_ready:
                keep = {n for n in names if n in self.ready}
                todo = [(i, size) for i, size in todo if names[i] not in keep]
            alloc, offs, evicted = self._plan([size for _, size in todo], owner, all_or_none, keep)
            # the plan fits (or is partial by request): only now is anything evicted
            self.alloc = alloc
            for o in evicted:
                del self.ready[o.name]
            objs: list[Obj | None] = [None] * len(names)
            offsets: list[int | None] = [-1] * len(names)
            for (i, size), off in zip(todo, offs, strict=True):
                offsets[i] = off
                if off is not None:
                    objs[i] = Obj(name=names[i], offset=off, size=size, owner=owner)
            token = secrets.token_hex(8)
            self.reservations[token] = _Reservation(owner, objs)
            self._report_evictions(evicted, f"reservation by {owner}")
            return token, offsets

    def _plan(
        self, sizes: Sequence[int], owner: str, all_or_none: bool, keep: Set[str] = frozenset()
    ) -> tuple[ExtentAllocator, list[int | None], list[Obj]]:
        """Plan extents for pages of ``sizes`` bytes on a copy of the allocator, evicting unheld ready pages in LRU
        order where free room runs out, never those named in ``keep`` (lock held; nothing changes here until the
        caller applies the plan). Returns the planned allocator, per page its offset (None: no room, only without
        ``all_or_none``) and the pages to evict. Raises NoRoom (``all_or_none``) when the pages cannot all fit even
        with every unheld page evicted: then nothing is evicted."""
        # pages that fit in the bump region need no eviction and cannot fail: plan on the allocator itself
        fits = aligned_bytes(sizes) <= self.alloc.capacity - self.alloc.top
        # without all_or_none the plan is always applied: plan on the allocator itself (no copy on SGLang's puts)
        alloc = self.alloc if fits or not all_or_none else self.alloc.copy()
        offs: list[int | None] = []
        evicted: list[Obj] = []
        victims: Iterator[Obj] | None = None  # ready pages, oldest first, listed once eviction is needed
        now = time.monotonic()
        for size in sizes:
            off = alloc.alloc(size)
            while off is None:
                if victims is None:
                    victims = iter(list(self.ready.values()))
                o = next((v for v in victims if v.name not in keep and not self._held(v, now)), None)
                if o is None:
                    break
                alloc.free(o.offset, o.size)
                evicted.append(o)
                off = alloc.alloc(size)
            if off is None and all_or_none:
                need = aligned_bytes(sizes)
                raise NoRoom(
                    f"no room for {len(sizes)} pages ({need} bytes of arena) for {owner}: {self.alloc.used} of "
                    f"{self.arena_bytes} bytes in use, of which only the unpinned ready pages may be evicted "
                    "(nothing was)"
                )
            offs.append(off)
        return alloc, offs, evicted

    def pending(self, token: str) -> list[Obj | None]:
        """The reservation's objects (None where nothing was reserved). Raises KeyError for an unknown token."""
        with self.lock:
            return list(self.reservations[token].objs)

    def commit(
        self,
        token: str,
        written: Sequence[bool] | None = None,
        *,
        origin: str = ORIGIN_WRITE,
        replace: bool = False,
    ) -> list[bool]:
        """Make the reservation's pages ready (only those with ``written[i]`` true, when given; the others are
        freed), with provenance ``origin``. A page that became ready meanwhile keeps the existing copy, unless
        ``replace`` (a verified peer copy): then the new page replaces it (the old extent is freed once no lease
        or pin holds it). Returns per name whether it is ready now. Unknown tokens commit nothing."""
        with self.lock:
            res = self.reservations.pop(token, None)
            if res is None:
                return [False] * (len(written) if written is not None else 0)
            out: list[bool] = []
            for i, o in enumerate(res.objs):
                if o is None:
                    out.append(True if written is None or written[i] else False)
                    continue
                ok = written is None or bool(written[i])
                if not ok or (o.name in self.ready and not replace):
                    self.alloc.free(o.offset, o.size)
                    out.append(ok)
                    continue
                self._make_ready(o, origin, None)
                out.append(True)
            self.landed.notify_all()
            return out

    def commit_page(self, token: str, index: int, digest: int | None, *, origin: str) -> bool:
        """Make page ``index`` of a reservation ready now, ahead of the rest (a verified page of a peer copy, so a
        reader may load the leading pages while the others arrive): with provenance ``origin``, replacing what was
        held under its name. A later :meth:`commit` skips it, :meth:`abort` leaves it. Returns whether the page is
        ready (False for an unknown token)."""
        with self.lock:
            res = self.reservations.get(token)
            if res is None:
                return False
            o = res.objs[index]
            if o is not None:
                res.objs[index] = None
                self._make_ready(o, origin, digest)
                self.landed.notify_all()
            return True

    def _make_ready(self, o: Obj, origin: str, digest: int | None) -> None:
        """A reserved page becomes the ready page of its name (lock held); the page it replaces is freed once no
        lease or pin holds it."""
        old = self.ready.pop(o.name, None)
        if old is not None:
            old.retired = True
            self._free_retired(old)
        o.ready = True
        o.owner = None
        o.origin = origin
        self.seen_namespaces.add(o.name.partition(".")[0])
        if digest is not None:
            o.digest = digest
        self.ready[o.name] = o

    def hash_later(self, token_objs: Iterable[Obj]) -> None:
        """Compute these ready objects' digests in a background thread (so a later push does not pay for them)."""
        with self.lock:
            self._to_hash.extend(o for o in token_objs if o.digest is None)
            if self._hasher is None:
                self._hasher = threading.Thread(target=self._hash_loop, name="btbctl-agent-digests", daemon=True)
                self._hasher.start()
            self._hash_wake.notify()

    def _hash_loop(self) -> None:
        while True:
            with self.lock:
                while not self._to_hash and not self._closed:
                    self._hash_wake.wait()
                if self._closed:
                    return
                o = self._to_hash.pop(0)
                if not o.ready or o.digest is not None or self.ready.get(o.name) is not o:
                    continue
                o.pins += 1  # held while hashed: its extent cannot be reused meanwhile
            try:
                d = xxhash.xxh3_64_intdigest(self.view[o.offset : o.offset + o.size])
            finally:
                with self.lock:
                    o.pins -= 1
                    self._free_retired(o)
                    if o.digest is None:
                        o.digest = d

    def abort(self, token: str) -> int:
        """Free a reservation's pending pages; returns bytes freed (0 for an unknown token)."""
        with self.lock:
            res = self.reservations.pop(token, None)
            if res is None:
                return 0
            n = 0
            for o in res.objs:
                if o is not None:
                    self.alloc.free(o.offset, o.size)
                    n += o.size
            return n

    def drop_owner(self, owner: str) -> None:
        """Release every lease and abort every reservation of ``owner`` (a local store that disconnected)."""
        with self.lock:
            for lid in [lid for lid, ow in self.lease_owner.items() if ow == owner]:
                self.release(lid)
            for tok in [t for t, r in self.reservations.items() if r.owner == owner]:
                self.abort(tok)

    def expire_reservations(self, max_age_s: float, owner_prefix: str = "") -> list[str]:
        """Abort reservations older than ``max_age_s`` whose owner starts with ``owner_prefix``; returns their
        owners."""
        with self.lock:
            now = time.monotonic()
            old = [
                (t, r.owner)
                for t, r in self.reservations.items()
                if now - r.created_s > max_age_s and r.owner.startswith(owner_prefix)
            ]
            for t, _ in old:
                self.abort(t)
            return [o for _, o in old]

    def write(self, offset: int, data: bytes | memoryview) -> None:
        """Copy ``data`` into the arena at ``offset`` (tests and the file mode)."""
        self.view[offset : offset + len(data)] = data

    def read(self, offset: int, size: int) -> memoryview:
        """A view of ``size`` bytes at ``offset`` (valid while the page is pinned, leased or pending)."""
        return self.view[offset : offset + size]

    def names_with_suffix_key(self, keys: Sequence[str]) -> dict[str, list[str]]:
        """For each page key, the ready object names ``<ns>.<key>`` of every namespace (sorted)."""
        with self.lock:
            out: dict[str, list[str]] = {}
            nss = sorted(self.namespaces)
            for k in keys:
                out[k] = [f"{ns}.{k}" for ns in nss if f"{ns}.{k}" in self.ready]
            return out

    def wait_landed(self, timeout_s: float) -> bool:
        """Block until pages become ready somewhere in the store or ``timeout_s`` passes (callers re-check); False
        once the store is closing (:meth:`stop_waits`) or closed: nothing will land."""
        with self.lock:
            if self._closed or self._stopping:
                return False
            self.landed.wait(timeout_s)
            return not (self._closed or self._stopping)

    def stop_waits(self) -> None:
        """Wake every :meth:`wait_landed` and make later ones return at once (the agent is stopping)."""
        with self.lock:
            self._stopping = True
            self.landed.notify_all()

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._hash_wake.notify_all()
            self.landed.notify_all()
            try:
                self.view.release()
                self.mm.close()
            except (BufferError, ValueError):
                pass
            try:
                os.close(self.fd)
            except OSError:
                pass


__all__ = [
    "ALIGN_BYTES",
    "aligned_bytes",
    "ExtentAllocator",
    "NoRoom",
    "Obj",
    "PageStore",
]
