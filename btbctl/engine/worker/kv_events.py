"""The emulated worker's KV events (``--kv-events-config``, SGLang's option and wire format:
:mod:`btbctl.engine.kvevents`), so an emulated fleet exercises the gateway's event path as SGLang workers do.

* A request's prompt teaches :class:`WorkerEvents` the tokens of each of its pages (:meth:`WorkerEvents.learn`);
  when the model inserts a page into its cache a :class:`~btbctl.engine.kvevents.BlockStored` of that page goes
  out (``block_hashes``: the page's chain hash read as a signed int64; ``parent_block_hash``: its parent's, None
  at the root; ``medium`` ``GPU``), an eviction sends :class:`~btbctl.engine.kvevents.BlockRemoved`, a
  ``/flush_cache`` :class:`~btbctl.engine.kvevents.AllBlocksCleared`.
* The events of one turn of the event loop go out as one batch (SGLang sends one per scheduler step).
* Pages that arrived by a copy and whose tokens this worker never saw in a prompt are not published (their
  tokens are unknown here; the gateway records a copy's target as a holder when the copy is confirmed).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from btbctl.engine.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEventsConfig, Publisher

log = logging.getLogger("btbctl.worker")

#: Pages whose tokens are remembered at most (a product choice; 2**18 pages of 16 tokens are about 40 MB).
KNOWN_PAGES = 1 << 18


def block_id(block_hash: Hashable) -> int:
    """The int64 a page is published under: its 16-hex-digit chain hash (or the first 16 digits of a longer key)
    read as a signed 64-bit integer."""
    return int.from_bytes(bytes.fromhex(str(block_hash)[:16]), "big", signed=True)


class WorkerEvents:
    """Publishes one worker's cache changes (see the module docstring). ``start`` binds the sockets (raises
    ``zmq.ZMQError`` when an address is taken)."""

    def __init__(self, cfg: KvEventsConfig, page_size: int, name: str = "worker") -> None:
        self.publisher = Publisher(cfg, name, log)
        self.page_size = page_size
        self._pages: OrderedDict[Hashable, tuple[Hashable | None, list[int]]] = OrderedDict()
        self._published: set[Hashable] = set()
        self._queue: list = []
        self._flush_scheduled = False

    def start(self) -> None:
        self.publisher.start()

    async def close(self) -> None:
        self._send()
        await self.publisher.close()

    def learn(self, chain: Sequence[Hashable], tokens: Sequence[int]) -> None:
        """The pages of a prompt: ``chain[k]`` holds ``tokens[k * page_size : (k + 1) * page_size]``."""
        ps = self.page_size
        parent: Hashable | None = None
        pages = self._pages
        for k, h in enumerate(chain):
            if h in pages:
                pages.move_to_end(h)
            else:
                pages[h] = (parent, list(tokens[k * ps : (k + 1) * ps]))
            parent = h
        while len(pages) > KNOWN_PAGES:
            pages.popitem(last=False)

    def inserted(self, block_hash: Hashable) -> None:
        """The model made a page resident."""
        known = self._pages.get(block_hash)
        if known is None or block_hash in self._published:
            return
        parent, tokens = known
        if parent is not None and parent not in self._published:
            return  # its parent was never published: a subscriber could not key it
        self._published.add(block_hash)
        self._enqueue(
            BlockStored(
                block_hashes=[block_id(block_hash)],
                parent_block_hash=None if parent is None else block_id(parent),
                token_ids=tokens,
                block_size=len(tokens),
                lora_id=None,
                medium="GPU",
            )
        )

    def evicted(self, block_hash: Hashable) -> None:
        """The model dropped a page."""
        if block_hash in self._published:
            self._published.discard(block_hash)
            self._enqueue(BlockRemoved(block_hashes=[block_id(block_hash)], medium="GPU"))

    def cleared(self) -> None:
        """The cache was flushed."""
        self._published.clear()
        self._enqueue(AllBlocksCleared())

    def _enqueue(self, ev) -> None:
        self._queue.append(ev)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self._send)
            except RuntimeError:  # no loop (a synchronous caller): send now
                self._send()

    def _send(self) -> None:
        self._flush_scheduled = False
        if self._queue:
            events, self._queue = self._queue, []
            self.publisher.publish(events)
