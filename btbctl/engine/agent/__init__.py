"""The node agent of BTB on stock SGLang (``btbctl agent``): the page store that ``btbctl.sglang_l3.BtbL3Store``
instances use, and agent-to-agent page copies.

* :mod:`~btbctl.engine.agent.pages`: the shared-memory arena, LRU, pins, leases, pending copies.
* :mod:`~btbctl.engine.agent.local`: the Unix-socket server for local stores (protocol in
  :mod:`btbctl.sglang_l3.wire`).
* :mod:`~btbctl.engine.agent.peer`: authenticated TCP copies between agents, fan-out, bounds, deadlines.
* :mod:`~btbctl.engine.agent.control`: the HTTP control API (has / expect / push / progress / cancel / pin) and
  Prometheus ``/metrics``.
* :mod:`~btbctl.engine.agent.events`: structured log lines and metrics.
* :mod:`~btbctl.engine.agent.agent`: wiring and :func:`~btbctl.engine.agent.agent.run`.
"""
