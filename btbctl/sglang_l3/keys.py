"""SGLang's HiCache page keys, computed without SGLang, and the object-key namespace of btbctl's L3 store.

Page keys (SGLang 0.5.23 ``srt/mem_cache/utils.py:116-153``: ``get_hash_str``, ``storage_namespace_seed``,
``get_storage_hash_str``; the native hasher ``srt/mem_cache/cpp_utils/hash_binding.cpp:62-80,224-262``). For page
``i`` of ``page_size`` tokens::

    digest_i = SHA256(digest_{i-1} || payload_i)     # digest_{-1}: absent, or the 32-byte namespace seed
    payload_i = token ids as little-endian uint32    # every id of the page < 2**32
              = b"\\xff" || ids as little-endian uint64   # some id of the page >= 2**32 (decided per page)
    key_i = digest_i as 64 lowercase hex characters

A trailing partial page is hashed the same way over its tokens (SGLang only stores whole pages). The seed is absent
unless the request has an ``extra_key`` (LoRA id) or a ``cache_salt``; then it is
``SHA256(b"sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`` with
``part(None) = b"\\x00"`` and ``part(s) = b"\\x01" || len(utf8(s)) as 8-byte little-endian || utf8(s)``.
Token ids must be in ``0 .. 2**63 - 1`` (the native hasher refuses others). SGLang's EAGLE "bigram" keys are not
covered (they hash pairs of ids).

Object keys: a page in the store carries no header, so the store keys every page by a :class:`Namespace` (served
model, TP size and rank, PP/CP ranks, page size, host layout, KV dtype, page bytes, the interface that wrote it and
the SGLang version) plus the page key: ``<namespace id>.<page key>``. Two workers whose pages are not byte-compatible
never share a namespace, so a mismatch is a miss, never wrong KV.

Only the standard library is imported here (this module runs inside SGLang's scheduler process).
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

#: Prefix of the namespace seed (SGLang 0.5.23 ``srt/mem_cache/utils.py:133``).
NAMESPACE_SEED_PREFIX = b"sglang-cache-namespace-v1"
#: Tag byte before a page hashed as uint64 words (``hash_binding.cpp:71-75``: "an odd byte count separates wide
#: encoding from legacy u32 pages").
WIDE_PAGE_TAG = b"\xff"
_U32_MAX = (1 << 32) - 1
_I64_MAX = (1 << 63) - 1
#: Characters of a namespace id (hex of SHA-256 of its canonical description).
NAMESPACE_ID_CHARS = 16


def namespace_seed(extra_key: str | None = None, cache_salt: str | None = None) -> bytes | None:
    """The 32-byte digest that seeds a request's page chain, or None when both parts are None (see the module
    docstring). Raises TypeError for a part that is not a str or None."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(NAMESPACE_SEED_PREFIX)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
            continue
        if not isinstance(part, str):
            raise TypeError(f"extra_key/cache_salt must be str or None, got {type(part).__name__}")
        b = part.encode("utf-8")
        h.update(b"\x01" + len(b).to_bytes(8, "little") + b)
    return h.digest()


def _page_payload(page: Sequence[int]) -> bytes:
    wide = False
    for t in page:
        if not isinstance(t, int) or isinstance(t, bool):
            raise TypeError(f"token ids must be int, got {type(t).__name__}")
        if t < 0 or t > _I64_MAX:
            raise ValueError(f"token id {t} outside 0..2**63-1")
        if t > _U32_MAX:
            wide = True
    arr = array("Q" if wide else "I", page)
    if arr.itemsize != (8 if wide else 4):  # pragma: no cover - exotic platforms
        arr = array("Q" if wide else "L", page)
    if sys.byteorder != "little":  # pragma: no cover - SGLang itself runs only on little-endian Linux
        arr.byteswap()
    return (WIDE_PAGE_TAG + arr.tobytes()) if wide else arr.tobytes()


def page_keys(
    token_ids: Iterable[int], page_size: int, extra_key: str | None = None, cache_salt: str | None = None
) -> list[str]:
    """SGLang's storage page keys for ``token_ids`` split into pages of ``page_size`` tokens.

    Args:
        token_ids: the prompt's token ids after the chat template (what SGLang's radix tree holds), each in
            ``0 .. 2**63 - 1``.
        page_size: tokens per page (``--page-size``), >= 1.
        extra_key: the request's extra key (LoRA id), or None.
        cache_salt: the request's cache salt, or None (an empty salt counts as none, as in SGLang's ``RadixKey``).

    Returns:
        one 64-character lowercase hex key per page (``ceil(len / page_size)`` keys; the last may cover a partial
        page).

    Raises:
        ValueError: ``page_size < 1`` or a token id out of range. TypeError: a non-integer token id.
    """
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    ids = list(token_ids)
    # SGLang's RadixKey stores ``cache_salt or None`` (srt/mem_cache/radix_cache.py:77): an empty salt is no salt
    prior = namespace_seed(extra_key, cache_salt or None)
    keys: list[str] = []
    for start in range(0, len(ids), page_size):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(_page_payload(ids[start : start + page_size]))
        prior = h.digest()
        keys.append(prior.hex())
    return keys


