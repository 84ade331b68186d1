"""How live prompts become block-hash chains (gateway, emulated worker, ``btbctl bench`` and ``replicate`` agree).

* **Tokens.** When a request carries ``input_ids`` they are the tokens. For text there is no tokenizer here (the
  gateway must not depend on the model's), so text is cut into pseudo-tokens of :data:`BYTES_PER_TOKEN` UTF-8
  bytes (about the 4 characters per token of BPE tokenizers on English text, OpenAI's rule of thumb). Equal text
  gives equal tokens, and so equal hashes, which is all prefix matching needs.
* **Blocks.** Tokens are grouped in blocks (pages) of ``block_tokens``; only *full* blocks are hashed, as SGLang's
  radix cache only caches full pages when ``--page-size`` > 1.
* **Chain hashes.** ``h[k] = xxh3_64(h[k-1] || tokens of block k)`` as 16 hex digits (``h[-1]`` = empty), so a hash
  identifies the whole prefix through its block, like the Mooncake traces' ``hash_ids``.
* **Prefix id.** The id users type (``btbctl replicate --prefix``) is the hash of a prefix's last block
  (:mod:`btbctl.engine.chains`).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

#: UTF-8 bytes per pseudo-token for text prompts.
BYTES_PER_TOKEN = 4
_LITTLE = sys.byteorder == "little"
_xxh3_digest = xxhash.xxh3_64_digest


def pack_text(text: str, errors: str = "strict") -> bytes:
    """UTF-8 bytes of ``text`` zero-padded to a whole number of pseudo-tokens: the packed (little-endian uint32)
    form of :func:`text_to_tokens` ``(text)``. ``errors`` is passed to ``str.encode``."""
    data = text.encode("utf-8", errors)
    pad = (-len(data)) % BYTES_PER_TOKEN
    return data + b"\0" * pad if pad else data


def pack_tokens(tokens: Sequence[int], strict: bool = False) -> bytes:
    """Token ids packed as little-endian uint32, each taken modulo 2**32 (``strict``: OverflowError for an id
    outside [0, 2**32) instead). Raises TypeError for non-integers."""
    try:
        arr = array("I", tokens)
    except OverflowError:  # negative or >= 2**32
        if strict:
            raise
        arr = array("I", [t & 0xFFFFFFFF for t in tokens])
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


#: Name under which a worker declares that its tokenizer is :func:`text_to_tokens` (``tokenizer`` of the emulated
#: worker's ``/btb/info``): a gateway may then compute a text prompt's ids itself instead of asking.
PSEUDO_TOKENIZER = "btbctl-utf8-4"


def text_to_tokens(text: str) -> list[int]:
    """Pseudo-tokens of ``text``: each group of :data:`BYTES_PER_TOKEN` UTF-8 bytes read as a little-endian
    integer (the last group zero-padded). Empty text gives ``[]``."""
    arr = array("I")
    arr.frombytes(pack_text(text))
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def tokens_to_text(tokens: Sequence[int]) -> str:
    """Inverse of :func:`text_to_tokens` for tokens it produced (used to synthesise prompts)."""
    data = b"".join(int(t).to_bytes(BYTES_PER_TOKEN, "little") for t in tokens)
    return data.rstrip(b"\0").decode("utf-8", errors="replace")


def chain_hashes(tokens: Sequence[int], block_tokens: int) -> list[str]:
    """Chain hashes of the full blocks of ``tokens`` (16 hex digits each). Raises ValueError for
    ``block_tokens < 1``."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    n_full = len(tokens) // block_tokens
    return chain_from_packed(pack_tokens(tokens[: n_full * block_tokens]), block_tokens)


def chain_from_packed(data: bytes, block_tokens: int) -> list[str]:
    """Chain hashes (16 hex digits each) of the full ``block_tokens``-token blocks of packed tokens (as
    :func:`pack_text` or :func:`pack_tokens` give): equal to :func:`chain_hashes` of the tokens ``data`` packs, in
    one pass of xxh3 per block over the bytes as they are. Raises ValueError for ``block_tokens < 1``."""
    if block_tokens < 1:
        raise ValueError("block_tokens must be >= 1")
    step = block_tokens * BYTES_PER_TOKEN
    out: list[str] = []
    prev = b""
    mv = memoryview(data)
    for k in range(len(data) // step):
        prev = _xxh3_digest(prev + mv[k * step : (k + 1) * step])
        out.append(prev.hex())
    return out


def next_chain_hash(prev: str | None, tokens: Sequence[int]) -> str:
    """Chain hash of the block of ``tokens`` that follows the block hashed ``prev`` (16 hex digits; None: the
    first block): one step of :func:`chain_hashes`, for blocks learnt one at a time (a worker's KV events). Raises
    ValueError for a ``prev`` that is not hex, TypeError/OverflowError as :func:`pack_tokens` (``strict``)."""
    head = bytes.fromhex(prev) if prev else b""
    return _xxh3_digest(head + pack_tokens(tokens, strict=True)).hex()


def block_payload(block_hash: str, nbytes: int) -> bytes:
    """Deterministic content of a KV block in the emulated worker's store: ``nbytes`` bytes of the PCG64 raw bit
    stream seeded with the block's chain hash (NumPy keeps bit-generator streams fixed across releases), so any copy
    can be verified against its hash alone."""
    import numpy as np

    if _is_hex(block_hash):
        seed = int(block_hash, 16)
    else:
        seed = int.from_bytes(xxhash.xxh3_64_digest(block_hash.encode()), "big")
    words = np.random.PCG64(seed).random_raw((nbytes + 7) // 8)
    return words.astype("<u8").tobytes()[:nbytes]


def _is_hex(s: str) -> bool:
    try:
        int(s, 16)
    except ValueError:
        return False
    return True


def payload_digest(data: bytes) -> str:
    """Integrity digest of a block's bytes on the wire (xxh3_64, 16 hex digits)."""
    return xxhash.xxh3_64_hexdigest(data)
