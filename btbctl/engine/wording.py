"""Counts and sizes in human text, one way everywhere (the CLI's output, launcher messages, errors)."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun: ``1 request``, ``0 requests``, ``1,024 requests`` (``nouns``: the plural where it is
    not ``noun + "s"``, e.g. ``plural(2, "copy", "copies")``)."""
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"


def human_bytes(n: float | None) -> str:
    """Bytes in decimal units (GB = 1e9, as ``btbctl presets`` and the TUI): ``1.34 GB``, ``20.5 kB``."""
    n = float(n or 0)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


__all__ = ["human_bytes", "plural"]
