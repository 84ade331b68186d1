"""Prompt -> (token count, block-hash chain) without materialising token lists.

Gives exactly what :func:`btbctl.engine.hashing.text_to_tokens` followed by
:func:`btbctl.engine.hashing.chain_hashes` give (a test checks it): the prompt is packed once
(:func:`~btbctl.engine.hashing.pack_text`, :func:`~btbctl.engine.hashing.pack_tokens`) and hashed block by block
over the packed bytes (:func:`~btbctl.engine.hashing.chain_from_packed`).
"""

from __future__ import annotations

from collections.abc import Sequence

from btbctl.engine.hashing import BYTES_PER_TOKEN, chain_from_packed, pack_text, pack_tokens


def text_chain(text: str, block_tokens: int) -> tuple[int, list[str]]:
    """``(pseudo-token count, chain hashes of the full blocks)`` of ``text``. Raises ValueError for
    ``block_tokens < 1``."""
    data = pack_text(text)
    return len(data) // BYTES_PER_TOKEN, chain_from_packed(data, block_tokens)


def ids_chain(ids: Sequence[int], block_tokens: int) -> tuple[int, list[str]]:
    """``(len(ids), chain hashes of the full blocks)``; ids must be integers in ``[0, 2**32)``. Raises ValueError
    for ``block_tokens < 1``."""
    return len(ids), chain_from_packed(pack_tokens(ids), block_tokens)
