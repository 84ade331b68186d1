"""The discrete-event fleet simulator (see :mod:`btbctl.engine.sim.simulator`)."""

from btbctl.engine.sim.simulator import RequestRecord, SimFleetView, SimResult, Simulator, simulate

__all__ = ["RequestRecord", "SimFleetView", "SimResult", "Simulator", "simulate"]
