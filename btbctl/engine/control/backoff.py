"""Exponential backoff between attempts to reach the control API (the dashboard's reconnections of the event stream
and of polling while the fleet is unreachable): one schedule, no clock of its own, so callers decide how to wait
(``asyncio.sleep``, or "not before" a time of an injected clock)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Waits between attempts, seconds: ``first_s`` after the first failure, doubling after each further one, never
    above ``max_s``; :meth:`reset` after a success starts over.

    Raises:
        ValueError: ``first_s`` not positive, or ``max_s`` below ``first_s``.
    """

    first_s: float
    max_s: float
    next_s: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got first_s={self.first_s}, max_s={self.max_s}")
        self.next_s = self.first_s

    def failed(self) -> float:
        """An attempt failed: the wait before the next one, seconds (the one after waits twice as long)."""
        wait_s = self.next_s
        self.next_s = min(self.max_s, wait_s * 2)
        return wait_s

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``first_s`` again."""
        self.next_s = self.first_s


__all__ = ["Backoff"]
