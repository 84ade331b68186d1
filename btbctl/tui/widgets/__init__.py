"""Dashboard panels; each renders one part of a :class:`~btbctl.engine.dashboard.FleetSnapshot`."""
