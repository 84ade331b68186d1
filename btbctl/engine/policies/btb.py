"""``btb``: Biting the Bullet's published rule: detect a burst, replicate its prefix, spread it over the copies.

Rule (Birmiwal & Bhat, "Biting the Bullet", 2026-07-22, policy ``early_rdma``; REFERENCE.md s1), per request:

1. Feed the prompt's chain to the :class:`~btbctl.engine.detector.BurstDetector`: the prefix is the first
   ``Y = prefix_blocks`` block hashes; it turns hot when ``X = threshold`` arrivals fall inside the trailing
   ``Z = window_s`` seconds, and stays active while arrivals keep coming with gaps under ``window_s`` (the
   detector's docstring defines "active"). Prompts shorter than Y blocks never trigger.
2. While the prefix is active (on the arrival that fires it and on every later one, so a failed copy or an
   evicted holder is topped up): make sure ``min(M, n_replicas)`` replicas (``M = warm_replicas``) hold it.
   *Holders* have all Y blocks computed (``view.cached_blocks(r, prefix) >= Y``); *covered* replicas have a copy
   of it in flight (``view.copy_in_flight``) or are computing it (``view.pending_blocks(r, prefix) >= Y``).
   While holders + covered < M, plan copies to the least-loaded replicas that are neither (ties random): one
   :class:`~btbctl.engine.copies.CopyPlan` whose targets are all of them in that order and whose ``want`` is the
   shortfall, so the executor moves on to the next candidate when it refuses one.
   The source is the least-loaded holder; when no replica holds all Y blocks yet (the first request is still
   prefilling) it is the least-loaded replica computing them, as the published simulator copied from the replica
   computing the prefix; the executor must then make the copy trail the source's compute. With no holder and nobody
   computing it, nothing is copied until a later arrival finds a source.
3. Routing: while the prefix is active, the request goes to the least-loaded holder (ties random). With no holder
   yet, and for every other request, it falls back to cache-aware routing
   (:class:`~btbctl.engine.policies.cache_aware.CacheAware`, sglang-router 0.3.2 defaults, with its ties between
   equally loaded replicas broken at random as in the published simulator, REFERENCE.md s2, instead of to the
   first replica); the cache-aware tree also records the requests BTB routes itself, so its affinity stays
   consistent.

Published defaults: X = 2, Y = 256 blocks (of 256 tokens), Z = 1.0 s, M = ``warm_replicas`` = 4
(:class:`~btbctl.engine.constants.BtbConstants`). No rollback on misprediction: copies age out of the replicas'
caches by LRU. ``set_constants`` retunes the detector and M live.

Where copies cannot be made (ours; the published simulator never refused one). A replica that cannot take part
in a copy (``view.accepts_copies`` False: a gateway's worker without the BTB routes, such as a stock SGLang server,
or an unhealthy one) is neither a copy target nor a source, and neither is, for ``Z`` seconds, a target the executor
just refused (:class:`~btbctl.engine.policies.base.CopyRefusals`, fed by :meth:`Btb.on_copy_result`). When the
holders cannot grow towards M that way (no candidate target, or no holder or computing replica that can send; the
replicas the load rule sent a request to, which then compute the prefix, do not count towards M), a hot request
is not forced onto the holders past the fallback's load rule: if the fleet's loads trip the cache-aware imbalance
switch (spread > 64 and > 1.5x) it goes to the least-loaded replica, as the fallback would send it; otherwise to
the least-loaded holder as above. Where copies are accepted (every simulated fleet) this
changes nothing.

What the published rule does that we keep, as evidence: while the first request still computes the prefix nothing
holds it, so every hot request falls back to cache-aware affinity and queues on the source; once copies land the
source keeps that queue (300 requests sharing a 65,536-token prefix over 3 s on 4 replicas split 123/59/59/59).
``btb_plus`` routes by expected time to first token instead.
"""

from __future__ import annotations

import random
from collections.abc import Hashable

from btbctl.engine.chains import DEFAULT_BLOCK_TOKENS
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyPlan
from btbctl.engine.detector import BurstDetector
from btbctl.engine.policies.base import CopyRefusals, FleetView, Policy, Route, least_loaded
from btbctl.engine.policies.cache_aware import CacheAware
from btbctl.engine.trace.model import Request


