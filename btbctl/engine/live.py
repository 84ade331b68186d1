"""Live views of a fleet for dashboards: one interface (:class:`LiveSource`), two implementations.

* :class:`SimLiveSource`: the incremental :class:`~btbctl.engine.sim.simulator.Simulator` replaying a trace paced
  to the wall clock (times a speed factor) in a background thread, so the dashboard works with no fleet at all.
* :class:`ControlApiLiveSource`: an aiohttp client of a running fleet's control API (``btbctl up``), reconnecting
  with exponential backoff after the fleet goes away and saying so in :attr:`FleetSnapshot.message`.

Both answer :meth:`LiveSource.snapshot` with the same :class:`FleetSnapshot`, and accept the same three actions
(set constants, set policy, replicate a prefix). Nothing here imports a UI toolkit.

Units: times in seconds, sizes in bytes or tokens as the field names say, rates per second.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Hashable, Protocol, Sequence

from btbctl.engine import chains
from btbctl.engine.chains import SHORT_ID_CHARS, check_prefix_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.stats import percentile
from btbctl.engine.copies import CopyPlan, carry_out
from btbctl.engine.errors import BtbctlError, ConfigError

#: Width of one TTFT-series bucket, seconds of fleet time.
TTFT_BUCKET_S = 1.0
#: Buckets kept in the TTFT series (two minutes at 1 s).
TTFT_BUCKETS = 120
#: Finished transfers kept for the "recent" list.
RECENT_TRANSFERS = 20


class LiveError(BtbctlError):
    """An action the fleet refused or could not carry out (message says why)."""


# -- the snapshot -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class WorkerRow:
    """One worker (a replica: one model instance over ``gpus`` GPUs).

    Attributes:
        name: worker name (``w0`` ...).
        healthy: answers health checks; ``error`` says why not.
        running: requests running (prefill or decode).
        queued: requests waiting for admission.
        kv_used_tokens / kv_capacity_tokens: KV cache in use / size, tokens (None: not reported).
    """

    name: str
    healthy: bool
    running: int
    queued: int
    kv_used_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU's memory. ``source``: ``nvml`` (read locally), ``worker`` (as its worker reports it) or ``sim``
    (modelled: weights share plus KV in use). ``util_pct`` 0..100 or None when unknown."""

    name: str
    used_bytes: float
    total_bytes: float
    util_pct: float | None
    source: str


@dataclass(frozen=True, slots=True)
class PrefixRow:
    """One prefix in the detector window.

    Attributes:
        prefix_id: the prefix id ``btbctl replicate --prefix`` takes (hash of its last block, hex).
        prefix_tokens: prefix length, tokens.
        arrivals_in_window: arrivals in the trailing ``window_s``.
        threshold: arrivals that make it hot.
        holders: workers holding all of it.
        copies_in_flight: copies of it under way.
        hot: whether the detector has it active.
    """

    prefix_id: str
    prefix_tokens: int
    arrivals_in_window: int
    threshold: int
    holders: int
    copies_in_flight: int
    hot: bool

    @property
    def short_id(self) -> str:
        return self.prefix_id[:SHORT_ID_CHARS]


@dataclass(frozen=True, slots=True)
class TransferRow:
    """One KV-cache copy. ``state``: ``running``, ``stalled`` (waiting for the source's prefill), ``done`` or
    ``failed`` (``error`` says why). ``eta_s`` None when unknown (stalled, finished)."""

    copy_id: str
    prefix_id: str
    source: str
    target: str
    bytes_sent: float
    bytes_total: float
    bytes_per_s: float
    eta_s: float | None
    state: str
    error: str | None = None

    @property
    def fraction(self) -> float:
        return 1.0 if self.bytes_total <= 0 else min(1.0, self.bytes_sent / self.bytes_total)


