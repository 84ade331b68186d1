"""Latency summaries shared by the simulator, the gateway, the dashboard and ``btbctl bench``: one percentile
function, one summary, one TTFT series."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

PERCENTILES = (("p50", 50.0), ("p95", 95.0), ("p99", 99.0))
#: TTFT samples a :class:`TtftSeries` keeps (ring buffer).
TTFT_RING = 200_000


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


def summarize(values: Iterable[float], method: str = "linear") -> dict[str, float]:
    """``{"mean", "p50", "p95", "p99", "max"}`` of ``values`` (seconds). ``method`` is ``linear`` or ``index``
    (Infer-Sim's definition). All NaN -> JSON ``null`` is the caller's business; empty input gives NaNs."""
    vals = sorted(values)
    pick = percentile if method == "linear" else percentile_index
    out = {"mean": (math.fsum(vals) / len(vals)) if vals else math.nan}
    for name, q in PERCENTILES:
        out[name] = pick(vals, q)
    out["max"] = vals[-1] if vals else math.nan
    return out


class TtftSeries:
    """Ring buffer of ``(now_s, ttft_s)`` samples measured at the gateway, and summaries over windows."""

    def __init__(self, maxlen: int = TTFT_RING) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, now_s: float, ttft_s: float) -> None:
        self.samples.append((now_s, ttft_s))

    def window(self, now_s: float, window_s: float) -> list[tuple[float, float]]:
        lo = now_s - window_s
        out = []
        for s in reversed(self.samples):
            if s[0] <= lo:
                break
            out.append(s)
        out.reverse()
        return out

    def series(self, now_s: float, window_s: float, step_s: float) -> list[dict[str, Any]]:
        """One row per ``step_s`` bucket of the trailing ``window_s``: ``{"t_s"`` (bucket end, gateway seconds),
        ``"n"``, ``"p50_s"``, ``"p95_s"`` (null for an empty bucket), ``"rps"`` (first bytes per second)``}``."""
        nb = max(1, int(math.ceil(window_s / step_s)))
        start = now_s - nb * step_s
        buckets: list[list[float]] = [[] for _ in range(nb)]
        for t, v in self.window(now_s, nb * step_s):
            i = min(nb - 1, int((t - start) / step_s))
            buckets[i].append(v)
        rows = []
        for i, b in enumerate(buckets):
            b.sort()
            rows.append(
                {
                    "t_s": round(start + (i + 1) * step_s, 6),
                    "n": len(b),
                    "p50_s": percentile(b, 50.0) if b else None,
                    "p95_s": percentile(b, 95.0) if b else None,
                    "rps": len(b) / step_s,
                }
            )
        return rows

    def summary(self, now_s: float, window_s: float) -> dict[str, Any]:
        """``{"n", "mean_s", "p50_s", "p95_s", "p99_s", "max_s"}`` over the trailing window (null when empty)."""
        vals = sorted(v for _, v in self.window(now_s, window_s))
        if not vals:
            return {"n": 0, "mean_s": None, "p50_s": None, "p95_s": None, "p99_s": None, "max_s": None}
        return {
            "n": len(vals),
            "mean_s": math.fsum(vals) / len(vals),
            "p50_s": percentile(vals, 50.0),
            "p95_s": percentile(vals, 95.0),
            "p99_s": percentile(vals, 99.0),
            "max_s": vals[-1],
        }
