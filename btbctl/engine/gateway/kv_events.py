"""The gateway's holdings from the workers' KV events (SGLang's ``--kv-events-config``; wire format in
:mod:`btbctl.engine.kvevents`).

One :class:`KvEventsSubscriber` per worker with an events endpoint (``GatewayConfig.kv_events``) reads its batches
over a ZMQ SUB socket and a :class:`HoldingsFeed` turns them into that worker's holding record
(:class:`~btbctl.engine.gateway.state.WorkerState`):

* **Keys.** SGLang's block hashes are its own; the gateway's chains use its own keys (``push``/``none``:
  :func:`~btbctl.engine.hashing.next_chain_hash` of the page's tokens; ``l3``: SGLang's page keys,
  :func:`~btbctl.sglang_l3.keys.next_page_key`). A :class:`BlockStored` is keyed page by page from its
  ``token_ids`` and the gateway key of its parent page, and the feed keeps SGLang's hash -> gateway key (and each
  key's parent) so a :class:`BlockRemoved` can drop it. Pages whose parent is unknown (stored before a resync or
  before the gateway started, without a replay) or whose ``block_size`` differs from the gateway's page size cannot
  be keyed: they are counted (``unkeyed_blocks``) and skipped; their extensions are skipped too.
* **Which prompts match.** Keys recomputed from token ids equal the gateway's chains when the gateway hashed the
  same token ids: always in ``l3`` mode (the gateway tokenizes with the worker's tokenizer) and for ``input_ids``
  prompts; in ``push`` mode a text prompt on a real SGLang worker is hashed from the gateway's pseudo-tokens, so its
  events key other pages than its chain (the routing inference still records it; the emulated worker's tokens are
  the pseudo-tokens, so there both agree).
* **Media.** A page is held while any medium (``GPU``, ``CPU_PINNED`` ...) holds it: a device eviction of a page
  HiCache kept on the host leaves it held (a later request loads it back).
* **Reconciliation: both sources are kept.** The routing inference (a first byte on the worker records its
  chain; copies confirmed ``done``; ``/btb/match``) stays, because the events of a prefill arrive some
  milliseconds after its first byte and a copy target's blocks arrive by a path SGLang may not report. The events
  add what the inference cannot see (blocks of requests the gateway did not route, decode pages) and remove what is
  gone: a :class:`BlockRemoved` of the last medium, or :class:`AllBlocksCleared`, drops the gateway key from the
  record whatever recorded it, so a worker whose events say its blocks are gone stops being a holder (and a copy
  source) at once. ``GatewayConfig.routing_holdings = false`` turns the inference off for the workers with
  events (their record is then the events' alone).
* **Missed batches.** Batches carry consecutive sequence numbers. A gap is recovered through the publisher's replay
  socket when one is configured (every missed batch still in its buffer); otherwise, or when the buffer no longer
  reaches back, the worker's record is resynced: dropped whole (what was removed meanwhile is unknown) and rebuilt
  from the batches that follow. One ``kv_events_resync`` line says so. A publisher that starts over (sequence
  number 0 again: the worker restarted) is a resync too.
* **Down and up.** A worker marked down loses its record as before (:meth:`WorkerState.forget`); the feed keeps
  its maps, so pages stored after it came back are keyed and recorded with their whole prefix again.
* **Late start.** A subscriber asks the replay socket for everything from sequence number 0 first: while the
  publisher's buffer still holds it the record is exact, else it starts from the oldest batch kept (a resync);
  without a replay socket it starts fresh from the first live batch.

Every state change is one log line (``kv_events_connected``, ``kv_events_replayed``, ``kv_events_resync``,
``kv_events_unkeyed``, ``kv_events_bad_message``). pyzmq and msgspec are imported here, and this module is imported
only when a worker has an events endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from btbctl.engine.gateway.state import WorkerState
from btbctl.engine.hashing import next_chain_hash
from btbctl.engine.logfmt import log_event

if TYPE_CHECKING:  # the wire format (msgspec) is imported when a subscriber starts, not with the gateway
    from btbctl.engine.kvevents import BlockRemoved, BlockStored, KVEventBatch

log = logging.getLogger("btbctl.gateway")

#: Computes the gateway key of one page: ``(parent key or None, the page's token ids, cache_salt) -> key``.
Keyer = Callable[[str | None, list[int], str | None], str]
#: SGLang blocks mapped per worker at most; beyond, the worker is resynced (a product choice: 2**22 blocks are far
#: more than any worker's cache holds, about 1 GB of maps; a publisher that never removes would otherwise grow them
#: without bound).
MAX_EVENT_BLOCKS = 1 << 22
#: Longest wait for a replay's answer, seconds (the publisher answers from memory; a product choice).
REPLAY_TIMEOUT_S = 5.0


def chain_keyer(parent: str | None, page: list[int], cache_salt: str | None) -> str:
    """Keys of replication modes ``push`` and ``none``: the gateway's chain hashes (salt not part of them)."""
    return next_chain_hash(parent, page)


