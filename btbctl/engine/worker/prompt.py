"""Prompt -> (token count, block-hash chain) without materialising token lists.

Gives exactly what :func:`btbctl.engine.hashing.text_to_tokens` followed by
:func:`btbctl.engine.hashing.chain_hashes` give (a test checks it), an order of magnitude faster: a text
pseudo-token is 4 UTF-8 bytes read little-endian and ``chain_hashes`` packs each token back as 4 little-endian
bytes, so a block's hashed bytes are simply the zero-padded UTF-8 bytes of its tokens; token ids are packed with
NumPy.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from btbctl.engine.hashing import BYTES_PER_TOKEN


def _chain(data: bytes, block_tokens: int) -> list[str]:
    step = block_tokens * BYTES_PER_TOKEN
    out: list[str] = []
    prev = b""
    view = memoryview(data)
    for k in range(len(data) // step):
        h = xxhash.xxh3_64(prev)
        h.update(view[k * step:(k + 1) * step])
        prev = h.digest()
        out.append(prev.hex())
    return out


def text_chain(text: str, block_tokens: int) -> tuple[int, list[str]]:
    """``(pseudo-token count, chain hashes of the full blocks)`` of ``text``."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    data = text.encode("utf-8")
    pad = (-len(data)) % BYTES_PER_TOKEN
    if pad:
        data += b"\0" * pad
    return len(data) // BYTES_PER_TOKEN, _chain(data, block_tokens)


def ids_chain(ids: Sequence[int], block_tokens: int) -> tuple[int, list[str]]:
    """``(len(ids), chain hashes of the full blocks)``; ids must be integers in ``[0, 2**32)``."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    data = np.asarray(ids, dtype=np.uint64).astype("<u4").tobytes()
    return len(ids), _chain(data, block_tokens)
