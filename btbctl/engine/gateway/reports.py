"""What the control API and its event stream answer: the gateway's state as the models of
:mod:`btbctl.engine.control.schema` (one builder per answer, shared by the routes and the events).

The builders read the gateway through :class:`ReportInputs` (the fleet state, the detector, the constants, the
policy's name, the page size), never the gateway itself.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any, Protocol

from btbctl.engine.chains import check_prefix_id
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.schema import (
    TTFT_RECENT_WINDOW_S,
    ConstantsAnswer,
    FleetAnswer,
    FleetWorker,
    PrefixEntry,
    PrefixesAnswer,
    PrewarmAnswer,
    ReplicateAnswer,
    ReplicateCopy,
    ReplicationAnswer,
    TransferEntry,
    TransfersAnswer,
    TransferTotals,
    TtftAnswer,
    TtftBucket,
    TtftEvent,
    TtftSummary,
)
from btbctl.engine.copies import CopyState
from btbctl.engine.detector import PrefixHeat
from btbctl.engine.gateway.replicator import PrewarmOutcome, ReplicateOutcome
from btbctl.engine.gateway.state import FleetState, Transfer, WorkerState
from btbctl.engine.policies import POLICIES

#: Prefixes in a ``prefixes`` event; rows in a ``transfers`` event.
EVENT_TOP_PREFIXES = 10
EVENT_TRANSFERS = 50


class HeatSource(Protocol):
    """The part of the burst detector the reports read."""

    def heat(self, now_s: float, top: int = 10) -> list[PrefixHeat]: ...

    def prefix_of(self, key: Hashable) -> tuple | None: ...


class ReportInputs(Protocol):
    """What the reports read (the gateway provides it)."""

    @property
    def state(self) -> FleetState: ...

    @property
    def detector(self) -> HeatSource: ...

    @property
    def constants(self) -> BtbConstants: ...

    @property
    def policy_name(self) -> str: ...

    @property
    def page_size(self) -> int: ...


class PrefixLookupError(Exception):
    """A prefix the control API cannot resolve: ``status`` (400 malformed or ambiguous, 404 unknown), the message,
    and the error fields (``key``, ``candidates``)."""

    def __init__(self, status: int, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.status = status
        self.fields = fields


def _typed(info: dict, key: str, kind: type) -> Any:
    """``info[key]`` when it has type ``kind`` (never a bool for int), else None: a worker's ``/btb/info`` is not
    trusted to be well-formed."""
    v = info.get(key)
    if isinstance(v, kind) and not (kind is int and isinstance(v, bool)):
        return v
    return None


def _num(info: dict, key: str) -> float | None:
    """``info[key]`` when it is a finite number >= 0 (not a bool), else None."""
    v = info.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
        return float(v)
    return None


#: Fields of :data:`~btbctl.engine.control.schema.WORKER_NUMBERS` read from ``/metrics`` only.
_METRICS_ONLY = (
    "kv_cached_tokens",
    "host_tier_tokens",
    "host_tier_capacity_tokens",
    "storage_hit_tokens_total",
    "storage_prefetched_tokens_total",
    "storage_backup_tokens_total",
    "load_back_tokens_total",
)


def worker_numbers(w: WorkerState) -> dict[str, Any]:
    """``w``'s own numbers as the worker-row fields of :data:`~btbctl.engine.control.schema.WORKER_NUMBERS`.

    Running and queued requests, the tokens of running requests and the capacity come from its ``/v1/loads``
    (read every health round), else from its ``/metrics``; the cached tokens and the HiCache counters from its
    ``/metrics`` (read every ``metrics_interval_s``). ``metrics_source`` says whose numbers they are: ``modelled``
    for btbctl's emulated worker (its ``/server_info`` says so, or it answers ``/btb/info``), else
    ``sglang_metrics`` or ``sglang_loads``."""
    loads = w.loads or {}
    m = w.metrics or {}

    def pick(load_key: str, metric_key: str) -> int | None:
        v = loads.get(load_key)
        if isinstance(v, int) and not (load_key == "max_tokens" and v == 0):  # a 0 capacity: not reported
            return v
        return m.get(metric_key)

    used = pick("used_tokens", "kv_used_tokens")
    cap = pick("max_tokens", "kv_capacity_tokens")
    cached = m.get("kv_cached_tokens")
    if cap and used is not None:
        kv_use: float | None = min(1.0, (used + (cached or 0)) / cap)
    else:
        kv_use = loads.get("token_usage")
    emulated = (w.server_info or {}).get("emulated") is True or w.info is not None
    if emulated:
        source: str | None = "modelled"
    elif w.metrics:
        source = "sglang_metrics"
    elif w.loads:
        source = "sglang_loads"
    else:
        source = None
    return {
        "metrics_source": source,
        "running": pick("running", "running"),
        "waiting": pick("waiting", "waiting"),
        "kv_used_tokens": used,
        "kv_capacity_tokens": cap,
        "kv_use": kv_use,
        **{k: m.get(k) for k in _METRICS_ONLY},
        "metrics_note": w.metrics_note,
        "last_metrics_s": w.metrics_s,
    }


class Reports:
    """Builds every control-API answer from ``src``."""

    def __init__(self, src: ReportInputs) -> None:
        self.src = src

    @property
    def _urls(self) -> list[str]:
        return [w.url for w in self.src.state.workers]

    # -- fleet --------------------------------------------------------------------------------------------------

    def worker(self, w: WorkerState) -> FleetWorker:
        """One worker of ``GET /control/fleet``."""
        loads = w.loads or {}
        info = w.info or {}
        mode = getattr(self.src, "replication_mode", "push")
        agents = getattr(self.src, "worker_agent_names", None)
        agent = agents[w.index] if agents else None
        if mode == "l3" and agent is None:
            possible, note = False, "l3: no node agent serves it now (none registered it): no copies to or from it"
        elif mode == "l3":
            possible = w.healthy
            note = f"l3: HiCache L3 tier in node agent {agent}; copies proved by a warm-up"
        elif mode == "none":
            possible, note = False, "replication mode none: routing only"
        else:
            possible, note = w.btb is True, _typed(info, "note", str) or w.replication_note
        hbm_total, hbm_used, kv_tok = _num(info, "hbm_total_bytes"), None, _num(info, "kv_bytes_per_token")
        weights, used_tokens = _num(info, "weight_bytes"), loads.get("used_tokens")
        if hbm_total and weights is not None and kv_tok is not None and isinstance(used_tokens, int):
            # an emulated worker's modelled HBM: weights plus every KV token it holds, the running requests' and
            # the cached prefixes' (from its /metrics; they occupy HBM until evicted)
            cached = (w.metrics or {}).get("kv_cached_tokens")
            held = used_tokens + (cached if isinstance(cached, int) else 0)
            hbm_used = weights + held * kv_tok
        return FleetWorker(
            name=w.name,
            url=w.url,
            healthy=w.healthy,
            error=w.health_error,
            degraded=w.degraded,
            load=w.inflight,
            prefilling=w.prefilling,
            served=w.served,
            failed=w.failed,
            **worker_numbers(w),
            replication=possible,
            replication_note=note,
            replication_mode=mode,
            agent=agent,
            held_blocks=len(w.holdings),
            model=_typed(info, "model", str),
            gpu=_typed(info, "gpu", str),
            tp_size=_typed(info, "tp_size", int),
            page_size=_typed(info, "page_size", int),
            transfer_addr=_typed(info, "transfer_addr", str),
            last_health_s=w.last_health_s,
            last_progress_s=w.last_progress_s,
            ttft_ewma_s=w.ttft_ewma_s,
            hbm_used_bytes=hbm_used,
            hbm_total_bytes=hbm_total if hbm_used is not None else None,
            hbm_modelled=True if hbm_used is not None else None,
            kv_bytes_per_token=kv_tok,
            kv_bytes_scale=_typed(info, "kv_bytes_scale", int),
        )

    def fleet(self) -> FleetAnswer:
        """``GET /control/fleet``; ``replication`` says on how many workers copies are possible."""
        src = self.src
        ws = src.state.workers
        mode = getattr(src, "replication_mode", "push")
        n_btb = sum(1 for w in ws if w.btb is True)
        if mode == "l3":
            note = "l3: copies through the node agents, each proved by a warm-up"
        elif mode == "none":
            note = "replication mode none: routing only"
        elif n_btb == len(ws):
            note = "supported on all workers"
        elif n_btb == 0:
            note = "unsupported: no worker has the /btb routes (plain SGLang); routing only"
        else:
            note = f"supported on {n_btb} of {len(ws)} workers"
        return FleetAnswer(
            now_s=src.state.clock(),
            policy=src.policy_name,
            page_size=src.page_size,
            constants=src.constants,
            healthy=sum(1 for w in ws if w.healthy),
            total=len(ws),
            replication=note,
            replication_mode=mode,
            workers=[self.worker(w) for w in ws],
        )

    # -- prefixes -----------------------------------------------------------------------------------------------

    def prefixes(self, top: int = EVENT_TOP_PREFIXES) -> PrefixesAnswer:
        """``GET /control/prefixes``: the ``top`` prefixes by arrivals in the window."""
        src = self.src
        state = src.state
        now = state.clock()
        c = src.constants
        ps = src.page_size
        urls = self._urls
        active = state.transfers.active
        rows = [
            PrefixEntry(
                id=str(h.key),
                prefix_blocks=h.prefix_blocks,
                prefix_tokens=h.prefix_blocks * ps,
                arrivals_in_window=h.arrivals_in_window,
                total_arrivals=h.total_arrivals,
                threshold=c.threshold,
                hot=h.hot,
                fires=h.fires,
                first_seen_s=h.first_seen_s,
                last_seen_s=h.last_seen_s,
                holders=[urls[i] for i in state.holders(h.key)],
                copies_in_flight=sum(1 for t in active.values() if t.hot_id == str(h.key)),
            )
            for h in src.detector.heat(now, top)
        ]
        return PrefixesAnswer(
            now_s=now,
            window_s=c.window_s,
            threshold=c.threshold,
            prefix_blocks=c.prefix_blocks,
            prefix_tokens=c.prefix_blocks * ps,
            page_size=ps,
            prefixes=rows,
        )

    # -- transfers ----------------------------------------------------------------------------------------------

    def transfer(self, t: Transfer, now: float) -> TransferEntry:
        """One copy of ``GET /control/transfers``."""
        urls = self._urls
        return TransferEntry(
            copy_id=t.copy_id,
            prefix=str(t.key),
            prefix_blocks=len(t.chain),
            hot_prefix=t.hot_id,
            prefix_tokens=t.copied_tokens,
            source=urls[t.source],
            target=urls[t.target],
            state=t.state,
            bytes_sent=t.bytes_sent,
            bytes_total=t.bytes_total,
            blocks_verified=t.blocks_verified,
            bytes_per_s=t.bytes_per_s(now),
            eta_s=t.eta_s(now),
            error=t.error,
            created_s=t.created_s,
            started_s=t.started_s,
            finished_s=t.finished_s,
            manual=t.manual,
            mode=t.mode,
            duration_s=None if t.finished_s is None else t.finished_s - t.created_s,
            transfer_s=t.transfer_s,
            covered_tokens=t.covered_tokens,
            proof=t.proof,
            proof_storage_tokens=t.proof_storage_tokens,
            outcome=t.outcome,
            usable_s=t.usable_s,
            blocks_available=t.blocks_available if t.blocks_available >= 0 else None,
            overlap_s=t.overlap_s,
            send_s=t.send_s,
            **{f"phase_{k}_s": v for k, v in t.phases().items()},
        )

    def transfers(self, limit: int = EVENT_TRANSFERS) -> TransfersAnswer:
        """``GET /control/transfers``: in flight first, then the most recent finished, at most ``limit`` rows."""
        state = self.src.state
        now = state.clock()
        tt = state.transfers
        done = [t for t in tt.recent if t.state is CopyState.DONE]
        return TransfersAnswer(
            now_s=now,
            in_flight=len(tt.active),
            transfers=[self.transfer(t, now) for t in tt.all()[:limit]],
            totals=TransferTotals(
                done=len(done),
                failed=sum(1 for t in tt.recent if t.state is CopyState.FAILED),
                bytes=sum(t.bytes_sent for t in done),
            ),
        )

    # -- TTFT ---------------------------------------------------------------------------------------------------

    def ttft(self, window_s: float, step_s: float) -> TtftAnswer:
        """``GET /control/ttft``: ``window_s / step_s`` buckets and a summary over the window."""
        state = self.src.state
        now = state.clock()
        series = state.ttft
        return TtftAnswer(
            now_s=now,
            window_s=window_s,
            step_s=step_s,
            series=[TtftBucket(**r) for r in series.series(now, window_s, step_s)],
            summary=TtftSummary(**series.summary(now, window_s)),
        )

    def ttft_event(self) -> TtftEvent:
        """The ``ttft`` event: the last 10 s and 60 s summarised and the trailing 1-second bucket."""
        state = self.src.state
        now = state.clock()
        return TtftEvent(
            now_s=now,
            last_10s=TtftSummary(**state.ttft.summary(now, 10.0)),
            point=TtftBucket(**state.ttft.series(now, 1.0, 1.0)[-1]),
            last_60s=TtftSummary(**state.ttft.summary(now, TTFT_RECENT_WINDOW_S)),
        )

    # -- constants ----------------------------------------------------------------------------------------------

    def constants(self) -> ConstantsAnswer:
        """``GET /control/constants``."""
        src = self.src
        c = src.constants
        return ConstantsAnswer(
            policy=src.policy_name,
            policies=list(POLICIES),
            constants=c,
            page_size=src.page_size,
            prefix_tokens=c.prefix_blocks * src.page_size,
        )

    # -- replication --------------------------------------------------------------------------------------------

    def resolve_prefix(self, text: object) -> tuple[str, tuple]:
        """A prefix id, or an unambiguous leading part of one (>= 8 hex digits), as ``(id, chain)``: looked up in
        the chains of the requests the gateway routed, then in the detector's prefixes.

        Raises:
            PrefixLookupError: malformed (400), ambiguous (400, with ``candidates``), unknown (404).
        """
        try:
            s = check_prefix_id(text)
        except ValueError as e:
            raise PrefixLookupError(400, f"prefix: {e}", key="prefix") from None
        chains = self.src.state.chains
        if s in chains.parent:
            key = s
        else:
            cands = chains.find(s)
            if not cands:
                raise PrefixLookupError(
                    404, f"unknown prefix {s!r}: the gateway knows the prefixes of the requests it routed", key="prefix"
                )
            if len(cands) > 1:
                raise PrefixLookupError(
                    400, f"prefix {s!r} is ambiguous", key="prefix", candidates=[str(c) for c in cands]
                )
            key = cands[0]
        chain = chains.chain_of(key) or self.src.detector.prefix_of(key)
        if chain is None:
            raise PrefixLookupError(404, f"prefix {key} is no longer tracked", key="prefix")
        return str(key), tuple(chain)

    def replication(self, key: str, chain: tuple) -> ReplicationAnswer:
        """``GET /control/replications/{prefix}`` of the resolved prefix ``key`` with ``chain``."""
        state = self.src.state
        now = state.clock()
        return ReplicationAnswer(
            prefix=key,
            prefix_blocks=len(chain),
            holders=[w.url for w in state.workers if w.held_blocks(chain) >= len(chain)],
            copies=[self.transfer(t, now) for t in state.transfers.for_key(key)],
        )

    def replicate(self, outcome: ReplicateOutcome) -> ReplicateAnswer:
        """``POST /control/replicate``'s answer for what the replicator started."""
        urls = self._urls
        started = outcome.started
        return ReplicateAnswer(
            prefix=outcome.prefix,
            source=urls[outcome.source],
            targets=[urls[t.target] for t in started],
            copy_ids=[t.copy_id for t in started],
            copies=[
                ReplicateCopy(copy_id=t.copy_id, target=urls[t.target], state=t.state, error=t.error) for t in started
            ],
            skipped=outcome.skipped,
            holders=[urls[r] for r in outcome.holders],
        )

    def prewarm(self, done: PrewarmOutcome) -> PrewarmAnswer:
        """``POST /control/prewarm``'s answer: the copies as :meth:`replicate` and who computed the prompt."""
        urls = self._urls
        copies = self.replicate(done.copies).model_dump()  # the same fields, as a PrewarmAnswer extends them
        computed = urls[done.computed_by] if 0 <= done.computed_by < len(urls) else ""
        return PrewarmAnswer(
            **copies,
            computed_by=computed,
            prompt_tokens=done.prompt_tokens,
            prefix_blocks=done.blocks,
            hot_prefix=done.hot_prefix,
        )


__all__ = [
    "EVENT_TOP_PREFIXES",
    "EVENT_TRANSFERS",
    "HeatSource",
    "PrefixLookupError",
    "ReportInputs",
    "Reports",
    "worker_numbers",
]
