"""``cache_aware``: the SGLang router's cache-aware rule as shipped in ``sglang-router`` 0.3.2.

Rule (REFERENCE.md s4; smg-project/smg ``src/policies/cache_aware.rs`` at the 0.3.2 release), per request:

1. ``load(r)`` = requests the router itself has in flight to replica ``r`` (``view.load``).
2. If ``max_load - min_load > balance_abs_threshold`` **and** ``max_load > balance_rel_threshold * min_load``
   (the fleet is imbalanced): send to the least-loaded replica (ties: the first, i.e. lowest index).
3. Otherwise match the prompt against the router's own approximate prefix tree; if
   ``matched tokens / input tokens > cache_threshold`` send to the replica that created the deepest matched node
   (if that replica's entry was evicted there, the node's oldest remaining tenant); else (a miss) to the
   least-loaded replica (ties: the first).
4. In every case insert the prompt into the tree under the chosen replica.

Read from the released source (the ``sglang-router`` 0.3.2 sdist on PyPI; ``src/policies/cache_aware.rs`` and
``src/policies/tree.rs`` of that release; read, not copied):

* imbalance: ``cache_aware.rs:363-372`` (min and max over every worker's load, then both thresholds), routed by
  ``select_worker_min_load`` (``cache_aware.rs:306-310``: ``min_by_key`` over the healthy workers, which keeps the
  first of equal minima) and still inserted into the tree (``cache_aware.rs:312-320``);
* hit: ``cache_aware.rs:403-409``, the matched node's cached tenant (``tree.rs:566-599``), set to the tenant that
  created the node (``tree.rs:409``), kept when the node is split (``tree.rs:449-451``) and replaced by another of
  the node's tenants only once the creator's entry is gone (``tree.rs:573-585``: whichever its hash map yields
  first; here the oldest remaining tenant);
* miss: ``cache_aware.rs:410-416``, ``min_by_key`` over the healthy workers' loads: the least-loaded worker, the
  first in the worker list among equals. The file's header comment (``cache_aware.rs:29-30``) still says a miss
  goes to "the worker with smallest tree size"; that was the rule of the router before its policies moved to
  ``src/policies/`` (``tree.get_smallest_tenant()`` in the old ``router.rs``), not what 0.3.2 runs;
* a hit whose tenant is unhealthy removes it from the tree and goes to the first healthy worker
  (``cache_aware.rs:442-461``; here a fleet view has no unhealthy replicas, the gateway overrides the choice).

So on a fleet with equal loads every miss goes to the first worker: 20 unrelated sequential prompts on an idle
4-worker fleet all land on worker 0. That is the shipped rule and this policy keeps it (the evidence, not a bug of
ours); ``btb``'s fallback (:class:`~btbctl.engine.policies.btb.Btb`) uses the same rule with random ties, as the
published BTB simulator does (REFERENCE.md s2), and ``cache_aware_spill`` models smg 1.13, whose ties are random.

Thresholds (the router's CLI defaults): ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64,
``balance_rel_threshold`` 1.5; eviction every 60 s down to ``max_tree_size`` = 2**26 characters per worker.

The tree. The router matches characters of the request text; here the tree is over **block hashes** (the only
prompt content a trace has). Because hashes are prefix-chained (the ``k``-th hash identifies the whole prefix
through block ``k``), the tree is a dict ``block hash -> node`` and a match is the longest leading run of the
chain whose hashes are known; since the tree is prefix-closed (see :meth:`BlockPrefixTree.match`), a binary
search finds it in O(log blocks) dict lookups. Matched tokens = ``min(matched blocks x block_tokens,
input_tokens)`` (every block is full except possibly the last, so a fully matched prompt has ratio 1). Each node
records its creator and all its tenants (replicas that inserted it), so the same tree serves the spill variant.
Eviction is per tenant, least recently used first, leaves before their parents, every ``eviction_interval_s``
seconds of the time passed in (60 s, as the router), down to ``max_blocks_per_worker``; as a memory guard a
tenant that grows past twice the bound is trimmed at once. The default bound converts the router's 2**26
characters at about 4 characters per token (a common rule of thumb for English text with BPE tokenizers; an
approximation) into blocks: ``2**24 // block_tokens`` (65,536 blocks of 256 tokens).

Consequence (REFERENCE.md s4): a hot prefix sticks to its first replica until the fleet-wide spread passes 64
requests.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from itertools import repeat

from btbctl.engine.chains import DEFAULT_BLOCK_TOKENS, leading_run
from btbctl.engine.constants import (
    CACHE_TREE_MAX_BLOCKS,
    CACHE_TREE_MAX_BYTES,
    MIN_CACHE_TREE_BYTES,
    BtbConstants,
)
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies.base import FleetView, Policy, Route
from btbctl.engine.trace.model import Request

#: ``--cache-threshold`` default of sglang-router 0.3.2 (REFERENCE.md s4).
CACHE_THRESHOLD = 0.3
#: ``--balance-abs-threshold`` default of sglang-router 0.3.2 (REFERENCE.md s4).
BALANCE_ABS_THRESHOLD = 64
#: ``--balance-rel-threshold`` default of sglang-router 0.3.2 (REFERENCE.md s4).
BALANCE_REL_THRESHOLD = 1.5
#: ``--eviction-interval`` default of sglang-router 0.3.2, seconds (REFERENCE.md s4).
EVICTION_INTERVAL_S = 60.0
#: ``--max-tree-size`` default of sglang-router 0.3.2, characters per worker (REFERENCE.md s4).
MAX_TREE_CHARS = 2**26
#: Characters per token used to turn :data:`MAX_TREE_CHARS` into blocks (rule of thumb; an approximation).
CHARS_PER_TOKEN = 4
#: Estimated bytes one tree node retains, with its first tenant's entry counted in :data:`ENTRY_BYTES`: its slot in
#: the node dict, the node object and its tenant dict, its slot in the fleet-wide LRU order, and the block hash
#: itself taken as a 16-character hex string (the gateway's xxh3 ids; the simulators' integer ids are smaller, so
#: there it overestimates). Measured with ``tracemalloc`` on CPython 3.11, 64-bit, by
#: ``python benchmarks/bench_ca_tree_memory.py --measure`` (64k and 256k nodes of unique 64-block prompts: 406-452
#: bytes, of which 72 the hash; with one tenant's entry 530 either way, the dicts' growth steps moving bytes between
#: the two figures); the chains waiting to be settled are transient and left out (at most
#: :data:`SINCE_SLACK_BLOCKS` references).
NODE_BYTES = 420
#: Estimated bytes of one (node, tenant) entry: its slot in the tenant's LRU order and in the node's tenant dict
#: (measured as :data:`NODE_BYTES`: 78-125 bytes).
ENTRY_BYTES = 120
#: Block references the chains waiting to be settled into the LRU orders may hold (per-tenant and fleet lists
#: together) before they are settled anyway: their memory stays bounded whatever the workload (hot prompts
#: inserted again and again never trip an eviction). A product choice: 2**17 references are 1 MiB of slots.
SINCE_SLACK_BLOCKS = 1 << 17


def default_max_blocks_per_worker(block_tokens: int) -> int:
    """The router's per-worker tree bound (:data:`MAX_TREE_CHARS`) in blocks of ``block_tokens`` tokens."""
    return max(1, MAX_TREE_CHARS // CHARS_PER_TOKEN // block_tokens)


class _Node:
    __slots__ = ("creator", "tenants")

    def __init__(self, creator: int) -> None:
        self.creator = creator
        self.tenants: dict[int, None] = {creator: None}  # insertion order = oldest tenant first


def _settle_into(
    lru: OrderedDict[Hashable, None],
    since: list[Sequence[Hashable]],
    keep: Callable[[Hashable], bool] | None,
) -> None:
    """Apply the chains of ``since`` (oldest first) to ``lru`` (least recently used first) as if each had refreshed
    all its blocks, deepest first; blocks of those chains failing ``keep`` are left out.

    Walking the chains newest first, a chain's blocks not met in a newer chain are a suffix of it (a newer chain
    holding a block holds its ancestors too), found by binary search; they rank by that chain's refresh order (its
    root most recent) and move to the most recent end in that order. Blocks no chain touched keep their order,
    before all of them. Cost: O(log len(chain)) per chain plus O(1) per block new to the walk, whatever the size of
    ``lru``."""
    seen: dict[Hashable, None] = {}
    recent: list[Hashable] = []  # most recent first
    for chain in reversed(since):
        n = len(chain)
        lo = leading_run(chain, seen.__contains__)
        if lo == n:
            continue
        run = chain[lo:] if lo else chain
        seen.update(zip(run, repeat(None)))
        recent.extend(run if keep is None else filter(keep, run))
    recent.reverse()
    deque(map(lru.pop, recent, repeat(None)), maxlen=0)
    lru.update(zip(recent, repeat(None)))


class BlockPrefixTree:
    """The router-side approximate prefix tree over prefix-chained block hashes, shared by all replicas.

    Args:
        n_replicas: replicas (tenants are ``0 .. n_replicas - 1``).
        max_blocks_per_worker: per-tenant bound enforced by :meth:`evict` (>= 1).
        max_blocks: bound on the whole tree, all tenants together, in nodes (blocks); default
            :data:`~btbctl.engine.constants.CACHE_TREE_MAX_BLOCKS`.
        max_bytes: bound on :meth:`estimated_bytes`, all tenants together; default
            :data:`~btbctl.engine.constants.CACHE_TREE_MAX_BYTES`.

    Nodes are keyed by block hash; a node's tenants are the replicas that inserted a prompt through it, in the
    order they did (the creator first unless its entry was evicted). The tree reflects routing decisions, not
    the replicas' real caches (it is "approximate" exactly as the router's).

    Two bounds. The router's per-tenant one (:meth:`evict`, ``max_blocks_per_worker``) multiplies by the fleet
    size; the fleet bound (``max_blocks`` nodes and ``max_bytes`` estimated bytes) holds for the whole tree: as
    soon as an insert passes either, whole nodes (every tenant's entry on them) are dropped least recently used
    first across all tenants (a node's use: the latest prompt inserted through it, by any tenant), leaves before
    their parents, until both are back under 7/8 of their bound (so the settling below is paid once per 1/8 of
    the bound; O(1) amortized per evicted entry). The tree is never over either bound between calls. Until it
    reaches them nothing differs from the per-tenant rule alone.
    """

    def __init__(
        self,
        n_replicas: int,
        max_blocks_per_worker: int,
        *,
        max_blocks: int = CACHE_TREE_MAX_BLOCKS,
        max_bytes: int = CACHE_TREE_MAX_BYTES,
    ) -> None:
        self.nodes: dict[Hashable, _Node] = {}
        # Per tenant, its blocks least recently used first as of the last settling, then the chains inserted since
        # (each one refreshed all its blocks, deepest first); the order is worked out only when an eviction needs
        # it, or once the chains waiting hold SINCE_SLACK_BLOCKS block references (see _settle).
        self._lru: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(n_replicas)]
        self._since: list[list[Sequence[Hashable]]] = [[] for _ in range(n_replicas)]
        self._blocks = [0] * n_replicas  # per tenant: blocks recorded (nodes listing it as a tenant)
        # The same for the whole tree (every node, by its latest use by any tenant), for the fleet bound.
        self._fleet_lru: OrderedDict[Hashable, None] = OrderedDict()
        self._fleet_since: list[Sequence[Hashable]] = []
        self._pending = 0  # block references in the chains waiting, per-tenant and fleet lists together
        self._entries = 0  # (node, tenant) entries: sum of _blocks
        self.max_blocks_per_worker = max_blocks_per_worker
        self.max_blocks = max_blocks
        self.max_bytes = max_bytes
        self.evicted_blocks = 0
        self.fleet_evicted_blocks = 0

    def set_bounds(self, *, max_blocks: int | None = None, max_bytes: int | None = None) -> None:
        """Change the fleet bound (None: keep that one) and enforce it now."""
        if max_blocks is not None:
            self.max_blocks = max_blocks
        if max_bytes is not None:
            self.max_bytes = max_bytes
        if len(self.nodes) > self.max_blocks or self.estimated_bytes() > self.max_bytes:
            self._evict_fleet()

    def bounds(self) -> tuple[int, int]:
        """The fleet bound: ``(max_blocks, max_bytes)``."""
        return self.max_blocks, self.max_bytes

    def estimated_bytes(self) -> int:
        """What the tree retains, estimated: :data:`NODE_BYTES` per node plus :data:`ENTRY_BYTES` per
        (node, tenant) entry (see those constants for the source)."""
        return len(self.nodes) * NODE_BYTES + self._entries * ENTRY_BYTES

    def entries(self) -> int:
        """(node, tenant) entries: blocks recorded, summed over the tenants."""
        return self._entries

    def match(self, chain: Sequence[Hashable]) -> tuple[int, _Node | None]:
        """The longest known prefix of ``chain``: ``(matched blocks, deepest matched node or None)``.

        Cost: O(log len(chain)) dict lookups. Binary search is valid because the tree is *prefix-closed*: a
        prompt's chain always starts at block 0 and :meth:`insert` refreshes a tenant's blocks deepest first, so a
        block is never less recently used than its descendants for any tenant; LRU eviction therefore removes
        descendants before their ancestors, and a known block implies all its ancestors are known.
        """
        nodes = self.nodes
        n = len(chain)
        if n == 0:
            return 0, None
        node = nodes.get(chain[-1])
        if node is not None:
            return n, node
        lo = leading_run(chain, nodes.__contains__)
        return (lo, nodes[chain[lo - 1]]) if lo else (0, None)

    def match_linear(self, chain: Sequence[Hashable]) -> tuple[int, _Node | None]:
        """:meth:`match` by a forward walk (O(matched blocks)); the reference the binary search must agree with."""
        nodes = self.nodes
        node = None
        n = 0
        for h in chain:
            nxt = nodes.get(h)
            if nxt is None:
                break
            node = nxt
            n += 1
        return n, node

    @staticmethod
    def owner(node: _Node) -> int:
        """The replica a hit on ``node`` goes to under the 0.3.2 rule: its creator, or its oldest tenant."""
        if node.creator in node.tenants:
            return node.creator
        return next(iter(node.tenants))

    def insert(self, chain: Sequence[Hashable], replica: int) -> None:
        """Record that ``replica`` was sent a prompt with block hashes ``chain``: every block of it becomes the
        replica's most recently used, deepest first (parents end up more recent than children, so eviction takes
        leaves first). O(log len(chain) + blocks new to the replica); the LRU order itself is settled lazily."""
        if not chain:
            return
        nodes = self.nodes
        known, _ = self.match(chain)
        # the replica's blocks are prefix-closed too (inserted as whole chains, evicted leaves first): it holds
        # chain[:have], found by binary search over the known prefix
        have = 0
        if known and replica in nodes[chain[known - 1]].tenants:
            have = known
        elif known and replica in nodes[chain[0]].tenants:
            lo, hi = 1, known - 1  # chain[lo - 1] is the replica's, chain[hi] is not
            while lo < hi:
                mid = (lo + hi) // 2
                if replica in nodes[chain[mid]].tenants:
                    lo = mid + 1
                else:
                    hi = mid
            have = lo
        added = 0
        for k in range(len(chain) - 1, have - 1, -1):
            h = chain[k]
            node = nodes.get(h)
            if node is None:
                nodes[h] = _Node(replica)
                added += 1
            elif replica not in node.tenants:
                node.tenants[replica] = None
                added += 1
        self._since[replica].append(chain)
        self._fleet_since.append(chain)
        self._pending += len(chain)
        self._blocks[replica] += added
        self._entries += added
        if self._blocks[replica] > 2 * self.max_blocks_per_worker:
            self._evict_tenant(replica)
        if len(self.nodes) > self.max_blocks or self.estimated_bytes() > self.max_bytes:
            self._evict_fleet()
        elif self._pending > SINCE_SLACK_BLOCKS:
            self._settle_all()  # memory: the chains waiting to be settled hold a bounded number of references

    def _settle(self, replica: int) -> OrderedDict[Hashable, None]:
        """The replica's blocks, least recently used first, with the chains inserted since the last call applied."""
        since = self._since[replica]
        lru = self._lru[replica]
        if since:
            _settle_into(lru, since, None)
            since.clear()
        return lru

    def _settle_fleet(self) -> OrderedDict[Hashable, None]:
        """Every node, least recently used first (by any tenant), with the chains inserted since applied; blocks
        of those chains that are no longer nodes (evicted by the per-tenant rule meanwhile) are left out."""
        since = self._fleet_since
        lru = self._fleet_lru
        if since:
            _settle_into(lru, since, self.nodes.__contains__)
            since.clear()
        return lru

    def _settle_all(self) -> None:
        for r in range(len(self._lru)):
            self._settle(r)
        self._settle_fleet()
        self._pending = 0

    def evict(self) -> None:
        """Trim every tenant to ``max_blocks_per_worker`` blocks, least recently used first."""
        for r in range(len(self._lru)):
            self._evict_tenant(r)

    def _evict_tenant(self, replica: int) -> None:
        bound = self.max_blocks_per_worker
        if self._blocks[replica] <= bound:
            return
        lru = self._settle(replica)
        nodes = self.nodes
        fleet_lru = self._fleet_lru
        dropped = 0
        while len(lru) > bound:
            h, _ = lru.popitem(last=False)
            node = nodes[h]
            del node.tenants[replica]
            if not node.tenants:
                del nodes[h]
                fleet_lru.pop(h, None)  # not there yet if only a chain waiting in _fleet_since has it
            dropped += 1
        self.evicted_blocks += dropped
        self._entries -= dropped
        self._blocks[replica] = len(lru)

    def _evict_fleet(self) -> None:
        """Drop whole nodes, least recently used first across all tenants, until the tree is under 7/8 of both
        fleet bounds. Every tenant's order is settled first so each dropped entry leaves its tenant's order in
        O(1)."""
        self._settle_all()
        order = self._fleet_lru
        nodes = self.nodes
        lrus = self._lru
        blocks = self._blocks
        max_nodes = self.max_blocks - self.max_blocks // 8
        max_bytes = self.max_bytes - self.max_bytes // 8
        entries = self._entries
        while order and (len(nodes) > max_nodes or len(nodes) * NODE_BYTES + entries * ENTRY_BYTES > max_bytes):
            h, _ = order.popitem(last=False)
            node = nodes.pop(h)
            for t in node.tenants:
                del lrus[t][h]
                blocks[t] -= 1
            entries -= len(node.tenants)
            self.evicted_blocks += len(node.tenants)
            self.fleet_evicted_blocks += 1
        self._entries = entries

    def tenant_blocks(self, replica: int) -> int:
        """Blocks recorded for ``replica``."""
        return self._blocks[replica]

    def __len__(self) -> int:
        return len(self.nodes)


