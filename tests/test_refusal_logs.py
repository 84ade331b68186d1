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


# -- the gateway: Host and Origin checks, counted refusals -------------------------------------------------------


def _rejected(text: str, reason: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "btb_rejected_requests_total" and s.labels.get("reason") == reason:
                return s.value
    return 0.0


async def test_gateway_refuses_foreign_host_and_cross_origin_writes_and_counts_them(caplog):
    from gateway_fakes import GatewayEnv

    async with GatewayEnv(2) as env:
        with caplog.at_level(logging.INFO, logger="btbctl.engine.gateway.guard"):
            # DNS rebinding: the page's own name, resolved to 127.0.0.1
            for _ in range(20):
                async with env.http.get(env.control + "/control/constants", headers={"Host": "evil.example:8081"}) as r:
                    assert r.status == 403
            # a cross-site form / text/plain POST to the data plane
            for _ in range(20):
                async with env.http.post(
                    env.url + "/generate",
                    data=b'{"text": "hi"}',
                    headers={"Content-Type": "text/plain", "Origin": "https://evil.example"},
                ) as r:
                    assert r.status == 403
            # the same from btbctl's own clients (no Origin, loopback Host) is served
            status, _ = await env.get_control("/control/constants")
            assert status == 200
            async with env.http.get(env.control + "/control/constants", headers={"Host": "localhost:1"}) as r:
                assert r.status == 200
            async with env.http.post(
                env.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}
            ) as r:
                assert r.status == 200
            # a wrong token on a control write: counted
            for _ in range(20):
                async with env.http.put(env.control + "/control/constants", json={"threshold": 3}) as r:
                    assert r.status == 401
        async with env.http.get(env.url + "/metrics") as r:
            text = await r.text()
    assert _rejected(text, "host") == 20 and _rejected(text, "origin") == 20 and _rejected(text, "auth") == 20
    refused = [r.getMessage() for r in caplog.records if "request_refused" in r.getMessage()]
    assert len(refused) == 2  # one line per listener and reason in the window
    denied = [r.getMessage() for r in caplog.records if "control_denied" in r.getMessage()]
    assert len(denied) == 1


async def test_emulated_worker_counts_refused_btb_requests_and_logs_once(caplog):
    from btbctl.engine.worker.config import make_config
    from btbctl.engine.worker.core import Worker
    from btbctl.engine.worker.http import build_app

    cfg = make_config(model_path="qwen3-8b", tp_size=1, zero_delay=True, port=0, btb_token="w-token")
    worker = Worker(cfg)
    client = TestClient(TestServer(build_app(worker)))
    await client.start_server()
    try:
        with caplog.at_level(logging.INFO, logger="btbctl.worker"):
            for i in range(40):
                headers = {"Authorization": "Bearer nope"} if i % 2 else {}
                async with client.post("/btb/expect", json={}, headers=headers) as r:
                    assert r.status in (401, 403)
    finally:
        await client.close()
        await worker.stop()
    reg = worker.metrics.registry
    count = sum(
        reg.get_sample_value("btbctl_worker_auth_failures_total", {"reason": why}) or 0.0
        for why in ("no_token", "wrong_token")
    )
    assert count == 40
    lines = [r.getMessage() for r in caplog.records if "auth_failed" in r.getMessage()]
    assert len(lines) == 2  # one per reason in the window


async def test_agent_control_api_refuses_foreign_host_and_cross_site_writes(caplog):
    agent = _Agent()
    client = TestClient(TestServer(make_app(agent, bind_host="127.0.0.1")))
    await client.start_server()
    auth = {"Authorization": "Bearer s3cret"}
    try:
        with caplog.at_level(logging.INFO, logger="btbctl.agent"):
            for _ in range(10):
                async with client.get("/v1/info", headers={**auth, "Host": "rebound.example"}) as r:
                    assert r.status == 403
                async with client.post(
                    "/v1/has",
                    data=b'{"names": []}',
                    headers={**auth, "Content-Type": "text/plain", "Origin": "http://evil.example"},
                ) as r:
                    assert r.status == 403
    finally:
        await client.close()
    reg = agent.metrics.registry
    assert reg.get_sample_value("btbctl_agent_requests_refused_total", {"reason": "host"}) == 10
    assert reg.get_sample_value("btbctl_agent_requests_refused_total", {"reason": "origin"}) == 10
    lines = [r.getMessage() for r in caplog.records if "request_refused" in r.getMessage()]
    assert len(lines) == 2
