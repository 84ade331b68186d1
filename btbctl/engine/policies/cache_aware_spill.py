"""``cache_aware_spill``: the SGLang router's cache-aware rule with the per-request spill gate of ``smg`` 1.13.0.

Rule (REFERENCE.md s4; read from the ``smg`` 1.13.0 source distribution, ``model_gateway/src/policies/
cache_aware.rs`` and ``crates/kv_index``), per request:

1. ``load(r)`` = requests the router has in flight to replica ``r``; ``avg`` = mean load over the fleet.
   There is no fleet-wide request-count imbalance switch any more (1.13 keeps only a KV-usage switch, off by
   default, which this policy does not model).
2. Match the prompt against the router's approximate tree (the same block-hash tree as ``cache_aware``). If
   ``matched tokens / input tokens > cache_threshold`` (a hit), the candidates are up to
   ``MATCHED_TENANTS_CAP`` = 8 tenants of the deepest matched node (every replica the router has sent that prefix
   to, oldest first). A candidate is **gated** when ``load > avg x balance_rel_threshold`` **and**
   ``load > avg + margin(avg)``, with ``margin(avg) = min(balance_abs_threshold, max(4, ceil(2 x sqrt(avg))))``:
   the absolute margin is capped at two standard deviations of a Poisson in-flight count at the fleet mean and
   floored at 4 requests (``MIN_ABSOLUTE_MARGIN``) unless the configured absolute threshold is lower still.
   The request goes to the least-loaded non-gated candidate (ties random); if every candidate is gated it
   **spills** to the least-loaded non-gated replica of the fleet (any replica if all are gated; ties random),
   which recomputes the prefix (no KV moves).
3. On a miss: the least-loaded replica (ties random).
4. Insert the prompt into the tree under the chosen replica, so a spill target becomes a new tenant of the prefix
   and later requests spread over both.

Where the release says so (the ``smg`` 1.13.0 sdist on PyPI, ``model_gateway/src/policies/cache_aware.rs``,
``least_load.rs`` beside it and ``crates/kv_index/src/common.rs``; read, not copied), for the HTTP (text) path:

* imbalance: no request-count switch. The file's header (``cache_aware.rs:4-6``) still describes one, but
  ``is_kv_imbalanced`` (``cache_aware.rs:617-660``) fires only on backend KV usage and returns at once with the
  defaults (``cache_aware.rs:638-644``); request-count pressure is the per-request gate below.
* miss (``cache_aware.rs:3246-3256``: ratio at or under ``cache_threshold``): ``resolve_selection`` with no
  candidates (``cache_aware.rs:2133-2134``) -> ``select_final_from_affinity`` (``cache_aware.rs:2089-2090``) ->
  the least expected wait over every healthy worker (``select_expected_wait``, ``cache_aware.rs:1773``), ties
  within ``TIE_EPSILON_SECS`` = 1 microsecond drawn uniformly (``least_load.rs:25-31``, ``least_load.rs:560-600``:
  "instead of first-index-wins, which herded ties onto one worker").
* hit: the candidates are the healthy workers among the matched node's tenants (``cache_aware.rs:2296-2305``), at
  most ``MATCHED_TENANTS_CAP`` = 8 (``crates/kv_index/src/common.rs:41``); those not over the gate
  (``candidate_requires_spill``, ``cache_aware.rs:1842``; ``over_count_pressure_gate``, ``cache_aware.rs:1805-1808``;
  ``absolute_margin``, ``cache_aware.rs:1827-1831``; ``MIN_ABSOLUTE_MARGIN``, ``cache_aware.rs:150``) go to the
  least expected wait (``cache_aware.rs:2076-2083``); if all are over it, the request spills to the least expected
  wait among the healthy workers not over the gate, or among all if none (``cache_aware.rs:2092-2102``).
* the warm-up slice and divert that send some misses to a returning worker (``cache_aware.rs:1880``, ``1973``)
  run only on the event-driven (gRPC + KV events) path (``cache_aware.rs:2439``, ``2449``), not on the text path.

So a miss on an idle fleet goes to a random worker, and a hot prefix spreads once its holders pass the gate. The
two released rules users run differ only there: ``cache_aware`` models sglang-router 0.3.2 (imbalance switch,
ties to the first worker), this policy smg 1.13.0.

Thresholds (``smg launch`` defaults in 1.13.0): ``cache_threshold`` 0.3, ``balance_abs_threshold``
(alias ``--spill-abs-threshold``) 64, ``balance_rel_threshold`` (``--spill-rel-threshold``) 1.5,
``MIN_ABSOLUTE_MARGIN`` 4, ``MATCHED_TENANTS_CAP`` 8.

Differences from the router, on purpose: 1.13 ranks candidates and spill targets by its LeastLoad
expected-wait estimate; here by in-flight count, the load the gate itself uses (REFERENCE.md s4 states the rule
that way). The router's tree is over characters, so the deepest matched node of a request with a unique suffix
may be a suffix node only the first worker holds; over block hashes the deepest matched node is the shared
prefix's last block, whose tenants include every spill target. Measured on the router with two 1-second fake
workers, 40 concurrent shared-prefix requests went 23/17; this block-level rule spills first when the holder
carries 11 of 11 in flight and then splits the rest evenly (20/20).
"""

