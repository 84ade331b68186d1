"""The replica model of the simulator driven in (scaled) real time: the emulated worker's "GPU".

One :class:`~btbctl.engine.sim.simulator.Simulator` with one replica. Model time runs at ``time_scale`` model
seconds per wall second: ``model_now = (monotonic() - t0) x time_scale``. A driver task sleeps until the next model
event (converted back to wall time) and is woken by every submission, so each request's first token and finish
happen at the wall time the model says. In zero-delay mode (``--zero-delay`` or ``time_scale`` 0) model time is
decoupled from the wall clock: a submission runs the model forward until that request finishes, at once; cache
bookkeeping is the same.

A streamed request whose HTTP client went away is aborted (as SGLang does): it leaves the decode batch at once, or
stops at its first token if it had not reached it; a non-streamed one runs to completion.

Copies. *Outgoing*: :meth:`LiveModel.wait_blocks` lets a sender wait until the model has committed the leading
blocks of a chain it is still computing (blocks commit at the end of each prefill chunk, as in the simulator);
waiters are checked after every step of the model. *Incoming*: :meth:`LiveModel.begin_copy` registers a chain
whose blocks are arriving as pending in the model (room reserved, the blocks already resident pinned), so a request
needing them waits for them instead of recomputing; :meth:`LiveModel.end_copy` commits them (all verified) or
drops the reservation (the copy failed: waiting requests then compute the blocks themselves).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from btbctl.engine.aiotasks import cancel_and_wait
from btbctl.engine.constants import BtbConstants
from btbctl.engine.policies import make_policy
from btbctl.engine.sim.simulator import RequestRecord, Simulator
from btbctl.engine.trace.model import Request, Trace
from btbctl.engine.worker.config import WorkerConfig


class TooLarge(ValueError):
    """A request whose prompt plus output can never fit in this worker's KV cache (HTTP 400)."""


class BlocksLost(RuntimeError):
    """Blocks a sender waits for are neither resident nor being computed here any more (evicted, or never
    planned), or did not arrive within the wait's timeout."""


class NoRoom(RuntimeError):
    """An incoming copy does not fit in the KV cache (even after evicting every unpinned block)."""


@dataclass
class IncomingCopy:
    """Bookkeeping of one copy arriving at this model (see :meth:`LiveModel.begin_copy`).

    Attributes:
        chain: the copy's block hashes.
        have: leading blocks resident when it began (pinned until it ends).
        reserved: blocks reserved for it (``len(chain) - have``).
        marked: block hashes it registered as pending (those not already pending for a prefill here).
    """

    chain: tuple
    have: int
    reserved: int
    marked: list
    marker: object = None
    open: bool = True


@dataclass
class LiveRequest:
    """One request in flight. Wall times are ``time.monotonic()`` seconds; model times are model seconds.

    ``first`` resolves when the first token is out (with ``cached_tokens``), ``done`` when the request finished.
    """

    rid: str
    sim_id: str
    prompt_tokens: int
    max_new_tokens: int
    arrival_wall: float
    first: asyncio.Future
    done: asyncio.Future
    cached_tokens: int = 0
    first_wall: float = math.nan
    finish_wall: float = math.nan
    ttft_model_s: float = math.nan
    e2e_model_s: float = math.nan
    itl_wall_s: float = 0.0
    """Estimated wall seconds between output tokens (decode step time at the first token / time_scale)."""
    record: RequestRecord | None = field(default=None, repr=False)


