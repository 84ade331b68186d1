"""An emulated SGLang worker for machines without GPUs (``btbctl worker``).

It speaks SGLang 0.5's HTTP API (:mod:`~btbctl.engine.worker.http`), takes its timing and prefix-cache behaviour
from the simulator's replica model driven in real time (:mod:`~btbctl.engine.worker.model`), keeps a KV block
store of real bytes (:mod:`~btbctl.engine.worker.store`) and sends/receives prefix copies over the transfer port
(:mod:`~btbctl.engine.worker.copies`); :mod:`~btbctl.engine.worker.core` puts the parts together,
:mod:`~btbctl.engine.worker.metrics` exports them, :mod:`~btbctl.engine.worker.server` runs the process. Its process
interface and routes (SGLang's and the ``/btb/*`` extension) are specified in ``docs/emulated-worker.md``.
"""

from btbctl.engine.worker.config import WorkerConfig, make_config

__all__ = ["WorkerConfig", "make_config"]
