"""Health checking of the workers: a prober that reports through plain callbacks.

One round for a worker: ``GET /health`` (2xx passes); when the worker comes (back) up or was never identified,
``GET /btb/info`` (its page size, capacity, transfer address: BTB's extension routes; 404/405 means a plain SGLang
server); then ``GET /v1/loads`` (SGLang's load report, summed over ranks by :func:`summarize_loads`). A worker is
reported down after ``unhealthy_after`` failed rounds in a row (at once when it is not up yet).

The prober keeps its own bookkeeping on the :class:`~btbctl.engine.gateway.state.WorkerState` it probes
(``last_health_s``, ``consecutive_failures``); what a result means for the fleet is the callbacks' business.
"""

from __future__ import annotations

import asyncio
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
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[dst] += int(v)
                seen = True
        u = r.get("token_usage")
        if isinstance(u, (int, float)) and not isinstance(u, bool):
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
        on_up: ``(worker)``: it passed its check after being down or unidentified (after ``on_info``).
        on_loads: ``(worker, loads)``: end of a passing round, with :func:`summarize_loads` of its ``/v1/loads``
            (None when unknown).
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
    ) -> None:
        self.workers = workers
        self._session = session
        self._clock = clock
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
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

    async def probe(self, w: WorkerState) -> None:
        """One health round for ``w`` (see the module docstring)."""
        now = self._clock()
        try:
            async with self._session().get(f"{w.url}/health", timeout=self.timeout) as resp:
                ok = 200 <= resp.status < 300
                reason = None if ok else f"/health answered HTTP {resp.status}"
                await resp.read()
        except _PROBE_ERRORS as e:
            if is_local_exhaustion(e):  # the gateway has no descriptor left: says nothing about the worker
                return
            ok, reason = (
                False,
                f"/health failed: {type(e).__name__}: {e}" if str(e) else f"/health failed: {type(e).__name__}",
            )
        w.last_health_s = now
        if not ok:
            w.consecutive_failures += 1
            if w.consecutive_failures >= self.unhealthy_after or not w.healthy:
                self.on_down(w, reason or "health check failed")
            return
        w.consecutive_failures = 0
        if not w.healthy or w.btb is None:
            await self._probe_info(w)
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
        """Stop probing (idempotent)."""
        await cancel_and_wait(self._task)
        self._task = None
