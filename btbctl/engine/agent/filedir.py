"""File mode: the agent as the copier of SGLang's stock ``file`` HiCache backend (a fallback to ``BtbL3Store``).

SGLang 0.5.23's ``HiCacheFile`` (``srt/mem_cache/hicache_storage.py:728-800``) keeps one file per page in a
directory (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` or the ``file_storage_path`` extra-config key), named
``<page key><suffix>.bin`` with ``suffix = _<model>_<tp_rank>_<tp_size>`` (MLA: ``_<model>``), written to a temp file
and ``os.replace``-d. With ``btbctl agent --file-dir DIR`` (a node-local tmpfs directory), the agent's pages are
those files: object names are the file stems, a namespace is a suffix, and a copy moves exactly the files named by
the keys. Inbound pages are staged in the arena, verified like any copy, and written (temp file, then
``os.replace``) only at commit, so a failed copy leaves no file behind.
"""

from __future__ import annotations

import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Sequence

from btbctl.engine.agent.pages import NoRoom, Obj, PageStore
from btbctl.engine.copies import ORIGIN_WRITE

#: Most files whose copy provenance is remembered (about 200 bytes each).
MAX_ORIGINS = 1 << 18

_NAME = re.compile(r"^[0-9a-f]{64}[A-Za-z0-9_.+-]{0,160}\Z")


