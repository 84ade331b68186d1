"""The gateway's replicator: carries out copy plans over the workers' ``/btb`` routes and tracks each copy job.

The executor of the policies' copy plans (:meth:`Replicator.execute`, called by the gateway with each route's
:class:`~btbctl.engine.copies.CopyPlan`) and of the control API's manual replicate (:meth:`Replicator.replicate`).
It depends on the fleet state (:mod:`~btbctl.engine.gateway.state`) and plain callbacks, not on the gateway.

A copy job (one source, one target, one prefix chain):

1. **Source check.** ``POST {source}/btb/match {"chain"}`` must answer ``cached_blocks == len(chain)`` or
   ``pending_blocks == len(chain)`` (the source holds the prefix, or computes it: a request there is prefilling
   it or queued to). Then the push goes out at once, without waiting for the source's prefill: the copy trails
   it, each block streamed as soon as the source's model commits it (see ``POST /btb/push`` of
   :mod:`btbctl.engine.worker`). Only while the gateway has a request of the prefix in flight to the source that
   the source does not show yet (it is on its way) does the job wait (state ``stalled``), re-checking every
   :data:`SOURCE_RECHECK_S` for at most ``source_wait_s``. Otherwise the job fails ("source does not hold the
   prefix").
2. **Push.** The gateway mints a random per-copy token and authorizes the copy at the target first: ``POST
   {target}/btb/expect {"chain", "copy_id", "token"}`` (201; the target's transfer port accepts nothing
   else, see :mod:`btbctl.engine.replication.auth`). Then ``POST {source}/btb/push {"chain", "target": <target's
   transfer_addr from /btb/info>, "copy_id", "token"}``; both with ``Authorization: Bearer <worker token>``.
   202 once the target accepted the copy (it then makes requests needing the blocks wait for them; state
   ``running``), 409 means the source lost the chain.
3. **Progress.** ``GET {source}/btb/copies/{copy_id}?wait_s=<poll_interval_s>&since=<version>`` (a long poll: the worker
   answers at its copies' next change after the version it last reported) updates ``bytes_sent``, ``bytes_total``,
   ``blocks_verified`` and ``blocks_available`` (blocks the source has computed so far); the rate is the average since
   sending started. A worker that answers at once (no ``X-BTB-Long-Poll: 1`` header) is polled every
   ``poll_interval_s``.
4. **Outcome.** Only on ``done`` (the source reports it after the target verified and committed every block) is
   the target recorded as holding the prefix. ``failed``, an HTTP error, the source or target turning unhealthy,
   or ``copy_timeout_s`` without an outcome fail the job with the reason; a failed target is never treated as
   warm.

Refusals (``request_copy`` returns None): same worker, a worker unknown/unhealthy/without the BTB routes, the
target already recorded as holding the chain, a copy of it to that target already in flight, or the target
without a ``transfer_addr``. The replicator does not weigh copy time against recompute time: BTB's rule copies
whenever the detector fires; the fabric break-even (REFERENCE.md s6) is for the operator to judge.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field

import aiohttp

from btbctl.engine.chains import prefix_id, short_id
from btbctl.engine.copies import CopyOutcome, CopyPlan, CopyState, carry_out
from btbctl.engine.detector import tracked_key
from btbctl.engine.gateway.fleetshare import Claim, FleetShare
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.logfmt import log_event
from btbctl.engine.policies.base import Policy
from btbctl.engine.replication.auth import new_token

log = logging.getLogger(__name__)

#: Seconds between progress polls of a copy and between source checks (a product choice: ten updates a second
#: is what a dashboard shows smoothly).
DEFAULT_POLL_INTERVAL_S = 0.1
#: Answer header of a worker that held a progress poll until the copy changed (long poll).
LONG_POLL_HEADER = "X-BTB-Long-Poll"
#: Seconds between source checks while a request of the prefix is on its way to the source (a product choice:
#: a request reaches a loopback or LAN worker within milliseconds).
SOURCE_RECHECK_S = 0.005
#: Longest wait for a source that does not show the prefix yet, seconds (a 64k-token prefill of a 70B model on
#: one slow replica takes tens of seconds; a product choice).
DEFAULT_SOURCE_WAIT_S = 60.0
#: Longest time a copy may take once pushed, seconds (10 GiB over kernel TCP at about 1 GB/s is about 10 s;
#: a generous product choice).
DEFAULT_COPY_TIMEOUT_S = 300.0
#: Timeout of one control call to a worker (match, push, progress), seconds.
DEFAULT_CALL_TIMEOUT_S = 5.0


def _hot_fields(t: Transfer) -> dict[str, object]:
    """The log fields naming the hot prefix a copy is for (its short id, as ``detector_fired`` and
    ``btbctl prefixes`` show it) and the length copied (tokens; omitted when the page size is unknown)."""
    out: dict[str, object] = {"hot_prefix": short_id(prefix_id(t.hot_id))}
    if t.copied_tokens is not None:
        out["copied_tokens"] = t.copied_tokens
    return out


class ReplicateError(Exception):
    """A manual replication that cannot start; ``status`` is the HTTP status for the control API."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class ReplicateOutcome:
    """What :meth:`Replicator.replicate` started: ``prefix`` (id), the ``source`` worker index, the copies
    ``started`` (their :class:`~btbctl.engine.gateway.state.Transfer` records, live), how many fewer than asked
    (``skipped``) and the worker indexes that held the whole prefix when they started (``holders``). No copy
    started (``started`` empty) means every eligible worker already holds the prefix or is receiving it."""

    prefix: str
    source: int
    started: list[Transfer]
    skipped: int
    holders: list[int] = field(default_factory=list)


