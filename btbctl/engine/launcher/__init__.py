"""Launching a fleet on this machine: the cluster file, the run directory, the process launcher and the benchmark
client.

* :mod:`~btbctl.engine.launcher.cluster`: the validated cluster file (``[gateway]``, ``[btb]``, ``[[workers]]``),
  the embedded default fleet and the SGLang / emulated-worker command lines.
* :mod:`~btbctl.engine.launcher.rundir`: where a running fleet is recorded (``state.json``, tokens, logs).
* :mod:`~btbctl.engine.launcher.local`: start processes in their own session, wait until they are ready, stop
  them by process group.
* :mod:`~btbctl.engine.launcher.fleet`: ``up`` / ``down`` / ``status`` built from the three above.
* :mod:`~btbctl.engine.launcher.control`: where the control API of the recorded fleet is (URL and token).
* :mod:`~btbctl.engine.launcher.bench`: replay a trace against any SGLang-compatible endpoint and measure TTFT.
"""
