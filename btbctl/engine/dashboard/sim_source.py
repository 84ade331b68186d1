"""The dashboard's simulation source: the incremental simulator replaying a trace paced to the wall clock."""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

from btbctl.engine import chains
from btbctl.engine.chains import SHORT_ID_CHARS, check_prefix_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.schema import TTFT_RECENT_WINDOW_S
from btbctl.engine.copies import CopyPlan, carry_out
from btbctl.engine.dashboard.snapshot import (
    FleetSnapshot,
    GpuRow,
    PrefixRow,
    ReplicateResult,
    SourceError,
    TransferRow,
    TtftPoint,
    WorkerRow,
)
from btbctl.engine.detector import BurstDetector
from btbctl.engine.dryrun import load_trace
from btbctl.engine.errors import ConfigError
from btbctl.engine.policies import make_policy
from btbctl.engine.sim.results import check_fits
from btbctl.engine.sim.simulator import CopyInfo, Simulator
from btbctl.engine.stats import TtftSeries

#: Width of one TTFT-series bucket, seconds of fleet time.
TTFT_BUCKET_S = 1.0
#: Buckets kept in the TTFT series (the window the panel states, at 1 s).
TTFT_BUCKETS = int(TTFT_RECENT_WINDOW_S / TTFT_BUCKET_S)
#: Finished transfers kept for the "recent" list.
RECENT_TRANSFERS = 20


class _CompleteBuckets:
    """TTFT samples and arrivals in :class:`~btbctl.engine.stats.TtftSeries`, which the snapshot reads only up to
    the end of the last complete bucket: samples of the bucket in progress wait here until it ends."""

    def __init__(self) -> None:
        self.ttft = TtftSeries()  # (fleet time of the first token, TTFT seconds)
        self.arrivals = TtftSeries()  # (arrival time, 0.0): arrivals per bucket
        self._new_ttft: deque[tuple[float, float]] = deque()
        self._new_arrivals: deque[tuple[float, float]] = deque()

    def add_ttft(self, now_s: float, ttft_s: float) -> None:
        self._new_ttft.append((now_s, ttft_s))

    def add_arrival(self, now_s: float) -> None:
        self._new_arrivals.append((now_s, 0.0))

    def points(self, now_s: float) -> tuple[list[TtftPoint], float]:
        """The last :data:`TTFT_BUCKETS` complete buckets before ``now_s`` (leading ones without a first token or an
        arrival left out) and the arrival rate of the last one, requests/s."""
        end = math.floor(now_s / TTFT_BUCKET_S) * TTFT_BUCKET_S
        for new, series in ((self._new_ttft, self.ttft), (self._new_arrivals, self.arrivals)):
            while new and new[0][0] < end:
                series.add(*new.popleft())
        window_s = TTFT_BUCKETS * TTFT_BUCKET_S
        pts: list[TtftPoint] = []
        for row, arr in zip(
            self.ttft.series(end, window_s, TTFT_BUCKET_S),
            self.arrivals.series(end, window_s, TTFT_BUCKET_S),
            strict=True,
        ):
            if not row["n"] and not arr["n"] and not pts:
                continue
            p50, p95 = row["p50_s"], row["p95_s"]
            pts.append(
                TtftPoint(row["t_s"], math.nan if p50 is None else p50, math.nan if p95 is None else p95, arr["rps"])
            )
        return pts, (pts[-1].rps if pts else 0.0)

    def summary(self, now_s: float) -> dict[str, Any]:
        """TTFT over the complete buckets of the trailing :data:`TTFT_RECENT_WINDOW_S` before ``now_s`` (call after
        :meth:`points`): ``{"n", "p50_s", "p95_s", ...}`` as :meth:`~btbctl.engine.stats.TtftSeries.summary`."""
        end = math.floor(now_s / TTFT_BUCKET_S) * TTFT_BUCKET_S
        return self.ttft.summary(end, TTFT_RECENT_WINDOW_S)


