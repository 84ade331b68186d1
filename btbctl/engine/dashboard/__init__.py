"""What the dashboard reads and does, with no UI toolkit: one interface (:class:`~.snapshot.DashboardSource`), one
snapshot type, two sources.

* :class:`~.sim_source.SimSource`: the incremental simulator replaying a trace paced to the wall clock (times a
  speed factor) in a background thread, so the dashboard works with no fleet at all.
* :class:`~.control_source.ControlApiSource`: a client of a running fleet's control API (``btbctl up``) that
  follows its event stream and pushes snapshots (a :class:`~.snapshot.StreamingSource`), polls only while the
  stream is down, and reconnects with exponential backoff after the fleet goes away, saying so in
  :attr:`~.snapshot.FleetSnapshot.message`.

Both answer :meth:`DashboardSource.snapshot` with the same :class:`~.snapshot.FleetSnapshot`, and accept the same
three actions (set constants, set policy, replicate a prefix).

Units: times in seconds, sizes in bytes or tokens as the field names say, rates per second.
"""

from __future__ import annotations

from btbctl.engine.dashboard.snapshot import (
    GPU_SOURCES,
    DashboardSource,
    FleetSnapshot,
    GpuRow,
    PrefixRow,
    ReplicateResult,
    SourceError,
    StreamingSource,
    TransferRow,
    TtftPoint,
    WorkerRow,
)

__all__ = [
    "GPU_SOURCES",
    "DashboardSource",
    "FleetSnapshot",
    "GpuRow",
    "PrefixRow",
    "ReplicateResult",
    "SourceError",
    "StreamingSource",
    "TransferRow",
    "TtftPoint",
    "WorkerRow",
]