@dataclass(frozen=True, slots=True)
class TtftPoint:
    """TTFT over one bucket of fleet time ending at ``t_s``: percentiles in seconds (NaN: no first token in the
    bucket) and arrivals per second ``rps``."""

    t_s: float
    p50_s: float
    p95_s: float
    rps: float


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Everything a dashboard shows at one moment.

    Attributes:
        now_s: fleet time of the snapshot, seconds (simulated time for the simulation).
        connected: the source answered; when False the other fields are the last known values and ``message``
            says what is wrong.
        message: one line about the source (``simulation x10``, ``fleet unreachable: ...; retry in 2.0 s``).
        workers, gpus, prefixes, transfers, ttft: rows as above (transfers: in flight first, then recent).
        gpu_note: why no GPU rows exist (``NVML unavailable: <reason>``), else None.
        constants: the four constants in force (``BtbConstants.as_dict()``).
        policy: the routing policy in force.
        rps: arrivals per second over the latest complete bucket.
        finished: the simulation replayed its whole trace (always False for a live fleet).
    """

    now_s: float
    connected: bool
    message: str
    workers: tuple[WorkerRow, ...] = ()
    gpus: tuple[GpuRow, ...] = ()
    gpu_note: str | None = None
    prefixes: tuple[PrefixRow, ...] = ()
    transfers: tuple[TransferRow, ...] = ()
    ttft: tuple[TtftPoint, ...] = ()
    constants: dict = field(default_factory=dict)
    policy: str = ""
    rps: float = 0.0
    finished: bool = False


@dataclass(frozen=True, slots=True)
class ReplicateResult:
    """Outcome of :meth:`LiveSource.replicate`: ``copy_ids`` of the copies started (may be fewer than asked),
    the ``source`` worker and ``targets``; ``message`` one line for the screen."""

    prefix_id: str
    copy_ids: tuple[str, ...]
    source: str
    targets: tuple[str, ...]
    message: str


class LiveSource(Protocol):
    """What the dashboard talks to. All methods are coroutines and never block the event loop.

    ``set_constants`` returns the constants the fleet confirms (a dict of the four) and raises
    :class:`~btbctl.engine.errors.ConfigError` naming the key it refuses; ``set_policy`` returns the policy in
    force; ``replicate`` raises :class:`LiveError` when nothing can be copied.
    """

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def snapshot(self) -> FleetSnapshot: ...

    async def set_constants(self, **changes: Any) -> dict: ...

    async def set_policy(self, name: str) -> str: ...

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult: ...


# -- the simulation -----------------------------------------------------------------------------------------------

class _Buckets:
    """TTFT samples and arrivals per bucket of fleet time."""

    def __init__(self, width_s: float = TTFT_BUCKET_S, keep: int = TTFT_BUCKETS) -> None:
        self.width = width_s
        self.keep = keep
        self.ttft: dict[int, list[float]] = {}
        self.arrivals: dict[int, int] = {}

    def _trim(self, b: int) -> None:
        lo = b - self.keep
        for d in (self.ttft, self.arrivals):
            if len(d) > self.keep + 4:
                for k in [k for k in d if k <= lo]:
                    del d[k]

    def add_ttft(self, t_s: float, ttft_s: float) -> None:
        b = int(t_s // self.width)
        self.ttft.setdefault(b, []).append(ttft_s)
        self._trim(b)

    def add_arrival(self, t_s: float) -> None:
        b = int(t_s // self.width)
        self.arrivals[b] = self.arrivals.get(b, 0) + 1
        self._trim(b)

    def series(self, now_s: float) -> tuple[list[TtftPoint], float]:
        cur = int(now_s // self.width)
        pts = []
        for b in range(max(0, cur - self.keep), cur):  # complete buckets only
            xs = sorted(self.ttft.get(b, ()))
            n = self.arrivals.get(b, 0)
            if not xs and not n and not pts:
                continue
            pts.append(TtftPoint((b + 1) * self.width, percentile(xs, 50), percentile(xs, 95), n / self.width))
        rps = pts[-1].rps if pts else 0.0
        return pts, rps


class SimLiveSource:
    """A live simulation behind the :class:`LiveSource` interface.

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

    def __init__(self, trace, cluster, constants: BtbConstants | None = None, policy: str = "btb", *,
                 seed: int = 42, speed: float = 1.0, paced: bool = True, start_s: float | None = None,
                 tick_s: float = 0.01, clock: Callable[[], float] = time.monotonic) -> None:
        from btbctl.engine.policies import make_policy
        from btbctl.engine.sim.simulator import Simulator, check_fits

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
        pol = make_policy(policy, cluster.replicas, random.Random(seed), self.constants,
                          block_tokens=trace.block_tokens)
        self.sim = Simulator(trace, pol, cluster, self.constants)
        first = self._reqs[0].arrival_s if self._reqs else 0.0
        self.start_s = max(0.0, first - 1.0) if start_s is None else float(start_s)
        self.sim.advance_to(self.start_s)
        self._lock = threading.Lock()
        self._buckets = _Buckets()
        self._own_detector = None
        self._chains: dict[Hashable, tuple] = {}  # detector key -> its Y-block prefix
        self._ids: dict[str, Hashable] = {}  # prefix id -> key
        self._copy_keys: dict[int, str] = {}  # copy id -> prefix id
        self._failed: deque[TransferRow] = deque(maxlen=RECENT_TRANSFERS)
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
                    self._chains = {k: v for k, v in self._chains.items() if det.prefix_of(k) is not None
                                    or det.arrivals_in_window(k, self.sim.now)}
        self._buckets.add_arrival(self.sim.now)
        self.submitted += 1
        self.sim.submit(req)

    def _on_first_token(self, req, replica: int, ttft_s: float, cached_tokens: int) -> None:
        self._buckets.add_ttft(self.sim.now, ttft_s)

    # -- detector ---------------------------------------------------------------------------------------------
    def _detector(self):
        det = getattr(self.sim.policy, "detector", None)
        return det if det is not None else self._own_detector

    def _sync_detector(self) -> None:
        """Policies without a detector (round_robin, ...) get one kept here for the heat view."""
        from btbctl.engine.detector import BurstDetector

        if getattr(self.sim.policy, "detector", None) is None:
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
        for i in range(len(sim.replicas)):
            st = sim.replica_state(i)
            workers.append(WorkerRow(f"w{i}", True, st["running"], st["waiting"], st["used_tokens"],
                                     st["capacity_tokens"]))
            rep = sim.replicas[i]
            used = (cost.model.weight_bytes + st["used_tokens"] * kvb) / g
            util = 100.0 if rep.busy else 0.0
            for j in range(g):
                gpus.append(GpuRow(f"w{i}/gpu{j}", used, cost.gpu.hbm_bytes, util, "sim"))
        det = self._detector()
        y = det.constants.prefix_blocks
        copies_by_key: dict[Hashable, int] = {}
        for c in sim.net.active:
            if len(c.chain) >= y:
                k = c.chain[y - 1]
                copies_by_key[k] = copies_by_key.get(k, 0) + 1
        prefixes = []
        for h in det.heat(now, top):
            chain = self._chains.get(h.key) or det.prefix_of(h.key)
            holders = 0
            if chain is not None:
                holders = sum(1 for r in sim.replicas if r.cache.match(chain) >= len(chain))
            prefixes.append(PrefixRow(self._prefix_id(h.key), y * self.block_tokens, h.arrivals_in_window,
                                      det.constants.threshold, holders, copies_by_key.get(h.key, 0), h.hot))
        transfers = [self._transfer_row(c, now, y) for c in sim.net.active]
        recent = [self._transfer_row(c, now, y) for c in sim.completed_copies[-RECENT_TRANSFERS:]]
        recent.extend(self._failed)
        transfers.extend(reversed(recent[-RECENT_TRANSFERS:]))
        ttft, rps = self._buckets.series(now)
        policy = getattr(sim.policy, "name", type(sim.policy).__name__)
        mode = "manual clock" if not self.paced else f"x{self.speed:g}"
        msg = f"simulation {mode}, t={now:.1f} s, {self.submitted} requests"
        return FleetSnapshot(now_s=now, connected=True, message=msg, workers=tuple(workers), gpus=tuple(gpus),
                             gpu_note=None, prefixes=tuple(prefixes), transfers=tuple(transfers), ttft=tuple(ttft),
                             constants=self.constants.as_dict(), policy=policy, rps=rps, finished=self.finished)

    def _transfer_row(self, c, now: float, y: int) -> TransferRow:
        key = c.chain[y - 1] if len(c.chain) >= y else c.chain[-1]
        pid = self._copy_keys.get(c.cid) or self._prefix_id(key)
        if c.done_s is not None:
            return TransferRow(f"c{c.cid}", pid, f"w{c.src}", f"w{c.dst}", c.total_bytes, c.total_bytes, 0.0,
                               None, "done")
        sent = min(c.total_bytes, c.avail_bytes, c.sent_bytes + c.rate * max(0.0, now - c.t_last))
        sent = max(sent, c.sent_bytes)
        eta = (c.total_bytes - sent) / c.rate if c.rate > 0 else None
        state = "stalled" if c.rate <= 0 else "running"
        return TransferRow(f"c{c.cid}", pid, f"w{c.src}", f"w{c.dst}", sent, c.total_bytes, c.rate, eta, state)

    # -- actions ----------------------------------------------------------------------------------------------
    async def set_constants(self, **changes: Any) -> dict:
        """Validate (:meth:`BtbConstants.with_updates`) and apply to the policy; returns the constants in force.
        Raises :class:`ConfigError` naming the refused key."""
        return await asyncio.to_thread(self.set_constants_sync, **changes)

    def set_constants_sync(self, **changes: Any) -> dict:
        with self._lock:
            new = self.constants.with_updates(**changes)
            self.sim.policy.set_constants(new)
            self.sim.constants = new
            self.constants = new
            self._sync_detector()
            return new.as_dict()

    async def set_policy(self, name: str) -> str:
        """Route with a fresh policy ``name`` from now on (its routing state starts empty). Raises
        :class:`ConfigError` for an unknown name."""
        return await asyncio.to_thread(self.set_policy_sync, name)

    def set_policy_sync(self, name: str) -> str:
        from btbctl.engine.policies import make_policy

        with self._lock:
            pol = make_policy(name, len(self.sim.replicas), random.Random(self._seed), self.constants,
                              block_tokens=self.block_tokens)
            self.sim.policy = pol
            self._sync_detector()
            return pol.name

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult:
        """Copy the prefix ``prefix_id`` (or an unambiguous leading part of at least
        :data:`~btbctl.engine.chains.MIN_PREFIX_ID_CHARS` hex digits) from its least-loaded holder to ``n`` more workers, least-loaded
        first. Raises :class:`LiveError` (unknown or ambiguous id, no holder, nothing accepted) or
        :class:`ConfigError` (``n`` < 1)."""
        return await asyncio.to_thread(self.replicate_sync, prefix_id, n)

    def replicate_sync(self, prefix_id: str, n: int) -> ReplicateResult:
        if not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        try:
            pid = check_prefix_id(prefix_id)
        except ValueError as e:
            raise LiveError(f"prefix id: {e}") from None
        with self._lock:
            sim = self.sim
            for key in self._chains:
                self._ids.setdefault(chains.prefix_id(key), key)
            matches = [k for k in self._ids if k.startswith(pid)]
            if not matches:
                raise LiveError(f"unknown prefix {prefix_id!r}")
            if len(matches) > 1:
                raise LiveError(f"prefix id {prefix_id!r} is ambiguous ({len(matches)} prefixes match)")
            full = matches[0]
            chain = self._chains.get(self._ids[full])
            if chain is None:
                raise LiveError(f"prefix {full[:SHORT_ID_CHARS]} is no longer tracked")
            view = sim.view
            y = len(chain)
            holders = [r for r in range(view.n_replicas) if view.cached_blocks(r, chain) >= y]
            if not holders:
                raise LiveError(f"no worker holds all of prefix {full[:SHORT_ID_CHARS]} yet")
            source = min(holders, key=lambda r: (view.load(r), r))
            free = [r for r in range(view.n_replicas)
                    if r not in holders and not view.copy_in_flight(r, chain)
                    and view.pending_blocks(r, chain) < y]
            free.sort(key=lambda r: (view.load(r), r))
            started, targets = [], []
            if free:
                plan = CopyPlan(tuple(chain), source, tuple(free), min(n, len(free)))
                for r in carry_out(plan, lambda t: sim.start_copy(plan.prefix, source, t, sim.now)):
                    c = next(c for c in reversed(sim.net.active) if c.dst == r and c.chain == plan.prefix)
                    self._copy_keys[c.cid] = full
                    started.append(f"c{c.cid}")
                    targets.append(f"w{r}")
            if not started:
                raise LiveError(f"prefix {full[:SHORT_ID_CHARS]}: no worker can take a copy (all hold it, "
                                "receive it, or lack room)")
            msg = f"copying {full[:SHORT_ID_CHARS]} from w{source} to {', '.join(targets)}"
            if len(started) < n:
                msg += f" ({n - len(started)} fewer than asked: no other worker can take it)"
            return ReplicateResult(full, tuple(started), f"w{source}", tuple(targets), msg)


