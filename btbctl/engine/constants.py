"""BTB's four tuning constants, validated. Shared by the detector, the policies, the simulator and the control API."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from btbctl.engine.errors import ConfigError


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
        if isinstance(self.prefix_blocks, bool) or not isinstance(self.prefix_blocks, int) or self.prefix_blocks < 1:
            raise ConfigError("prefix_blocks", f"must be an integer >= 1, got {self.prefix_blocks!r}")
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold < 1:
            raise ConfigError("threshold", f"must be an integer >= 1, got {self.threshold!r}")
        if (isinstance(self.window_s, bool) or not isinstance(self.window_s, (int, float))
                or not 0 < self.window_s < math.inf):
            raise ConfigError("window_s", f"must be a finite number > 0, got {self.window_s!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError("replicas", f"must be an integer >= 1, got {self.replicas!r}")

    def with_updates(self, **changes) -> "BtbConstants":
        """A validated copy with ``changes`` applied (unknown keys raise :class:`ConfigError`)."""
        unknown = set(changes) - set(asdict(self))
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"unknown constant; valid: {', '.join(asdict(self))}")
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)
