"""The agent's local server: serves the node's :class:`~btbctl.sglang_l3.store.BtbL3Store` instances over a Unix
socket (protocol: :mod:`btbctl.sglang_l3.wire`), one thread per connection.

The socket file is created with mode 0600 (``socket_mode``): only the agent's user (the one running SGLang) can
connect, and a connection is handed the arena's memfd. When a connection closes, its leases are released and its
pending writes aborted. A local write reservation older than :data:`LOCAL_RESERVATION_MAX_AGE_S` is aborted (a
store that hung mid-write cannot hold room).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable

from btbctl.engine.agent.pages import NoRoom, PageStore
from btbctl.engine.copies import write_origin
from btbctl.sglang_l3.config import worker_url_ok
from btbctl.sglang_l3.frames import MAX_PAGE_BYTES
from btbctl.sglang_l3.keys import NAMESPACE_ID_CHARS, Namespace, is_page_key
from btbctl.sglang_l3.wire import WireError, encode, recv_frame

log = logging.getLogger("btbctl.agent")

#: Longest a local store may hold a write reservation, seconds (a batch of 128 pages of 80 MiB copies in far less
#: than a second at memory bandwidth; a product choice with a wide margin).
LOCAL_RESERVATION_MAX_AGE_S = 60.0
#: Most keys in one local request (SGLang's batches are at most 128 pages, ``hicache_storage.py:25``; prefetch
#: existence checks go in the same batches).
MAX_LOCAL_KEYS = 4096
#: Most local connections at once (each SGLang rank opens one per storage thread).
MAX_LOCAL_CONNECTIONS = 256


class LocalServer:
    """Args:
    store: the node's page store.
    path: the Unix socket path (an existing socket file there is replaced).
    socket_mode: permission bits of the socket file.
    on_event: ``on_event(event, fields)`` for structured log lines.
    """

    def __init__(
        self, store: PageStore, path: str, socket_mode: int = 0o600, on_event: Callable[[str, dict], None] | None = None
    ) -> None:
        self.store = store
        self.path = path
        self.socket_mode = socket_mode
        self.on_event = on_event or (lambda e, f: None)
        self._sock: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._stop = threading.Event()
        self._ids = 0
        self._lock = threading.Lock()
        self._workers: dict[str, str] = {}  # the worker URL each connection's hello named, by owner

    def start(self) -> None:
        """Bind and serve in a background thread. Raises OSError when the path cannot be bound."""
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if os.path.exists(self.path):
                os.unlink(self.path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, self.socket_mode)
        s.listen(64)
        self._sock = s
        t = threading.Thread(target=self._accept_loop, name="btbctl-agent-local", daemon=True)
        t.start()

    def close(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if len(self._conns) >= MAX_LOCAL_CONNECTIONS:
                    conn.close()
                    continue
                self._ids += 1
                owner = f"local:{self._ids}"
                self._conns.add(conn)
            t = threading.Thread(
                target=self._serve, args=(conn, owner, _peer_pid(conn)), name=f"btbctl-agent-{owner}", daemon=True
            )
            t.start()

    def _serve(self, conn: socket.socket, owner: str, pid: int | None = None) -> None:
        store = self.store
        try:
            while not self._stop.is_set():
                try:
                    req = recv_frame(conn)
                except (WireError, OSError):
                    return
                op = req.get("op")
                if op == "release":
                    lid = req.get("lease")
                    if isinstance(lid, int):
                        store.release(lid)
                    continue
                try:
                    if op == "hello":
                        rep = self._hello(req, owner)
                        socket.send_fds(conn, [encode(rep)], [store.fd])
                        continue
                    rep = self._handle(op, req, owner, pid)
                except _Bad as e:
                    rep = {"ok": False, "error": str(e)}
                conn.sendall(encode(rep))
        except OSError:
            return
        finally:
            store.drop_owner(owner)
            with self._lock:
                gone = self._workers.pop(owner, None)
                still = gone is not None and gone in self._workers.values()
            if gone is not None and not still:
                self.on_event("worker_disconnected", {"worker": gone})
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def workers(self) -> list[str]:
        """The worker URLs named by the stores connected now (their ``hello``; SGLang's ranks keep their
        connections open), sorted: the workers whose L3 tier this agent is."""
        with self._lock:
            return sorted(set(self._workers.values()))

    def _hello(self, req: dict, owner: str = "") -> dict:
        worker = req.get("worker")
        if worker is not None:
            if not isinstance(worker, str) or not worker_url_ok(worker):
                raise _Bad("worker must be the worker's URL (http://host:port)")
            worker = worker.rstrip("/")
            with self._lock:
                new = worker not in self._workers.values()
                self._workers[owner] = worker
            if new:
                self.on_event("worker_connected", {"worker": worker})
        ns = req.get("ns")
        ns_id = None
        if ns is not None:
            try:
                nso = Namespace.from_dict(ns)
            except (TypeError, ValueError) as e:
                raise _Bad(f"bad namespace: {e}") from None
            ns_id = nso.ns_id
            if ns_id not in self.store.namespaces:
                self.store.register_namespace(ns_id, ns)
                self.on_event(
                    "namespace_registered",
                    {
                        "ns": ns_id,
                        "model": nso.model,
                        "tp_rank": nso.tp_rank,
                        "tp_size": nso.tp_size,
                        "page_bytes": nso.page_bytes,
                        "layout": nso.layout,
                        "interface": nso.interface,
                    },
                )
        return {"ok": True, "arena_id": self.store.arena_id, "arena_bytes": self.store.arena_bytes, "ns_id": ns_id}

    def _names(self, req: dict) -> list[str]:
        ns, keys = req.get("ns"), req.get("keys")
        if not (isinstance(ns, str) and len(ns) == NAMESPACE_ID_CHARS):
            raise _Bad("ns must be a namespace id")
        if not isinstance(keys, list) or len(keys) > MAX_LOCAL_KEYS or not all(is_page_key(k) for k in keys):
            raise _Bad(f"keys must be a list of at most {MAX_LOCAL_KEYS} page keys")
        return [f"{ns}.{k}" for k in keys]

    @staticmethod
    def _size(req: dict) -> int:
        size = req.get("size")
        if not isinstance(size, int) or not 1 <= size <= MAX_PAGE_BYTES:
            raise _Bad(f"size must be 1..{MAX_PAGE_BYTES} bytes")
        return size

    def _handle(self, op: object, req: dict, owner: str, pid: int | None = None) -> dict:
        store = self.store
        if op == "exists":
            size = req.get("size")
            return {"ok": True, "n": store.leading_ready(self._names(req), size if isinstance(size, int) else None)}
        if op == "get":
            offsets, lid = store.lease(self._names(req), self._size(req), owner)
            return {"ok": True, "offsets": offsets, "lease": lid}
        if op == "put":
            names, size = self._names(req), self._size(req)
            expired = store.expire_reservations(LOCAL_RESERVATION_MAX_AGE_S, "local:")
            for ow in expired:
                self.on_event("local_write_expired", {"owner": ow, "max_age_s": LOCAL_RESERVATION_MAX_AGE_S})
            try:
                token, offsets = store.reserve(names, [size] * len(names), owner, all_or_none=False)
            except NoRoom as e:  # pragma: no cover - all_or_none=False never raises
                raise _Bad(str(e)) from None
            if offsets and all(o is None for o in offsets):
                self.on_event(
                    "local_write_refused",
                    {
                        "owner": owner,
                        "pages": len(names),
                        "bytes": size * len(names),
                        "reason": "store full (pinned, leased or pending pages)",
                    },
                )
            return {"ok": True, "offsets": offsets, "token": token}
        if op == "commit":
            token, written = req.get("token"), req.get("written")
            if not isinstance(token, str) or not isinstance(written, list):
                raise _Bad("commit needs token and written")
            objs = [o for o in store.pending(token) if o is not None] if token in store.reservations else []
            committed = store.commit(token, [bool(w) for w in written], origin=write_origin(pid))
            store.hash_later(o for o in objs if o.ready)
            return {"ok": True, "committed": committed}
        raise _Bad(f"unknown op {op!r}; valid: hello, exists, get, release, put, commit")


class _Bad(Exception):
    pass


def _peer_pid(conn: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (``SO_PEERCRED``; None where unavailable)."""
    try:
        pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError, struct.error):
        return None
    return pid or None


__all__ = ["LOCAL_RESERVATION_MAX_AGE_S", "LocalServer", "MAX_LOCAL_KEYS", "MAX_PAGE_BYTES"]
