"""A node agent registers with every gateway one name resolves to (``--gateway-service``, a headless Service on
Kubernetes): two live gateways whose control APIs listen on the same port of two loopback addresses, one real agent
(in process) whose resolver maps the service's name to both. Both hold its registration; when the name stops
resolving to one, a line says so and that gateway lets the registration lapse; a failed resolution is one line."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from btbctl.engine.agent.agent import Agent, AgentConfig, parse_gateway_service
from btbctl.engine.errors import ConfigError
from gateway_fakes import GatewayEnv, until

SECRET = b"gateway-service-test-fleet-secret-0123456789"
SERVICE_HOST = "btb-control-pods.btb.svc.cluster.local"
#: Registration period of the agent under test, seconds (its registrations hold 3 of them).
INTERVAL_S = 0.2


@pytest.mark.parametrize(
    "url",
    [
        "https://gw:7000",  # announcements go to the pods' addresses, where no certificate names them
        "http://gw",
        "http://gw:0",
        "http://gw:99999",
        "http://gw:7000/control",
        "http://user@gw:7000",
        "gw:7000",
        "",
    ],
)
def test_a_gateway_service_that_is_not_http_name_port_is_refused_naming_the_option(url):
    with pytest.raises(ConfigError) as e:
        parse_gateway_service(url)
    assert e.value.key == "--gateway-service" and len(str(e.value).splitlines()) == 1


def test_a_gateway_service_gives_its_name_and_port():
    assert parse_gateway_service(f"http://{SERVICE_HOST}:7001") == (SERVICE_HOST, 7001)
    assert parse_gateway_service("http://[fd00::1]:7001/") == ("fd00::1", 7001)


def _lines(caplog, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"event={event} " in r.getMessage() + " "]


async def _agent_names(env: GatewayEnv) -> list[str]:
    """The agents whose registration ``env``'s gateway holds now (``GET /control/agents``)."""
    status, body = await env.get_control("/control/agents", headers=env.auth())
    assert status == 200, body
    return [a["name"] for a in body["agents"]]


async def _holds(env: GatewayEnv, names: list[str], timeout_s: float = 10.0) -> None:
    """Wait until ``env``'s gateway holds exactly the registrations of ``names``; fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while (got := await _agent_names(env)) != names:
        assert loop.time() < end, f"{env.control} holds {got}, not {names}"
        await asyncio.sleep(0.02)


async def test_an_agent_registers_with_every_gateway_its_service_name_resolves_to(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="btbctl")
    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    l3 = {"replication": "l3", "agent_secret_file": str(secret)}
    async with GatewayEnv(1, page_size=16, control_host="127.0.0.1", control_port=0, **l3) as first:
        port = int(first.control.rpartition(":")[2])
        async with GatewayEnv(1, page_size=16, control_host="127.0.0.2", control_port=port, **l3) as second:
            assert second.control == f"http://127.0.0.2:{port}"
            answers: list = [["127.0.0.2", "127.0.0.1", "127.0.0.2"]]  # repeats are announced to once
            asked: list[tuple[str, int]] = []

            async def resolve(host: str, p: int) -> list[str]:
                asked.append((host, p))
                if isinstance(answers[0], OSError):
                    raise answers[0]
                return answers[0]

            service = f"http://{SERVICE_HOST}:{port}"
            agent = Agent(
                AgentConfig(
                    socket_path=str(tmp_path / "a.sock"),
                    arena_bytes=4 << 20,
                    secret=SECRET,
                    agent_id="node-a",
                    gateway_services=(service,),
                    register_interval_s=INTERVAL_S,
                ),
                resolve=resolve,
            )
            await agent.start()
            try:
                # both gateways hold the registration, each announced to at its own address
                await _holds(first, ["node-a"])
                await _holds(second, ["node-a"])
                assert set(asked) == {(SERVICE_HOST, port)}
                announced = sorted(line.split("gateway=")[1].split()[0] for line in _lines(caplog, "agent_announced"))
                assert announced == [f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"]
                (resolved,) = _lines(caplog, "gateway_service_resolved")
                assert f"gateway_service={service}" in resolved and "addresses=127.0.0.1,127.0.0.2" in resolved

                # the name drops the second gateway: one line says so, and its registration lapses there
                answers[0] = ["127.0.0.1"]
                await until(lambda: len(_lines(caplog, "gateway_service_resolved")) == 2, timeout_s=10.0)
                line = _lines(caplog, "gateway_service_resolved")[-1]
                assert "addresses=127.0.0.1 " in line + " " and "old_addresses=127.0.0.1,127.0.0.2" in line
                assert "removed=127.0.0.2" in line and "added=" not in line
                await _holds(second, [])
                assert await _agent_names(first) == ["node-a"]

                # the name stops resolving: one line naming the service, however many periods it lasts; the
                # agent keeps announcing to the addresses it had
                answers[0] = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
                n = len(asked)
                await until(lambda: len(asked) >= n + 4, timeout_s=10.0)
                (failed,) = [line for line in _lines(caplog, "agent_announce_failed") if "gateway_service=" in line]
                assert f"gateway_service={service}" in failed and SERVICE_HOST in failed and "kept=127.0.0.1" in failed
                assert await _agent_names(first) == ["node-a"]
                # it resolves again: a line says so (the same addresses as before)
                answers[0] = ["127.0.0.1"]
                await until(lambda: len(_lines(caplog, "gateway_service_resolved")) == 3, timeout_s=10.0)
                assert "removed=" not in _lines(caplog, "gateway_service_resolved")[-1]
            finally:
                await agent.close()


def test_the_cli_refuses_a_bad_gateway_service_in_one_line(tmp_path, capsys):
    from btbctl.commands.app import main

    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    with pytest.raises(SystemExit) as e:
        main(["agent", "--secret-file", str(secret), "--gateway-service", "https://gw:7000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--gateway-service" in err and "https://gw:7000" in err and len(err.strip().splitlines()) == 1


async def test_a_real_agent_process_resolves_its_gateway_service_with_the_system_resolver(tmp_path):
    """``btbctl agent --gateway-service http://localhost:P``: the option reaches the agent, ``localhost`` resolves
    through ``getaddrinfo`` and the gateway on 127.0.0.1:P holds the registration."""
    from agent_helpers import start_agent

    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    l3 = {"replication": "l3", "agent_secret_file": str(secret)}
    async with GatewayEnv(1, page_size=16, control_host="127.0.0.1", control_port=0, **l3) as env:
        port = int(env.control.rpartition(":")[2])
        extra = ["--gateway-service", f"http://localhost:{port}", "--register-interval-s", str(INTERVAL_S)]
        agent = await asyncio.to_thread(start_agent, tmp_path, "node-b", secret=SECRET, extra=extra)
        try:
            await _holds(env, ["node-b"])
            assert "event=gateway_service_resolved" in agent.log() and "127.0.0.1" in agent.log()
        finally:
            agent.stop()