class Btb(Policy[FleetView]):
    """The published BTB rule over a cache-aware fallback (see the module docstring).

    Args:
        n_replicas: fleet size.
        rng: seeded random source (ties among holders and among copy targets).
        constants: the four constants (default: the published ones).
        block_tokens: tokens per block, for the cache-aware fallback's match ratio (default 256; :meth:`configure`
            may set it).
        max_tracked: the detector's bound on tracked prefixes (default 65,536).

    Attributes:
        detector: the :class:`~btbctl.engine.detector.BurstDetector` (for heat views).
        fallback: the inner :class:`~btbctl.engine.policies.cache_aware.CacheAware` policy.
    """

    name = "btb"
    summary = "BTB (published): X arrivals of a Y-block prefix in Z s -> copy to M replicas, route to holders"

    def __init__(
        self,
        n_replicas: int,
        rng: random.Random,
        constants: BtbConstants | None = None,
        *,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        max_tracked: int = 65536,
    ) -> None:
        super().__init__(n_replicas, rng, constants)
        self.detector = BurstDetector(self.constants, max_tracked=max_tracked)
        self.fallback = CacheAware(n_replicas, rng, self.constants, block_tokens=block_tokens, random_ties=True)
        self.refusals = CopyRefusals()
        self._copies = 0
        self._refused = 0
        self._no_source = 0
        self._holder_routes = 0
        self._fallback_routes = 0
        self._balanced_routes = 0

    def configure(self, *, block_tokens: int | None = None) -> None:
        """Pass the workload's block size to the cache-aware fallback."""
        self.fallback.configure(block_tokens=block_tokens)

    def set_constants(self, constants: BtbConstants) -> None:
        """Retune live: the detector and M follow from the next request (a new Y drops the detector's state)."""
        super().set_constants(constants)
        self.detector.set_constants(constants)

    def share_detector(self, detector: BurstDetector) -> bool:
        """Observe through ``detector`` from now on (see :meth:`Policy.share_detector`)."""
        self.detector = detector
        return True

    def tree_holder(self) -> CacheAware:
        """The cache-aware policy it falls back to for requests without a hot prefix."""
        return self.fallback

    def route(self, req: Request, view: FleetView, now_s: float) -> Route:
        chain = req.block_hashes
        det = self.detector.observe(chain, now_s, req.arrivals)
        if det is not None:
            holders, plan, stuck = self._ensure_replicas(det.prefix, view, now_s)
            copies = (plan,) if plan is not None else ()
            if holders:
                fb = self.fallback
                if stuck:
                    loads = [view.load(r) for r in range(self.n_replicas)]
                    if fb.imbalanced(loads):
                        self._balanced_routes += 1
                        fb.record_imbalanced()
                        choice = fb.least_loaded(loads)
                        fb.record(chain, choice, now_s)
                        return Route(choice, copies)
                self._holder_routes += 1
                choice = least_loaded(view, holders, self.rng)
                fb.record(chain, choice, now_s)
                return Route(choice, copies)
            self._fallback_routes += 1
            return Route(self.fallback.choose(req, view, now_s), copies)
        return Route(self.fallback.choose(req, view, now_s))

    def on_copy_result(self, plan: CopyPlan, target: int, started: bool, now_s: float) -> None:
        self.refusals.note(target, started, now_s)
        if started:
            self._copies += 1
        else:
            self._refused += 1

    def _ensure_replicas(
        self, prefix: tuple[Hashable, ...], view: FleetView, now_s: float
    ) -> tuple[list[int], CopyPlan | None, bool]:
        """The replicas holding all of ``prefix`` now, the plan topping its copies up towards M (None: no copy
        needed or none possible), and whether the holders fall short of M with no way to grow (no replica that
        accepts a copy, or no source that can send one)."""
        y = len(prefix)
        n = self.n_replicas
        hold_s = self.constants.window_s
        holders: list[int] = []
        computing: list[int] = []
        others: list[int] = []
        arriving = 0
        for r in range(n):
            if view.cached_blocks(r, prefix) >= y:
                holders.append(r)
            elif view.copy_in_flight(r, prefix):
                arriving += 1
            elif view.pending_blocks(r, prefix) >= y:
                computing.append(r)
            else:
                others.append(r)
        want = min(self.constants.warm_replicas, n)
        if want - len(holders) - arriving <= 0:
            return holders, None, False  # M reached counting the copies on their way: neither short nor stuck
        free = [r for r in others if view.accepts_copies(r) and not self.refusals.refused(r, now_s, hold_s)]
        # Stuck: short of M even counting the copies on their way, and no copy can be made (no replica that could
        # receive one, or none that could send one). Replicas computing the prefix do not make up for it here: where
        # copies are refused they compute it only because the load rule below sent them a request.
        receivers = free or [r for r in computing if view.accepts_copies(r)]
        can_send = any(view.accepts_copies(r) for r in holders + computing)
        stuck = want - len(holders) - arriving > 0 and not (receivers and can_send)
        need = want - len(holders) - arriving - len(computing)
        if need <= 0 or not free:
            return holders, None, stuck
        senders = [r for r in holders if view.accepts_copies(r)]
        if senders:
            source = least_loaded(view, senders, self.rng)
        else:
            senders = [r for r in computing if view.accepts_copies(r)]
            if not senders:
                self._no_source += 1
                return holders, None, stuck
            source = least_loaded(view, senders, self.rng)
        rng = self.rng
        order = sorted(free, key=lambda r: (view.load(r), rng.random()))
        return holders, CopyPlan(prefix, source, tuple(order), min(need, len(order))), False

    def stats(self) -> dict[str, int]:
        """``fires`` (detector activations), ``copies_requested`` (copies the fleet accepted), ``copies_refused``,
        ``no_source`` (hot arrivals with nothing to copy from yet), ``holder_routes`` (requests sent to a holder),
        ``fallback_routes`` (active-prefix requests with no holder yet), ``balanced_routes`` (active-prefix requests
        sent to the least-loaded replica because the holders could not grow and the fleet was imbalanced),
        ``tracked_prefixes``, and the cache-aware fallback's counters prefixed ``cache_aware_``. All values are
        integers."""
        det = self.detector.stats()
        out = {
            "fires": det["fires"],
            "copies_requested": self._copies,
            "copies_refused": self._refused,
            "no_source": self._no_source,
            "holder_routes": self._holder_routes,
            "fallback_routes": self._fallback_routes,
            "balanced_routes": self._balanced_routes,
            "tracked_prefixes": det["tracked"],
        }
        for k, v in self.fallback.stats().items():
            out[f"cache_aware_{k}"] = v
        return out
