"""The emulated worker's KV block store: real bytes for replication, mirroring the replica model's cache.

* **Block size** (bytes) = ``page_size x kv_bytes_per_token / kv_bytes_scale``, at least 64 (see
  :meth:`~btbctl.engine.worker.config.WorkerConfig.block_bytes`); the scale keeps memory small.
* **Content** of a block is ``hashing.block_payload(hash, block_bytes)``: derived from its chain hash, so any copy
  can be verified against the hash alone.
* **What is kept.** The replica model decides which blocks are resident. Blocks the worker computed itself (by
  prefill) are not stored: when one must be sent, it is regenerated from its hash, and only if the model says it
  is still resident. Blocks that *arrived by copy* are stored as the bytes that arrived (after verification) until
  the model evicts them, so a block relayed onwards is the very data that came in, and verification downstream is
  meaningful.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from btbctl.engine.hashing import block_payload


class BlockStore:
    """Args:
    block_bytes: bytes per block.
    """

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._arrived: dict[str, bytes] = {}

    def __len__(self) -> int:
        return len(self._arrived)

    @property
    def stored_bytes(self) -> int:
        """Bytes held for blocks that arrived by copy."""
        return len(self._arrived) * self.block_bytes

    def expected(self, block_hash: str) -> bytes:
        """The bytes a block with this hash must have."""
        return block_payload(block_hash, self.block_bytes)

    def get(self, block_hash: str) -> bytes:
        """The block's bytes: the arrived copy if there is one, else regenerated from the hash. The caller checks
        that the model holds the block."""
        data = self._arrived.get(block_hash)
        return data if data is not None else self.expected(block_hash)

    def put_many(self, chain: Sequence[str], blocks: Iterable[bytes]) -> None:
        """Keep the verified bytes of an arrived copy."""
        for h, b in zip(chain, blocks, strict=True):
            self._arrived[h] = b

    def drop(self, block_hash) -> None:
        """The model evicted the block."""
        self._arrived.pop(block_hash, None)

    def clear(self) -> None:
        self._arrived.clear()

    def has_arrived(self, block_hash: str) -> bool:
        return block_hash in self._arrived
