"""Counts in human text, one way everywhere (the CLI's output, launcher messages, errors)."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun: ``1 request``, ``0 requests``, ``1,024 requests`` (``nouns``: the plural where it is
    not ``noun + "s"``, e.g. ``plural(2, "copy", "copies")``)."""
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"


__all__ = ["plural"]