class FileDirStore(PageStore):
    """A :class:`PageStore` whose ready pages are the ``.bin`` files of ``directory``; the arena (``arena_bytes``)
    stages pages being sent or received.

    Raises:
        OSError: the directory cannot be created.
    """

    def __init__(self, directory: str, arena_bytes: int, on_event=None) -> None:
        super().__init__(arena_bytes, on_event=on_event, allocate=False)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self._staged: dict[int, Obj] = {}  # id(obj) -> staging object of a send
        #: name -> (inode, mtime_ns, origin) of the files copies wrote (at most MAX_ORIGINS; see :meth:`_remember`)
        self._origins: OrderedDict[str, tuple[int, int, str]] = OrderedDict()

    # -- names --------------------------------------------------------------------------------------------------

    @staticmethod
    def valid_name(name: str) -> bool:
        return isinstance(name, str) and bool(_NAME.match(name)) and ".." not in name

    @staticmethod
    def name_of(ns: str, key: str) -> str:
        return key + ns

    @staticmethod
    def key_of(name: str) -> str:
        return name[:64]

    def _path(self, name: str) -> str:
        if not self.valid_name(name):
            raise ValueError(f"bad page file name {name!r}")
        return os.path.join(self.directory, name + ".bin")

    def suffixes(self) -> list[str]:
        """The namespaces present: every suffix after a 64-character key among the ``.bin`` files."""
        out = set()
        with os.scandir(self.directory) as it:
            for e in it:
                if e.name.endswith(".bin") and self.valid_name(e.name[:-4]):
                    out.add(e.name[64:-4])
        return sorted(out)

    # -- reads ----------------------------------------------------------------------------------------------------

    def leading_ready(self, names: Sequence[str], size: int | None = None) -> int:
        n = 0
        for name in names:
            try:
                st = os.stat(self._path(name))
            except (OSError, ValueError):
                break
            if size is not None and st.st_size != size:
                break
            n += 1
        return n

    def pin_ready(self, names: Sequence[str]) -> list[Obj | None]:
        """Stage each existing file in the arena for sending (None for missing files)."""
        out: list[Obj | None] = []
        try:
            for name in names:
                try:
                    with open(self._path(name), "rb") as f:
                        data = f.read()
                except (OSError, ValueError):
                    out.append(None)
                    continue
                with self.lock:
                    off = self._alloc(len(data), [])
                self.write(off, data)
                o = Obj(name=name, offset=off, size=len(data), ready=True, pins=1)
                self._staged[id(o)] = o
                out.append(o)
        except NoRoom:
            self.unpin_objs(out)
            raise
        return out

    def unpin_objs(self, objs) -> None:
        with self.lock:
            for o in objs:
                if o is not None and self._staged.pop(id(o), None) is not None:
                    self.alloc.free(o.offset, o.size)

    def digest_of(self, o: Obj) -> int:
        import xxhash

        if o.digest is None:
            o.digest = xxhash.xxh3_64_intdigest(self.view[o.offset : o.offset + o.size])
        return o.digest

    # -- writes -----------------------------------------------------------------------------------------------------

    def reserve(self, names, sizes, owner, *, all_or_none, skip_ready=True):
        if not all(self.valid_name(n) for n in names):
            raise NoRoom("page names are not file names of SGLang's file backend")
        present = {n for n in names if skip_ready and self.leading_ready([n]) == 1}
        with self.lock:
            objs, offsets = [], []
            try:
                for name, size in zip(names, sizes, strict=True):
                    if name in present:
                        objs.append(None)
                        offsets.append(-1)
                        continue
                    off = self._alloc(size, [])
                    objs.append(Obj(name=name, offset=off, size=size, owner=owner))
                    offsets.append(off)
            except NoRoom:
                for o in objs:
                    if o is not None:
                        self.alloc.free(o.offset, o.size)
                raise NoRoom(f"staging area of {self.arena_bytes} bytes is too small for this copy") from None
            from btbctl.engine.agent.pages import _Reservation

            token = secrets.token_hex(8)
            self.reservations[token] = _Reservation(owner, objs)
            return token, offsets

    def _remember(self, name: str, st: os.stat_result, origin: str) -> None:
        """Record that a copy wrote file ``name``. Past :data:`MAX_ORIGINS` files, records of files rewritten or
        removed since go first, then the oldest down to three quarters of the bound (whose files then read as
        SGLang's own), so the sweep (a stat per record, under the lock) runs once per quarter of the bound of new
        records, not on every one."""
        with self.lock:
            self._origins[name] = (st.st_ino, st.st_mtime_ns, origin)
            self._origins.move_to_end(name)
            if len(self._origins) <= MAX_ORIGINS:
                return
            for n, (ino, mtime, _) in list(self._origins.items()):
                try:
                    cur = os.stat(self._path(n))
                    stale = (cur.st_ino, cur.st_mtime_ns) != (ino, mtime)
                except (OSError, ValueError):
                    stale = True
                if stale:
                    del self._origins[n]
            while len(self._origins) > MAX_ORIGINS * 3 // 4:
                self._origins.popitem(last=False)

    def provenance(self, names: Sequence[str]) -> list[str | None]:
        """Per name: the copy that wrote the file (while the file is the one it wrote), else :data:`ORIGIN_WRITE`
        (SGLang wrote it); None where no file is."""
        out: list[str | None] = []
        for name in names:
            try:
                st = os.stat(self._path(name))
            except (OSError, ValueError):
                out.append(None)
                continue
            with self.lock:
                rec = self._origins.get(name)
            out.append(rec[2] if rec is not None and rec[:2] == (st.st_ino, st.st_mtime_ns) else ORIGIN_WRITE)
        return out

    def commit(self, token, written=None, *, origin=ORIGIN_WRITE, replace=False):
        with self.lock:
            res = self.reservations.pop(token, None)
        if res is None:
            return []
        out = []
        for i, o in enumerate(res.objs):
            if o is None:
                out.append(True)
                continue
            ok = written is None or bool(written[i])
            if ok:
                path = self._path(o.name)
                tmp = os.path.join(self.directory, f".btbctl-{secrets.token_hex(8)}.tmp")
                with open(tmp, "wb") as f:
                    f.write(self.view[o.offset : o.offset + o.size])
                os.replace(tmp, path)
                self.seen_namespaces.add(o.name[64:])
                self._remember(o.name, os.stat(path), origin)
            with self.lock:
                if o.pins > 0:  # a relay still reads it: freed by unpin_objs
                    self._staged[id(o)] = o
                else:
                    self.alloc.free(o.offset, o.size)
            out.append(ok)
        return out

    def commit_page(self, token, index, digest, *, origin):
        """Not ahead of the rest here: a copy's files are written when it commits (SGLang's ``file`` backend reads
        whatever file exists, so a file is only written once the whole copy verified)."""
        return False

    def pin_for(self, names, ttl_s):
        return self.leading_ready(names)

    def unpin(self, names) -> None:
        return None


__all__ = ["FileDirStore"]
