"""Block-level prefix cache of one replica: what SGLang's radix cache does, at block granularity.

Blocks are identified by prefix-chained hashes (a block's hash identifies its whole prefix), so the radix tree
reduces to a dict ``hash -> parent hash``. Invariant kept at all times (*ancestor closure*): if a block is resident,
its parent is resident. Matching a chain is then a binary search over the chain (O(log n) dict look-ups).

Space is counted in tokens: every block occupies ``block_tokens`` tokens (page granularity) whether resident or
*reserved* (being computed here or arriving by copy). ``private_tokens`` holds per-request reservations that are
not shared (decode tokens, prompt tails without a hash). Resident blocks are either pinned (reference count > 0:
used by a running request or an in-flight copy) or on an LRU list; eviction takes the least recently used
unpinned *leaf* (a block with no resident child), which keeps ancestor closure.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from functools import partial
from itertools import compress, filterfalse, repeat
from operator import add, ge, sub

#: Chains shorter than this are pinned and unpinned by a plain loop (the C-level passes pay off above it).
_LOOP_BELOW = 8
_le_zero = partial(ge, 0)  # _le_zero(x) == (0 >= x)


def _consume(it: Iterable[object]) -> None:
    deque(it, maxlen=0)


class PrefixCache:
    """Args:
    capacity_tokens: KV budget of the replica in tokens (from the cost model).
    block_tokens: tokens per block.
    on_insert, on_evict: optional callbacks ``f(hash)`` (fleet-wide bookkeeping).
    """

    __slots__ = (
        "capacity_tokens",
        "block_tokens",
        "parent",
        "children",
        "refs",
        "lru",
        "reserved_blocks",
        "private_tokens",
        "on_insert",
        "on_evict",
        "evictions",
    )

    def __init__(
        self,
        capacity_tokens: int,
        block_tokens: int,
        on_insert: Callable[[Hashable], None] | None = None,
        on_evict: Callable[[Hashable], None] | None = None,
    ) -> None:
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.parent: dict[Hashable, Hashable | None] = {}
        self.children: dict[Hashable, int] = {}
        self.refs: dict[Hashable, int] = {}
        self.lru: OrderedDict[Hashable, None] = OrderedDict()
        self.reserved_blocks = 0
        self.private_tokens = 0
        self.on_insert = on_insert
        self.on_evict = on_evict
        self.evictions = 0

    # -- queries ----------------------------------------------------------------------------------------------
    def __contains__(self, h: Hashable) -> bool:
        return h in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    @property
    def used_tokens(self) -> int:
        return (len(self.parent) + self.reserved_blocks) * self.block_tokens + self.private_tokens

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def evictable_tokens(self) -> int:
        return len(self.lru) * self.block_tokens

    def match(self, chain: Sequence[Hashable]) -> int:
        """Number of leading blocks of ``chain`` resident here (binary search, relies on ancestor closure)."""
        parent = self.parent
        n = len(chain)
        if n == 0 or chain[0] not in parent:
            return 0
        if chain[n - 1] in parent:
            return n
        lo, hi = 1, n - 1  # chain[lo-1] resident, chain[hi] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in parent:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- space ------------------------------------------------------------------------------------------------
    def make_room(self, tokens: int) -> bool:
        """Evict LRU unpinned leaves until ``tokens`` more tokens fit. Returns False (evicting nothing) when even
        evicting every unpinned block would not make room."""
        need = tokens - self.free_tokens
        if need <= 0:
            return True
        if need > self.evictable_tokens:
            return False
        lru, children, parent = self.lru, self.children, self.parent
        evict = -(-need // self.block_tokens)  # every eviction frees one block
        while evict > 0:
            h, _ = lru.popitem(last=False)
            if children.get(h, 0):
                # Unreachable while callers commit pinned and unpin deepest-first (descendants then sit nearer the
                # LRU end than their ancestors); kept as a guard so eviction never breaks ancestor closure.
                lru[h] = None
                continue
            p = parent.pop(h)
            self.refs.pop(h, None)
            if p is not None and p in children:
                c = children[p] - 1
                if c:
                    children[p] = c
                else:
                    del children[p]
            self.evictions += 1
            evict -= 1
            if self.on_evict is not None:
                self.on_evict(h)
        return True

    # -- pinning ----------------------------------------------------------------------------------------------
    def pin(self, chain: Sequence[Hashable], n: int) -> None:
        """Pin the first ``n`` blocks of ``chain`` (all resident)."""
        refs, lru = self.refs, self.lru
        hs = chain[:n]
        if n <= _LOOP_BELOW or len(set(hs)) < len(hs):
            for h in hs:
                r = refs.get(h, 0)
                if r == 0:
                    lru.pop(h, None)
                refs[h] = r + 1
            return
        # the same in C-level passes (a chain of distinct hashes; refs never holds a 0)
        unpinned = list(filterfalse(refs.__contains__, hs))
        if unpinned:
            _consume(map(lru.pop, unpinned, repeat(None)))
        refs.update(zip(hs, map(add, map(refs.get, hs, repeat(0)), repeat(1)), strict=True))

    def unpin(self, chain: Sequence[Hashable], n: int) -> None:
        """Unpin the first ``n`` blocks of ``chain``; blocks reaching zero go to the MRU end, deepest first so
        that ancestors stay more recent than their descendants."""
        refs, lru, parent = self.refs, self.lru, self.parent
        hs = chain[n - 1 :: -1] if n > 0 else ()
        if n <= _LOOP_BELOW or len(set(hs)) < len(hs):
            for h in hs:
                r = refs.get(h, 0) - 1
                if r <= 0:
                    refs.pop(h, None)
                    if h in parent:
                        lru[h] = None
                else:
                    refs[h] = r
            return
        # the same in C-level passes; only the blocks reaching zero (in order) take a Python step
        left = list(map(sub, map(refs.get, hs, repeat(0)), repeat(1)))
        refs.update(zip(hs, left, strict=True))
        if min(left) <= 0:
            zeros = list(compress(hs, map(_le_zero, left)))
            _consume(map(refs.__delitem__, zeros))
            lru.update(zip(filter(parent.__contains__, zeros), repeat(None)))

    def touch(self, chain: Sequence[Hashable], n: int) -> None:
        """Mark the first ``n`` resident blocks as recently used (unpinned ones move to the MRU end)."""
        lru = self.lru
        for i in range(n - 1, -1, -1):
            h = chain[i]
            if h in lru:
                lru.move_to_end(h)

    # -- reservations and insertion ---------------------------------------------------------------------------
    def reserve_blocks(self, n: int) -> None:
        self.reserved_blocks += n

    def commit_block(self, h: Hashable, parent: Hashable | None, pinned: bool) -> None:
        """A reserved block became resident (computed here or arrived by copy)."""
        self.reserved_blocks -= 1
        if h in self.parent:  # already resident (computed twice): keep one copy, drop the reservation
            if pinned:
                self.pin((h,), 1)
            return
        self.parent[h] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        if pinned:
            self.refs[h] = self.refs.get(h, 0) + 1
        else:
            self.lru[h] = None
        if self.on_insert is not None:
            self.on_insert(h)

    def release_reservation(self, n: int) -> None:
        self.reserved_blocks -= n

    def flush(self) -> int:
        """Drop every unpinned block (SGLang ``/flush_cache``). Returns blocks dropped."""
        dropped = 0
        while self.lru:
            before = len(self.parent)
            self.make_room(self.free_tokens + self.evictable_tokens)
            dropped += before - len(self.parent)
            if before == len(self.parent):
                break
        return dropped