from __future__ import annotations

import math
import random
from itertools import islice

from btbctl.engine.chains import DEFAULT_BLOCK_TOKENS
from btbctl.engine.constants import CACHE_TREE_MAX_BLOCKS, CACHE_TREE_MAX_BYTES, BtbConstants
from btbctl.engine.policies.base import FleetView, least_loaded
from btbctl.engine.policies.cache_aware import (
    BALANCE_ABS_THRESHOLD,
    BALANCE_REL_THRESHOLD,
    CACHE_THRESHOLD,
    EVICTION_INTERVAL_S,
    CacheAware,
)
from btbctl.engine.trace.model import Request

#: Floor of the gate's swing-sized absolute margin, requests (smg 1.13.0 ``MIN_ABSOLUTE_MARGIN``).
MIN_ABSOLUTE_MARGIN = 4.0
#: Tenants of the matched node considered per hit (smg 1.13.0 ``kv_index::MATCHED_TENANTS_CAP``).
MATCHED_TENANTS_CAP = 8


def absolute_margin(avg_load: float, balance_abs_threshold: float) -> float:
    """The gate's absolute margin (requests) at fleet mean ``avg_load``:
    ``min(balance_abs_threshold, max(MIN_ABSOLUTE_MARGIN, ceil(2 x sqrt(avg_load))))``."""
    swing = math.ceil(2.0 * math.sqrt(max(avg_load, 0.0)))
    return min(float(balance_abs_threshold), max(float(swing), MIN_ABSOLUTE_MARGIN))


class CacheAwareSpill(CacheAware):
    """Cache-aware routing with smg 1.13.0's per-request spill gate (see the module docstring).

    Args: as :class:`~btbctl.engine.policies.cache_aware.CacheAware` (same defaults: 0.3, 64, 1.5); here
    ``balance_abs_threshold``/``balance_rel_threshold`` parameterise the spill gate, and ties use ``rng``.
    """

    name = "cache_aware_spill"
    summary = "smg 1.13: least-loaded tenant of the matched prefix, spill when > 1.5x mean and > mean + margin"

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
        tree_max_blocks: int = CACHE_TREE_MAX_BLOCKS,
        tree_max_bytes: int = CACHE_TREE_MAX_BYTES,
    ) -> None:
        super().__init__(
            n_replicas,
            rng,
            constants,
            cache_threshold=cache_threshold,
            balance_abs_threshold=balance_abs_threshold,
            balance_rel_threshold=balance_rel_threshold,
            block_tokens=block_tokens,
            max_blocks_per_worker=max_blocks_per_worker,
            eviction_interval_s=eviction_interval_s,
            tree_max_blocks=tree_max_blocks,
            tree_max_bytes=tree_max_bytes,
        )
        self._spills = 0

    def gated(self, load: float, avg_load: float) -> bool:
        """Whether a replica with ``load`` in flight is over the spill gate at fleet mean ``avg_load``."""
        return load > avg_load * self.balance_rel_threshold and load > avg_load + absolute_margin(
            avg_load, self.balance_abs_threshold
        )

    def choose(self, req: Request, view: FleetView, now_s: float) -> int:
        self.maybe_evict(now_s)
        n = self.n_replicas
        loads = [view.load(r) for r in range(n)]
        avg = sum(loads) / n
        chain = req.block_hashes
        matched, node = self.tree.match(chain)
        if node is not None and self.match_ratio(req, matched) > self.cache_threshold:
            self._hits += 1
            safe = [t for t in islice(node.tenants, MATCHED_TENANTS_CAP) if not self.gated(loads[t], avg)]
            if safe:
                choice = least_loaded(view, safe, self.rng)
            else:
                self._spills += 1
                open_ = [r for r in range(n) if not self.gated(loads[r], avg)]
                choice = least_loaded(view, open_ or range(n), self.rng)
        else:
            self._misses += 1
            choice = least_loaded(view, range(n), self.rng)
        self.tree.insert(chain, choice)
        return choice

    def stats(self) -> dict[str, int]:
        """As :meth:`CacheAware.stats` plus ``spills`` (hits whose every candidate was gated)."""
        out = super().stats()
        out["spills"] = self._spills
        return out
