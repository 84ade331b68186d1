"""Latency summaries shared by the simulator, the gateway and ``btbctl bench``."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

PERCENTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already sorted values, linear interpolation between closest ranks
    (numpy's default ``linear`` method). NaN for an empty input."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def percentile_index(sorted_values: Sequence[float], q: float) -> float:
    """Infer-Sim's percentile: ``sorted[int(q / 100 * n)]`` (clamped to the last element)."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    return sorted_values[min(n - 1, int(q / 100.0 * n))]


def summarize(values: Iterable[float], method: str = "linear") -> dict:
    """``{"mean", "p50", "p95", "p99", "max"}`` of ``values`` (seconds). ``method`` is ``linear`` or ``index``
    (Infer-Sim's definition). All NaN -> JSON ``null`` is the caller's business; empty input gives NaNs."""
    vals = sorted(values)
    pick = percentile if method == "linear" else percentile_index
    out = {"mean": (math.fsum(vals) / len(vals)) if vals else math.nan}
    for name, q in PERCENTILES:
        out[name] = pick(vals, q)
    out["max"] = vals[-1] if vals else math.nan
    return out
