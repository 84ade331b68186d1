"""The store side of the local protocol (:mod:`btbctl.sglang_l3.wire`): connections to the node's agent and the
mapped arena. Standard library only (ctypes for the copies); usable without SGLang.

Each thread gets its own connection (SGLang's prefetch and backup threads call the store concurrently). The arena
is mapped once per agent incarnation (``arena_id``); when the agent restarts, the next ``hello`` maps the new one.
Every call is bounded by ``timeout_s`` (the socket timeout covers each send and receive; a call is one request and
one reply). Failures raise :class:`AgentUnavailable`; the store turns them into misses.

The connection :meth:`AgentClient.hold` opens is kept for the client's life and watched: when the agent closes it
(it stopped), a background thread says hello again every :data:`RECONNECT_BACKOFF_S` until an agent answers, so a
restarted agent knows (and announces) the worker without waiting for its next store or load, and reports the new
incarnation to ``on_new_arena``.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable

from btbctl.sglang_l3.wire import WireError, encode, recv_frame, recv_frame_with_fds

#: Seconds a store waits before trying an agent that refused a connection again (a down agent costs one failed
#: connect per this interval per thread, not one per call).
RECONNECT_BACKOFF_S = 1.0
#: Seconds between looks at the held connection (how soon a store notices its agent stopped, and how long closing
#: the client may leave its watcher running).
WATCH_POLL_S = 0.2


class AgentUnavailable(Exception):
    """The agent cannot be reached or answered badly; ``kind`` names the failure for log-once bookkeeping."""

    def __init__(self, kind: str, message: str) -> None:
        self.kind = kind
        super().__init__(message)


#: ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): map every page without touching its contents.
MADV_POPULATE_WRITE = 23


class Arena:
    """A mapping of the agent's arena. ``base`` is its address (for ``ctypes.memmove``); ``view`` a memoryview.

    A background thread maps every page in (``MADV_POPULATE_WRITE``, safe while pages are copied), so that copies
    into fresh parts of the arena do not take a page fault per 4 KiB; until it finishes, faults happen as usual."""

    def __init__(self, fd: int, size: int, arena_id: str) -> None:
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self.arena_id = arena_id
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.base = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)
        threading.Thread(target=self._populate, name="btbctl-l3-arena", daemon=True).start()

    def _populate(self) -> None:
        try:
            self.mm.madvise(MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            pass


#: Arenas mapped in this process, by ``arena_id``: clients of the same agent share one mapping (an emulated worker
#: runs every TP rank's client in one process; SGLang runs one rank per process, where this holds one entry).
_ARENAS: dict[str, Arena] = {}
_ARENAS_LOCK = threading.Lock()


def _shared_arena(fd: int, size: int, arena_id: str) -> Arena:
    with _ARENAS_LOCK:
        a = _ARENAS.get(arena_id)
        if a is None or a.size != size:
            a = _ARENAS[arena_id] = Arena(fd, size, arena_id)
        return a


class _Conn:
    def __init__(self, sock: socket.socket, arena: Arena, ns_id: str | None) -> None:
        self.sock = sock
        self.arena = arena
        self.ns_id = ns_id


class AgentClient:
    """Args:
    socket_path: the agent's Unix socket.
    timeout_s: bound of every call, seconds.
    namespace: the namespace description this store registers (``Namespace.describe()``), or None.
    worker_url: the URL the gateway knows this worker by, named in every ``hello`` (the agent announces the workers
        connected to it), or None.
    """

    def __init__(
        self, socket_path: str, timeout_s: float = 2.0, namespace: dict | None = None, worker_url: str | None = None
    ) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.namespace = namespace
        self.worker_url = worker_url
        self._held: _Conn | None = None
        self._local = threading.local()
        self._arena: Arena | None = None
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._on_new_arena: Callable[[str, str], None] | None = None

    # -- connections ------------------------------------------------------------------------------------------

    def _connect(self) -> _Conn:
        now = time.monotonic()
        if now < self._down_until:
            raise AgentUnavailable(
                "agent_down", f"agent at {self.socket_path} unavailable (retrying in {self._down_until - now:.1f} s)"
            )
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout_s)
        try:
            s.connect(self.socket_path)
            hello: dict = {"op": "hello", "ns": self.namespace}
            if self.worker_url is not None:
                hello["worker"] = self.worker_url
            s.sendall(encode(hello))
            rep, fds = recv_frame_with_fds(s)
        except (OSError, WireError) as e:
            s.close()
            self._down_until = time.monotonic() + RECONNECT_BACKOFF_S
            raise AgentUnavailable("connect", f"cannot reach the agent at {self.socket_path}: {e}") from None
        try:
            if not rep.get("ok") or not fds:
                raise AgentUnavailable("hello", f"agent refused hello: {rep.get('error', 'no arena fd')}")
            with self._lock:
                arena = before = self._arena
                if arena is None or arena.arena_id != rep.get("arena_id"):
                    arena = _shared_arena(fds[0], int(rep["arena_bytes"]), str(rep["arena_id"]))
                    self._arena = arena
        except AgentUnavailable:
            s.close()
            raise
        except (KeyError, ValueError, TypeError, OSError) as e:
            s.close()
            raise AgentUnavailable("hello", f"bad hello reply from the agent: {e}") from None
        finally:
            for fd in fds:
                os.close(fd)
        cb = self._on_new_arena
        if cb is not None and before is not None and before is not arena:
            cb(before.arena_id, arena.arena_id)
        return _Conn(s, arena, rep.get("ns_id"))

    def conn(self) -> _Conn:
        """This thread's connection (connecting on first use, and again when another connection found a new agent:
        this one is to the old). Raises :class:`AgentUnavailable`."""
        c = getattr(self._local, "conn", None)
        if c is not None and c.arena is not self._arena:
            self._drop()
            c = None
        if c is None:
            c = self._connect()
            self._local.conn = c
        return c

    def hold(self, on_new_arena: Callable[[str, str], None] | None = None) -> None:
        """Say hello now on a connection kept open for the client's life (not one thread's), so the agent knows
        this store's namespace and worker from the start, and keep it: a background thread says hello again when
        the agent closes it (see the module docstring), and calls ``on_new_arena(old_arena_id, new_arena_id)`` (in
        the thread that connected: the watcher, or a store or load) when an agent answers with another arena than
        the one before (it restarted). The watcher starts even when this first hello fails (raises
        :class:`AgentUnavailable` then)."""
        if on_new_arena is not None:
            self._on_new_arena = on_new_arena
        with self._lock:
            self._closed.clear()  # a closed client held again is open again
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="btbctl-l3-hold", daemon=True)
                self._watcher.start()
        self._hold_once()

    def _hold_once(self) -> None:
        c = self._connect()
        with self._lock:
            old, self._held = self._held, c
            if self._closed.is_set():  # closed meanwhile: keep nothing open
                old, self._held = c, None
        if old is not None:
            with contextlib.suppress(OSError):
                old.sock.close()

    def _watch(self) -> None:
        """The held connection's watcher (see :meth:`hold`)."""
        while not self._closed.wait(WATCH_POLL_S):
            c = self._held
            if c is not None:
                try:
                    if c.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        continue  # open (an agent never sends on it unasked)
                except (BlockingIOError, InterruptedError):
                    continue  # open, nothing to read
                except OSError:
                    pass
                with self._lock:
                    if self._held is c:
                        self._held = None
                with contextlib.suppress(OSError):
                    c.sock.close()
            if self._closed.is_set():
                return
            try:
                self._hold_once()
            except AgentUnavailable:
                self._closed.wait(RECONNECT_BACKOFF_S)

    def _drop(self) -> None:
        c = getattr(self._local, "conn", None)
        self._local.conn = None
        if c is not None:
            try:
                c.sock.close()
            except OSError:
                pass

    def call(self, req: dict) -> tuple[dict, _Conn]:
        """One request, one reply. Raises :class:`AgentUnavailable` (the connection is dropped, so the next call
        reconnects)."""
        c = self.conn()
        try:
            c.sock.sendall(encode(req))
            rep = recv_frame(c.sock)
        except TimeoutError:
            self._drop()
            op = req.get("op")
            raise AgentUnavailable("timeout", f"agent did not answer {op} within {self.timeout_s} s") from None
        except (OSError, WireError) as e:
            self._drop()
            raise AgentUnavailable("connection", f"agent connection lost during {req.get('op')}: {e}") from None
        if not rep.get("ok"):
            raise AgentUnavailable("refused", f"agent refused {req.get('op')}: {rep.get('error')}")
        return rep, c

    def send(self, req: dict) -> None:
        """A request without reply (``release``); errors drop the connection silently (its leases end with it)."""
        c = getattr(self._local, "conn", None)
        if c is None:
            return
        try:
            c.sock.sendall(encode(req))
        except OSError:
            self._drop()

    def close(self) -> None:
        self._closed.set()
        self._drop()
        with self._lock:
            held, self._held = self._held, None
        if held is not None:
            with contextlib.suppress(OSError):
                held.sock.close()


memmove = ctypes.memmove

__all__ = ["AgentClient", "AgentUnavailable", "Arena", "RECONNECT_BACKOFF_S", "WATCH_POLL_S", "memmove"]
