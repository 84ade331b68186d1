"""The live gateway: data plane (OpenAI-compatible and SGLang-native routes), control API, fleet state and the
replication planner. See :mod:`.app`, :mod:`.control`, :mod:`.state`, :mod:`.planner` and :mod:`.server`.

Importing this package does not import aiohttp's server side until :func:`serve_gateway` runs.
"""

from __future__ import annotations

from btbctl.engine.gateway.config import GatewayConfig

__all__ = ["GatewayConfig", "serve_gateway", "run_gateway", "Gateway"]


def __getattr__(name: str):
    if name in ("serve_gateway", "run_gateway", "Gateway"):
        from btbctl.engine.gateway import server

        return getattr(server, name)
    raise AttributeError(name)