def next_page_key(prior_key: str | None, page: Sequence[int], seed: bytes | None = None) -> str:
    """The page key of ``page`` after the page keyed ``prior_key`` (None: the first page, seeded with ``seed``, a
    :func:`namespace_seed` or None): one step of :func:`page_keys`, for pages learnt one at a time (SGLang's KV
    events). Raises ValueError for a malformed ``prior_key`` or a token id out of range, TypeError for a non-integer
    one."""
    h = hashlib.sha256()
    if prior_key is not None:
        h.update(bytes.fromhex(prior_key))
    elif seed is not None:
        h.update(seed)
    h.update(_page_payload(page))
    return h.hexdigest()


def page_keys_packed(
    data: bytes | memoryview, page_size: int, extra_key: str | None = None, cache_salt: str | None = None
) -> list[str]:
    """:func:`page_keys` of token ids already packed as little-endian uint32 (4 bytes each, every id < 2**32):
    SGLang hashes such pages over exactly these bytes, so no per-token work is needed. ``len(data)`` must be a
    multiple of 4. Raises ValueError for ``page_size < 1`` or a ragged buffer."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1, got {page_size!r}")
    if len(data) % 4:
        raise ValueError("packed token ids must be a whole number of 4-byte words")
    if sys.byteorder != "little":  # pragma: no cover - SGLang itself runs only on little-endian Linux
        arr = array("I", bytes(data))
        return page_keys(arr.tolist(), page_size, extra_key, cache_salt)
    view = memoryview(data).cast("B")
    step = 4 * page_size
    prior = namespace_seed(extra_key, cache_salt or None)
    keys: list[str] = []
    for start in range(0, len(view), step):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(view[start : start + step])
        prior = h.digest()
        keys.append(prior.hex())
    return keys


def is_page_key(key: object) -> bool:
    """Whether ``key`` looks like an SGLang page key (64 lowercase hex characters)."""
    return isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)


@dataclass(frozen=True)
class Namespace:
    """What makes two workers' pages byte-compatible. Every field is part of the id.

    Attributes:
        model: served model name as SGLang gives it to storage backends (``HiCacheStorageConfig.model_name``; it
            carries the host pool's storage format tag when the pool has one).
        tp_size: tensor-parallel size (attention TP size under DP attention).
        tp_rank: this rank; None for rank-replicated KV (MLA), which every rank reads from rank 0's pages.
        pp_size, pp_rank: pipeline-parallel size and rank.
        cp_size, cp_rank: attention context-parallel size and rank.
        page_size: tokens per page.
        layout: the host pool's layout (``layer_first``, ``page_first``, ``page_first_direct``, ...).
        kv_dtype: the host pool's dtype (``torch.bfloat16`` ...).
        page_bytes: bytes of one page object.
        interface: ``v1`` (zero-copy: the pool's page buffers concatenated) or ``generic`` (the flat data page);
            the two order a ``layer_first`` page's bytes differently.
        sglang_version: SGLang's version string.
        mla: whether the KV is rank-replicated (MLA).
    """

    model: str
    tp_size: int
    tp_rank: int | None
    pp_size: int
    pp_rank: int
    cp_size: int
    cp_rank: int
    page_size: int
    layout: str
    kv_dtype: str
    page_bytes: int
    interface: str
    sglang_version: str
    mla: bool = False

    def describe(self) -> dict:
        """The canonical description (a JSON object of the fields)."""
        return asdict(self)

    @property
    def ns_id(self) -> str:
        """:data:`NAMESPACE_ID_CHARS` hex characters of SHA-256 over the canonical JSON description."""
        raw = json.dumps(self.describe(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:NAMESPACE_ID_CHARS]

    @classmethod
    def from_dict(cls, d: dict) -> Namespace:
        """Rebuild from :meth:`describe`. Raises TypeError/ValueError for a malformed description."""
        if not isinstance(d, dict):
            raise TypeError("namespace description must be an object")
        fields = cls.__dataclass_fields__
        unknown = set(d) - set(fields)
        if unknown:
            raise ValueError(f"unknown namespace fields: {', '.join(sorted(unknown))}")
        return cls(**d)


def object_key(ns_id: str, key: str) -> str:
    """The store's name of page ``key`` in namespace ``ns_id``: ``<ns_id>.<key>``."""
    return f"{ns_id}.{key}"


__all__ = [
    "NAMESPACE_ID_CHARS",
    "NAMESPACE_SEED_PREFIX",
    "Namespace",
    "WIDE_PAGE_TAG",
    "is_page_key",
    "namespace_seed",
    "object_key",
    "next_page_key",
    "page_keys",
    "page_keys_packed",
]