def sim_source_from_config(cfg, policy: str | None = None, *, speed: float = 1.0, paced: bool = True,
                           trace=None) -> SimLiveSource:
    """A :class:`SimLiveSource` for a :class:`~btbctl.engine.dryrun.DryRunConfig`: its trace (or ``trace``),
    cluster, constants and seed; ``policy`` default: ``btb`` when listed, else the config's first policy."""
    from btbctl.engine.dryrun import load_trace

    cfg.check()
    if trace is None:
        trace = load_trace(cfg)
    if policy is None:
        policy = "btb" if "btb" in cfg.policies else cfg.policies[0]
    return SimLiveSource(trace, cfg.cluster, cfg.btb, policy, seed=cfg.seed, speed=speed, paced=paced)


# -- a running fleet ----------------------------------------------------------------------------------------------

#: First and largest wait between reconnection attempts, seconds (doubling in between). A product choice: quick
#: enough to notice a restarted fleet within seconds, slow enough not to hammer a machine that is down.
RECONNECT_MIN_S = 0.5
RECONNECT_MAX_S = 8.0
#: Per-request timeout of control-API calls, seconds.
REQUEST_TIMEOUT_S = 3.0
#: Seconds between two NVML reads (NVML's own utilisation sample period is about a second).
NVML_EVERY_S = 2.0
#: Trailing seconds of TTFT series asked from the control API.
TTFT_WINDOW_S = 120.0


