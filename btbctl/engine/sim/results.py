"""What a simulation returns, whichever fidelity profile ran it: per-request records, the run's counters and the
stable summary, plus the fit check every profile makes before it starts.

Both simulators (:mod:`btbctl.engine.sim.simulator`, :mod:`btbctl.engine.sim.infersim`) import this module and
neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from btbctl.engine.errors import ConfigError
from btbctl.engine.stats import summarize
from btbctl.engine.trace.model import Trace


@dataclass(slots=True)
class RequestRecord:
    """Outcome of one simulated request. Times in seconds from trace start; token counts in tokens."""

    request_id: str
    kind: str
    arrival_s: float
    replica: int
    ttft_s: float
    queue_wait_s: float
    cached_tokens: int
    prefill_tokens: int
    finish_s: float
    input_tokens: int = 0
    #: prompt tokens this request computed while the same blocks were resident or being computed on another
    #: replica (redundant prefix work a copy could have saved)
    recomputed_prefix_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SimResult:
    """Per-request records plus counters of one policy's run."""

    policy: str
    records: list[RequestRecord]
    replications: int
    replicated_bytes: float
    copies_started: int
    copies_refused: int
    policy_stats: dict
    fidelity: str = "realistic"
    percentile_method: str = "linear"
    #: Completed copies that no request reused afterwards (None: the fidelity profile does not track it).
    wasted_replications: int | None = None
    #: Per completed copy, seconds from the moment the policy saw the need for it (``hot_since_s`` of
    #: its :class:`~btbctl.engine.copies.CopyPlan`, default the copy's start) to the arrival of its last byte (None: not
    #: tracked).
    time_to_warm_s: list[float] | None = None

    def summary(self, replication_details: bool = False) -> dict:
        """The stable summary used by ``dry-run --format json`` (see the README for the schema).

        With ``replication_details`` four keys follow the stable ones: ``copies_started`` and ``copies_refused``
        (copy requests the fleet accepted or refused), ``wasted_replications`` (completed copies never reused; None
        when not tracked) and ``time_to_warm_s`` (mean/p50/p95/p99/max seconds over completed copies, NaN when
        there were none; None when not tracked)."""
        recs = self.records
        by_kind: dict[str, list[float]] = {}
        for r in recs:
            by_kind.setdefault(r.kind, []).append(r.ttft_s)
        total_in = sum(r.input_tokens for r in recs)
        cached = sum(r.cached_tokens for r in recs)
        out = {
            "policy": self.policy,
            "requests": len(recs),
            "ttft_s": summarize((r.ttft_s for r in recs), self.percentile_method),
            "by_kind": {
                k: {"requests": len(v), "ttft_s": summarize(v, self.percentile_method)}
                for k, v in sorted(by_kind.items())
            },
            "prefix_hit_ratio": (cached / total_in) if total_in else math.nan,  # NaN -> null in JSON reports
            "replications": self.replications,
            "replicated_bytes": self.replicated_bytes,
            "recomputed_prefix_tokens": sum(r.recomputed_prefix_tokens for r in recs),
        }
        if replication_details:
            out["copies_started"] = self.copies_started
            out["copies_refused"] = self.copies_refused
            out["wasted_replications"] = self.wasted_replications
            out["time_to_warm_s"] = (
                None if self.time_to_warm_s is None else summarize(self.time_to_warm_s, self.percentile_method)
            )
        return out


def check_fits(trace: Trace, kv_budget_tokens: int) -> None:
    """Raise :class:`ConfigError` (key ``gpus_per_replica``) if some request's prompt + output cannot fit in one
    replica's KV budget of ``kv_budget_tokens`` tokens (a prompt occupies whole blocks: ``max(blocks x block
    tokens, input tokens)``)."""
    bt = trace.block_tokens
    worst = None
    for r in trace.requests:
        need = max(len(r.block_hashes) * bt, r.input_tokens) + r.output_tokens
        if need > kv_budget_tokens and (worst is None or need > worst[0]):
            worst = (need, r.request_id)
    if worst is not None:
        raise ConfigError(
            "gpus_per_replica",
            f"request {worst[1]} needs {worst[0]} tokens of KV cache but a replica holds {kv_budget_tokens}; "
            "use more GPUs per replica, a larger GPU or a higher mem_fraction",
        )


__all__ = ["RequestRecord", "SimResult", "check_fits"]
