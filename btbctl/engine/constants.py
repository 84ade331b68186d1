"""BTB's four tuning constants, validated. Shared by the detector, the policies, the simulator and the control API."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from btbctl.engine.errors import ConfigError


#: Upper bounds: sanity limits far beyond any real setting (a 2**20-block prefix is 268M tokens at 256 tokens per
#: block; a day-long window; thousands of replicas), so a typo cannot make the detector track absurd state.
_MAX_INT = {"prefix_blocks": 1 << 20, "threshold": 1 << 20, "replicas": 4096}
MAX_WINDOW_S = 86400.0


@dataclass(frozen=True)
class BtbConstants:
    """The four constants of Biting the Bullet.

    Defaults are the published ones (Birmiwal & Bhat, "Biting the Bullet", 2026-07-22; REFERENCE.md s1).

    Attributes:
        prefix_blocks: Y, length of the matched and copied prefix, in blocks of the trace's/gateway's block size
            (default 256 blocks x 256 tokens = 65,536 tokens). Prompts with fewer blocks never trigger.
        threshold: X, arrivals of the same Y-block prefix inside the window that fire replication (default 2).
        window_s: Z, trailing detection window in seconds (default 1.0).
        replicas: M, how many replicas should hold a hot prefix, the holder included (default 4).
    """

    prefix_blocks: int = 256
    threshold: int = 2
    window_s: float = 1.0
    replicas: int = 4

    def __post_init__(self) -> None:
        for key in ("prefix_blocks", "threshold", "replicas"):
            v = getattr(self, key)
            hi = _MAX_INT[key]
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ConfigError(key, f"must be an integer >= 1 and <= {hi}, got {v!r}")
        if (isinstance(self.window_s, bool) or not isinstance(self.window_s, (int, float))
                or not 0 < self.window_s <= MAX_WINDOW_S):
            raise ConfigError("window_s", f"must be a number > 0 and <= {MAX_WINDOW_S:g} s, got {self.window_s!r}")

    def with_updates(self, **changes) -> "BtbConstants":
        """A validated copy with ``changes`` applied (unknown keys raise :class:`ConfigError`)."""
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"unknown constant; valid: {', '.join(asdict(self))}")
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)
