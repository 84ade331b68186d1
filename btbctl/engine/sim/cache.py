"""Block-level prefix cache of one replica: what SGLang's radix cache does, at block granularity.

Blocks are identified by prefix-chained hashes (a block's hash identifies its whole prefix), so the radix tree
reduces to a dict ``hash -> parent hash``. Invariant kept at all times (*ancestor closure*): if a block is resident,
its parent is resident. Matching a chain is then a binary search over the chain (O(log n) dict look-ups).

Space is counted in tokens: every block occupies ``block_tokens`` tokens (page granularity) whether resident or
*reserved* (being computed here or arriving by copy). ``private_tokens`` holds per-request reservations that are
not shared (decode tokens, prompt tails without a hash). Resident blocks are either pinned (covered by a *hold*: a
running request or an in-flight copy) or on an LRU list; eviction takes the least recently used unpinned *leaf* (a
block with no resident child), which keeps ancestor closure.

Holds. A hold pins a chain prefix ``chain[:n]``. ``refs[h]`` counts the holds ending at ``h`` plus the pinned
children of ``h``, so a block is pinned (``h in refs``) exactly when a hold covers it, and the pinned blocks are
closed under ancestors; ``holds[root]`` counts the holds on chains starting at ``root``. Taking or releasing a hold
visits only the blocks whose pinned state changes (and one more), not the whole prefix.

Deferred release. When the last hold under a root is released, its chain would go to the MRU end of the LRU list
block by block, and the next request on the same prefix would take it back block by block. Instead the release is
kept aside (at most one): its blocks count as unpinned and evictable, sit logically at the MRU end (deepest first)
and keep their ``refs`` entries until :meth:`_settle` applies the release; a new hold on a prefix of that chain
takes it back in O(blocks not taken). Every operation that reads or changes the LRU list or a block the release
covers settles it first, so the observable state (``refs``, ``lru``, evictions) is that of the eager release.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import repeat

#: Runs of blocks shorter than this are pinned and unpinned by a plain loop (C-level passes pay off only above it on
#: CPython 3.11, whose specialised dict loops are as fast as map/zip for short runs).
_LOOP_BELOW = 64


def _consume(it: Iterable[object]) -> None:
    deque(it, maxlen=0)


class PrefixCache:
    """Args:
    capacity_tokens: KV budget of the replica in tokens (from the cost model).
    block_tokens: tokens per block.
    on_insert, on_evict: optional callbacks ``f(hash)`` (fleet-wide bookkeeping).
    on_insert_run, on_evict_run: optional callbacks ``f(hashes)`` for a run of distinct blocks, in order; when
        given they replace ``on_insert`` / ``on_evict`` for the runs :meth:`commit_run` and :meth:`make_room`
        report.
    """

    __slots__ = (
        "capacity_tokens",
        "block_tokens",
        "parent",
        "children",
        "_refs",
        "holds",
        "_lru",
        "_released",
        "reserved_blocks",
        "private_tokens",
        "on_insert",
        "on_evict",
        "on_insert_run",
        "on_evict_run",
        "evictions",
    )

    def __init__(
        self,
        capacity_tokens: int,
        block_tokens: int,
        on_insert: Callable[[Hashable], None] | None = None,
        on_evict: Callable[[Hashable], None] | None = None,
        on_insert_run: Callable[[Sequence[Hashable]], None] | None = None,
        on_evict_run: Callable[[Sequence[Hashable]], None] | None = None,
    ) -> None:
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self.parent: dict[Hashable, Hashable | None] = {}
        self.children: dict[Hashable, int] = {}
        self._refs: dict[Hashable, int] = {}
        self.holds: dict[Hashable, int] = {}  # root block -> holds on chains starting with it
        self._lru: OrderedDict[Hashable, None] = OrderedDict()
        # the deferred release (chain, n): chain[:n] unpinned, logically after every _lru entry (see the module doc)
        self._released: tuple[Sequence[Hashable], int] | None = None
        self.reserved_blocks = 0
        self.private_tokens = 0
        self.on_insert = on_insert
        self.on_evict = on_evict
        self.on_insert_run = on_insert_run
        self.on_evict_run = on_evict_run
        self.evictions = 0

    # -- queries ----------------------------------------------------------------------------------------------
    def __contains__(self, h: Hashable) -> bool:
        return h in self.parent

    def __len__(self) -> int:
        return len(self.parent)

    @property
    def refs(self) -> dict[Hashable, int]:
        """Pinned blocks: ``h -> holds ending at h + pinned children of h`` (read only)."""
        self._settle()
        return self._refs

    @property
    def lru(self) -> OrderedDict[Hashable, None]:
        """Unpinned resident blocks, least recently used first (read only)."""
        self._settle()
        return self._lru

    @property
    def used_tokens(self) -> int:
        return (len(self.parent) + self.reserved_blocks) * self.block_tokens + self.private_tokens

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    @property
    def evictable_tokens(self) -> int:
        released = self._released
        n = len(self._lru) if released is None else len(self._lru) + released[1]
        return n * self.block_tokens

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
        evicting every unpinned block would not make room. The evicted blocks are reported after the loop, in
        eviction order (LRU blocks are unpinned: none is in ``refs``)."""
        need = tokens - self.free_tokens
        if need <= 0:
            return True
        if need > self.evictable_tokens:
            return False
        lru, children, parent = self._lru, self.children, self.parent
        evict = -(-need // self.block_tokens)  # every eviction frees one block
        if evict > len(lru):
            self._settle()
        popitem = lru.popitem
        gone: list[Hashable] = []
        left = evict
        while left:
            h, _ = popitem(last=False)
            if h in children:  # entries are dropped at zero
                # Unreachable while callers commit pinned and unpin deepest-first (descendants then sit nearer the
                # LRU end than their ancestors); kept as a guard so eviction never breaks ancestor closure.
                self._settle()
                lru[h] = None
                continue
            p = parent.pop(h)
            if p is not None:
                c = children[p] - 1
                if c:
                    children[p] = c
                else:
                    del children[p]
            gone.append(h)
            left -= 1
        self.evictions += evict
        if self.on_evict_run is not None:
            self.on_evict_run(gone)
        elif self.on_evict is not None:
            for h in gone:
                self.on_evict(h)
        return True

    # -- pinning ----------------------------------------------------------------------------------------------
    def pin(self, chain: Sequence[Hashable], n: int) -> None:
        """Take a hold on the first ``n`` blocks of ``chain`` (all resident). Blocks that were unpinned leave the
        LRU list."""
        if n <= 0:
            return
        refs, holds = self._refs, self.holds
        root = chain[0]
        held = holds.get(root, 0)
        holds[root] = held + 1
        released = self._released
        if released is not None and released[0][0] == root:
            rchain, rn = released
            if not held and n <= rn and rchain[n - 1] == chain[n - 1]:
                # a prefix of the deferred release: take it back, release only the rest (the eager order)
                self._released = None
                if n < rn:
                    self._unpin_run(rchain[rn - 1 : n - 1 : -1])
                return
            self._settle()
        tip = chain[n - 1]
        r = refs.get(tip, 0)
        if r:
            refs[tip] = r + 1
            return
        # chain[:j] pinned, chain[j:n] not (ancestor closure of the pinned blocks): find j by binary search
        lo, hi = 0, n - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if chain[mid] in refs:
                lo = mid + 1
            else:
                hi = mid
        self._pin_run(chain[lo:n])
        if lo:
            above = chain[lo - 1]
            refs[above] = refs.get(above, 0) + 1

    def _pin_run(self, hs: Sequence[Hashable]) -> None:
        """Unpinned blocks ``hs`` (a chain run, root first) become pinned by one hold ending at the last."""
        refs, lru = self._refs, self._lru
        if len(hs) < _LOOP_BELOW:
            for h in hs:
                lru.pop(h, None)
                refs[h] = 1
            return
        _consume(map(lru.pop, hs, repeat(None)))
        refs.update(zip(hs, repeat(1)))

    def unpin(self, chain: Sequence[Hashable], n: int) -> None:
        """Release a hold on the first ``n`` blocks of ``chain``; blocks left unpinned go to the MRU end, deepest
        first, so that ancestors stay more recent than their descendants."""
        if n <= 0:
            return
        released = self._released
        if released is not None and released[0][0] == chain[0]:
            self._settle()  # no hold is under that root: only a stray unpin gets here
        refs, holds = self._refs, self.holds
        tip = chain[n - 1]
        r = refs.get(tip, 0)
        if not r:
            return  # not pinned: no hold to release
        root = chain[0]
        left = holds.get(root, 0) - 1
        if left > 0:
            holds[root] = left
        else:
            holds.pop(root, None)
        if r > 1:
            refs[tip] = r - 1
            return
        if left <= 0:
            # the last hold under its root: every block of chain[:n] has count 1; defer the release
            self._settle()
            self._released = (chain, n)
            return
        # the blocks whose count is 1 from the tip up lose their only pin: chain[j:n]
        self._settle()
        j = n - 1
        while j and refs.get(chain[j - 1], 0) == 1:
            j -= 1
        self._unpin_run(chain[n - 1 : j - 1 : -1] if j else chain[n - 1 :: -1])
        if j:
            above = chain[j - 1]
            r = refs.get(above, 0)
            if r > 1:
                refs[above] = r - 1

    def _unpin_run(self, hs: Sequence[Hashable]) -> None:
        """Pinned blocks ``hs`` (deepest first) lose their last pin: to the MRU end in that order."""
        refs, lru, parent = self._refs, self._lru, self.parent
        if len(hs) < _LOOP_BELOW:
            for h in hs:
                refs.pop(h, None)
                if h in parent:
                    lru[h] = None
            return
        _consume(map(refs.pop, hs, repeat(None)))
        lru.update(zip(filter(parent.__contains__, hs), repeat(None)))

    def _settle(self) -> None:
        """Apply the deferred release, if any."""
        released = self._released
        if released is not None:
            self._released = None
            chain, n = released
            self._unpin_run(chain[n - 1 :: -1])

    def touch(self, chain: Sequence[Hashable], n: int) -> None:
        """Mark the first ``n`` resident blocks as recently used (unpinned ones move to the MRU end)."""
        self._settle()
        lru = self._lru
        for i in range(n - 1, -1, -1):
            h = chain[i]
            if h in lru:
                lru.move_to_end(h)

    # -- reservations and insertion ---------------------------------------------------------------------------
    def reserve_blocks(self, n: int) -> None:
        self.reserved_blocks += n

    def commit_block(self, h: Hashable, parent: Hashable | None, pinned: bool) -> None:
        """A reserved block became resident (computed here or arrived by copy). ``pinned``: the hold ending at
        ``parent`` (a new hold when ``parent`` is None) now ends at ``h``."""
        self.reserved_blocks -= 1
        refs = self._refs
        if pinned and parent is None:  # a new hold on the root block
            self.holds[h] = self.holds.get(h, 0) + 1
        if h in self.parent:  # already resident (computed twice): keep one copy, drop the reservation
            if pinned:
                self._settle()
                r = refs.get(h, 0)
                refs[h] = r + 1
                if not r:
                    self._lru.pop(h, None)  # newly pinned: parent's count unchanged (one hold less, one child more)
                elif parent is not None:
                    r = refs.get(parent, 0)
                    if r > 1:
                        refs[parent] = r - 1
            return
        self.parent[h] = parent
        if parent is not None:
            self.children[parent] = self.children.get(parent, 0) + 1
        if pinned:
            refs[h] = refs.get(h, 0) + 1
        else:
            self._settle()
            self._lru[h] = None
        if self.on_insert is not None:
            self.on_insert(h)

    def commit_run(self, chain: Sequence[Hashable], start: int, stop: int) -> None:
        """``commit_block(chain[k], chain[k - 1], pinned=True)`` for ``k`` in ``range(start, stop)`` in one loop:
        the hold ending at ``chain[start - 1]`` (a new one when ``start`` is 0) extends over the run. New blocks
        are reported after the loop, in order."""
        parent, children, refs = self.parent, self.children, self._refs
        self.reserved_blocks -= stop - start
        if stop <= start:
            return
        if start:
            p = chain[start - 1]
        else:  # a new hold on the root block
            p = None
            self.holds[chain[0]] = self.holds.get(chain[0], 0) + 1
        new: list[Hashable] = []
        p_new = False  # p was committed by this loop: no children yet
        for h in chain[start:stop]:
            if h in parent:  # already resident (computed twice): keep one copy, the hold moves on to it
                self._settle()
                r = refs.get(h, 0)
                refs[h] = r + 1
                if not r:
                    self._lru.pop(h, None)
                elif p is not None:
                    r = refs.get(p, 0)
                    if r > 1:
                        refs[p] = r - 1
                p_new = False
            else:
                parent[h] = p
                if p_new:
                    children[p] = 1
                elif p is not None:
                    children[p] = children.get(p, 0) + 1
                refs[h] = 1  # not resident, so not pinned
                new.append(h)
                p_new = True
            p = h
        if not new:
            return
        if self.on_insert_run is not None:
            self.on_insert_run(new)
        elif self.on_insert is not None:
            for h in new:
                self.on_insert(h)

    def release_reservation(self, n: int) -> None:
        self.reserved_blocks -= n

    def flush(self) -> int:
        """Drop every unpinned block (SGLang ``/flush_cache``). Returns blocks dropped."""
        dropped = 0
        self._settle()
        while self._lru:
            before = len(self.parent)
            self.make_room(self.free_tokens + self.evictable_tokens)
            dropped += before - len(self.parent)
            if before == len(self.parent):
                break
        return dropped