class LiveModel:
    """Args:
        cfg: worker settings.
        clock: wall clock (monotonic seconds), injectable for tests.

    Raises:
        ConfigError: a model that does not fit its GPUs, unknown presets.
    """

    def __init__(self, cfg: WorkerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.cluster = cfg.cluster()
        self.cost = self.cluster.replica_cost()
        self.block_tokens = cfg.page_size
        self.capacity_tokens = self.cost.kv_budget_tokens
        self.zero = cfg.zero
        self.scale = cfg.time_scale
        self.clock = clock
        self.t0 = clock()
        self._ids = itertools.count(1)
        self._live: dict[str, LiveRequest] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.on_evict: list[Callable[[object], None]] = []
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        #: senders waiting for blocks: (chain, blocks needed, future resolved with the resident count)
        self._block_waiters: list[tuple[tuple, int, asyncio.Future]] = []
        self._incoming: set[int] = set()  # ids of incoming copies still open
        self.sim = self._new_sim()

    # -- construction -----------------------------------------------------------------------------------------
    def _new_sim(self) -> Simulator:
        policy = make_policy("round_robin", 1, random.Random(0))
        sim = Simulator(Trace([], self.block_tokens, "live"), policy, self.cluster, BtbConstants())
        sim.on_first_token = self._first_token
        sim.on_finish = self._finished
        cache = sim.replicas[0].cache
        inner = cache.on_evict

        def evicted(h, _inner=inner) -> None:
            if _inner is not None:
                _inner(h)
            for cb in self.on_evict:
                cb(h)

        cache.on_evict = evicted
        return sim

    @property
    def cache(self):
        """The replica's :class:`~btbctl.engine.sim.cache.PrefixCache` (read-only use)."""
        return self.sim.replicas[0].cache

    # -- clock ------------------------------------------------------------------------------------------------
    def model_now(self) -> float:
        """Current model time, seconds."""
        if self.zero:
            return self.sim.now
        return (self.clock() - self.t0) * self.scale

    def sync(self) -> None:
        """Bring the model up to the current time (fires hooks of events that are due)."""
        if not self.zero:
            self.sim.advance_to(self.model_now())
        if self._block_waiters:
            self._release_blocks()

    def start(self) -> None:
        """Start the driver task (not needed in zero-delay mode). Call inside the running event loop."""
        if not self.zero and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    @property
    def alive(self) -> bool:
        """Whether the model is able to serve (driver running, or zero-delay mode)."""
        return self.zero or (self._task is not None and not self._task.done())

    async def _drive(self) -> None:
        while True:
            self._wake.clear()
            self.sim.advance_to(self.model_now())
            if self._block_waiters:
                self._release_blocks()
            nxt = self.sim.next_event_s()
            timeout = None if nxt is None else max(0.0, (nxt - self.model_now()) / self.scale)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    # -- hooks ------------------------------------------------------------------------------------------------
    def _first_token(self, req: Request, replica: int, ttft_s: float, cached_tokens: int) -> None:
        lr = self._live.get(req.request_id)
        if lr is None:
            return
        lr.first_wall = self.clock()
        lr.cached_tokens = cached_tokens
        lr.ttft_model_s = ttft_s
        self.cached_tokens_total += cached_tokens
        if lr.max_new_tokens > 1 and not self.zero:
            # decode step of the sequences past their first token now (this one included), at their KV size
            decoding = [x for x in self._live.values() if not math.isnan(x.first_wall)]
            kv = sum(x.prompt_tokens + x.max_new_tokens // 2 for x in decoding)
            step = self.cost.decode_step_time_s(len(decoding), kv)
            lr.itl_wall_s = step / self.scale
        if not lr.first.done():
            lr.first.set_result(cached_tokens)

    def _finished(self, record: RequestRecord) -> None:
        lr = self._live.pop(record.request_id, None)
        if lr is None:
            return
        lr.finish_wall = self.clock()
        lr.e2e_model_s = record.finish_s - record.arrival_s
        lr.record = record
        if not lr.done.done():
            lr.done.set_result(record)

    # -- requests ---------------------------------------------------------------------------------------------
    def check_fits(self, prompt_tokens: int, n_blocks: int, max_new_tokens: int) -> None:
        """Raise :class:`TooLarge` when the request can never fit in the KV cache."""
        need = max(n_blocks * self.block_tokens, prompt_tokens) + max(1, max_new_tokens)
        if need > self.capacity_tokens:
            raise TooLarge(f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) need {need} "
                           f"tokens of KV cache; this worker holds {self.capacity_tokens}")

    def submit(self, chain: Sequence[str], prompt_tokens: int, max_new_tokens: int, rid: str) -> LiveRequest:
        """Start a request now. ``chain``: block hashes of the prompt's full pages; ``prompt_tokens`` >= 1.

        Raises:
            TooLarge: the request cannot fit.
        """
        self.check_fits(prompt_tokens, len(chain), max_new_tokens)
        loop = asyncio.get_running_loop()
        sim_id = f"r{next(self._ids)}"
        lr = LiveRequest(rid=rid, sim_id=sim_id, prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                         arrival_wall=self.clock(), first=loop.create_future(), done=loop.create_future())
        self._live[sim_id] = lr
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        req = Request(request_id=sim_id, arrival_s=0.0, input_tokens=prompt_tokens,
                      output_tokens=max(1, max_new_tokens), block_hashes=tuple(chain))
        self.sync()
        self.sim.submit(req, replica=0)
        if self.zero:
            while not lr.done.done():
                t = self.sim.next_event_s()
                if t is None:
                    if self._incoming:  # it waits for a copy arriving here: end_copy runs it on
                        break
                    # cannot happen otherwise for a request that fits; never spin
                    self._live.pop(sim_id, None)
                    raise RuntimeError("model went idle with a request unfinished")
                self.sim.advance_to(t)
            if self._block_waiters:
                self._release_blocks()
        else:
            self._wake.set()
        return lr

    # -- cache ------------------------------------------------------------------------------------------------
    def cached_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident now."""
        self.sync()
        return self.sim.view.cached_blocks(0, chain)

    def pending_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident or being computed here."""
        self.sync()
        return self.sim.view.pending_blocks(0, chain)

    def planned_blocks(self, chain: Sequence[str]) -> int:
        """Leading blocks of ``chain`` resident, being computed or arriving here, or that a request queued here
        will compute (the simulator's ``planned_blocks``: what a copy from this worker may trail)."""
        self.sync()
        return self.sim.view.planned_blocks(0, chain)

    # -- outgoing copies: waiting for the source's compute ----------------------------------------------------
    async def wait_blocks(self, chain: Sequence[str], need: int, timeout_s: float) -> int:
        """Wait until at least ``need`` leading blocks of ``chain`` are resident; returns how many are.

        Raises:
            BlocksLost: the blocks are neither resident nor planned here (evicted, or no request computes them),
                or ``timeout_s`` seconds passed first.
        """
        chain = tuple(chain)
        self.sync()
        have = self.cache.match(chain)
        if have >= need:
            return have
        if self.sim.view.planned_blocks(0, chain) < need:
            raise BlocksLost(f"block {have} ({chain[have]}) is neither resident nor being computed here")
        fut = asyncio.get_running_loop().create_future()
        entry = (chain, need, fut)
        self._block_waiters.append(entry)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise BlocksLost(f"block {self.cache.match(chain)} was not computed within {timeout_s:g} s") from None
        finally:
            if entry in self._block_waiters:
                self._block_waiters.remove(entry)

    def _release_blocks(self) -> None:
        """Resolve the senders whose blocks are now resident, fail those whose blocks are lost."""
        view = self.sim.view
        keep = []
        for entry in self._block_waiters:
            chain, need, fut = entry
            if fut.done():
                continue
            have = self.cache.match(chain)
            if have >= need:
                fut.set_result(have)
            elif view.planned_blocks(0, chain) < need:
                fut.set_exception(BlocksLost(f"block {have} ({chain[have]}) was evicted or is no longer "
                                             "being computed here"))
            else:
                keep.append(entry)
        self._block_waiters = keep

    def pin(self, chain: Sequence[str], start: int, stop: int) -> None:
        """Pin blocks ``start..stop-1`` of ``chain`` (resident) so they cannot be evicted while being sent."""
        if stop > start:
            self.cache.pin(chain[start:stop], stop - start)

    def unpin(self, chain: Sequence[str], n: int) -> None:
        """Undo :meth:`pin` of the first ``n`` blocks of ``chain``."""
        if n > 0:
            self.cache.unpin(chain, n)
            self._poke()

    # -- incoming copies ----------------------------------------------------------------------------------------
    def begin_copy(self, chain: Sequence[str]) -> IncomingCopy:
        """A copy of ``chain`` starts arriving: reserve room for the blocks not resident, pin the resident
        leading ones, and register the missing ones as pending, so that a request needing them waits for the
        copy (the simulator's ``start_copy`` bookkeeping on the target side).

        Raises:
            NoRoom: the missing blocks do not fit even after evicting every unpinned block.
        """
        self.sync()
        chain = tuple(chain)
        rep = self.sim.replicas[0]
        cache = rep.cache
        have = cache.match(chain)
        add = len(chain) - have
        cache.pin(chain, have)
        if add and not cache.make_room(add * self.block_tokens):
            cache.unpin(chain, have)
            raise NoRoom(f"no room in the KV cache for {add} blocks (in use by running requests)")
        cache.reserve_blocks(add)
        marker = object()
        marked = []
        for h in chain[have:]:
            if h not in rep.pending:
                rep.pending[h] = marker
                marked.append(h)
        inc = IncomingCopy(chain=chain, have=have, reserved=add, marked=marked, marker=marker)
        self._incoming.add(id(inc))
        return inc

    def end_copy(self, inc: IncomingCopy, ok: bool) -> bool:
        """End an incoming copy: with ``ok`` every block arrived and verified and becomes resident; otherwise
        the reservation is dropped and requests waiting for the blocks compute them. Returns True when the whole
        chain is resident afterwards. Idempotent."""
        if not inc.open:
            return False
        inc.open = False
        self._incoming.discard(id(inc))
        self.sync()
        rep = self.sim.replicas[0]
        marker = inc.marker
        for h in inc.marked:
            if rep.pending.get(h) is marker:
                del rep.pending[h]
        cache = rep.cache
        cache.release_reservation(inc.reserved)
        cache.unpin(inc.chain, inc.have)
        if ok:
            # the reserved room was just released and nothing ran in between: the insert cannot lack room
            self.sim.insert_prefix(0, inc.chain)
        self._poke()
        return cache.match(inc.chain) == len(inc.chain)

    def _poke(self) -> None:
        """Blocks became resident or free: let the model admit waiting requests now, and wake the driver."""
        self.sim._kick(self.sim.replicas[0])  # the simulator's own "new work may be admissible" step
        if self.zero:  # run the requests that waited for the blocks to completion, as submit does
            while self._live:
                t = self.sim.next_event_s()
                if t is None:
                    break
                self.sim.advance_to(t)
        self._wake.set()
        if self._block_waiters:
            self._release_blocks()

    def resident(self, block_hash: str) -> bool:
        return block_hash in self.cache

    def insert(self, chain: Sequence[str]) -> bool:
        """Make ``chain`` resident (blocks that arrived by copy). True when the whole chain is resident after."""
        self.sync()
        self.sim.insert_prefix(0, list(chain))
        self._wake.set()
        return self.sim.view.cached_blocks(0, chain) == len(chain)

    def busy(self) -> bool:
        st = self.sim.replica_state(0)
        return bool(st["running"] or st["waiting"])

    def abort(self, lr: LiveRequest) -> bool:
        """The client of ``lr`` went away: a decoding request leaves the batch now and frees its KV cache; one not
        yet at its first token stops there (SGLang aborts requests whose connection closed). Returns whether the
        model still had it."""
        if lr.done.done():
            return False
        self.sync()
        found = self.sim.abort(lr.sim_id)
        self._wake.set()
        return found

    def flush(self) -> int:
        """Drop every unpinned block (SGLang ``/flush_cache``); returns blocks dropped. Callers check idleness."""
        self.sync()
        return self.cache.flush()

    def state(self) -> dict:
        """``running``, ``waiting``, ``used_tokens``, ``capacity_tokens``, ``cached_blocks`` (model counters)."""
        self.sync()
        return self.sim.replica_state(0)

    def cache_hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over all requests that reached their first token."""
        return self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0

    def prefixes(self, limit: int) -> list[dict]:
        """Resident chains' deepest blocks, most recently used first: ``[{"hash", "blocks"}]`` (blocks in use by a
        running request or a copy come first)."""
        self.sync()
        cache = self.cache
        parent, children = cache.parent, cache.children
        leaves = [h for h in parent if not children.get(h)]
        pos = {h: i for i, h in enumerate(cache.lru)}
        leaves.sort(key=lambda h: (0, 0) if h in cache.refs else (1, -pos.get(h, -1)))
        depth: dict = {}
        out = []
        for h in leaves[:max(0, limit)]:
            path = []
            x = h
            while x is not None and x not in depth:
                path.append(x)
                x = parent.get(x)
            d = depth.get(x, 0) if x is not None else 0
            for y in reversed(path):
                d += 1
                depth[y] = d
            out.append({"hash": h, "blocks": depth[h]})
        return out