def l3_keyer(parent: str | None, page: list[int], cache_salt: str | None) -> str:
    """Keys of replication mode ``l3``: SGLang's page keys (a root page seeded by the request's ``cache_salt``)."""
    from btbctl.sglang_l3.keys import namespace_seed, next_page_key

    seed = namespace_seed(None, cache_salt or None) if parent is None else None
    return next_page_key(parent, page, seed)


class HoldingsFeed:
    """One worker's KV events applied to its holding record (no I/O; :class:`KvEventsSubscriber` feeds it).

    Args:
        worker: the worker whose record the events write.
        keyer: the gateway's page key (:func:`chain_keyer` or :func:`l3_keyer`).
        page_size: the gateway's tokens per page (a callable: it settles after the first probes).
        on_change: called after a batch changed the record (the gateway marks its fleet view).

    Attributes: ``keys`` (SGLang block hash -> gateway key), ``parents`` (gateway key -> parent key or None),
    ``media`` (SGLang block hash -> media holding it), ``stored_blocks`` / ``removed_blocks`` /
    ``unkeyed_blocks`` / ``resyncs`` (counts since start).
    """

    def __init__(
        self,
        worker: WorkerState,
        keyer: Keyer,
        page_size: Callable[[], int],
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.worker = worker
        self.keyer = keyer
        self.page_size = page_size
        self.on_change = on_change
        self.keys: dict[int, str] = {}
        self.parents: dict[str, str | None] = {}
        self.media: dict[int, set[str]] = {}
        self.stored_blocks = 0
        self.removed_blocks = 0
        self.unkeyed_blocks = 0
        self.resyncs = 0
        self._unkeyed_logged = False

    # -- batches ---------------------------------------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch's events in order."""
        from btbctl.engine.kvevents import AllBlocksCleared, BlockRemoved, BlockStored

        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self._cleared()
        if batch.events and self.on_change is not None:
            self.on_change()

    def resync(self, reason: str) -> None:
        """Drop the worker's record and every mapping (events were missed); one ``kv_events_resync`` line."""
        self.resyncs += 1
        dropped = len(self.worker.holdings)
        self._reset()
        self._unkeyed_logged = False
        log_event(
            log,
            "kv_events_resync",
            logging.WARNING,
            worker=self.worker.name,
            reason=reason,
            dropped_blocks=dropped,
        )
        if self.on_change is not None:
            self.on_change()

    def _reset(self) -> None:
        self.keys.clear()
        self.parents.clear()
        self.media.clear()
        self.worker.forget()

    def _stored(self, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        size = ev.block_size
        if size != self.page_size() or len(ev.token_ids) != n * size:
            why = (
                f"block_size {size} differs from the gateway's page size {self.page_size()}"
                if size != self.page_size()
                else f"{len(ev.token_ids)} token ids for {n} blocks of {size}"
            )
            self._unkeyed(n, why)
            return
        parent: str | None = None
        if ev.parent_block_hash is not None:
            parent = self.keys.get(ev.parent_block_hash)
            if parent is None:
                self._unkeyed(n, "parent block unknown (stored before a resync or before the gateway started)")
                return
        new_media = ev.medium or "GPU"
        last = parent
        for i, h in enumerate(ev.block_hashes):
            key = self.keys.get(h)
            if key is None:
                page = ev.token_ids[i * size : (i + 1) * size]
                try:
                    key = self.keyer(last, page, ev.cache_salt)
                except (ValueError, TypeError, OverflowError) as e:
                    self._unkeyed(n - i, f"token ids not hashable: {e}")
                    break
                self.keys[h] = key
                self.parents[key] = last
            self.media.setdefault(h, set()).add(new_media)
            self.stored_blocks += 1
            last = key
        if last is not None and last != parent:
            self.worker.hold(self._chain_to(last))
        if len(self.keys) > MAX_EVENT_BLOCKS:
            self.resync(f"more than {MAX_EVENT_BLOCKS} blocks mapped: the publisher's removals are not arriving")

    def _chain_to(self, key: str) -> list[str]:
        chain: list[str] = []
        k: str | None = key
        while k is not None:
            chain.append(k)
            k = self.parents.get(k)
        chain.reverse()
        return chain

    def _removed(self, ev: BlockRemoved) -> None:
        medium = ev.medium or "GPU"
        gone: list[str] = []
        for h in ev.block_hashes:
            media = self.media.get(h)
            if media is None:
                continue
            media.discard(medium)
            if media:
                continue  # still held in another tier
            del self.media[h]
            key = self.keys.pop(h)
            self.parents.pop(key, None)
            gone.append(key)
            self.removed_blocks += 1
        if gone:
            self.worker.drop_blocks(gone)

    def _cleared(self) -> None:
        self._reset()

    def _unkeyed(self, n: int, why: str) -> None:
        self.unkeyed_blocks += n
        if not self._unkeyed_logged:  # once per resync: the count is in the fleet view
            self._unkeyed_logged = True
            log_event(log, "kv_events_unkeyed", worker=self.worker.name, blocks=n, reason=why)


class KvEventsSubscriber:
    """Reads one worker's KV events and applies them to its :class:`HoldingsFeed` (see the module docstring for
    gaps, replays and late starts).

    Args:
        feed: where the batches go.
        endpoint: the publisher's PUB address (``tcp://*:PORT`` as configured on the worker means loopback here).
        replay_endpoint: its ROUTER address, or None.
        topic: the topic subscribed to ("" : all).
        replay_timeout_s: longest wait for a replay's answer, seconds.

    Attributes: ``expected`` (the next sequence number, None before the first batch), ``batches`` (applied),
    ``replayed`` (of which came through the replay socket), ``connected`` (the SUB socket is set up).
    """

    def __init__(
        self,
        feed: HoldingsFeed,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
    ) -> None:
        from btbctl.engine.kvevents import subscriber_address

        self.feed = feed
        self.endpoint = subscriber_address(endpoint)
        self.replay_endpoint = subscriber_address(replay_endpoint) if replay_endpoint else None
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.expected: int | None = None
        self.batches = 0
        self.replayed = 0
        self.connected = False
        self._ctx: Any = None
        self._task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.feed.worker.name

    def start(self) -> None:
        """Start reading in a task of the running loop."""
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self.connected = True
        log_event(
            log,
            "kv_events_connected",
            worker=self.name,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )
        try:
            if self.replay_endpoint is not None:
                await self._replay(0)  # a late start: everything the publisher still keeps
            while True:
                frames = await sub.recv_multipart()
                self._live(frames)
                if self._gap is not None:
                    start, seq = self._gap
                    self._gap = None
                    await self._recover(start, seq)
        finally:
            sub.close(linger=0)

    _catching_up = False  # a replay ended and no live batch after it was taken yet
    _gap: tuple[int, int] | None = None
    _pending: tuple[int, KVEventBatch] | None = None

    def _live(self, frames: list[bytes]) -> None:
        """One live message; a gap is left in ``_gap`` (with the message kept) for :meth:`_recover`."""
        from btbctl.engine.kvevents import decode_batch, seq_of

        if len(frames) != 3:
            self._bad(f"{len(frames)} frames instead of 3")
            return
        try:
            seq = seq_of(frames[1])
            batch = decode_batch(frames[2])
        except ValueError as e:
            self._bad(str(e))
            return
        exp = self.expected
        if exp is not None and seq < exp:
            if self._catching_up:
                return  # already applied: a replay overlapped the live messages queued meanwhile
            # the publisher started over (the worker restarted): a fresh start with an empty record
            self.feed.resync(f"the publisher went back from sequence {exp - 1} to {seq} (worker restarted)")
            self.expected = exp = None
            if seq > 0 and self.replay_endpoint is not None:
                self._gap, self._pending = (0, seq), (seq, batch)
                return
        self._catching_up = False
        if exp is None and seq > 0:
            if self.replay_endpoint is None:
                log_event(log, "kv_events_late_start", worker=self.name, first_seq=seq, note="no replay: starts fresh")
            else:
                self._gap, self._pending = (0, seq), (seq, batch)
                return
        elif exp is not None and seq > exp:
            if self.replay_endpoint is None:
                self.feed.resync(f"missed sequences {exp}..{seq - 1} and no replay endpoint")
            else:
                self._gap, self._pending = (exp, seq), (seq, batch)
                return
        self._take(seq, batch)

    def _take(self, seq: int, batch: KVEventBatch, replayed: bool = False) -> None:
        self.feed.apply(batch)
        self.expected = seq + 1
        self.batches += 1
        if replayed:
            self.replayed += 1

    async def _recover(self, start: int, seq: int) -> None:
        """Replay ``start..seq - 1``, then apply the live batch ``seq`` that showed the gap."""
        await self._replay(start)
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pseq, batch = pending
        exp = self.expected
        if exp is None or pseq >= exp:
            if exp is not None and pseq > exp:
                self.feed.resync(f"missed sequences {exp}..{pseq - 1}: the replay buffer no longer holds them")
            self._take(pseq, batch)

    async def _replay(self, start: int) -> None:
        """Ask the replay socket for every batch from ``start`` and apply them in order. When the first one it
        returns is later than ``start`` (its buffer no longer reaches back) or it does not answer, the record is
        resynced first."""
        import zmq

        from btbctl.engine.kvevents import decode_batch, seq_bytes, seq_of

        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        got = 0
        first: int | None = None
        try:
            await dealer.send_multipart((b"", seq_bytes(start)))
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    self.feed.resync(f"the replay endpoint did not answer in {self.replay_timeout_s:g} s")
                    return
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    self._bad(f"replay answer of {len(frames)} frames instead of 4")
                    continue
                seq = seq_of(frames[2])
                if seq == -1:
                    break
                if first is None:
                    first = seq
                    if seq > start and (start > 0 or self.expected is not None or self.feed.worker.holdings):
                        self.feed.resync(f"replay from {start} began at {seq}: the publisher's buffer moved on")
                    elif seq > start:
                        log_event(
                            log, "kv_events_late_start", worker=self.name, first_seq=seq, note="older batches gone"
                        )
                if self.expected is not None and seq < self.expected:
                    continue
                try:
                    batch = decode_batch(frames[3])
                except ValueError as e:
                    self._bad(str(e))
                    continue
                self._take(seq, batch, replayed=True)
                got += 1
        finally:
            dealer.close(linger=0)
        self._catching_up = True
        log_event(log, "kv_events_replayed", worker=self.name, from_seq=start, first_seq=first, batches=got)

    def _bad(self, why: str) -> None:
        log_event(log, "kv_events_bad_message", logging.WARNING, worker=self.name, reason=why[:200])
