"""Traces: the request type, readers (Mooncake JSONL, btb-mixed-trace-v1 JSONL, Azure 2023 CSV), a writer, the
Bursted workload generator and the fan-out audit."""

from btbctl.engine.trace.model import KINDS, Request, Trace

__all__ = ["KINDS", "Request", "Trace"]
