"""Network model of the simulator: per-replica NICs shared by concurrent KV-cache copies.

Each replica has one NIC of ``nic_bytes_per_s`` (its GPUs' NICs together). NICs are full duplex, as RDMA NICs are:
the transmit side is shared by the copies the replica sends, the receive side by the copies it receives. Rates
are max-min fair (progressive filling) over those two constraints and are recomputed whenever a copy starts,
finishes, stalls or resumes.

A copy can only send bytes the source has computed: ``avail_bytes`` grows as the source's prefill commits blocks,
and a copy that has sent everything available is *stalled* (rate 0, not sharing the NIC) until more arrives.
Time is always passed in.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

_EPS = 1e-9


@dataclass(eq=False)
class Copy:
    """One KV-cache copy in flight.

    Attributes:
        src, dst: replica indices.
        chain: the whole prefix chain being made resident at ``dst``.
        offset: leading blocks ``dst`` already had (not sent).
        total_bytes: bytes to send (blocks ``offset..len(chain)``).
        avail_bytes: bytes the source has computed so far (<= total).
        sent_bytes: bytes sent so far.
        rate: current bytes/s.
    """

    cid: int
    src: int
    dst: int
    chain: tuple[Hashable, ...]
    offset: int
    bytes_per_block: float
    started_s: float
    total_bytes: float
    avail_bytes: float = 0.0
    sent_bytes: float = 0.0
    rate: float = 0.0
    t_last: float = 0.0
    version: int = 0
    src_pinned: int = 0
    done_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def eta_s(self) -> float | None:
        """Seconds until the next milestone (done or stalled) at the current rate; None if stalled."""
        target = min(self.avail_bytes, self.total_bytes)
        if self.rate <= 0:
            return None
        return max(0.0, (target - self.sent_bytes) / self.rate)

    @property
    def stalled(self) -> bool:
        return self.sent_bytes >= self.avail_bytes and self.avail_bytes < self.total_bytes

    @property
    def finished(self) -> bool:
        return self.sent_bytes >= self.total_bytes


class Network:
    """Full-duplex NICs with max-min fair sharing.

    Args:
        n_replicas: number of NICs.
        nic_bytes_per_s: capacity of each NIC direction, bytes/s.
    """

    def __init__(self, n_replicas: int, nic_bytes_per_s: float) -> None:
        self.cap = nic_bytes_per_s
        self.active: list[Copy] = []

    def advance(self, now_s: float) -> None:
        """Account bytes sent by every active copy up to ``now_s``."""
        for c in self.active:
            if c.rate > 0:
                target = min(c.avail_bytes, c.total_bytes)
                sent = c.sent_bytes + c.rate * (now_s - c.t_last)
                # snap when less than a nanosecond of sending is left: float time cannot resolve it
                if sent >= target - c.rate * 1e-9:
                    sent = target
                c.sent_bytes = sent
            c.t_last = now_s

    def reallocate(self) -> None:
        """Max-min fair rates over transmit (per source) and receive (per target) capacity."""
        flows = [c for c in self.active if not c.stalled and not c.finished]
        for c in self.active:
            c.rate = 0.0
        if not flows:
            return
        tx_left = {}
        rx_left = {}
        for c in flows:
            tx_left[c.src] = self.cap
            rx_left[c.dst] = self.cap
        unfrozen = set(range(len(flows)))
        while unfrozen:
            tx_n: dict[int, int] = {}
            rx_n: dict[int, int] = {}
            for i in unfrozen:
                c = flows[i]
                tx_n[c.src] = tx_n.get(c.src, 0) + 1
                rx_n[c.dst] = rx_n.get(c.dst, 0) + 1
            share = min(min(tx_left[s] / k for s, k in tx_n.items()), min(rx_left[d] / k for d, k in rx_n.items()))
            frozen = []
            for i in unfrozen:
                c = flows[i]
                if tx_left[c.src] / tx_n[c.src] <= share + _EPS or rx_left[c.dst] / rx_n[c.dst] <= share + _EPS:
                    frozen.append(i)
            for i in frozen:
                c = flows[i]
                c.rate = share
                tx_left[c.src] -= share
                rx_left[c.dst] -= share
                unfrozen.discard(i)