class CacheAware(Policy[FleetView]):
    """The sglang-router 0.3.2 cache-aware rule over a block-hash tree (see the module docstring).

    Args:
        n_replicas: fleet size.
        rng: seeded random source (ties when ``random_ties``; the router's own ties go to the first replica).
        constants: BTB constants (unused).
        cache_threshold: minimum match ratio (exclusive) for affinity routing, in [0, 1] (default 0.3).
        balance_abs_threshold: requests; imbalance needs ``max - min`` above it (default 64).
        balance_rel_threshold: imbalance needs ``max > rel x min`` (default 1.5, >= 1).
        block_tokens: tokens per block of the requests' hash chains (default 256; :meth:`configure` may set it).
        max_blocks_per_worker: per-replica tree bound in blocks (default: :func:`default_max_blocks_per_worker`).
        tree_max_blocks: bound on the whole tree, all replicas together, in blocks (default
            :data:`~btbctl.engine.constants.CACHE_TREE_MAX_BLOCKS`; see :class:`BlockPrefixTree`).
        tree_max_bytes: bound on the whole tree's estimated bytes (default
            :data:`~btbctl.engine.constants.CACHE_TREE_MAX_BYTES`).
        eviction_interval_s: seconds of (passed-in) time between evictions (default 60).
        random_ties: break ties between equally loaded replicas (misses, imbalance) with ``rng`` instead of taking
            the first (default False: the router's rule; ``btb``'s fallback sets it).

    Raises:
        ConfigError: a threshold or bound out of range.
    """

    name = "cache_aware"
    summary = "SGLang router 0.3.2: longest prefix match (ratio > 0.3) unless load spread > 64 and > 1.5x"

    def __init__(
        self,
        n_replicas: int,
        rng: random.Random,
        constants: BtbConstants | None = None,
        *,
        cache_threshold: float = CACHE_THRESHOLD,
        balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_blocks_per_worker: int | None = None,
        eviction_interval_s: float = EVICTION_INTERVAL_S,
        random_ties: bool = False,
        tree_max_blocks: int = CACHE_TREE_MAX_BLOCKS,
        tree_max_bytes: int = CACHE_TREE_MAX_BYTES,
    ) -> None:
        super().__init__(n_replicas, rng, constants)
        self.random_ties = random_ties
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError("cache_threshold", f"must be within [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0:
            raise ConfigError("balance_abs_threshold", f"must be >= 0, got {balance_abs_threshold!r}")
        if not (balance_rel_threshold >= 1.0 and math.isfinite(balance_rel_threshold)):
            raise ConfigError("balance_rel_threshold", f"must be finite and >= 1, got {balance_rel_threshold!r}")
        if max_blocks_per_worker is not None and max_blocks_per_worker < 1:
            raise ConfigError("max_blocks_per_worker", f"must be >= 1, got {max_blocks_per_worker!r}")
        if not eviction_interval_s > 0:
            raise ConfigError("eviction_interval_s", f"must be > 0, got {eviction_interval_s!r}")
        check_tree_bounds(tree_max_blocks, tree_max_bytes)
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.eviction_interval_s = float(eviction_interval_s)
        self._explicit_max = max_blocks_per_worker
        self.block_tokens = self._check_block_tokens(block_tokens)
        self.tree = BlockPrefixTree(
            n_replicas,
            max_blocks_per_worker or default_max_blocks_per_worker(self.block_tokens),
            max_blocks=tree_max_blocks,
            max_bytes=tree_max_bytes,
        )
        self._next_evict_s: float | None = None
        self._hits = 0
        self._misses = 0
        self._imbalanced = 0

    @staticmethod
    def _check_block_tokens(block_tokens: int) -> int:
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError("block_tokens", f"must be an integer >= 1, got {block_tokens!r}")
        return block_tokens

    def configure(self, *, block_tokens: int | None = None) -> None:
        """Set the workload's block size (tokens per hash); the default tree bound follows it."""
        if block_tokens is None:
            return
        self.block_tokens = self._check_block_tokens(block_tokens)
        if self._explicit_max is None:
            self.tree.max_blocks_per_worker = default_max_blocks_per_worker(self.block_tokens)

    # -- shared pieces ------------------------------------------------------------------------------------------

    def match_ratio(self, req: Request, matched_blocks: int) -> float:
        """Matched tokens / input tokens for ``matched_blocks`` leading blocks of ``req`` (0 for empty input)."""
        if matched_blocks <= 0 or req.input_tokens <= 0:
            return 0.0
        return min(matched_blocks * self.block_tokens, req.input_tokens) / req.input_tokens

    def maybe_evict(self, now_s: float) -> None:
        """Run the periodic eviction when ``eviction_interval_s`` has passed since the previous one."""
        if self._next_evict_s is None:
            self._next_evict_s = now_s + self.eviction_interval_s
        elif now_s >= self._next_evict_s:
            self.tree.evict()
            self._next_evict_s = now_s + self.eviction_interval_s

    def record(self, chain: Sequence[Hashable], replica: int, now_s: float) -> None:
        """Insert ``chain`` under ``replica`` without routing (for a policy that chose the replica itself)."""
        self.maybe_evict(now_s)
        self.tree.insert(chain, replica)

    # -- the rule -----------------------------------------------------------------------------------------------

    def tree_holder(self) -> CacheAware:
        """It routes by its own prefix tree."""
        return self

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        return Route(self.choose(req, view, now_s))

    def imbalanced(self, loads: Sequence[int]) -> bool:
        """Whether ``loads`` (one per replica) trip the rule's imbalance switch: ``max - min >
        balance_abs_threshold`` and ``max > balance_rel_threshold x min``."""
        max_load = max(loads)
        min_load = min(loads)
        return max_load - min_load > self.balance_abs_threshold and max_load > min_load * self.balance_rel_threshold

    def least_loaded(self, loads: Sequence[int]) -> int:
        """The replica with the lowest load: the first of equals, or a random one with ``random_ties``."""
        low = min(loads)
        if not self.random_ties:
            return loads.index(low)
        tied = [r for r, x in enumerate(loads) if x == low]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def choose(self, req: Request, view: FleetView, now_s: float) -> int:
        """The rule's replica for ``req`` (inserted into the tree under it)."""
        self.maybe_evict(now_s)
        loads = [view.load(r) for r in range(self.n_replicas)]
        chain = req.block_hashes
        if self.imbalanced(loads):
            self._imbalanced += 1
            choice = self.least_loaded(loads)
        else:
            matched, node = self.tree.match(chain)
            if node is not None and self.match_ratio(req, matched) > self.cache_threshold:
                self._hits += 1
                choice = BlockPrefixTree.owner(node)
            else:
                self._misses += 1
                choice = self.least_loaded(loads)
        self.tree.insert(chain, choice)
        return choice

    def record_imbalanced(self) -> None:
        """Count a route made by the imbalance switch on behalf of a policy that uses this one as its fallback."""
        self._imbalanced += 1

    def stats(self) -> dict[str, int]:
        """``hits`` (affinity routes), ``misses`` (ratio at or under the threshold), ``imbalanced`` (shortest-queue
        routes), ``tree_blocks`` (nodes now), ``tree_bytes`` (their estimated bytes), ``evicted_blocks`` (tenant
        entries evicted, by either bound), ``fleet_evicted_blocks`` (nodes dropped by the whole-tree bound)."""
        return {
            "hits": self._hits,
            "misses": self._misses,
            "imbalanced": self._imbalanced,
            "tree_blocks": len(self.tree),
            "tree_bytes": self.tree.estimated_bytes(),
            "evicted_blocks": self.tree.evicted_blocks,
            "fleet_evicted_blocks": self.tree.fleet_evicted_blocks,
        }


def check_tree_bounds(max_blocks: object, max_bytes: object) -> None:
    """Raise a one-line :class:`ConfigError` naming ``cache_tree_max_blocks`` / ``cache_tree_max_bytes`` when
    a whole-tree bound is not an integer in range."""
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
        raise ConfigError("cache_tree_max_blocks", f"must be an integer >= 1, got {max_blocks!r}")
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < MIN_CACHE_TREE_BYTES:
        raise ConfigError(
            "cache_tree_max_bytes", f"must be an integer >= {MIN_CACHE_TREE_BYTES} (1 MiB), got {max_bytes!r}"
        )