@dataclass
class PrewarmOutcome:
    """What a prewarm did: the worker index that computed the prompt (``computed_by``; -1 when its answer named
    no known worker), the prompt's length (``prompt_tokens``) and whole blocks (``blocks``), and the copies
    (``copies``, as for a replicate)."""

    copies: ReplicateOutcome
    computed_by: int
    prompt_tokens: int
    blocks: int
    hot_prefix: str | None = None
    """The id the detector tracks this prompt under (its first ``prefix_blocks`` blocks; what ``btbctl prefixes``
    lists), or None when the prompt is shorter than that."""


class CopyExecutor:
    """What every executor of copy plans shares (the push :class:`Replicator` and the ``l3`` one): carrying out a
    policy's plan, a job per copy in a background task, the manual replicate's choice of targets, finishing a
    job (state, transfer table, one log line, callbacks) and cancelling the jobs at shutdown. Subclasses say why a
    copy would be refused (:meth:`refusal`), build a job's :class:`Transfer` and run it (:meth:`_job`)."""

    #: Replication mode (``push``, ``l3``) and the prefix of the job's log events (``copy_done``, ``l3_copy_done``).
    mode = ""
    event_prefix = ""
    #: The :class:`Transfer` field a finished job's log line reports as ``bytes``, and what a chain's entries are.
    logged_bytes = "bytes_sent"
    unit = "blocks"

    def __init__(
        self,
        state: FleetState,
        session: Callable[[], aiohttp.ClientSession],
        on_change: Callable[[Transfer], None] | None,
        on_finish: Callable[[Transfer], None] | None,
    ) -> None:
        self.state = state
        self._session = session
        self.on_change = on_change
        self.on_finish = on_finish
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0
        #: The detector's prefix length (blocks) and the page size (tokens), read when a job starts (the gateway
        #: sets them; 0: unknown): a job records the hot prefix it is for and the tokens it copies.
        self.prefix_blocks: Callable[[], int] = lambda: 0
        self.block_tokens: Callable[[], int] = lambda: 0
        #: The fleet's shared copy orders (:class:`~btbctl.engine.gateway.fleetshare.FleetShare`; the gateway sets it
        #: with a ``redis_url``): each job claims its (prefix, target) first, and a copy another gateway claimed is
        #: awaited instead of run. None: this gateway alone.
        self.orders: FleetShare | None = None
        #: the ids of the jobs this gateway claimed (their outcome is published when they end)
        self._claimed: set[str] = set()
        #: longest wait for another gateway's copy outcome, seconds (the subclasses set their copy timeout)
        self.order_wait_s: float = 300.0

    def refusal(self, chain: Sequence[Hashable], source: int, target: int) -> str | None:
        """Why a copy of ``chain`` from ``source`` to ``target`` would be refused, or None when it would start."""
        raise NotImplementedError

    def accepts_copies(self, r: int) -> bool:
        """Whether worker ``r`` can send or receive a copy now (the policies' ``accepts_copies``)."""
        raise NotImplementedError

    def after_s(self, target: int, blocks: int) -> float:
        """Seconds from the last byte of a copy of ``blocks`` blocks at worker ``target`` until it serves them
        from its KV cache: 0 here (push: blocks land in the target's KV cache as they arrive)."""
        return 0.0

    async def replicate(self, chain: Sequence[Hashable], n: int, *, wait_s: float = 10.0) -> ReplicateOutcome:
        """Copy ``chain`` to ``n`` more workers now (the control API's manual replicate). Raises
        :class:`ReplicateError`."""
        raise NotImplementedError

    def _transfer(self, chain: tuple, source: int, target: int, manual: bool) -> Transfer:
        """A new job's record (the subclass adds its mode's fields)."""
        y, bt = self.prefix_blocks(), self.block_tokens()
        hot = tracked_key(chain, y)  # None: the chain is shorter than the detector's prefix
        return Transfer(
            copy_id=secrets.token_hex(8),
            key=chain[-1],
            chain=chain,
            source=source,
            target=target,
            created_s=self.state.clock(),
            manual=manual,
            hot_key=str(chain[-1] if hot is None else hot),
            copied_tokens=len(chain) * bt if bt > 0 else None,
        )

    async def _job(self, t: Transfer, source_confirmed: bool) -> None:
        raise NotImplementedError

    def _fail(self, t: Transfer, reason: str) -> None:
        raise NotImplementedError

    # -- starting jobs ------------------------------------------------------------------------------------------

    def execute(self, plan: CopyPlan, policy: Policy, excluded: Collection[int] = ()) -> list[int]:
        """Carry out a policy's copy plan: try its targets in order (:func:`~btbctl.engine.copies.carry_out`), each
        a background job (:meth:`request_copy`), never to or from a worker in ``excluded``; every attempt is
        reported to ``policy``. Returns the targets whose jobs started."""
        now = self.state.clock()
        source = plan.source

        def start(target: int) -> bool:
            if source in excluded or target in excluded:
                self.refused += 1
                return False
            return self.request_copy(plan.prefix, source, target) is not None

        return carry_out(plan, start, lambda t, ok: policy.on_copy_result(plan, t, ok, now))

    def request_copy(
        self,
        chain: Sequence[Hashable],
        source: int,
        target: int,
        *,
        manual: bool = False,
        source_confirmed: bool = False,
        ordered_by: str | None = None,
    ) -> Transfer | None:
        """Start a background copy job; returns its :class:`Transfer`, or None when refused (see
        :meth:`refusal`). Never blocks: the job runs in a task. ``ordered_by``: the id of the fleet's gateway that
        announced it runs this copy (:attr:`orders`); the job then only awaits that gateway's outcome."""
        chain = tuple(chain)
        if self.refusal(chain, source, target) is not None:
            self.refused += 1
            return None
        t = self._transfer(chain, source, target, manual)
        t.pushed = asyncio.Event()
        self.state.transfers.add(t)
        self._event("copy_accepted", t, **{self.unit: len(chain)}, manual=manual)
        task = asyncio.get_running_loop().create_task(
            self._job(t, source_confirmed)
            if self.orders is None
            else self._ordered_job(t, source_confirmed, ordered_by)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        # a job cancelled before it ran (the gateway stopping) never reaches its own handler: end it here
        task.add_done_callback(lambda _task, t=t: self._fail(t, "gateway stopped") if t.active else None)
        self._changed(t)
        return t

    async def _ordered_job(self, t: Transfer, source_confirmed: bool, ordered_by: str | None) -> None:
        """Job ``t`` in a fleet of gateways: claim its (prefix, target) for this gateway, then run it; when another
        gateway holds the claim, wait for that copy's outcome instead (the target holds the prefix only if it came
        ``done``). Without Redis the job runs unclaimed."""
        orders = self.orders
        assert orders is not None
        ws = self.state.workers
        target_url = ws[t.target].url
        try:
            if ordered_by is None:
                claim = await orders.claim(t.key, target_url, t.chain, ws[t.source].url)
            else:
                claim = Claim(ordered_by)
            if claim.owner == "self":
                self._claimed.add(t.copy_id)
            if claim.mine:
                await self._job(t, source_confirmed)
                return
            t.ordered_by = claim.owner
            t.routable = False  # never routed to before the other gateway's copy is proven
            self._event("copy_ordered_elsewhere", t, gateway=claim.owner, done=claim.done)
            self._changed(t)
            if claim.done:
                state, why = "done", f"copy ordered by gateway {claim.owner} already done"
            else:
                state, why = await orders.wait_outcome(t.key, target_url, self.order_wait_s)
            if t.active:
                if state == "done":
                    self._finish(t, CopyState.DONE, "copy_done", outcome=CopyOutcome.DONE, ordered_by=claim.owner)
                else:
                    self._fail(t, why)
        except asyncio.CancelledError:
            if t.active:
                self._fail(t, "gateway stopped")
            raise
        finally:
            if t.pushed is not None:
                t.pushed.set()

    def _publish_outcome(self, t: Transfer) -> None:
        """A claimed job ended: tell the other gateways (in the background)."""
        orders = self.orders
        if orders is None or t.copy_id not in self._claimed:
            return
        self._claimed.discard(t.copy_id)
        url = self.state.workers[t.target].url
        task = asyncio.get_running_loop().create_task(
            orders.publish_outcome(t.key, url, t.chain, t.state is CopyState.DONE)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start_manual(
        self, chain: tuple, cands: list[int], holders: list[int], n: int, wait_s: float, why_none: str
    ) -> ReplicateOutcome:
        """The manual replicate once the holders are known: the least-loaded holder is the source, the
        least-loaded candidates that neither hold the prefix nor receive it the targets (ties: lower index); waits
        up to ``wait_s`` for each push to be accepted or refused. When every candidate already holds the prefix or
        is receiving it, nothing starts and the outcome says so (no copies, ``holders``: not an error). Raises
        :class:`ReplicateError` (409, ``why_none``) when targets were free but every copy to them was refused."""
        ws = self.state.workers
        source = min(holders, key=lambda r: (ws[r].inflight, r))
        free = [r for r in cands if r not in holders and not self.state.transfers.in_flight(r, chain[-1])]
        free.sort(key=lambda r: (ws[r].inflight, r))
        started: list[Transfer] = []
        refused: list[str] = []
        for r in free:
            if len(started) >= n:
                break
            t = self.request_copy(chain, source, r, manual=True, source_confirmed=True)
            if t is not None:
                started.append(t)
            else:  # a refusal changes nothing: asked again, it gives the same reason
                refused.append(f"{ws[r].name}: {self.refusal(chain, source, r)}")
        if not started and free:
            raise ReplicateError(409, f"no eligible target for prefix {chain[-1]}: {why_none} ({'; '.join(refused)})")
        try:
            await asyncio.wait_for(asyncio.gather(*(t.pushed.wait() for t in started if t.pushed)), timeout=wait_s)
        except asyncio.TimeoutError:
            pass
        return ReplicateOutcome(
            prefix=str(chain[-1]),
            source=source,
            started=started,
            skipped=max(0, n - len(started)),
            holders=sorted(holders),
        )

    async def close(self) -> None:
        """Cancel every running job (at shutdown); they end ``failed`` with reason ``gateway stopped``."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- bookkeeping --------------------------------------------------------------------------------------------

    def _event(self, event: str, t: Transfer, **fields: object) -> None:
        """One log line about job ``t``: ``<event_prefix><event>`` with its id, the chain copied (``prefix``), the hot
        prefix it is for as ``btbctl prefixes`` lists it (``hot_prefix``) and the tokens copied, workers by name and
        URL."""
        ws = self.state.workers
        log_event(
            log,
            self.event_prefix + event,
            copy_id=t.copy_id,
            prefix=t.key,
            **_hot_fields(t),
            source=ws[t.source].name,
            source_url=ws[t.source].url,
            target=ws[t.target].name,
            target_url=ws[t.target].url,
            **fields,
        )

    def _changed(self, t: Transfer) -> None:
        if self.on_change is not None:
            self.on_change(t)

    def _finish(self, t: Transfer, state: CopyState, event: str, reason: str | None = None, **fields: object) -> None:
        """End job ``t`` in ``state`` (``done``: the target holds the prefix from now on): the transfer table, one
        log line ``event`` with the bytes and the duration, then the callbacks."""
        t.state = state
        t.finished_s = self.state.clock()
        outcome = fields.get("outcome")
        t.outcome = None if outcome is None else str(outcome)
        if state is CopyState.DONE:
            if t.bytes_total and t.bytes_sent < t.bytes_total:
                t.bytes_sent = t.bytes_total
            self.state.workers[t.target].hold(t.chain)
        else:
            t.error = reason
        self.state.transfers.finish(t)
        self._event(
            event,
            t,
            bytes=getattr(t, self.logged_bytes),
            duration_s=round(t.finished_s - t.created_s, 6),
            **fields,
            reason=reason,
        )
        self._publish_outcome(t)
        self._changed(t)
        if self.on_finish is not None:
            self.on_finish(t)


class Replicator(CopyExecutor):
    """Starts and runs prefix copies between the workers of ``state`` (replication mode ``push``; with
    ``enabled`` False, mode ``none``: every copy is refused).

    Args:
        state: the live fleet state (its transfer table is where jobs are tracked).
        session: a callable returning the shared :class:`aiohttp.ClientSession`.
        worker_token: bearer token sent to the workers' ``/btb/push`` (None: no header).
        poll_interval_s / source_wait_s / copy_timeout_s / call_timeout_s: see the module constants.
        on_change: called with the transfer after every state or progress change (metrics, events).
        on_finish: called once with the transfer when it ends ``done`` or ``failed``.
    """

    mode = "push"

    def __init__(
        self,
        state: FleetState,
        session: Callable[[], aiohttp.ClientSession],
        *,
        worker_token: str | None = None,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        source_wait_s: float = DEFAULT_SOURCE_WAIT_S,
        copy_timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        on_change: Callable[[Transfer], None] | None = None,
        on_finish: Callable[[Transfer], None] | None = None,
    ) -> None:
        super().__init__(state, session, on_change, on_finish)
        self.worker_token = worker_token
        self.poll_interval_s = poll_interval_s
        self.source_wait_s = source_wait_s
        self.copy_timeout_s = copy_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=call_timeout_s)
        self.enabled = True

    # -- eligibility ---------------------------------------------------------------------------------------------

    def _usable(self, r: int) -> bool:
        ws = self.state.workers
        return 0 <= r < len(ws) and ws[r].healthy and ws[r].btb is True

    def accepts_copies(self, r: int) -> bool:
        """Whether worker ``r`` can send or receive a pushed copy now (the policies' ``accepts_copies``): replication
        on, healthy, serving the BTB routes and naming its ``transfer_addr``."""
        ws = self.state.workers  # _usable's test inlined: asked per worker per routing decision
        if not (self.enabled and 0 <= r < len(ws)):
            return False
        w = ws[r]
        return w.healthy and w.btb is True and bool((w.info or {}).get("transfer_addr"))

    def refusal(self, chain: Sequence[Hashable], source: int, target: int) -> str | None:
        """Why a copy of ``chain`` from ``source`` to ``target`` would be refused, or None when it would start."""
        if not self.enabled:
            return "replication mode none: the gateway only routes"
        if not chain:
            return "empty chain"
        if source == target:
            return "source and target are the same worker"
        if not self._usable(source):
            return "source unhealthy or without the BTB routes"
        if not self._usable(target):
            return "target unhealthy or without the BTB routes"
        tw = self.state.workers[target]
        if tw.held_blocks(chain) >= len(chain):
            return "target already holds the prefix"
        if self.state.transfers.in_flight(target, chain[-1]):
            return "a copy to the target is already in flight"
        if not (tw.info or {}).get("transfer_addr"):
            return "target has no transfer_addr in /btb/info"
        return None

    # -- starting jobs ------------------------------------------------------------------------------------------

    async def replicate(self, chain: Sequence[Hashable], n: int, *, wait_s: float = 10.0) -> ReplicateOutcome:
        """Copy ``chain`` to ``n`` more workers now (the control API's manual replicate).

        The source is the least-loaded healthy worker that confirms the whole chain with ``/btb/match`` (every
        healthy worker with the BTB routes is asked, so holders the gateway did not see are found too); the
        targets are the least-loaded healthy workers with the routes that neither hold it nor are receiving it
        (ties: lower index). Waits up to ``wait_s`` for each push to be accepted or refused.

        Returns:
            the source, the copies started (each already accepted by its target, refused, or still waiting after
            ``wait_s``) and ``n`` minus their number.

        Raises:
            ReplicateError: 409 when no healthy worker holds the chain or no worker can receive it.
        """
        chain = tuple(chain)
        ws = self.state.workers
        if not self.enabled:
            raise ReplicateError(409, "replication mode none: the gateway only routes")
        cands = [w.index for w in ws if self._usable(w.index)]
        if not cands:
            raise ReplicateError(
                409,
                "no healthy worker with the BTB routes (replication needs emulated workers "
                "or workers with the /btb extension)",
            )
        answers = await asyncio.gather(*(self._match(r, chain) for r in cands))
        holders = [r for r, a in zip(cands, answers, strict=True) if a is not None and a[0] >= len(chain)]
        if not holders:
            raise ReplicateError(409, f"no healthy worker holds prefix {chain[-1]} ({len(chain)} blocks)")
        return await self._start_manual(
            chain,
            cands,
            holders,
            n,
            wait_s,
            "every worker free to receive it refused the copy",
        )

    # -- the job ------------------------------------------------------------------------------------------------

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.worker_token}"} if self.worker_token else {}

    async def _post(self, url: str, body: dict) -> tuple[int, str]:
        """POST ``body`` as JSON with the worker token: ``(status, text)``. Raises aiohttp.ClientError and
        asyncio.TimeoutError."""
        async with self._session().post(url, json=body, headers=self._headers(), timeout=self.timeout) as resp:
            return resp.status, await resp.text()

    async def _match(self, r: int, chain: tuple) -> tuple[int, int] | None:
        """``(cached_blocks, pending_blocks)`` of ``chain`` on worker ``r`` by ``/btb/match`` (None on error).
        A full match is recorded as a holding."""
        w = self.state.workers[r]
        try:
            async with self._session().post(
                f"{w.url}/btb/match", json={"chain": list(chain)}, timeout=self.timeout
            ) as resp:
                if resp.status != 200:
                    return None
                body = await resp.json(content_type=None)
            cached = int(body.get("cached_blocks", 0))
            pending = int(body.get("pending_blocks", cached))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, AttributeError):
            return None
        if cached >= len(chain):
            w.hold(chain)
        return cached, pending

    def _fail(self, t: Transfer, reason: str) -> None:
        self._finish(t, CopyState.FAILED, "copy_failed", reason, outcome=CopyOutcome.FAILED)

    def _done(self, t: Transfer) -> None:
        self._finish(t, CopyState.DONE, "copy_done", outcome=CopyOutcome.DONE)

    async def _job(self, t: Transfer, source_confirmed: bool) -> None:
        pushed = t.pushed
        assert pushed is not None
        try:
            if not source_confirmed:
                reason = await self._wait_source(t)
                if reason is not None:
                    self._fail(t, reason)
                    return
            reason = await self._push(t)
            if reason is not None:
                self._fail(t, reason)
                return
            pushed.set()
            await self._poll(t)
        except asyncio.CancelledError:
            if t.active:
                self._fail(t, "gateway stopped")
            raise
        except Exception as e:  # a bug or an unexpected answer: the job fails, the gateway keeps running
            log.exception("copy %s crashed", t.copy_id)
            if t.active:
                self._fail(t, f"internal error: {e!r}")
        finally:
            pushed.set()

    async def _wait_source(self, t: Transfer) -> str | None:
        clock = self.state.clock
        deadline = clock() + self.source_wait_s
        src = self.state.workers[t.source]
        n = len(t.chain)
        while True:
            if not self._usable(t.source):
                return "source became unhealthy"
            ans = await self._match(t.source, t.chain)
            if ans is None:
                return "source did not answer /btb/match"
            cached, pending = ans
            if cached >= n or pending >= n:
                return None  # holds it, or computes it: the push trails its prefill
            if t.chain[-1] not in src.pending:
                return f"source does not hold the prefix (cached {cached} of {n} blocks)"
            # a request of the gateway carrying the prefix is on its way there
            if not t.waited:
                t.waited = True
                self._changed(t)
            if clock() >= deadline:
                return f"source does not show the prefix after {self.source_wait_s:g} s"
            await asyncio.sleep(min(self.poll_interval_s, SOURCE_RECHECK_S))

    async def _push(self, t: Transfer) -> str | None:
        ws = self.state.workers
        if not self._usable(t.target):
            return "target became unhealthy"
        addr = (ws[t.target].info or {}).get("transfer_addr")
        if not addr:
            return "target has no transfer_addr in /btb/info"
        token = new_token()
        reason = await self._expect(t, token)
        if reason is not None:
            return reason
        body = {"chain": list(t.chain), "target": addr, "copy_id": t.copy_id, "token": token}
        try:
            status, text = await self._post(f"{ws[t.source].url}/btb/push", body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"push to source failed: {type(e).__name__}: {e}"
        if status == 409:
            return "source no longer holds the prefix (409 from /btb/push)"
        if status not in (200, 202):
            return f"source refused the push: HTTP {status}: {text[:200]}"
        try:
            ans = json.loads(text)
            t.bytes_total = int(ans.get("bytes", 0) or 0)
            t.blocks_available = int(ans.get("blocks_available", 0) or 0)
        except (ValueError, TypeError, AttributeError, OverflowError):  # OverflowError: int(Infinity)
            pass
        t.state = CopyState.RUNNING
        t.started_s = self.state.clock()
        log_event(
            log,
            "copy_started",
            copy_id=t.copy_id,
            prefix=t.key,
            **_hot_fields(t),
            source=ws[t.source].name,
            source_url=ws[t.source].url,
            target=ws[t.target].name,
            target_url=ws[t.target].url,
            bytes=t.bytes_total,
        )
        self._changed(t)
        return None

    async def _expect(self, t: Transfer, token: str) -> str | None:
        """Authorize copy ``t`` at its target with ``token`` (``/btb/expect``); None when done, else why not."""
        w = self.state.workers[t.target]
        body = {"chain": list(t.chain), "copy_id": t.copy_id, "token": token}
        try:
            status, text = await self._post(f"{w.url}/btb/expect", body)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"authorizing the copy at the target failed: {type(e).__name__}: {e}"
        if status not in (200, 201):
            return f"target refused to expect the copy: HTTP {status}: {text[:200]}"
        log_event(
            log, "copy_authorized", copy_id=t.copy_id, prefix=t.key, **_hot_fields(t), blocks=len(t.chain), target=w.url
        )
        return None

    async def _poll(self, t: Transfer) -> None:
        clock = self.state.clock
        ws = self.state.workers
        deadline = clock() + self.copy_timeout_s
        url = f"{ws[t.source].url}/btb/copies/{t.copy_id}"
        params = {"wait_s": f"{self.poll_interval_s:g}", "since": ""}
        errors = 0
        pause = 0.0  # the first poll goes out at once
        while True:
            if pause > 0:
                await asyncio.sleep(pause)
            pause = self.poll_interval_s  # after an error or an answer without news from a worker without long poll
            asked = clock()
            if not ws[t.source].healthy:
                self._fail(t, "source became unhealthy during the copy")
                return
            if not ws[t.target].healthy:
                self._fail(t, "target became unhealthy during the copy")
                return
            try:
                async with self._session().get(url, params=params, timeout=self.timeout) as resp:
                    status = resp.status
                    body = await resp.json(content_type=None) if status == 200 else None
                    long_poll = resp.headers.get(LONG_POLL_HEADER) == "1"
                    params["since"] = resp.headers.get("X-BTB-Copy-Version", "")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                errors += 1
                if errors >= 3:
                    self._fail(t, f"progress polls failed: {type(e).__name__}: {e}")
                    return
                continue
            if status == 404:
                self._fail(t, "source does not know the copy (404)")
                return
            if status != 200 or not isinstance(body, dict):
                errors += 1
                if errors >= 3:
                    self._fail(t, f"progress polls failed: HTTP {status}")
                    return
                continue
            errors = 0
            changed = False
            for attr, key in (
                ("bytes_sent", "bytes_sent"),
                ("bytes_total", "bytes_total"),
                ("blocks_verified", "blocks_verified"),
                ("blocks_available", "blocks_available"),
            ):
                v = body.get(key)
                if isinstance(v, int) and v != getattr(t, attr):
                    setattr(t, attr, v)
                    changed = True
            state = body.get("state")
            if state == "done":
                self._done(t)
                return
            if state == "failed":
                self._fail(t, str(body.get("error") or "failed at the source"))
                return
            if changed:
                self._changed(t)
            # a worker that holds polls answers at the copy's next change: ask again at once
            pause = 0.0 if long_poll else max(0.0, self.poll_interval_s - (clock() - asked))
            if clock() >= deadline:
                self._fail(t, f"no outcome after {self.copy_timeout_s:g} s")
                return
