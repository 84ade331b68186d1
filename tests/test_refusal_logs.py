"""Refusals are counted every time and logged once per kind and window: a client that fails authentication in a
loop cannot fill a log."""

from __future__ import annotations

import logging

from aiohttp.test_utils import TestClient, TestServer

from btbctl.engine.agent.control import make_app
from btbctl.engine.agent.events import AgentMetrics


def _auth_failures(m: AgentMetrics) -> float:
    return m.registry.get_sample_value("btbctl_agent_auth_failures_total") or 0.0


def test_a_flood_of_peer_auth_failures_is_counted_but_logged_once(caplog):
    m = AgentMetrics()
    with caplog.at_level(logging.INFO, logger="btbctl.agent"):
        for i in range(5000):
            m.event("auth_failed", {"peer": f"10.0.0.9:{40000 + i}", "direction": "inbound", "reason": "bad MAC"})
    lines = [r.getMessage() for r in caplog.records if "auth_failed" in r.getMessage()]
    assert _auth_failures(m) == 5000
    assert len(lines) == 1 and "\n" not in lines[0] and "Traceback" not in caplog.text


class _Agent:
    control_token = "s3cret"

    def __init__(self) -> None:
        self.metrics = AgentMetrics()

    def event(self, name: str, fields: dict) -> None:
        self.metrics.event(name, fields)


async def test_agent_control_api_counts_wrong_tokens(caplog):
    agent = _Agent()
    client = TestClient(TestServer(make_app(agent)))
    await client.start_server()
    try:
        with caplog.at_level(logging.INFO, logger="btbctl.agent"):
            statuses = []
            for i in range(50):
                headers = {"Authorization": "Bearer wrong"} if i % 2 else {}
                async with client.post("/v1/has", json={"names": []}, headers=headers) as r:
                    statuses.append(r.status)
    finally:
        await client.close()
    assert set(statuses) == {401, 403}
    assert _auth_failures(agent.metrics) == 50
    lines = [r.getMessage() for r in caplog.records if "auth_failed" in r.getMessage()]
    assert len(lines) == 1 and "listener=control" in lines[0]
