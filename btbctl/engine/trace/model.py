"""The one in-memory request type every reader produces and every consumer (simulator, gateway replay) uses.

A prompt is described by its **block-hash chain**: the prompt is cut into blocks of ``block_tokens`` tokens (the
last block may be partial) and block ``k`` carries a hash that identifies the *whole prefix* up to and including
block ``k`` (prefix-chained, as in the Mooncake traces and SGLang's radix cache). Two requests whose ``k``-th
hashes are equal therefore share their first ``k + 1`` blocks. Hashes are opaque hashable values (``int`` for
Mooncake, ``str`` for ``btb-mixed-trace-v1``); only equality matters.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

#: Request kinds used in reports. ``burst``/``decoy``/``background`` come from ``btb-mixed-trace-v1``'s
#: ``metadata.job_kind``; traces without kinds (Mooncake, Azure) label every request ``background``.
KINDS = ("burst", "decoy", "background")


@dataclass(slots=True)
class Request:
    """One LLM request of a trace.

    Attributes:
        request_id: unique id within the trace.
        arrival_s: arrival time in seconds from the start of the trace (>= 0).
        input_tokens: prompt length in tokens (>= 1).
        output_tokens: tokens to generate (>= 1; the first one is the TTFT token).
        block_hashes: prefix-chained block hashes, one per ``block_tokens`` tokens of the prompt; may be empty for
            traces without prefix information (Azure), in which case no two requests share cache.
        kind: ``burst``, ``decoy`` or ``background`` (free-form strings are kept as given).
        labels: optional extra metadata (``trace_id``, ``source``, ...), never used for routing.
        arrivals: how many arrivals the burst detector counts for this request (>= 1; more than 1 when a client
            declared the burst it is about to send, the gateway's ``X-BTB-Expected-Requests`` header).
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[Hashable, ...]
    kind: str = "background"
    labels: dict[str, Any] | None = None
    arrivals: int = 1


@dataclass(slots=True)
class Trace:
    """A list of requests sorted by arrival, with the block size its hashes refer to.

    Attributes:
        requests: sorted by ``arrival_s`` (stable for ties).
        block_tokens: tokens per block of ``block_hashes`` (Mooncake: 512, btb-mixed-trace-v1: 256).
        format: ``mooncake``, ``btb-mixed-trace-v1``, ``azure2023`` or ``generated``.
        path: file it came from, if any.
        prefix_chained: the hash chains are known to be prefix-chained (:func:`btbctl.engine.chains.chain_conflict`):
            set by the readers (which check) and the generators (which build them so); otherwise the simulators check.
    """

    requests: list[Request]
    block_tokens: int
    format: str
    path: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    prefix_chained: bool = False

    def __post_init__(self) -> None:
        self.requests.sort(key=lambda r: r.arrival_s)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        """Seconds from the first to the last arrival (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def kinds(self) -> list[str]:
        """Distinct request kinds, in first-seen order."""
        seen: dict[str, None] = {}
        for r in self.requests:
            seen.setdefault(r.kind, None)
        return list(seen)
