"""The live gateway: the data plane in front of the workers and the control API beside it.

Modules, one purpose each (imports point down this list, never up):

* :mod:`.server`: the wiring: :class:`~.server.Gateway` (builds the pieces, swaps policy and constants, lifecycle),
  :func:`~.server.serve_gateway`, :func:`~.server.run_gateway`;
* :mod:`.dataplane`: the OpenAI-compatible and SGLang-native routes (forwarding, streaming, retries, TTFT);
* :mod:`.httpserver`: the data listener's HTTP/1.1 server (asyncio protocols, ``httptools``);
* :mod:`.control_api`: the control API's handlers (routes in ``docs/control-api.md``);
* :mod:`.reports`: the control API's answers, as the models of :mod:`btbctl.engine.control.schema`;
* :mod:`.health`: the workers' health prober;
* :mod:`.replicator`: the executor of copy plans over the workers' ``/btb/push``;
* :mod:`.events`: the event bus behind ``GET /control/events``;
* :mod:`.state`: the fleet state (workers, holdings, copies, chains, TTFT), the policies' view;
* :mod:`.config`, :mod:`.prompt`, :mod:`.metrics`: settings, request bodies to block chains, Prometheus metrics.

Importing this package loads only the settings; the server side (aiohttp, the data plane's HTTP server, the
policies) is imported on first use of :class:`Gateway`, :func:`serve_gateway` or :func:`run_gateway`, so CLI
start-up stays fast.
"""

from __future__ import annotations

from btbctl.engine.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "serve_gateway", "run_gateway", "Gateway"]


def __getattr__(name: str):
    if name in ("serve_gateway", "run_gateway", "Gateway"):
        from btbctl.engine.gateway import server  # lazy: see the module docstring

        return getattr(server, name)
    raise AttributeError(name)
