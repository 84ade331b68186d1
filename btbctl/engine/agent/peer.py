"""Agent-to-agent page copies over TCP: authentication, the copy protocol, fan-out, bounds and deadlines.

Wire: the frames and the handshake of :mod:`btbctl.engine.replication.wire` (one copy per connection; ``J`` = a JSON
frame, ``P`` = a page frame ``u32 index | u64 xxh3_64(payload) | payload``).

1. **Authentication first** (the shared mutual HMAC-SHA256 challenge-response, under the link key of the two agents'
   ids, :mod:`~btbctl.engine.replication.credentials`: a node's credentials let it speak only as itself; nothing
   else is read before it succeeds, pre-auth frames are at most :data:`MAX_PREAUTH_BYTES` and must arrive within
   :data:`AUTH_TIMEOUT_S`)::

       source -> target  J {"op": "hello", "v": 2, "nonce": n_s, "agent": id_s}
       target -> source  J {"op": "challenge", "nonce": n_t, "agent": id_t}
       source -> target  J {"op": "auth", "mac": HMAC(link(id_s, id_t), label | "client" | n_t | n_s | id_s | id_t)}
       target -> source  J {"op": "auth_ok", "mac": HMAC(link(id_s, id_t), label | "server" | n_s | n_t | id_s | id_t)}

   A failed check closes the connection with one ``auth_failed`` log line; the source checks the target's MAC too.
2. **Offer**: ``J {"op": "offer", "copy_id", "token", "names": [...], "sizes": [...], "children": [...]}``. The
   target accepts only a copy id it was told to expect (``expect`` on its control API, which returned ``token``),
   with that token (constant-time compare), once: a second offer of the same id, an unknown id or a wrong token is
   refused. Then bounds: pages, arena bytes per copy (each page rounded up to ``ALIGN_BYTES``), copies and arena
   bytes per peer. Only then is room reserved (all pages or none; nothing is evicted for a copy that cannot fit)
   and the pages marked pending: every page is received, also one the target holds already (a page found on a node
   is never trusted over the copy; the verified copy replaces it at commit). Reply ``J {"op": "accept", "need":
   [indices]}`` or ``J {"op": "refuse", "error"}``.
3. **Pages**: one ``P`` frame per needed index, in order. The target reads each payload straight into its
   reserved arena slot and checks its length and xxh3_64; a forged, truncated or out-of-order page ends the copy
   (refused with the reason, reservation freed; a digest mismatch is also one ``page_refused`` line and counts in
   ``btbctl_agent_pages_refused_total{reason="digest_mismatch"}``).
4. **End**: ``J {"op": "end"}``; the target answers ``J {"op": "done", "pages", "bytes"}`` once every needed page
   arrived and verified. Each page is committed as soon as it verified (in order, with its digest and its
   provenance ``copy:<copy id>``, replacing what the target held under its name), so the target's worker can load
   the leading pages of a long prefix while the rest arrive. Anything else (connection lost, idle for
   ``idle_timeout_s``, past the copy's deadline ``DEADLINE_BASE_S + bytes / MIN_RATE_BYTES_PER_S``, cancelled, a
   page that fails its check) ends the copy ``failed`` and frees the rest of the reservation: the target keeps only
   the leading pages that verified before it, never a page that did not.

Fan-out: an offer may carry ``children`` (each ``{"addr", "token", "children"}``); the target relays every page to
them as soon as it verified it (cut-through), so a chain or tree spreads the copy without the source's NIC
carrying every replica. :func:`fanout_plan` builds ``chain``, ``tree`` (binary) or ``star`` plans.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from btbctl.engine.agent.pages import NoRoom, Obj, PageStore, aligned_bytes
from btbctl.engine.copies import CopyState, copy_origin
from btbctl.engine.replication.credentials import MAX_AGENT_ID_CHARS, Credentials
from btbctl.engine.replication.transport import CopyFaults, TransferError, check_copy_id, parse_address
from btbctl.engine.replication.wire import (
    ChannelError,
    ClientHandshake,
    DigestMismatch,
    FrameConn,
    HandshakeError,
    PageChannel,
    ServerHandshake,
    check_page,
    connect_channel,
    macs_equal,
)
from btbctl.sglang_l3.frames import KIND_JSON, KIND_PAGE, MAX_COPY_PAGES, MAX_PAGE_BYTES, MAX_PREAUTH_BYTES, PAGE_HEAD

#: Environment variable with faults an agent injects into the copies it sends (tests only): a comma-separated list
#: of ``corrupt_wire=K`` (flip a byte of page K after its digest: the target's check must catch it),
#: ``truncate=K`` (send page K one byte short), ``close_after=K`` (drop the connection after K pages, as a dying
#: source would) and ``delay_s=X`` (sleep X seconds after each page).
FAULT_ENV = "BTBCTL_AGENT_FAULT"


@dataclass(frozen=True)
class SendFaults(CopyFaults):
    """Faults a sending agent injects (tests only; see :data:`FAULT_ENV`): :class:`CopyFaults` and ``truncate``."""

    ENV: ClassVar[str] = FAULT_ENV

    truncate: int | None = None


log = logging.getLogger("btbctl.agent")

#: Version of the agents' handshake (the ``v`` of its hello).
PROTOCOL_VERSION = 2
#: Seconds a peer has to authenticate.
AUTH_TIMEOUT_S = 5.0
#: Copy deadline = DEADLINE_BASE_S + bytes / MIN_RATE_BYTES_PER_S (a product choice: kernel TCP moves ~1 GB/s,
#: REFERENCE.md s6; a copy slower than 50 MB/s is stuck or hostile).
DEADLINE_BASE_S = 10.0
MIN_RATE_BYTES_PER_S = 50e6
#: A connection silent this long is cut off, seconds.
DEFAULT_IDLE_TIMEOUT_S = 10.0
#: Inbound connections still authenticating at most; a new one pushes the oldest out.
DEFAULT_MAX_UNAUTHENTICATED = 64
#: Inbound connections from one peer address at most (authenticated or not); beyond, a new one pushes that peer's
#: oldest unauthenticated connection out, or is closed when it has none.
DEFAULT_MAX_PER_PEER = 16
#: First and longest pause of the accept loop after a failed ``accept()``, seconds (doubling in between).
ACCEPT_BACKOFF_S = (0.05, 1.0)
#: Longest a streaming copy may wait in all for its source's pages (the source's prefill), seconds: an offer's
#: ``stream_s`` is capped here (a 1M-token prefill at about 5k tokens/s takes about 200 s).
MAX_STREAM_S = 900.0
#: A streaming sender waiting for its source's next page sends a keep-alive frame this often, seconds (and at least
#: three times per idle timeout, so the receiver never cuts it off).
KEEPALIVE_S = 1.0
#: Most copies received at once from one peer, and in all.
MAX_COPIES_PER_PEER = 16
MAX_INBOUND_COPIES = 64
#: An expectation not used within this many seconds is forgotten (default ttl of ``expect``).
DEFAULT_EXPECT_TTL_S = 300.0
#: Most copies expected at once (each costs a few hundred bytes).
MAX_EXPECTS = 100_000
#: Copy records kept for progress queries.
MAX_RECORDS = 4096
#: Label of the agents' handshake MACs (a version bump changes every MAC).
AUTH_LABEL = b"btbctl-agent-auth-v2"


def copy_deadline_s(total_bytes: int, stream_s: float = 0.0) -> float:
    """Seconds a copy of ``total_bytes`` may take: :data:`DEADLINE_BASE_S` + bytes at :data:`MIN_RATE_BYTES_PER_S`,
    plus the stream window (seconds its source may still be computing the pages; at most :data:`MAX_STREAM_S`)."""
    return DEADLINE_BASE_S + total_bytes / MIN_RATE_BYTES_PER_S + min(max(0.0, stream_s), MAX_STREAM_S)


#: A protocol violation, refusal or I/O failure on a peer connection (one line).
PeerError = ChannelError
#: The agents' page channel on a TCP socket.
Conn = FrameConn


def _creds(secret: bytes | Credentials, agent_id: str) -> Credentials:
    return secret if isinstance(secret, Credentials) else Credentials.from_fleet_secret(secret, agent_id)


def client_auth(conn: PageChannel, secret: bytes | Credentials, agent_id: str) -> str:
    """Authenticate to a target (we push) with the link key of this node and the target's id (``secret``: this
    node's :class:`~btbctl.engine.replication.credentials.Credentials`, or the fleet secret). Returns the target's agent
    id. Raises :class:`PeerError`."""
    creds = _creds(secret, agent_id)
    hs = ClientHandshake(AUTH_LABEL, PROTOCOL_VERSION)
    conn.send_json(hs.hello(agent=agent_id))
    ch = conn.recv_json(MAX_PREAUTH_BYTES)
    id_t = str(ch.get("agent", ""))
    key = creds.as_sender(id_t)
    if key is None:
        raise PeerError(f"target failed authentication: this node holds no key for agent {id_t[:128]!r}")
    try:
        conn.send_json(hs.answer(ch, key, (agent_id, id_t)))
        hs.confirm(conn.recv_json(MAX_PREAUTH_BYTES))
    except HandshakeError as e:
        why = "different fleet secret, or not the agent it claims to be?"
        raise PeerError(f"target failed authentication ({why}): {e}") from None
    return id_t


def server_auth(conn: PageChannel, secret: bytes | Credentials, agent_id: str) -> str:
    """Authenticate a connecting peer: it proves the link key of the id it claims (derived here from this node's
    key). Returns its agent id. Raises :class:`PeerError`."""
    creds = _creds(secret, agent_id)
    hs = ServerHandshake(AUTH_LABEL, PROTOCOL_VERSION)
    try:
        id_s = str(hs.read_hello(conn.recv_json(MAX_PREAUTH_BYTES)).get("agent", ""))
    except HandshakeError as e:
        raise PeerError(f"not a btbctl agent: {e}") from None
    if not 1 <= len(id_s) <= MAX_AGENT_ID_CHARS:
        raise PeerError("malformed hello")
    conn.send_json(hs.challenge(agent=agent_id))
    key = creds.as_target(id_s)
    try:
        conn.send_json(hs.verify(conn.recv_json(MAX_PREAUTH_BYTES), key, (id_s, agent_id)))
    except HandshakeError:
        raise PeerError(f"bad MAC for agent {id_s!r} (not its node key, or a different fleet secret)") from None
    return id_s


# -- fan-out plans ----------------------------------------------------------------------------------------------


FANOUTS = ("chain", "tree", "star")


def fanout_plan(targets: Sequence[dict], fanout: str) -> list[dict]:
    """The source's direct children: ``targets`` (each ``{"addr", "token"}``) arranged as a ``chain`` (each target
    relays to the next), a binary ``tree`` (target i relays to 2i+1, 2i+2) or a ``star`` (the source sends to all).
    Raises ValueError for an unknown fan-out."""
    nodes = [{"addr": t["addr"], "token": t["token"], "children": []} for t in targets]
    if not nodes:
        return []
    if fanout == "star":
        return nodes
    if fanout == "chain":
        for a, b in zip(nodes, nodes[1:], strict=False):
            a["children"] = [b]
        return [nodes[0]]
    if fanout == "tree":
        # the source itself is the tree's root: its children are nodes 0 and 1, node i's are 2i+2 and 2i+3
        for i, n in enumerate(nodes):
            n["children"] = [nodes[j] for j in (2 * i + 2, 2 * i + 3) if j < len(nodes)]
        return nodes[:2]
    raise ValueError(f"unknown fanout {fanout!r}; valid: {', '.join(FANOUTS)}")


def _check_plan(children: object, depth: int = 0) -> list[dict]:
    if not isinstance(children, list) or depth > 64:
        raise PeerError("children must be a list of {addr, token, children}")
    out = []
    for c in children:
        if not isinstance(c, dict) or not isinstance(c.get("token"), str):
            raise PeerError("each child needs addr and token")
        try:
            parse_address(c.get("addr"))
        except TransferError as e:
            raise PeerError(str(e)) from None
        out.append({"addr": c["addr"], "token": c["token"], "children": _check_plan(c.get("children", []), depth + 1)})
    return out


def plan_targets(children: list[dict]) -> list[str]:
    """Every target address of a plan, depth first."""
    out: list[str] = []
    for c in children:
        out.append(c["addr"])
        out.extend(plan_targets(c["children"]))
    return out


# -- records ----------------------------------------------------------------------------------------------------


@dataclass
class CopyRecord:
    """One copy as seen by this agent. ``role``: ``source`` (it pushes its own pages) or ``target`` (it receives;
    with children it relays). Times are Unix seconds; ``targets`` maps each direct child's address to its
    ``{"state", "bytes_sent", "send_s", "error"}`` (``send_s``: seconds spent handing its pages to the socket, so a
    copy that waited for its source still shows the path's rate)."""

    copy_id: str
    role: str
    state: CopyState
    pages: int
    bytes_total: int
    bytes_done: int = 0
    pages_done: int = 0
    error: str | None = None
    started_s: float = field(default_factory=time.time)
    finished_s: float | None = None
    peer: str = ""
    targets: dict = field(default_factory=dict)
    #: pages the sender holds so far (a streaming source trails its worker's write-through; -1: not streaming)
    pages_ready: int = -1
    #: Unix seconds when the source held every page (None until then; a non-streaming push: at start)
    source_complete_s: float | None = None
    #: bumped at each milestone (state, source complete); ``GET /v1/copies/{id}?since=V`` waits for it to pass V
    version: int = 0
    #: Unix seconds when the first page went out (source) or verified (target); None before
    first_page_s: float | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["state"] = self.state.value
        return d


class CopyBook:
    """Copy records by ``(copy_id, role)``, oldest finished dropped past :data:`MAX_RECORDS`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: OrderedDict[tuple[str, str], CopyRecord] = OrderedDict()

    def put(self, rec: CopyRecord) -> CopyRecord:
        with self.lock:
            self.records[(rec.copy_id, rec.role)] = rec
            if len(self.records) > MAX_RECORDS:
                for k, r in list(self.records.items()):
                    if len(self.records) <= MAX_RECORDS:
                        break
                    if r.state.final:
                        del self.records[k]
            return rec

    def find(self, copy_id: str) -> list[CopyRecord]:
        with self.lock:
            return [r for (cid, _), r in self.records.items() if cid == copy_id]


# -- page sources ------------------------------------------------------------------------------------------------


class PageSource:
    """Pages a sender reads: ``names``/``sizes``, and per page its bytes once available (:meth:`wait`)."""

    names: list[str]
    sizes: list[int]
    #: seconds a receiver must allow for this source's pages to come in (0: they are all here; see ``stream_s``)
    stream_s: float = 0.0
    #: the pages will never all come (the upstream copy failed, or the stream window passed)
    failed: bool = False

    def wait(self, i: int, timeout_s: float) -> tuple[memoryview, int] | None:
        """``(bytes, xxh3_64)`` of page ``i`` once available; None when not available within ``timeout_s`` (and
        :attr:`failed` once it never will be)."""
        raise NotImplementedError


class LocalPages(PageSource):
    """Ready pages of this agent, pinned for the copy's duration (:meth:`release` unpins)."""

    def __init__(self, store: PageStore, names: list[str]) -> None:
        self.store = store
        self.names = names
        self.objs = store.pin_ready(names)
        missing = [n for n, o in zip(names, self.objs, strict=True) if o is None]
        if missing:
            store.unpin_objs(self.objs)
            raise NoRoom(f"{len(missing)} of {len(names)} pages are not held here (first: {missing[0]})")
        self.sizes = [o.size for o in self.objs]  # type: ignore[union-attr]

    def wait(self, i: int, timeout_s: float) -> tuple[memoryview, int] | None:
        o = self.objs[i]
        assert o is not None
        return self.store.read(o.offset, o.size), self.store.digest_of(o)

    def release(self) -> None:
        self.store.unpin_objs(self.objs)
        self.objs = []


class StreamPages(PageSource):
    """This agent's pages of a copy that trails its worker's write-through: page ``i`` is sent once it is ready here
    (SGLang writes each prefill chunk's pages through as the chunk is committed). Each page is pinned when it is
    taken; :meth:`release` unpins them.

    Args:
        store: the node's page store.
        names: the copy's page names, in chain order.
        sizes: each page's size (the namespace's ``page_bytes``; pages of another size are not these pages).
        until: monotonic deadline for the whole stream (the source's prefill must be done by then).
        on_ready: called with the number of leading pages ready, each time it grows.
    """

    def __init__(
        self, store: PageStore, names: list[str], sizes: list[int], until: float, on_ready: Callable[[int], None]
    ) -> None:
        self.store = store
        self.names = names
        self.sizes = sizes
        self.until = until
        self.on_ready = on_ready
        self.objs: list[Obj | None] = [None] * len(names)
        self.ready = 0
        self.failed = False
        self.lock = threading.Lock()

    def advance(self) -> None:
        """Count the leading pages the store holds now (taken by a sender or not), and report growth. Amortised
        O(1) per page."""
        store, names, sizes = self.store, self.names, self.sizes
        with self.lock, store.lock:
            n = self.ready
            while n < len(names):
                o = store.ready.get(names[n])
                if o is None or o.size != sizes[n]:
                    break
                n += 1
            grew = n > self.ready
            self.ready = n
        if grew:
            self.on_ready(n)

    def _take(self, i: int) -> Obj | None:
        o = self.store.pin_ready([self.names[i]])[0]
        if o is not None and o.size != self.sizes[i]:
            self.store.unpin_objs([o])
            return None
        return o

    def wait(self, i: int, timeout_s: float) -> tuple[memoryview, int] | None:
        end = min(self.until, time.monotonic() + timeout_s)
        with self.lock:
            o = self.objs[i]
        while o is None:
            if self.failed:
                return None
            o = self._take(i)
            if o is not None:
                with self.lock:
                    if self.objs[i] is None:
                        self.objs[i] = o
                    else:  # another target's sender took it first
                        self.store.unpin_objs([o])
                        o = self.objs[i]
                self.advance()
                break
            left = end - time.monotonic()
            if left <= 0:
                if time.monotonic() >= self.until:
                    self.failed = True
                return None
            if not self.store.wait_landed(min(left, 0.05)):
                self.failed = True
                return None
        assert o is not None
        return self.store.read(o.offset, o.size), self.store.digest_of(o)

    def release(self) -> None:
        with self.lock:
            objs, self.objs = self.objs, []
        self.store.unpin_objs(objs)


class InboundPages(PageSource):
    """Pages of a copy being received, available to relays as each one verifies."""

    def __init__(self, store: PageStore, names: list[str], sizes: list[int]) -> None:
        self.store = store
        self.names = names
        self.sizes = sizes
        self.slots: list[tuple[int, int] | None] = [None] * len(names)  # (offset, digest)
        self.cond = threading.Condition()
        self.failed = False
        self.held: list[Obj | None] = []

    def set(self, i: int, offset: int, digest: int) -> None:
        with self.cond:
            self.slots[i] = (offset, digest)
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def wait(self, i: int, timeout_s: float) -> tuple[memoryview, int] | None:
        end = time.monotonic() + timeout_s
        with self.cond:
            while self.slots[i] is None and not self.failed:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            if self.failed:
                return None
            off, dig = self.slots[i]  # type: ignore[misc]
        return self.store.read(off, self.sizes[i]), dig


class _Verifier:
    """Checks the xxh3_64 of received pages in a second thread, so hashing page i overlaps receiving page i+1
    (xxhash releases the GIL on large inputs). A page counts as arrived (relays may forward it, the record counts
    it) only once verified; with a reservation ``token``, it is then committed at once (ready on this node, with
    the copy's provenance), so the node's worker may load the leading pages while the rest arrive. :meth:`finish`
    waits for every queued page and raises the first mismatch; nothing after a mismatch is committed."""

    def __init__(
        self,
        store: PageStore,
        pages: InboundPages,
        names: list[str],
        rec: CopyRecord,
        metrics,
        event: Callable[[str, dict], None] | None = None,
        copy_id: str = "",
        peer: str = "",
        token: str | None = None,
    ) -> None:
        import queue

        self.store, self.pages, self.names, self.rec, self.metrics = store, pages, names, rec, metrics
        self.event, self.copy_id, self.peer, self.token = event, copy_id, peer, token
        self.q: queue.Queue = queue.Queue()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="btbctl-verify", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            i, off, size, digest = item
            if self.error is not None:
                continue
            try:
                data = self.store.read(off, size)
            except ValueError:  # the arena was released: the agent is stopping
                self.error = "the page store closed (the agent is stopping)"
                continue
            try:
                check_page(i, self.names[i], data, digest)
            except DigestMismatch as e:
                self.error = str(e)
                if self.event is not None:  # counted in btbctl_agent_pages_refused_total{reason="digest_mismatch"}
                    self.event(
                        "page_refused",
                        {
                            "copy_id": self.copy_id,
                            "peer": self.peer,
                            "page": self.names[i],
                            "index": i,
                            "reason": "digest_mismatch",
                            "sent_digest": f"{digest:016x}",
                            "digest": f"{e.digest:016x}",
                        },
                    )
                continue
            if self.token is not None:
                self.store.commit_page(self.token, i, digest, origin=copy_origin(self.copy_id))
            self.pages.set(i, off, digest)
            if self.rec.first_page_s is None:
                self.rec.first_page_s = time.time()
            self.rec.pages_done += 1
            self.rec.bytes_done += size
            if self.metrics is not None:
                self.metrics.pages.labels("in").inc()
                self.metrics.bytes.labels("in").inc(size)

    def check(self, i: int, off: int, size: int, digest: int) -> None:
        """Queue page ``i`` for verification; raises :class:`PeerError` if an earlier page failed."""
        if self.error is not None:
            raise PeerError(self.error)
        self.q.put((i, off, size, digest))

    def finish(self) -> None:
        """Wait until every queued page is checked. Raises :class:`PeerError` on a mismatch."""
        self.stop()
        if self.error is not None:
            raise PeerError(self.error)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join()


# -- the service --------------------------------------------------------------------------------------------------


@dataclass
class _Expect:
    token: str
    keys: frozenset | None
    expires: float
    used: bool = False


class PeerService:
    """Receives copies on a TCP port and pushes copies to other agents.

    Args:
        store: the node's page store.
        secret: this node's :class:`~btbctl.engine.replication.credentials.Credentials`, or the fleet secret (bytes, at
            least 16) to derive them from.
        agent_id: this agent's id (shown to peers and in logs).
        event: ``event(name, fields)`` structured-log sink (:class:`~btbctl.engine.agent.events.AgentMetrics`).
        metrics: the metrics object (pages/bytes counters), or None.
        host, port: address to listen on for peers (port 0 = ephemeral).
        idle_timeout_s: a peer connection silent this long is cut off.
        auth_timeout_s: a peer must authenticate within this long of connecting.
        max_unauthenticated: inbound connections still authenticating at most (a new one closes the oldest).
        max_per_peer: inbound connections of one peer address at most (a new one closes that peer's oldest
            unauthenticated one, or is closed).
        max_copy_bytes: largest copy accepted, bytes of arena (each page rounded up to ``ALIGN_BYTES``; default:
            half the arena).
        max_peer_bytes: most arena bytes reserved for one peer's copies at once (counted as ``max_copy_bytes``;
            default: half the arena).
        connect: opens the :class:`~btbctl.engine.replication.wire.PageChannel` an outbound copy goes through,
            ``(host, port, connect_timeout_s, idle_timeout_s)``; raises :class:`PeerError` (default: TCP).
    """

    def __init__(
        self,
        store: PageStore,
        secret: bytes | Credentials,
        agent_id: str,
        event: Callable[[str, dict], None],
        metrics=None,
        host: str = "127.0.0.1",
        port: int = 0,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_copy_bytes: int | None = None,
        max_peer_bytes: int | None = None,
        connect_timeout_s: float = 5.0,
        faults: SendFaults | None = None,
        auth_timeout_s: float = AUTH_TIMEOUT_S,
        max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED,
        max_per_peer: int = DEFAULT_MAX_PER_PEER,
        connect: Callable[[str, int, float, float], PageChannel] = connect_channel,
    ) -> None:
        if isinstance(secret, bytes) and len(secret) < 16:
            raise ValueError("the fleet secret must be at least 16 bytes")
        self.store = store
        #: this node's copy-port credentials (a fleet secret given here derives them)
        self.secret = _creds(secret, agent_id)
        self.agent_id = agent_id
        self.event = event
        self.metrics = metrics
        self.host = host
        self.port = port
        self.idle_timeout_s = idle_timeout_s
        self.auth_timeout_s = auth_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.max_per_peer = max_per_peer
        self.connect_timeout_s = connect_timeout_s
        self.connect = connect
        self.max_copy_bytes = max_copy_bytes if max_copy_bytes is not None else store.arena_bytes // 2
        self.max_peer_bytes = max_peer_bytes if max_peer_bytes is not None else store.arena_bytes // 2
        self.faults = faults
        self.book = CopyBook()
        self.lock = threading.Lock()
        self.expects: dict[str, _Expect] = {}
        self.peer_copies: dict[str, int] = {}
        self.peer_bytes: dict[str, int] = {}
        self.inbound = 0
        self.cancels: dict[str, threading.Event] = {}
        self.live: dict[str, set[PageChannel]] = {}
        self.changed = threading.Condition()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._preauth: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first: socket -> peer host
        self._per_peer: dict[str, int] = {}  # open inbound connections per peer host
        self._accept_thread: threading.Thread | None = None
        #: Why the copy port does not accept connections now (None: it does).
        self.port_error: str | None = None

    # -- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> int:
        """Listen; returns the bound port. Raises OSError when the address is taken."""
        fam = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.port))
        s.listen(128)
        self.port = s.getsockname()[1]
        self._sock = s
        self._accept_thread = self._spawn(self._accept_loop, "btbctl-agent-peers")
        return self.port

    def port_down(self) -> str | None:
        """Why the copy port is not accepting connections (its accept loop failing or gone), or None."""
        if self._stop.is_set():
            return "stopped"
        t = self._accept_thread
        if t is None or not t.is_alive():
            return "accept loop not running"
        return self.port_error

    def close(self) -> None:
        self._stop.set()
        with self.changed:
            self.changed.notify_all()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self.lock:
            conns = [c for s in self.live.values() for c in s]
            for ev in self.cancels.values():
                ev.set()
        for c in conns:
            c.close()

    def _spawn(self, fn, name: str, *args) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        return t

    def _track(self, copy_id: str, conn: PageChannel | None, add: bool) -> None:
        with self.lock:
            s = self.live.setdefault(copy_id, set())
            if conn is not None:
                (s.add if add else s.discard)(conn)
            if not s:
                self.live.pop(copy_id, None)

    # -- control operations -----------------------------------------------------------------------------------

    def expect(self, copy_id: str, keys: Sequence[str] | None = None, ttl_s: float = DEFAULT_EXPECT_TTL_S) -> str:
        """Allow one inbound copy ``copy_id`` (of pages whose page keys are in ``keys``, when given) within ``ttl_s``
        seconds; returns the token its sender must present. Raises ValueError for a bad or already known id."""
        try:
            check_copy_id(copy_id)
        except TransferError as e:
            raise ValueError(str(e)) from None
        now = time.monotonic()
        with self.lock:
            # unused ones go at their expiry; used ones (kept so that their id cannot be replayed) one ttl later
            for cid in [
                c
                for c, e in self.expects.items()
                if e.expires < now and (not e.used or e.expires < now - DEFAULT_EXPECT_TTL_S)
            ]:
                del self.expects[cid]
            if len(self.expects) >= MAX_EXPECTS:
                raise ValueError(f"{len(self.expects)} copies are expected already (limit {MAX_EXPECTS})")
            if copy_id in self.expects:
                raise ValueError(f"copy id {copy_id!r} is already expected or used")
            token = secrets.token_hex(16)
            self.expects[copy_id] = _Expect(token, frozenset(keys) if keys is not None else None, now + ttl_s)
            return token

    def cancel(self, copy_id: str) -> bool:
        """Stop a copy in progress here (sending or receiving); returns whether one was found."""
        with self.lock:
            ev = self.cancels.get(copy_id)
            conns = list(self.live.get(copy_id, ()))
        if ev is not None:
            ev.set()
        for c in conns:
            c.close()
        return ev is not None or bool(conns)

    def push(
        self,
        copy_id: str,
        names: list[str],
        children: list[dict],
        *,
        stream_s: float | None = None,
        sizes: list[int] | None = None,
    ) -> CopyRecord:
        """Start pushing this agent's pages ``names`` along the plan ``children`` (see :func:`fanout_plan`) in
        background threads; returns the (live) source record.

        Without ``stream_s`` every page must be held here now. With it (a **streaming** copy), pages of ``sizes``
        bytes may still be on their way from the node's worker (its write-through trails its prefill): each is sent
        as soon as it is ready here, and the copy fails when the pages are not all here within ``stream_s`` seconds
        (at most :data:`MAX_STREAM_S`). Receivers get keep-alive frames while the sender waits.

        Raises:
            ValueError: a bad copy id, a copy id already pushed here, an empty or oversized page list, a bad plan,
                a stream without one size per page or with a bad window.
            NoRoom: some page is not held here (not streaming).
        """
        try:
            check_copy_id(copy_id)
        except TransferError as e:
            raise ValueError(str(e)) from None
        if not names or len(names) > MAX_COPY_PAGES:
            raise ValueError(f"a copy carries 1..{MAX_COPY_PAGES} pages, got {len(names)}")
        try:
            children = _check_plan(children)
        except PeerError as e:
            raise ValueError(str(e)) from None
        if not children:
            raise ValueError("push needs at least one target")
        with self.lock:
            if copy_id in self.cancels or any(r.role == "source" for r in self.book.find(copy_id)):
                raise ValueError(f"copy id {copy_id!r} was already pushed from here")
            cancel = self.cancels[copy_id] = threading.Event()
        if stream_s is not None and (
            not 0 < stream_s <= MAX_STREAM_S
            or sizes is None
            or len(sizes) != len(names)
            or not all(isinstance(z, int) and 1 <= z <= MAX_PAGE_BYTES for z in sizes)
        ):
            with self.lock:
                self.cancels.pop(copy_id, None)
            raise ValueError(f"a streaming copy needs stream_s in (0, {MAX_STREAM_S:g}] and one size per page")
        rec = CopyRecord(
            copy_id, "source", CopyState.RUNNING, len(names), 0, peer=",".join(c["addr"] for c in children)
        )
        src: PageSource
        if stream_s is None:
            try:
                src = LocalPages(self.store, list(names))
            except NoRoom:
                with self.lock:
                    self.cancels.pop(copy_id, None)
                raise
            rec.pages_ready, rec.source_complete_s = len(names), time.time()
        else:
            assert sizes is not None

            def ready(n: int) -> None:
                rec.pages_ready = n
                if n == rec.pages:
                    rec.source_complete_s = time.time()
                    self._bump(rec)

            src = StreamPages(self.store, list(names), list(sizes), time.monotonic() + stream_s, ready)
            src.stream_s = stream_s
            rec.pages_ready = 0
        rec.bytes_total = sum(src.sizes)
        self.book.put(rec)
        self.event(
            "copy_started",
            {
                "copy_id": copy_id,
                "role": "source",
                "pages": len(names),
                "bytes": rec.bytes_total,
                "targets": ",".join(plan_targets(children)),
                "stream_s": stream_s,
            },
        )

        def run() -> None:
            try:
                self._fan_out(copy_id, src, children, rec, cancel)
            finally:
                src.release()  # type: ignore[attr-defined]
                with self.lock:
                    self.cancels.pop(copy_id, None)

        self._spawn(run, f"btbctl-push-{copy_id}")
        return rec

    # -- sending ----------------------------------------------------------------------------------------------

    def _fan_out(
        self, copy_id: str, src: PageSource, children: list[dict], rec: CopyRecord, cancel: threading.Event
    ) -> None:
        t0 = time.monotonic()
        for c in children:
            rec.targets[c["addr"]] = {"state": CopyState.STALLED.value, "bytes_sent": 0, "send_s": 0.0, "error": None}
        threads = [
            self._spawn(self._send_one, f"btbctl-send-{copy_id}", copy_id, src, c, rec, cancel) for c in children
        ]
        for t in threads:
            t.join()
        if isinstance(src, StreamPages):  # count the pages the store holds by the end (none may have been taken)
            src.advance()
        errors = [f"{a}: {t['error']}" for a, t in rec.targets.items() if t["state"] != CopyState.DONE.value]
        if rec.role == "source":
            rec.bytes_done = sum(t["bytes_sent"] for t in rec.targets.values())
            state = CopyState.FAILED if errors else CopyState.DONE
            error = "; ".join(errors) or None
            self.event(  # logged before the record turns final: a reader that sees it final finds the line
                "copy_finished",
                {
                    "copy_id": copy_id,
                    "role": "source",
                    "outcome": state.value,
                    "pages": rec.pages,
                    "bytes": rec.bytes_total,
                    "duration_s": round(time.monotonic() - t0, 6),
                    "error": error,
                },
            )
            rec.state, rec.error, rec.finished_s = state, error, time.time()
            self._bump(rec)

    def _send_one(self, copy_id: str, src: PageSource, child: dict, rec: CopyRecord, cancel: threading.Event) -> None:
        addr = child["addr"]
        st = rec.targets[addr]
        conn: PageChannel | None = None
        total = sum(src.sizes)
        try:
            host, port = parse_address(addr)
            conn = self.connect(host, port, self.connect_timeout_s, self.idle_timeout_s)
            self._track(copy_id, conn, True)
            conn.deadline = time.monotonic() + AUTH_TIMEOUT_S
            client_auth(conn, self.secret, self.agent_id)
            conn.deadline = time.monotonic() + copy_deadline_s(total, src.stream_s)
            offer = {
                "op": "offer",
                "copy_id": copy_id,
                "token": child["token"],
                "names": src.names,
                "sizes": src.sizes,
                "children": child["children"],
            }
            if src.stream_s:
                offer["stream_s"] = src.stream_s
            conn.send_json(offer)
            rep = conn.recv_json()
            if rep.get("op") != "accept":
                raise PeerError(f"refused: {rep.get('error', rep.get('op'))}")
            need = rep.get("need")
            if (
                not isinstance(need, list)
                or any(not isinstance(i, int) or not 0 <= i < len(src.names) for i in need)
                or any(a >= b for a, b in zip(need, need[1:], strict=False))  # each page once, in order
            ):
                raise PeerError("malformed accept")
            st["state"] = CopyState.RUNNING.value
            sent = 0
            for k, i in enumerate(need):
                if cancel.is_set():
                    raise PeerError("cancelled")
                data, digest = self._next_page(conn, src, i)
                f = self.faults
                if f is not None:
                    if f.close_after is not None and k >= f.close_after:
                        conn.close()
                        raise PeerError(f"fault injection dropped the connection after {f.close_after} pages")
                    if f.corrupt_wire == i:
                        bad = bytearray(data)
                        bad[len(bad) // 2] ^= 0xFF
                        data = memoryview(bytes(bad))
                    if f.truncate == i:
                        data = data[:-1]
                t_send = time.monotonic()
                conn.send_page(i, data, digest)
                st["send_s"] += time.monotonic() - t_send
                if rec.first_page_s is None:
                    rec.first_page_s = time.time()
                if f is not None and f.delay_s > 0:
                    time.sleep(f.delay_s)
                sent += len(data)
                st["bytes_sent"] = sent
                if rec.role == "source":
                    rec.bytes_done = sum(t["bytes_sent"] for t in rec.targets.values())
                    rec.pages_done += 1
                if self.metrics is not None:
                    self.metrics.pages.labels("out").inc()
                    self.metrics.bytes.labels("out").inc(len(data))
            t_end = time.monotonic()
            conn.send_json({"op": "end"})
            rep = conn.recv_json()
            # until the receiver confirmed: bytes still in socket buffers count as sending time
            st["send_s"] += time.monotonic() - t_end
            if rep.get("op") != "done":
                raise PeerError(f"target rejected the copy: {rep.get('error', rep.get('op'))}")
            st["state"] = CopyState.DONE.value
        except (PeerError, OSError) as e:
            msg = str(e) if isinstance(e, PeerError) else f"connection lost: {type(e).__name__}: {e}"
            if conn is not None and not isinstance(e, PeerError):
                with contextlib.suppress(Exception):  # the target may have said why before closing
                    conn.idle_timeout_s = 0.5
                    conn.deadline = None
                    rep = conn.recv_json()
                    if rep.get("error"):
                        msg = f"target rejected the copy: {rep['error']}"
            st["state"], st["error"] = CopyState.FAILED.value, msg
            if "authentication" in msg:
                self.event("auth_failed", {"peer": addr, "direction": "outbound", "reason": msg})
        finally:
            if conn is not None:
                conn.close()
                self._track(copy_id, conn, False)

    def _next_page(self, conn: PageChannel, src: PageSource, i: int) -> tuple[memoryview, int]:
        """Page ``i`` of ``src`` once available. While a source that trails a prefill (or a relay's upstream) has
        not got it yet, a keep-alive frame goes to the receiver every :data:`KEEPALIVE_S`; the copy's deadline
        bounds the wait."""
        waited = 0.0
        every = min(KEEPALIVE_S, self.idle_timeout_s / 3)
        while True:
            try:
                got = src.wait(i, every)
            except ValueError:  # the arena's view was released: the agent is stopping
                raise PeerError("the page store closed (the agent is stopping)") from None
            if got is not None:
                return got
            if src.failed:
                what = "did not reach this agent within the stream window" if src.stream_s else "failed upstream"
                raise PeerError(f"page {i} {what}")
            waited += every
            if not src.stream_s and waited >= self.idle_timeout_s:
                raise PeerError(f"source of page {i} stalled")
            conn.send_json({"op": "wait"})

    def _bump(self, rec: CopyRecord) -> None:
        """Mark a milestone of ``rec`` (wakes :meth:`wait_change`)."""
        with self.changed:
            rec.version += 1
            self.changed.notify_all()

    def wait_change(self, copy_id: str, since: int, timeout_s: float) -> list[CopyRecord]:
        """The records of ``copy_id`` once one of them passed version ``since`` (a milestone: its state, or its
        source holding every page), or after ``timeout_s``; empty when the copy is unknown."""
        end = time.monotonic() + timeout_s
        with self.changed:
            while True:
                recs = self.book.find(copy_id)
                if not recs or any(r.version > since for r in recs):
                    return recs
                left = end - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return recs
                self.changed.wait(left)

    # -- receiving --------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        """Accept until :meth:`close`. A failed ``accept()`` (``EMFILE`` and the like) never ends the loop: the port is
        marked down (one ``copy_port_down`` line), the loop pauses (doubling from ``ACCEPT_BACKOFF_S[0]`` to
        ``ACCEPT_BACKOFF_S[1]``) and retries; the first accepted connection marks it up again (``copy_port_up``)."""
        assert self._sock is not None
        first, longest = ACCEPT_BACKOFF_S
        pause = first
        while not self._stop.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError as e:  # never let the port die: back off and retry
                if self._stop.is_set():
                    return
                reason = f"{type(e).__name__}: {e}"
                if self.port_error is None:
                    self.event("copy_port_down", {"port": self.port, "reason": reason, "retry_s": pause})
                self.port_error = reason
                self._stop.wait(pause)
                pause = min(longest, pause * 2)
                continue
            pause = first
            if self.port_error is not None:
                self.port_error = None
                self.event("copy_port_up", {"port": self.port})
            try:
                self._admit(sock, addr)
            except (RuntimeError, OSError) as e:  # a thread that cannot start: drop this one, keep accepting
                with contextlib.suppress(OSError):
                    sock.close()
                self.event("connection_refused", {"listener": "copy_port", "peer": str(addr), "reason": str(e)})

    def _admit(self, sock: socket.socket, addr) -> None:
        """Count ``sock`` against the caps (pushing the oldest unauthenticated connections out) and serve it."""
        host = str(addr[0]) if isinstance(addr, tuple) else str(addr)
        evict: list[tuple[socket.socket, str, str]] = []
        with self.lock:
            if self._per_peer.get(host, 0) >= self.max_per_peer:
                old = next((k for k, h in self._preauth.items() if h == host), None)
                if old is None:
                    evict.append((sock, host, f"{self.max_per_peer} connections from this peer"))
                else:
                    del self._preauth[old]
                    evict.append((old, host, f"{self.max_per_peer} connections from this peer: the oldest goes"))
            if not evict or evict[0][0] is not sock:
                while len(self._preauth) >= self.max_unauthenticated:
                    old, h = self._preauth.popitem(last=False)
                    evict.append((old, h, f"{self.max_unauthenticated} connections authenticating: the oldest goes"))
                self._preauth[sock] = host
                self._per_peer[host] = self._per_peer.get(host, 0) + 1
        for victim, h, reason in evict:
            self.event("connection_refused", {"listener": "copy_port", "peer": h, "reason": reason})
            with contextlib.suppress(OSError):
                victim.shutdown(socket.SHUT_RDWR)  # its thread sees the end and closes it
        if evict and evict[0][0] is sock:
            sock.close()
            return
        try:
            self._spawn(self._handle, "btbctl-agent-peer", sock, addr)
        except BaseException:
            self._forget(sock, addr)
            raise

    def _forget(self, sock: socket.socket, addr) -> None:
        """Uncount an inbound connection that is closing."""
        host = str(addr[0]) if isinstance(addr, tuple) else str(addr)
        with self.lock:
            self._preauth.pop(sock, None)
            left = self._per_peer.get(host, 1) - 1
            if left > 0:
                self._per_peer[host] = left
            else:
                self._per_peer.pop(host, None)

    def _handle(self, sock: socket.socket, addr) -> None:
        peer_addr = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        conn = Conn(sock, min(self.idle_timeout_s, self.auth_timeout_s))
        conn.deadline = time.monotonic() + self.auth_timeout_s
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                peer_id = server_auth(conn, self.secret, self.agent_id)
            except (PeerError, OSError) as e:
                closed = isinstance(e, ConnectionResetError | BrokenPipeError) or str(e).startswith("connection closed")
                if conn.received or not closed:  # one that closed before sending a byte is a port probe
                    self.event("auth_failed", {"peer": peer_addr, "direction": "inbound", "reason": str(e)})
                return
            with self.lock:
                self._preauth.pop(sock, None)
            conn.idle_timeout_s = self.idle_timeout_s
            conn.deadline = None
            try:
                offer = conn.recv_json()
            except (PeerError, OSError):
                return
            self._receive(conn, f"{peer_id}@{peer_addr}", peer_id, offer)
        except Exception as e:  # a bug or an input nothing above refused: this connection ends, the agent goes on
            reason = f"{type(e).__name__}: {e}"[:256]
            self.event("peer_error", {"listener": "copy_port", "peer": peer_addr, "reason": reason})
            log.debug("peer connection from %s failed", peer_addr, exc_info=True)  # BTBCTL_DEBUG=1 shows it
        finally:
            self._forget(sock, addr)
            conn.close()

    def _refuse(
        self, conn: PageChannel, copy_id: object, peer: str, reason: str, pages: int = 0, nbytes: int = 0
    ) -> None:
        self.event(
            "copy_refused",
            {"copy_id": copy_id, "role": "target", "peer": peer, "pages": pages, "bytes": nbytes, "reason": reason},
        )
        with contextlib.suppress(Exception):
            conn.send_json({"op": "refuse", "error": reason})

    def _check_offer(self, offer: dict, peer_id: str) -> tuple[str, list[str], list[int], list[dict], _Expect, float]:
        if offer.get("op") != "offer":
            raise PeerError("expected an offer")
        copy_id, token = offer.get("copy_id"), offer.get("token")
        try:
            check_copy_id(copy_id)
        except TransferError as e:
            raise PeerError(str(e)) from None
        names, sizes = offer.get("names"), offer.get("sizes")
        if not isinstance(names, list) or not isinstance(sizes, list) or len(names) != len(sizes):
            raise PeerError("offer needs names and sizes of equal length")
        if not 1 <= len(names) <= MAX_COPY_PAGES:
            raise PeerError(f"a copy carries 1..{MAX_COPY_PAGES} pages, got {len(names)}")
        if not all(isinstance(n, str) and self.store.valid_name(n) for n in names):
            raise PeerError(
                "page names must be valid names of this store (1..256 characters; file mode: <page key><suffix>)"
            )
        if not all(isinstance(s, int) and 1 <= s <= MAX_PAGE_BYTES for s in sizes):
            raise PeerError(f"page sizes must be 1..{MAX_PAGE_BYTES} bytes")
        if len(set(names)) != len(names):
            raise PeerError("duplicate page names in the offer")
        children = _check_plan(offer.get("children", []))
        stream_s = offer.get("stream_s", 0.0)
        if isinstance(stream_s, bool) or not isinstance(stream_s, (int, float)) or not 0 <= stream_s <= MAX_STREAM_S:
            raise PeerError(f"stream_s must be a number of seconds in [0, {MAX_STREAM_S:g}]")
        with self.lock:
            exp = self.expects.get(copy_id)
            if exp is None:
                raise PeerError(f"unknown copy id {copy_id!r} (not expected here)")
            if not macs_equal(token, exp.token):
                raise PeerError(f"bad token for copy {copy_id}")
            if exp.used:
                raise PeerError(f"copy id {copy_id} was already used")
            if exp.expires < time.monotonic():
                raise PeerError(f"copy {copy_id} expired before it arrived")
            if exp.keys is not None and any(self.store.key_of(n) not in exp.keys for n in names):
                raise PeerError(f"copy {copy_id} offers pages that were not expected")
            exp.used = True
        return copy_id, names, sizes, children, exp, float(stream_s)

    def _receive(self, conn: PageChannel, peer: str, peer_id: str, offer: dict) -> None:
        try:
            copy_id, names, sizes, children, _exp, stream_s = self._check_offer(offer, peer_id)
        except PeerError as e:
            self._refuse(conn, offer.get("copy_id"), peer, str(e))
            return
        total = sum(sizes)
        held = aligned_bytes(sizes)  # the limits count arena bytes: every page takes whole ALIGN_BYTES slots
        with self.lock:
            reason = None
            if held > self.max_copy_bytes:
                reason = (
                    f"copy of {total} bytes ({held} bytes of arena) exceeds this agent's limit of {self.max_copy_bytes}"
                )
            elif self.inbound >= MAX_INBOUND_COPIES:
                reason = f"{self.inbound} copies arriving already (limit {MAX_INBOUND_COPIES})"
            elif self.peer_copies.get(peer_id, 0) >= MAX_COPIES_PER_PEER:
                reason = f"peer has {MAX_COPIES_PER_PEER} copies in progress already"
            elif self.peer_bytes.get(peer_id, 0) + held > self.max_peer_bytes:
                reason = f"peer's copies would hold more than {self.max_peer_bytes} bytes of arena"
            if reason is None:
                self.inbound += 1
                self.peer_copies[peer_id] = self.peer_copies.get(peer_id, 0) + 1
                self.peer_bytes[peer_id] = self.peer_bytes.get(peer_id, 0) + held
                cancel = self.cancels.setdefault(copy_id, threading.Event())
        if reason is not None:
            self._refuse(conn, copy_id, peer, reason, len(names), total)
            return
        try:
            self._receive_pages(conn, peer, copy_id, names, sizes, children, total, cancel, stream_s)
        finally:
            with self.lock:
                self.inbound -= 1
                self.peer_copies[peer_id] -= 1
                self.peer_bytes[peer_id] -= held
                self.cancels.pop(copy_id, None)

    def _receive_pages(
        self,
        conn: PageChannel,
        peer: str,
        copy_id: str,
        names: list[str],
        sizes: list[int],
        children: list[dict],
        total: int,
        cancel: threading.Event,
        stream_s: float = 0.0,
    ) -> None:
        store = self.store
        t0 = time.monotonic()
        try:
            # every page is received: one already held here is not trusted over the copy (replaced at commit)
            token, offsets = store.reserve(names, sizes, copy_origin(copy_id), all_or_none=True, skip_ready=False)
        except NoRoom as e:
            self._refuse(conn, copy_id, peer, f"store full: {e}", len(names), total)
            return
        rec = self.book.put(CopyRecord(copy_id, "target", CopyState.RUNNING, len(names), total, peer=peer))
        pages = InboundPages(store, names, sizes)
        pages.stream_s = stream_s  # a relay allows its children the same window
        pend = store.pending(token)
        if children:
            for o in pend:
                if o is not None:
                    o.pins += 1
        need = [i for i, off in enumerate(offsets) if off != -1]
        self.event(
            "copy_accepted",
            {
                "copy_id": copy_id,
                "peer": peer,
                "pages": len(names),
                "need": len(need),
                "bytes": total,
                "relay_to": ",".join(plan_targets(children)) or None,
            },
        )
        relay: threading.Thread | None = None
        if children:
            rrec = CopyRecord(copy_id, "relay", CopyState.RUNNING, len(names), total, peer=peer)
            relay = self._spawn(self._fan_out, f"btbctl-relay-{copy_id}", copy_id, pages, children, rrec, cancel)
            rec.targets = rrec.targets
        self._track(copy_id, conn, True)
        conn.deadline = t0 + copy_deadline_s(total, stream_s)
        outcome, error = CopyState.FAILED, None
        committed = False
        # provenance of the pages this copy replaces (what the target held before)
        replaced = [o for o in store.provenance(names) if o is not None]
        verifier = _Verifier(store, pages, names, rec, self.metrics, self.event, copy_id, peer, token)
        try:
            conn.send_json({"op": "accept", "need": need})
            k = 0
            while k < len(need):
                i = need[k]
                kind, n = conn.recv_head()
                if cancel.is_set():
                    raise PeerError("cancelled")
                if kind == KIND_JSON:
                    msg = conn.json_body(n, MAX_PREAUTH_BYTES)
                    if msg.get("op") == "wait":  # keep-alive of a sender trailing its source or its upstream
                        continue  # relay; the copy's deadline bounds the whole copy whatever the peer sends
                    raise PeerError(f"copy ended after {k} of {len(need)} pages ({msg.get('op')})")
                if kind != KIND_PAGE:
                    raise PeerError(f"unknown frame kind {kind}")
                index, digest = conn.recv_page_head()
                size = n - PAGE_HEAD.size
                if index != i:
                    raise PeerError(f"page {index} arrived where page {i} was due")
                if size != sizes[i]:
                    raise PeerError(f"page {i}: {size} bytes where {sizes[i]} were offered (truncated or forged)")
                o = pend[i]
                assert o is not None
                conn.recv_into(store.read(o.offset, size))
                verifier.check(i, o.offset, size, digest)
                k += 1
            end = conn.recv_json()
            if end.get("op") != "end":
                raise PeerError(f"expected end, got {end.get('op')!r}")
            verifier.finish()
            if cancel.is_set():
                raise PeerError("cancelled")
            # the verifier committed each page with its digest as it verified; a store that writes whole copies at
            # the end (file mode) commits them now
            store.commit(token, origin=copy_origin(copy_id), replace=True)
            committed = True
            outcome = CopyState.DONE
            conn.send_json({"op": "done", "pages": len(need), "bytes": rec.bytes_done})
        except (PeerError, OSError) as e:
            error = str(e) if isinstance(e, PeerError) else f"connection lost: {type(e).__name__}"
            if committed:  # only the final reply failed: the copy itself is in
                outcome, error = CopyState.DONE, None
            else:
                with contextlib.suppress(Exception):
                    conn.idle_timeout_s = 1.0
                    conn.deadline = None
                    conn.send_json({"op": "refuse", "error": error})
        finally:
            verifier.stop()
            self._track(copy_id, conn, False)
            if outcome is not CopyState.DONE:
                pages.fail()
            if relay is not None:
                relay.join()
            if children:  # the relay is done: its pins go (of every page, or of those committed before a failure)
                store.unpin_objs([o for o in pend if o is not None and (committed or o.ready)])
            if not committed:
                store.abort(token)
            self.event(  # logged before the record turns final: a reader that sees it final finds the line
                "copy_finished",
                {
                    "copy_id": copy_id,
                    "role": "target",
                    "peer": peer,
                    "outcome": outcome.value,
                    "pages": rec.pages_done,
                    "bytes": rec.bytes_done,
                    "duration_s": round(time.monotonic() - t0, 6),
                    "error": error,
                    "replaced": len(replaced) if committed else 0,
                    "replaced_from": ",".join(sorted(set(replaced)))[:256] or None if committed else None,
                },
            )
            rec.state, rec.error, rec.finished_s = outcome, error, time.time()
            self._bump(rec)


__all__ = [
    "AUTH_TIMEOUT_S",
    "Conn",
    "CopyBook",
    "CopyRecord",
    "DEADLINE_BASE_S",
    "FANOUTS",
    "InboundPages",
    "LocalPages",
    "MIN_RATE_BYTES_PER_S",
    "PageSource",
    "PeerError",
    "PeerService",
    "StreamPages",
    "client_auth",
    "copy_deadline_s",
    "fanout_plan",
    "plan_targets",
    "server_auth",
]