class SimSource:
    """A live simulation behind the :class:`DashboardSource` interface.

    The trace's requests are submitted to an incremental :class:`~btbctl.engine.sim.simulator.Simulator` when
    the simulated clock reaches their arrival; the clock runs at ``speed`` x the wall clock from ``start_s``
    (default: one second before the first arrival). With ``paced=False`` nothing runs by itself and the caller
    moves the clock with :meth:`advance_to` (tests, snapshots).

    Args:
        trace: the requests (:class:`~btbctl.engine.trace.model.Trace`); copied, never modified.
        cluster: the fleet (:class:`~btbctl.engine.config.ClusterConfig`).
        constants: BTB's four constants.
        policy: routing policy name (``btbctl.engine.policies.POLICIES``).
        seed: seeds the policy's random source.
        speed: simulated seconds per wall second (> 0).
        paced: run a background thread that follows the wall clock.
        tick_s: wall seconds between two steps of that thread (default 0.01).

    Raises:
        ConfigError: unknown policy or presets, a request that cannot fit, speed <= 0.
    """

    def __init__(
        self,
        trace,
        cluster,
        constants: BtbConstants | None = None,
        policy: str = "btb_plus",
        *,
        seed: int = 42,
        speed: float = 1.0,
        paced: bool = True,
        start_s: float | None = None,
        tick_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not speed > 0:
            raise ConfigError("speed", f"must be a number > 0, got {speed!r}")
        self.constants = constants or BtbConstants()
        cost = cluster.replica_cost()
        check_fits(trace, cost.kv_budget_tokens)
        self.cluster = cluster
        self.cost = cost
        self.speed = float(speed)
        self.paced = paced
        self.tick_s = tick_s
        self._clock = clock
        self._seed = seed
        self._reqs = list(trace.requests)
        self._next = 0
        self.block_tokens = trace.block_tokens
        pol = make_policy(
            policy, cluster.replicas, random.Random(seed), self.constants, block_tokens=trace.block_tokens
        )
        self.sim = Simulator(trace, pol, cluster, self.constants)
        first = self._reqs[0].arrival_s if self._reqs else 0.0
        self.start_s = max(0.0, first - 1.0) if start_s is None else float(start_s)
        self.sim.advance_to(self.start_s)
        self._lock = threading.Lock()
        self._buckets = _CompleteBuckets()
        self._own_detector = None
        self._chains: dict[Hashable, tuple] = {}  # detector key -> its Y-block prefix
        self._ids: dict[str, Hashable] = {}  # prefix id -> key
        self._copy_keys: dict[int, str] = {}  # copy id -> prefix id
        self.sim.on_first_token = self._on_first_token
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._wall0 = 0.0
        self._sim0 = self.start_s
        self.submitted = 0
        self._sync_detector()

    # -- pacing -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the paced thread (no-op with ``paced=False`` or when started)."""
        if not self.paced or self._thread is not None:
            return
        # The trace and the fleet model are long-lived: move them out of the collector's generations so a full
        # collection triggered by the replay does not walk them (it stops every thread, the UI's included).
        import gc

        gc.collect()
        gc.freeze()
        self._wall0 = self._clock()
        self._sim0 = self.sim.now
        self._thread = threading.Thread(target=self._run, name="btbctl-sim", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the paced thread."""
        self._stop.set()
        t = self._thread
        if t is not None:
            await asyncio.to_thread(t.join, 5.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            target = self._sim0 + (self._clock() - self._wall0) * self.speed
            with self._lock:
                self._step_to(target)
            self._stop.wait(self.tick_s)

    def advance_to(self, t_s: float) -> None:
        """Move the simulated clock to ``t_s`` (submitting every request that arrives on the way)."""
        with self._lock:
            self._step_to(t_s)

    @property
    def finished(self) -> bool:
        return self._next >= len(self._reqs) and self.sim.next_event_s() is None

    def _step_to(self, t: float) -> None:
        sim = self.sim
        reqs = self._reqs
        i, n = self._next, len(reqs)
        while i < n and reqs[i].arrival_s <= t:
            r = reqs[i]
            i += 1
            sim.advance_to(r.arrival_s)
            self._submit(replace(r))
        self._next = i
        sim.advance_to(t)

    def _submit(self, req) -> None:
        det = self._detector()
        y = det.constants.prefix_blocks
        chain = req.block_hashes
        if self._own_detector is not None:
            self._own_detector.observe(chain, self.sim.now)
        if len(chain) >= y:
            key = chain[y - 1]
            if key not in self._chains:
                self._chains[key] = tuple(chain[:y])
                if len(self._chains) > 4 * max(1024, len(det)):
                    self._chains = {
                        k: v
                        for k, v in self._chains.items()
                        if det.prefix_of(k) is not None or det.arrivals_in_window(k, self.sim.now)
                    }
        self._buckets.add_arrival(self.sim.now)
        self.submitted += 1
        self.sim.submit(req)

    def _on_first_token(self, req, replica: int, ttft_s: float, cached_tokens: int) -> None:
        self._buckets.add_ttft(self.sim.now, ttft_s)

    # -- detector ---------------------------------------------------------------------------------------------
    def _detector(self) -> BurstDetector:
        det = self.sim.detector
        return det if det is not None else self._own_detector

    def _sync_detector(self) -> None:
        """Policies without a detector (round_robin, ...) get one kept here for the heat view."""
        if self.sim.detector is None:
            if self._own_detector is None:
                self._own_detector = BurstDetector(self.constants)
            else:
                self._own_detector.set_constants(self.constants)
        else:
            self._own_detector = None

    # -- snapshot ---------------------------------------------------------------------------------------------
    async def snapshot(self) -> FleetSnapshot:
        """The state now (built in a worker thread under the simulation lock)."""
        return await asyncio.to_thread(self.snapshot_sync)

    def snapshot_sync(self, top: int = 10) -> FleetSnapshot:
        """:meth:`snapshot` without the thread hop (callers off the event loop, tests)."""
        with self._lock:
            return self._build(top)

    def _prefix_id(self, key: Hashable) -> str:
        pid = chains.prefix_id(key)
        self._ids[pid] = key
        return pid

    def _build(self, top: int) -> FleetSnapshot:
        sim = self.sim
        now = sim.now
        cost = self.cost
        kvb = cost.model.kv_bytes_per_token
        g = self.cluster.gpus_per_replica
        workers, gpus = [], []
        for i in range(sim.n_replicas):
            st = sim.replica_state(i)
            workers.append(
                WorkerRow(
                    f"w{i}",
                    True,
                    st.running,
                    st.waiting,
                    st.used_tokens,
                    st.capacity_tokens,
                    kv_cached_tokens=st.evictable_tokens,
                    source="modelled",
                )
            )
            used = (cost.model.weight_bytes + (st.used_tokens + st.evictable_tokens) * kvb) / g
            util = 100.0 if st.busy else 0.0
            for j in range(g):
                gpus.append(GpuRow(f"w{i}/gpu{j}", used, cost.gpu.hbm_bytes, util, "sim"))
        det = self._detector()
        y = det.constants.prefix_blocks
        active = sim.copies_in_flight()
        copies_by_key: dict[Hashable, int] = {}
        for c in active:
            if len(c.prefix) >= y:
                k = c.prefix[y - 1]
                copies_by_key[k] = copies_by_key.get(k, 0) + 1
        prefixes = []
        for h in det.heat(now, top):
            chain = self._chains.get(h.key) or det.prefix_of(h.key)
            holders = len(sim.holders(chain)) if chain is not None else 0
            prefixes.append(
                PrefixRow(
                    self._prefix_id(h.key),
                    y * self.block_tokens,
                    h.arrivals_in_window,
                    det.constants.threshold,
                    holders,
                    copies_by_key.get(h.key, 0),
                    h.hot,
                )
            )
        transfers = [self._transfer_row(c, y) for c in active]
        recent = [self._transfer_row(c, y) for c in sim.finished_copies(RECENT_TRANSFERS)]
        transfers.extend(reversed(recent))
        ttft, rps = self._buckets.points(now)
        win = self._buckets.summary(now)
        mode = "manual clock" if not self.paced else f"x{self.speed:g}"
        msg = f"simulation {mode}, t={now:.1f} s, {self.submitted} requests"
        return FleetSnapshot(
            now_s=now,
            connected=True,
            message=msg,
            workers=tuple(workers),
            gpus=tuple(gpus),
            gpu_note=None,
            prefixes=tuple(prefixes),
            transfers=tuple(transfers),
            ttft=tuple(ttft),
            constants=self.constants.as_dict(),
            policy=sim.policy_name,
            rps=rps,
            finished=self.finished,
            ttft_window_s=TTFT_RECENT_WINDOW_S,
            ttft_n=win["n"],
            ttft_p50_s=win["p50_s"],
            ttft_p95_s=win["p95_s"],
        )

    def _transfer_row(self, c: CopyInfo, y: int) -> TransferRow:
        key = c.prefix[y - 1] if len(c.prefix) >= y else c.prefix[-1]
        pid = self._copy_keys.get(c.copy_id) or self._prefix_id(key)
        return TransferRow(
            f"c{c.copy_id}",
            pid,
            f"w{c.source}",
            f"w{c.target}",
            c.sent_bytes,
            c.total_bytes,
            c.rate_bytes_per_s,
            c.eta_s,
            c.state.value,
            duration_s=max(0.0, (self.sim.now if c.done_s is None else c.done_s) - c.started_s),
            copied_tokens=len(c.prefix) * self.block_tokens,
            chain_id=self._prefix_id(c.prefix[-1]) if len(c.prefix) > y else "",
        )

    # -- actions ----------------------------------------------------------------------------------------------
    async def set_constants(self, **changes: Any) -> dict:
        """Validate (:meth:`BtbConstants.with_updates`) and apply to the policy; returns the constants in force.
        Raises :class:`ConfigError` naming the refused key."""
        return await asyncio.to_thread(self.set_constants_sync, **changes)

    def set_constants_sync(self, **changes: Any) -> dict:
        with self._lock:
            new = self.constants.with_updates(**changes)
            self.sim.set_constants(new)
            self.constants = new
            self._sync_detector()
            return new.as_dict()

    async def set_policy(self, name: str) -> str:
        """Route with a fresh policy ``name`` from now on (its routing state starts empty). Raises
        :class:`ConfigError` for an unknown name."""
        return await asyncio.to_thread(self.set_policy_sync, name)

    def set_policy_sync(self, name: str) -> str:
        with self._lock:
            pol = make_policy(
                name, self.sim.n_replicas, random.Random(self._seed), self.constants, block_tokens=self.block_tokens
            )
            self.sim.set_policy(pol)
            self._sync_detector()
            return pol.name

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult:
        """Copy the prefix ``prefix_id`` (or an unambiguous leading part of at least
        :data:`~btbctl.engine.chains.MIN_PREFIX_ID_CHARS` hex digits) from its least-loaded holder to ``n`` more
        workers, least-loaded first. Raises :class:`SourceError` (unknown or ambiguous id, no holder, nothing accepted)
        or :class:`ConfigError` (``n`` < 1)."""
        return await asyncio.to_thread(self.replicate_sync, prefix_id, n)

    async def prewarm(self, prompt: dict, n: int) -> ReplicateResult:
        """Not in a simulation: its requests are a trace's block hashes, not prompts. Raises :class:`SourceError`."""
        raise SourceError("prewarm needs a running fleet (btbctl up, then btbctl tui): a simulation has no prompts")

    def replicate_sync(self, prefix_id: str, n: int) -> ReplicateResult:
        if not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        try:
            pid = check_prefix_id(prefix_id)
        except ValueError as e:
            raise SourceError(f"prefix id: {e}") from None
        with self._lock:
            sim = self.sim
            for key in self._chains:
                self._ids.setdefault(chains.prefix_id(key), key)
            matches = [k for k in self._ids if k.startswith(pid)]
            if not matches:
                raise SourceError(f"unknown prefix {prefix_id!r}")
            if len(matches) > 1:
                raise SourceError(f"prefix id {prefix_id!r} is ambiguous ({len(matches)} prefixes match)")
            full = matches[0]
            chain = self._chains.get(self._ids[full])
            if chain is None:
                raise SourceError(f"prefix {full[:SHORT_ID_CHARS]} is no longer tracked")
            view = sim.view
            y = len(chain)
            holders = [r for r in range(view.n_replicas) if view.cached_blocks(r, chain) >= y]
            if not holders:
                raise SourceError(f"no worker holds all of prefix {full[:SHORT_ID_CHARS]} yet")
            source = min(holders, key=lambda r: (view.load(r), r))
            free = [
                r
                for r in range(view.n_replicas)
                if r not in holders and not view.copy_in_flight(r, chain) and view.pending_blocks(r, chain) < y
            ]
            free.sort(key=lambda r: (view.load(r), r))
            started, targets = [], []
            if free:
                plan = CopyPlan(tuple(chain), source, tuple(free), min(n, len(free)))
                for r in carry_out(plan, lambda t: sim.start_copy(plan.prefix, source, t, sim.now)):
                    c = sim.copy_info(r, plan.prefix)
                    self._copy_keys[c.copy_id] = full
                    started.append(f"c{c.copy_id}")
                    targets.append(f"w{r}")
            if not started:
                raise SourceError(
                    f"prefix {full[:SHORT_ID_CHARS]}: no worker can take a copy (all hold it, receive it, or lack room)"
                )
            msg = f"copying {full[:SHORT_ID_CHARS]} from w{source} to {', '.join(targets)}"
            if len(started) < n:
                msg += f" ({n - len(started)} fewer than asked: no other worker can take it)"
            return ReplicateResult(full, tuple(started), f"w{source}", tuple(targets), msg)


def sim_source_from_config(
    cfg, policy: str | None = None, *, speed: float = 1.0, paced: bool = True, trace=None
) -> SimSource:
    """A :class:`SimSource` for a :class:`~btbctl.engine.dryrun.DryRunConfig`: its trace (or ``trace``),
    cluster, constants and seed; ``policy`` default: ``btb_plus`` when listed, else ``btb`` when listed, else the
    config's first policy."""
    cfg.check()
    if trace is None:
        trace = load_trace(cfg)
    if policy is None:
        policy = next((p for p in ("btb_plus", "btb") if p in cfg.policies), cfg.policies[0])
    return SimSource(trace, cfg.cluster, cfg.btb, policy, seed=cfg.seed, speed=speed, paced=paced)
