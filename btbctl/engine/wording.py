"""Counts and sizes in human text, one way everywhere (the CLI's output, launcher messages, errors)."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun: ``1 request``, ``0 requests``, ``1,024 requests`` (``nouns``: the plural where it is
    not ``noun + "s"``, e.g. ``plural(2, "copy", "copies")``)."""
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"


#: Decimal byte units, as ``btbctl presets`` prints them (GB = 1e9 bytes: an H100's 80 GB shows as ``80 GB``).
BYTE_UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(n: float | None, spec: str = ".3g", sep: str = " ") -> str:
    """Bytes in decimal units (GB = 1e9): ``1.34 GB``, ``20.5 kB`` (whole bytes below 1 kB; ``spec``: the format of
    the number in larger units, ``sep``: between number and unit; the TUI's panels use ``.1f`` and none). None
    counts as 0. A number that would round to 1000 of a unit is written in the next one."""
    n = float(n or 0)
    for unit in BYTE_UNITS:
        if unit == "B" and abs(n) < 1000:
            return f"{n:.0f}{sep}B"
        if unit != "B" and (abs(float(format(n, spec))) < 1000 or unit == BYTE_UNITS[-1]):
            return f"{n:{spec}}{sep}{unit}"
        n /= 1000.0
    raise AssertionError("unreachable")  # pragma: no cover - the last unit returns


__all__ = ["BYTE_UNITS", "human_bytes", "plural"]