def resolve_control_api(*, url: str | None = None, token: str | None = None, token_file: str | None = None,
                        run_dir: str | None = None) -> tuple[str, str | None]:
    """The control-API base URL and bearer token to use: ``url`` or the one recorded by ``btbctl up`` in the run
    directory; ``token``, else the content of ``token_file``, else the run directory's ``control.token`` (None
    when there is none: reads work, writes will be refused).

    Raises:
        BtbctlError: no ``url`` and no running fleet recorded; an unreadable ``token_file``.
    """
    from btbctl.engine.launcher.rundir import RunDir

    rd = RunDir(run_dir)
    if url is None:
        state = rd.live_state()
        if not state.control_url:
            raise BtbctlError(f"the fleet recorded in {rd.path} has no control API yet (still starting?)")
        url = state.control_url
    if token is None and token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise BtbctlError(f"cannot read the token file {token_file}: {e.strerror or e}") from None
    if token is None:
        try:
            token = rd.read_token()
        except BtbctlError:
            token = None
    return url.rstrip("/"), token


def _is_loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _f(x: Any, default: float = 0.0) -> float:
    try:
        return default if x is None else float(x)
    except (TypeError, ValueError):
        return default


class ControlApiLiveSource:
    """A running fleet's control API behind the :class:`LiveSource` interface.

    Reads ``GET /control/fleet``, ``/control/prefixes?top=N``, ``/control/transfers`` and
    ``/control/ttft?window_s=`` concurrently for each snapshot; writes ``PUT /control/constants`` and
    ``POST /control/replicate`` with ``Authorization: Bearer <token>``. When the fleet cannot be reached the snapshot
    keeps the last known rows with ``connected=False`` and a message, and the next attempt waits
    :data:`RECONNECT_MIN_S` doubling up to :data:`RECONNECT_MAX_S` (attempts are not made more often, however often
    :meth:`snapshot` is called). GPUs: as the workers report them (``hbm_used_bytes``/``hbm_total_bytes`` in a
    worker row), else read through NVML when the control API is on this machine (loopback), else ``gpu_note`` says
    why there are none.

    Args:
        base_url: ``http://host:port`` of the control API.
        token: bearer token (None: writes raise :class:`LiveError`).
        top: prefixes asked for.
        nvml_module: passed to :func:`btbctl.engine.telemetry.nvml.read_gpus` (tests).
        clock: monotonic seconds (tests).
    """

    def __init__(self, base_url: str, token: str | None = None, *, top: int = 10, nvml_module: Any = None,
                 local_gpus: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.top = top
        self._nvml_module = nvml_module
        self._local = _is_loopback(self.base_url) if local_gpus is None else local_gpus
        self._clock = clock
        self._session = None
        self._last: FleetSnapshot | None = None
        self._next_try = 0.0
        self._backoff = RECONNECT_MIN_S
        self._nvml = None
        self._nvml_at = -math.inf
        self._last_fleet: dict = {}
        self.failures = 0

    async def start(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _get(self, path: str) -> Any:
        await self.start()
        async with self._session.get(self.base_url + path) as resp:
            if resp.status != 200:
                raise LiveError(f"GET {path}: HTTP {resp.status}")
            return await resp.json()

    async def _write(self, method: str, path: str, body: dict) -> Any:
        import aiohttp

        if not self.token:
            raise LiveError("no control token: pass --token/--token-file or use the run directory of 'btbctl up'")
        await self.start()
        headers = {"Authorization": f"Bearer {self.token}"}
        try:
            async with self._session.request(method, self.base_url + path, json=body, headers=headers) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    data = {"error": (await resp.text()).strip()}
                if resp.status >= 300:
                    err = data.get("error", data) if isinstance(data, dict) else data
                    if isinstance(err, dict):
                        key, msg = err.get("key"), err.get("message") or err.get("error")
                    else:
                        key, msg = None, err
                    if resp.status == 400 and key:
                        text = str(msg or "refused")
                        prefix = f"{key}: "
                        raise ConfigError(str(key), text[len(prefix):] if text.startswith(prefix) else text)
                    raise LiveError(f"{method} {path}: HTTP {resp.status}: {msg}")
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise LiveError(f"{method} {path}: fleet unreachable ({type(e).__name__}: {e})") from None

    def _down(self, why: str) -> FleetSnapshot:
        self.failures += 1
        now = self._clock()
        self._next_try = now + self._backoff
        msg = f"fleet unreachable at {self.base_url}: {why}; retrying in {self._backoff:.1f} s"
        self._backoff = min(RECONNECT_MAX_S, self._backoff * 2)
        last = self._last
        if last is None:
            return FleetSnapshot(now_s=0.0, connected=False, message=msg)
        return replace(last, connected=False, message=msg)

    async def snapshot(self) -> FleetSnapshot:
        """Fetch the fleet's state (or, while it is unreachable and the backoff runs, the last one marked
        ``connected=False``)."""
        import aiohttp

        if self._last is not None and not self._last.connected and self._clock() < self._next_try:
            return self._last
        try:
            fleet, prefixes, transfers, ttft = await asyncio.gather(
                self._get("/control/fleet"), self._get(f"/control/prefixes?top={self.top}"),
                self._get("/control/transfers"), self._get(f"/control/ttft?window_s={TTFT_WINDOW_S:g}"))
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, LiveError, ValueError) as e:
            why = str(e) or type(e).__name__
            self._last = self._down(why)
            return self._last
        self._last_fleet = fleet
        gpus, note = await self._gpus(fleet)
        was_down = self._last is not None and not self._last.connected
        self._backoff = RECONNECT_MIN_S
        snap = self._parse(fleet, prefixes, transfers, ttft, gpus, note)
        if was_down:
            snap = replace(snap, message=f"reconnected to {self.base_url}")
        self._last = snap
        return snap

    async def _gpus(self, fleet: dict) -> tuple[tuple[GpuRow, ...], str | None]:
        rows = []
        for w in fleet.get("workers", []):
            if w.get("hbm_total_bytes"):
                rows.append(GpuRow(str(w.get("name")), _f(w.get("hbm_used_bytes")), _f(w.get("hbm_total_bytes")),
                                   w.get("gpu_util_pct"), "worker"))
        if rows:
            return tuple(rows), None
        if not self._local:
            return (), "NVML unavailable: the fleet is not on this machine and its workers report no HBM"
        now = self._clock()
        if self._nvml is None or now - self._nvml_at >= NVML_EVERY_S:
            from btbctl.engine.telemetry.nvml import read_gpus

            self._nvml = await asyncio.to_thread(read_gpus, self._nvml_module)
            self._nvml_at = now
        res = self._nvml
        if not res.available:
            return (), f"NVML unavailable: {res.reason}"
        return tuple(GpuRow(f"gpu{g.index}", g.used_bytes, g.total_bytes, g.util_pct, "nvml") for g in res.gpus), None

    def _parse(self, fleet: dict, prefixes: dict, transfers: dict, ttft: Any, gpus, note) -> FleetSnapshot:
        names = {}
        workers = []
        for w in fleet.get("workers", []):
            name = str(w.get("name"))
            names[w.get("url")] = name
            workers.append(WorkerRow(
                name, bool(w.get("healthy")), int(w.get("running") or 0), int(w.get("waiting") or 0),
                None if w.get("kv_used_tokens") is None else int(w["kv_used_tokens"]),
                None if w.get("kv_capacity_tokens") is None else int(w["kv_capacity_tokens"]),
                w.get("error")))
        prows = []
        for p in prefixes.get("prefixes", []):
            holders = p.get("holders", 0)
            prows.append(PrefixRow(
                str(p.get("id")), int(p.get("prefix_tokens") or 0), int(p.get("arrivals_in_window") or 0),
                int(p.get("threshold") or prefixes.get("threshold") or 0),
                len(holders) if isinstance(holders, list) else int(holders or 0),
                int(p.get("copies_in_flight") or 0), bool(p.get("hot"))))
        trows = []
        for t in transfers.get("transfers", []):
            trows.append(TransferRow(
                str(t.get("copy_id")), str(t.get("prefix") or t.get("prefix_id") or ""),
                names.get(t.get("source"), str(t.get("source"))), names.get(t.get("target"), str(t.get("target"))),
                _f(t.get("bytes_sent")), _f(t.get("bytes_total")), _f(t.get("bytes_per_s")),
                None if t.get("eta_s") is None else _f(t.get("eta_s")), str(t.get("state")), t.get("error")))
        series = ttft.get("series", ttft.get("points", [])) if isinstance(ttft, dict) else ttft
        pts = tuple(TtftPoint(_f(r.get("t_s", r.get("t"))), _f(r.get("p50_s", r.get("p50")), math.nan),
                              _f(r.get("p95_s", r.get("p95")), math.nan), _f(r.get("rps")))
                    for r in series or ())
        healthy = sum(1 for w in workers if w.healthy)
        msg = f"fleet {self.base_url}: {healthy}/{len(workers)} workers healthy"
        return FleetSnapshot(
            now_s=_f(fleet.get("now_s")), connected=True, message=msg, workers=tuple(workers), gpus=gpus,
            gpu_note=note, prefixes=tuple(prows), transfers=tuple(trows), ttft=pts,
            constants=dict(fleet.get("constants") or {}), policy=str(fleet.get("policy") or ""),
            rps=pts[-1].rps if pts else 0.0)

    async def set_constants(self, **changes: Any) -> dict:
        """``PUT /control/constants`` with ``changes`` (validated here first); returns the four constants the
        fleet confirms. Raises :class:`ConfigError` (the key it refuses) or :class:`LiveError`."""
        current = self._last.constants if self._last is not None and self._last.constants else None
        (BtbConstants(**current) if current else BtbConstants()).with_updates(**changes)
        data = await self._write("PUT", "/control/constants", changes)
        confirmed = data.get("constants", data) if isinstance(data, dict) else {}
        out = {k: confirmed[k] for k in BtbConstants().as_dict() if k in confirmed}
        if self._last is not None:
            self._last = replace(self._last, constants={**self._last.constants, **out})
        return out

    async def set_policy(self, name: str) -> str:
        """``PUT /control/constants`` with ``{"policy": name}``; returns the policy in force."""
        data = await self._write("PUT", "/control/constants", {"policy": name})
        return str(data.get("policy", name)) if isinstance(data, dict) else name

    async def replicate(self, prefix_id: str, n: int) -> ReplicateResult:
        """``POST /control/replicate {"prefix", "n"}``."""
        if not isinstance(n, int) or n < 1:
            raise ConfigError("n", f"must be an integer >= 1, got {n!r}")
        data = await self._write("POST", "/control/replicate", {"prefix": prefix_id, "n": n})
        data = data if isinstance(data, dict) else {}
        names = {}
        if self._last is not None:
            names = {w.get("url"): w.get("name") for w in self._last_fleet.get("workers", [])}
        ids = tuple(str(c) for c in data.get("copy_ids", [c.get("copy_id") for c in data.get("copies", [])]))
        targets = tuple(names.get(t, str(t)) for t in data.get("targets", []))
        source = names.get(data.get("source"), str(data.get("source", "")))
        full = str(data.get("prefix", prefix_id))
        msg = f"copying {full[:SHORT_ID_CHARS]} from {source} to {', '.join(targets) or '-'}"
        return ReplicateResult(full, ids, source, targets, msg)
