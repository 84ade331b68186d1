"""Block-hash chains and prefix ids: one definition used by the simulator, the policies, the gateway, the worker,
the control API and the dashboard.

A prompt is cut into KV blocks (pages) of ``block_tokens`` tokens; only full blocks are hashed. Hashes are
**prefix-chained** (``h[k]`` identifies the whole prefix through block ``k``: :mod:`btbctl.engine.hashing` for live
prompts, the traces' ``hash_ids`` for replays), so the last hash of a prefix identifies the whole prefix: it is the
prefix's **key**, and its hex form is the **prefix id** users type (``btbctl replicate --prefix``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

#: A prompt's block hashes, root first (hex strings live; trace ids or labels in replays).
Chain = tuple[Hashable, ...]
#: Tokens per KV block when neither the trace nor the workers say otherwise: BTB's 256-token block (REFERENCE.md
#: s1; the ``btb-mixed-trace-v1`` block and the block of BTB's Y).
DEFAULT_BLOCK_TOKENS = 256
#: Shortest accepted prefix-id abbreviation, hex digits.
MIN_PREFIX_ID_CHARS = 8
#: Hex digits of a prefix id shown in tables and on the dashboard (48 bits: unambiguous among the prefixes a fleet
#: tracks; a product choice). Always >= :data:`MIN_PREFIX_ID_CHARS`, so a shown id can be typed back.
SHORT_ID_CHARS = 12
_HEX = frozenset("0123456789abcdef")


def count_blocks(counts: dict[Hashable, int], blocks: Iterable[Hashable]) -> None:
    """Add one to the count of each of ``blocks`` (a multiset of blocks: a missing block counts 0)."""
    for b in blocks:
        counts[b] = counts.get(b, 0) + 1


def uncount_blocks(counts: dict[Hashable, int], blocks: Iterable[Hashable]) -> None:
    """Take one off the count of each of ``blocks``, dropping counts that reach 0 (:func:`count_blocks`' inverse)."""
    for b in blocks:
        n = counts.get(b, 0) - 1
        if n > 0:
            counts[b] = n
        else:
            counts.pop(b, None)


def chain_conflict(
    parents: dict[Hashable, Hashable | None], chain: Sequence[Hashable]
) -> tuple[int, Hashable | None, Hashable | None] | None:
    """Check ``chain`` against the parents recorded so far (``parents``: block -> the block before it where it
    first appeared, None at a chain's root; updated in place) for the **prefix-chained** rule: a block always
    follows the same block. Returns None, or the first conflict as ``(index, block before it here, block before it
    where it first appeared)``. A block repeated within a chain is a conflict too. Two C-level passes."""
    if not chain:
        return None
    before = (None, *chain[:-1])
    got = tuple(map(parents.setdefault, chain, before))
    if got == before:
        return None
    i = next(i for i, (g, b) in enumerate(zip(got, before, strict=True)) if g != b)
    return i, before[i], got[i]


def follows(block: Hashable | None) -> str:
    """How :func:`chain_conflict`'s blocks read in an error: ``opens the chain`` or ``follows <block>``."""
    return "opens the chain" if block is None else f"follows {block!r}"


def leading_run(chain: Sequence[Hashable], contains: Callable[[Hashable], bool]) -> int:
    """How many leading blocks of ``chain`` satisfy ``contains``, for a **prefix-closed** membership (a block is
    in only if every block before it is): a binary search, O(log len(chain)) calls.

    Prefix-closed sets: a radix/prefix cache, a holding record whose chains are inserted deepest block first and
    evicted least recently used first, the union of such sets along one chain.
    """
    n = len(chain)
    if n == 0 or not contains(chain[0]):
        return 0
    if contains(chain[n - 1]):
        return n
    lo, hi = 1, n - 1  # chain[lo - 1] is in, chain[hi] is not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if contains(chain[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def leading_run_linear(chain: Sequence[Hashable], contains: Callable[[Hashable], bool]) -> int:
    """:func:`leading_run` by a forward walk (any membership, O(run)); the reference the binary search agrees with
    on prefix-closed sets."""
    n = 0
    for h in chain:
        if not contains(h):
            break
        n += 1
    return n


def prefix_id(key: Hashable) -> str:
    """The hex prefix id of a prefix key: the key itself when it is lowercase hex of at least
    :data:`MIN_PREFIX_ID_CHARS` digits (live chains), 16 hex digits for a non-negative integer (Mooncake ids),
    else 16 hex digits of xxh3_64 over its text (generated traces use readable labels)."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return f"{key:016x}"
    s = str(key)
    if len(s) >= MIN_PREFIX_ID_CHARS and _HEX.issuperset(s):
        return s
    import xxhash

    return xxhash.xxh3_64_hexdigest(s.encode())


def short_id(pid: str) -> str:
    """The first :data:`SHORT_ID_CHARS` hex digits of a prefix id (what tables show; accepted back as input)."""
    return pid[:SHORT_ID_CHARS]


def check_prefix_id(text: object) -> str:
    """A typed prefix id (or an abbreviation of one) normalised to lowercase hex.

    Raises:
        ValueError: not a string of hex digits, or shorter than :data:`MIN_PREFIX_ID_CHARS` (the message says
            which; callers prefix it with the flag or key).
    """
    if not isinstance(text, str):
        raise ValueError(f"must be a hexadecimal prefix id, got {text!r}")
    p = text.strip().lower()
    if not p or not _HEX.issuperset(p):
        raise ValueError(f"{text!r} is not a hexadecimal prefix id")
    if len(p) < MIN_PREFIX_ID_CHARS:
        raise ValueError(f"give at least {MIN_PREFIX_ID_CHARS} hex digits, got {len(p)}")
    return p


__all__ = [
    "Chain",
    "DEFAULT_BLOCK_TOKENS",
    "MIN_PREFIX_ID_CHARS",
    "SHORT_ID_CHARS",
    "check_prefix_id",
    "leading_run",
    "leading_run_linear",
    "prefix_id",
    "short_id",
]
