"""Health checking of the workers: a prober that reports through plain callbacks.

One round for a worker: ``GET /health`` (2xx passes); when the worker comes (back) up or was never identified,
``GET /btb/info`` (its page size, capacity, transfer address: BTB's extension routes; 404/405 means a plain SGLang
server); then ``GET /v1/loads`` (SGLang's load report, summed over ranks by :func:`summarize_loads`). A worker is
reported down after ``unhealthy_after`` failed rounds in a row (at once when it is not up yet).

**Busy is not dead.** A ``/health`` that does not answer within ``timeout_s`` is left running (up to
``progress_window_s``): when it answers late, that answer is a sign of life (``last_progress_s``, which the data
plane also sets on every answer and stream chunk of real traffic). A timed-out round on a worker that showed a sign
of life within ``progress_window_s`` reports it *degraded* (``on_degraded``: still routed, brought back when it
was down), never down; a refused or broken connection or an error answer is a failure as before, and so is a
timeout on a worker that shows no sign of life (a frozen process).

The prober keeps its own bookkeeping on the :class:`~btbctl.engine.gateway.state.WorkerState` it probes
(``last_health_s``, ``consecutive_failures``, ``failure_kind``, ``last_progress_s`` of late answers); what a result
means for the fleet is the callbacks' business.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from btbctl.engine.aiotasks import cancel_and_wait, every
from btbctl.engine.gateway.guard import is_local_exhaustion
from btbctl.engine.gateway.state import WorkerState

#: Exceptions that mean "no usable answer" from a worker.
_PROBE_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


def summarize_loads(body: Any) -> dict | None:
    """Sum SGLang's ``/v1/loads`` answer over ranks: ``{"running", "waiting", "used_tokens", "max_tokens",
    "token_usage"}`` (token_usage = used / max, or the reported one). Accepts a list of per-rank objects, an object
    with such a list under ``loads`` or ``ranks``, or one per-rank object; None when nothing fits."""
    ranks: list
    if isinstance(body, list):
        ranks = body
    elif isinstance(body, dict):
        inner = body.get("loads", body.get("ranks"))
        ranks = inner if isinstance(inner, list) else [body]
    else:
        return None
    out = {"running": 0, "waiting": 0, "used_tokens": 0, "max_tokens": 0}
    usage = []
    seen = False
    for r in ranks:
        if not isinstance(r, dict):
            continue
        for src, dst in (
            ("num_running_reqs", "running"),
            ("num_waiting_reqs", "waiting"),
            ("num_used_tokens", "used_tokens"),
            ("max_total_num_tokens", "max_tokens"),
        ):
            v = r.get(src)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[dst] += int(v)
                seen = True
        u = r.get("token_usage")
        if isinstance(u, (int, float)) and not isinstance(u, bool) and math.isfinite(u):
            usage.append(float(u))
    if not seen and not usage:
        return None
    if out["max_tokens"] > 0:
        out["token_usage"] = out["used_tokens"] / out["max_tokens"]
    else:
        out["token_usage"] = sum(usage) / len(usage) if usage else None
    return out


class HealthProber:
    """Probes workers, once (:meth:`probe`, :meth:`probe_all`) or every ``interval_s`` (:meth:`start`).

    Args:
        workers: the workers to probe (their URLs, their health bookkeeping).
        session: returns the shared :class:`aiohttp.ClientSession` (opened by the caller).
        clock: the gateway's ``now_s``.
        interval_s / timeout_s: seconds between rounds / limit of one request.
        unhealthy_after: failed rounds in a row that report a healthy worker down.
        on_down: ``(worker, reason)``: the worker failed its check (called on every failed round once it counts).
        on_info: ``(worker, info)``: its ``/btb/info`` answer, or None when it has no BTB routes (404/405);
            not called when the request failed otherwise.
        on_up: ``(worker)``: it passed its check after being down, unidentified (after ``on_info``) or degraded.
        on_loads: ``(worker, loads)``: end of a passing round, with :func:`summarize_loads` of its ``/v1/loads``
            (None when unknown).
        on_degraded: ``(worker, reason)``: its ``/health`` timed out but it showed a sign of life within
            ``progress_window_s`` (called on every such round; after ``on_info`` when it was not identified yet).
        progress_window_s: see the module docstring (also the longest a late ``/health`` answer is waited for).
    """

    def __init__(
        self,
        workers: Sequence[WorkerState],
        session: Callable[[], aiohttp.ClientSession],
        clock: Callable[[], float],
        *,
        interval_s: float,
        timeout_s: float,
        unhealthy_after: int,
        on_down: Callable[[WorkerState, str], None],
        on_info: Callable[[WorkerState, dict | None], None],
        on_up: Callable[[WorkerState], None],
        on_loads: Callable[[WorkerState, dict | None], None],
        on_degraded: Callable[[WorkerState, str], None] | None = None,
        progress_window_s: float | None = None,
    ) -> None:
        self.workers = workers
        self._session = session
        self._clock = clock
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.progress_window_s = progress_window_s or 2 * (interval_s + timeout_s)
        self.on_degraded = on_degraded
        self._late: dict[int, asyncio.Future] = {}  # worker index -> its /health still out after a timeout
        self._callbacks: dict[int, Callable[[asyncio.Future], None]] = {}
        self._sent: dict[int, float] = {}  # worker index -> when its latest /health request was sent
        self.unhealthy_after = unhealthy_after
        self.on_down = on_down
        self.on_info = on_info
        self.on_up = on_up
        self.on_loads = on_loads
        self._task: asyncio.Task | None = None

    async def _get_json(self, url: str) -> tuple[int, Any]:
        async with self._session().get(url, timeout=self.timeout) as resp:
            if resp.status != 200:
                return resp.status, None
            try:
                return 200, await resp.json(content_type=None)
            except ValueError:
                return 200, None

    async def _get_health(self, w: WorkerState) -> int:
        """``GET /health``: its status (bounded by ``progress_window_s``, the longest a late answer is awaited)."""
        timeout = aiohttp.ClientTimeout(total=max(self.timeout_s, self.progress_window_s))
        async with self._session().get(f"{w.url}/health", timeout=timeout) as resp:
            await resp.read()
            return resp.status

    def _late_answer(self, w: WorkerState, fut: asyncio.Future) -> None:
        """A ``/health`` that outlived its round ended: a passing answer is a sign of life."""
        if self._late.get(w.index) is fut:
            del self._late[w.index]
        if not fut.cancelled() and fut.exception() is None and 200 <= fut.result() < 300:
            w.last_progress_s = self._clock()

    async def _health(self, w: WorkerState) -> tuple[str | None, str | None]:
        """One ``/health`` check: ``(None, None)`` when it passed, else ``(reason, kind)`` with kind ``slow`` (no
        answer within ``timeout_s``; the request goes on in the background, see :meth:`_late_answer`), ``refused``
        (no connection, or it broke) or ``error`` (an error answer); ``("", None)`` when the gateway itself is out
        of descriptors (says nothing about the worker). A request still out from an earlier round is awaited again
        instead of sending another one."""
        fut = self._late.pop(w.index, None)
        late = fut is not None
        if fut is not None:
            fut.remove_done_callback(self._late_cb(w))
        else:
            fut = asyncio.ensure_future(self._get_health(w))
            self._sent[w.index] = self._clock()
        done, _ = await asyncio.wait((fut,), timeout=self.timeout_s)
        took = self._clock() - self._sent.get(w.index, 0.0)
        if not done:
            self._late[w.index] = fut
            fut.add_done_callback(self._late_cb(w))
            return f"/health did not answer within {self.timeout_s:g} s", "slow"
        e = fut.exception()
        if e is None:
            status = fut.result()
            if not 200 <= status < 300:
                return f"/health answered HTTP {status}", "error"
            if late:  # it answered, later than timeout_s: alive, and slow
                w.last_progress_s = self._clock()
                return f"/health answered after {took:.1f} s (over {self.timeout_s:g} s)", "slow"
            return None, None
        if not isinstance(e, _PROBE_ERRORS):
            raise e
        if is_local_exhaustion(e):
            return "", None
        reason = f"/health failed: {type(e).__name__}: {e}" if str(e) else f"/health failed: {type(e).__name__}"
        return reason, "slow" if isinstance(e, asyncio.TimeoutError) else "refused"

    def _late_cb(self, w: WorkerState) -> Callable[[asyncio.Future], None]:
        cb = self._callbacks.get(w.index)
        if cb is None:
            cb = self._callbacks[w.index] = lambda fut, w=w: self._late_answer(w, fut)
        return cb

    async def probe(self, w: WorkerState) -> None:
        """One health round for ``w`` (see the module docstring)."""
        now = self._clock()
        reason, kind = await self._health(w)
        if reason == "":
            return
        w.last_health_s = now
        if reason is not None:
            w.consecutive_failures += 1
            w.failure_kind = kind
            if kind == "slow" and self.on_degraded is not None and w.alive(self._clock(), self.progress_window_s):
                if not w.healthy and w.btb is None:
                    await self._probe_info(w)
                self.on_degraded(w, reason)  # busy, not dead
                return
            if w.consecutive_failures >= self.unhealthy_after or not w.healthy:
                self.on_down(w, reason)
            return
        w.consecutive_failures = 0
        w.failure_kind = None
        if not w.healthy or w.btb is None:
            await self._probe_info(w)
            self.on_up(w)
        elif w.degraded is not None:
            self.on_up(w)
        try:
            status, body = await self._get_json(f"{w.url}/v1/loads")
            loads = summarize_loads(body) if status == 200 else None
        except _PROBE_ERRORS:
            loads = None
        self.on_loads(w, loads)

    async def _probe_info(self, w: WorkerState) -> None:
        try:
            status, body = await self._get_json(f"{w.url}/btb/info")
        except _PROBE_ERRORS:
            return
        if status == 200 and isinstance(body, dict):
            self.on_info(w, body)
        elif status in (404, 405):
            self.on_info(w, None)

    async def probe_all(self) -> None:
        """One round for every worker, concurrently (a failing probe does not stop the others)."""
        await asyncio.gather(*(self.probe(w) for w in self.workers), return_exceptions=True)

    def start(self) -> None:
        """Probe every ``interval_s`` in a background task (the first round after one interval)."""
        if self._task is None:
            self._task = every(self.interval_s, self.probe_all, at_once=False)

    async def stop(self) -> None:
        """Stop probing, and the ``/health`` requests still out (idempotent)."""
        await cancel_and_wait(self._task)
        self._task = None
        late, self._late = list(self._late.values()), {}
        for fut in late:
            fut.cancel()
        if late:
            await asyncio.wait(late)
