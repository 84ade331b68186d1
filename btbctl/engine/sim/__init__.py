"""The discrete-event fleet simulator: the replica model (:mod:`~btbctl.engine.sim.replica`), the ``realistic``
fleet (:mod:`~btbctl.engine.sim.simulator`), the ``infersim`` profile (:mod:`~btbctl.engine.sim.infersim`), their
shared results (:mod:`~btbctl.engine.sim.results`) and :func:`simulate` over both. See ``docs/simulator.md``."""

from btbctl.engine.sim.dispatch import simulate
from btbctl.engine.sim.replica import ReplicaModel
from btbctl.engine.sim.results import RequestRecord, SimResult
from btbctl.engine.sim.simulator import SimFleetView, Simulator

__all__ = ["ReplicaModel", "RequestRecord", "SimFleetView", "SimResult", "Simulator", "simulate"]
