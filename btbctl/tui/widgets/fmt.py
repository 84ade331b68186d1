"""Small text formatters shared by the panels (sizes, rates, durations, bars, sparklines)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from btbctl.engine import wording

_SPARKS = "▁▂▃▄▅▆▇█"


def human_bytes(n: float | None) -> str:
    """``n`` bytes with a decimal unit, compact for panels (``1.3GB``;
    :func:`btbctl.engine.wording.human_bytes` with one decimal and no space); ``-`` for None/NaN."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return wording.human_bytes(n, ".1f", "")


def human_tokens(n: int) -> str:
    """Token counts as ``512``, ``64k``, ``1.2M``."""
    if n >= 1_000_000:
        return f"{n / 1_048_576:.1f}M"
    if n >= 1024:
        return f"{n / 1024:.0f}k"
    return str(n)


def seconds(x: float | None) -> str:
    """Seconds with a unit (``850ms``, ``3.2s``, ``2m05``); ``-`` for None/NaN."""
    if x is None or math.isnan(x) or math.isinf(x):
        return "-"
    if x < 1.0:
        return f"{x * 1000:.0f}ms"
    if x < 60:
        return f"{x:.1f}s"
    return f"{int(x // 60)}m{int(x % 60):02d}"


def bar(fraction: float, width: int) -> str:
    """A text progress bar of ``width`` cells."""
    fraction = 0.0 if math.isnan(fraction) else max(0.0, min(1.0, fraction))
    full = int(round(fraction * width))
    return "█" * full + "░" * (width - full)


def kv_bar(used: float, cached: float, width: int) -> str:
    """A KV-cache bar of ``width`` cells: ``used`` (fraction held by running requests) as full blocks, ``cached``
    (fraction holding cached prefixes) as shaded ones, the rest light."""
    used = 0.0 if math.isnan(used) else max(0.0, min(1.0, used))
    cached = 0.0 if math.isnan(cached) else max(0.0, min(1.0 - used, cached))
    u = int(round(used * width))
    c = min(width - u, int(round((used + cached) * width)) - u)
    return "█" * u + "▓" * c + "░" * (width - u - c)


def sparkline(values: Sequence[float], width: int) -> str:
    """The last ``width`` values as block characters scaled to their maximum (blank when all zero)."""
    vals = list(values)[-width:]
    top = max(vals, default=0)
    if top <= 0:
        return " " * len(vals)
    return "".join(
        _SPARKS[min(len(_SPARKS) - 1, int(v / top * (len(_SPARKS) - 1) + 0.5))] if v > 0 else " " for v in vals
    )
