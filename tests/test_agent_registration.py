"""Node agents register with the gateway: the signed announcement, the l3 executor's map of which agent serves which
worker (replaced by a re-registration, dropped after its ttl), and ``POST /control/agents`` on a live gateway."""

from __future__ import annotations

import asyncio
import logging

import pytest

from btbctl.engine.gateway.l3 import L3Replicator
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.replication.credentials import node_key
from btbctl.engine.replication.registration import (
    MAX_CLOCK_SKEW_S,
    SIGNATURE_HEADER,
    Announcement,
    AnnouncementError,
    sign,
    verify,
)
from gateway_fakes import GatewayEnv, until

SECRET = b"registration-test-fleet-secret-0123456789"
NOW = 1_800_000_000.0


def _ann(agent: str = "node-a", workers: tuple[str, ...] = ("http://w0:1",), **kw) -> Announcement:
    d = {
        "agent": agent,
        "node": agent,
        "peer_addr": "10.0.0.5:7500",
        "control_url": "http://10.0.0.5:7501",
        "workers": workers,
        "ttl_s": 15.0,
        "sent_at": NOW,
    }
    d.update(kw)
    return Announcement(**d)


def _signed(ann: Announcement, secret: bytes = SECRET, as_agent: str | None = None) -> tuple[bytes, str]:
    body = ann.body()
    return body, sign(node_key(secret, as_agent or ann.agent), body)


def test_a_signed_fresh_announcement_is_taken():
    body, sig = _signed(_ann(workers=("http://w0:1/", "http://w1:1")))
    got = verify(body, sig, SECRET, NOW + 5)
    assert got.agent == "node-a" and got.workers == ("http://w0:1", "http://w1:1")
    assert got.peer_addr == "10.0.0.5:7500" and got.control_url == "http://10.0.0.5:7501"
    assert got.instance is None and b"instance" not in body  # an agent that names no incarnation


def test_an_announcement_names_the_agents_incarnation():
    body, sig = _signed(_ann(instance="9f3c0a1b2c3d4e5f"))
    assert verify(body, sig, SECRET, NOW).instance == "9f3c0a1b2c3d4e5f"
    for bad in ("", 7, "x" * 65):
        body, sig = _signed(_ann(instance=bad))
        with pytest.raises(AnnouncementError, match=r"instance must be a string of 1\.\.64 characters"):
            verify(body, sig, SECRET, NOW)


@pytest.mark.parametrize(
    ("case", "status", "words"),
    [
        ("no signature", 401, "missing or wrong"),
        ("another agent's key", 401, "missing or wrong"),
        ("another fleet's secret", 401, "missing or wrong"),
        ("body changed after signing", 401, "missing or wrong"),
        ("old", 403, "a replay"),
        ("bad peer", 400, "peer_addr"),
        ("unknown key", 400, "unknown key 'extra'"),
    ],
)
def test_announcements_not_signed_by_their_agent_or_stale_or_malformed_are_refused(case, status, words):
    ann = _ann()
    body, sig = _signed(ann)
    sig_or_none: str | None = sig
    if case == "no signature":
        sig_or_none = None
    elif case == "another agent's key":
        body, sig_or_none = _signed(ann, as_agent="node-b")
    elif case == "another fleet's secret":
        body, sig_or_none = _signed(ann, secret=b"another-fleet-secret-000000000")
    elif case == "body changed after signing":
        body = body.replace(b"10.0.0.5:7500", b"10.6.6.6:7500")
    elif case == "old":
        body, sig_or_none = _signed(_ann(sent_at=NOW - MAX_CLOCK_SKEW_S - 1))
    elif case == "bad peer":
        body, sig_or_none = _signed(_ann(peer_addr="0.0.0.0:7500"))
    elif case == "unknown key":
        body = body[:-1] + b',"extra":1}'
        sig_or_none = sign(node_key(SECRET, "node-a"), body)
    with pytest.raises(AnnouncementError) as e:
        verify(body, sig_or_none, SECRET, NOW)
    assert e.value.status == status and words in str(e.value), str(e.value)


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _replicator(n: int = 3, agents=(), worker_agents=()) -> tuple[L3Replicator, _Clock]:
    clock = _Clock()
    state = FleetState([f"http://127.0.0.1:{10 + i}" for i in range(n)], clock)
    for w in state.workers:
        w.healthy = True
    rep = L3Replicator(
        state,
        lambda: None,
        agents=list(agents),
        worker_agents=list(worker_agents),
        agent_token=None,
        prefix_tokens=None,  # type: ignore[arg-type]
        page_size=lambda: 16,
    )
    return rep, clock


def _events(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"event={name}" in r.getMessage()]


def test_registrations_build_the_map_a_re_registration_replaces_and_a_silent_agent_is_dropped(caplog):
    caplog.set_level(logging.INFO, logger="btbctl")
    rep, clock = _replicator(3)
    assert rep.agent_names() == [None, None, None] and not rep.accepts_copies(0)
    assert rep.refusal(("k0",), 0, 1) == "the source has no node agent (none registered it)"

    assert rep.register("node-a", "http://a:1", "a:2", [0, 1], 6.0, node="node-a")
    assert rep.register("node-b", "http://b:1", "b:2", [2], 6.0)
    assert rep.agent_names() == ["node-a", "node-a", "node-b"]
    assert rep.accepts_copies(0) and rep.accepts_copies(2)
    assert len(_events(caplog, "agent_registered")) == 2

    clock.t += 4.0  # a heartbeat that changes nothing: renewed, not logged
    assert not rep.register("node-a", "http://a:1", "a:2", [0, 1], 6.0)
    assert len(_events(caplog, "agent_registered")) == 2

    # node-a now serves only w0, at a new copy address: w1 loses its agent
    assert rep.register("node-a", "http://a:1", "a:3", [0], 6.0)
    assert rep.agent_names() == ["node-a", None, "node-b"]
    line = _events(caplog, "agent_registered")[-1]
    assert "old_peer=a:2" in line and "peer=a:3" in line and "old_workers=w0,w1" in line and "workers=w0" in line
    assert rep.agents[rep.worker_agents[0]]["peer_addr"] == "a:3"

    clock.t += 3.0  # node-b last announced 7 s ago (ttl 6 s); node-a 3 s ago
    assert rep.expire() == ["node-b"]
    assert rep.agent_names() == ["node-a", None, None]
    assert not rep.accepts_copies(2)
    assert rep.refusal(("k0",), 0, 2) == "the target has no node agent (none registered it)"
    dropped = _events(caplog, "agent_dropped")
    assert len(dropped) == 1 and "agent=node-b" in dropped[0] and "old_workers=w2" in dropped[0]

    # it comes back: picked up again without a restart, and expires again when silent
    assert rep.register("node-b", "http://b:1", "b:2", [1, 2], 6.0)
    assert rep.agent_names() == ["node-a", "node-b", "node-b"]
    clock.t += 6.0
    assert sorted(rep.expire()) == ["node-a", "node-b"]
    assert rep.agent_names() == [None, None, None]


def test_static_agents_keep_their_workers_and_never_expire_and_registered_workers_move_between_agents(caplog):
    caplog.set_level(logging.INFO, logger="btbctl")
    static = [{"name": "agent-local", "control_url": "http://127.0.0.1:9", "peer_addr": "127.0.0.1:9"}]
    rep, clock = _replicator(3, static, [0, 0, -1])
    assert rep.agent_names() == ["agent-local", "agent-local", None] and rep.next_expiry() is None
    # a registered agent cannot take a worker the settings give another agent
    assert rep.pinned(1, "node-b") and not rep.pinned(1, "agent-local") and not rep.pinned(2, "node-b")
    assert rep.register("node-b", "http://b:1", "b:2", [1, 2], 5.0)
    assert rep.agent_names() == ["agent-local", "agent-local", "node-b"]
    # a worker one registered agent had moves to the one that claims it now
    assert rep.register("node-c", "http://c:1", "c:2", [2], 5.0)
    assert rep.agent_names() == ["agent-local", "agent-local", "node-c"]
    assert "taken_from=w2:node-b" in _events(caplog, "agent_registered")[-1]
    clock.t += 1000.0
    assert sorted(rep.expire()) == ["node-b", "node-c"]
    assert rep.agent_names() == ["agent-local", "agent-local", None]


def test_a_copy_whose_agent_was_dropped_during_it_is_not_proved():
    rep, _ = _replicator(2)
    rep.register("node-a", "http://a:1", "a:2", [0], 5.0)
    rep.register("node-b", "http://b:1", "b:2", [1], 5.0)
    t = Transfer(copy_id="c1", key="k1", chain=("k0", "k1"), source=0, target=1, mode="l3")
    t.path = ("node-a", "node-b")
    assert rep._agent_changed(t) is None
    rep.register("node-c", "http://c:1", "c:2", [1], 5.0)  # another agent took the target's worker
    assert "target's node agent node-b was dropped or replaced" in (rep._agent_changed(t) or "")
    rep.register("node-b", "http://b:1", "b:2", [1], 5.0)
    rep.state.clock.t += 10.0  # type: ignore[attr-defined]
    rep.expire()
    assert "source's node agent node-a was dropped" in (rep._agent_changed(t) or "")


async def test_the_gateway_takes_signed_registrations_without_its_bearer_token_and_drops_silent_agents(tmp_path):
    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    cfg = {"replication": "l3", "agent_secret_file": str(secret)}
    async with GatewayEnv(2, page_size=16, **cfg) as env:
        gw = env.gw
        await until(lambda: all(w.healthy for w in gw.state.workers))
        now = gw.wall_clock()
        w0 = gw.state.workers[0].url
        ann = _ann("node-a", workers=(w0, "http://elsewhere:1"), ttl_s=1.0, sent_at=now)
        body, sig = _signed(ann)
        url = env.control + "/control/agents"
        async with env.http.post(url, data=body) as r:  # unsigned: refused
            assert r.status == 401, await r.text()
        async with env.http.post(url, data=body, headers={SIGNATURE_HEADER: sig}) as r:
            assert r.status == 200, await r.text()
            got = await r.json()
        assert got["workers"] == ["w0"] and got["unknown_workers"] == ["http://elsewhere:1"] and got["changed"]
        assert got["pinned_workers"] == []
        status, fleet = await env.get_control("/control/fleet")
        assert status == 200
        assert [w["agent"] for w in fleet["workers"]] == ["node-a", None]
        assert [w["replication"] for w in fleet["workers"]] == [True, False]
        assert "no node agent serves it" in fleet["workers"][1]["replication_note"]
        assert gw.replicator.accepts_copies(0) and not gw.replicator.accepts_copies(1)
        # the gateway now drives that agent with the control token it derives for it
        assert gw.replicator.tokens["node-a"]
        await until(lambda: gw.replicator.agent_names() == [None, None], timeout_s=5.0)


async def test_the_registration_listener_takes_signed_announcements_and_nothing_else(tmp_path, caplog):
    """``register_hosts``: a listener for agents on other machines while the control API stays on loopback; it
    takes a signed registration and refuses every other request, with or without the bearer token."""
    caplog.set_level(logging.INFO)
    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    cfg = {"replication": "l3", "agent_secret_file": str(secret), "register_hosts": ["127.0.0.1"]}
    async with GatewayEnv(2, page_size=16, **cfg) as env:
        gw = env.gw
        [reg] = gw.register_urls
        assert reg != env.control and reg.startswith("http://127.0.0.1:")
        assert any(f"event=register_listen urls={reg}" in r.getMessage() for r in caplog.records)
        await until(lambda: all(w.healthy for w in gw.state.workers))
        ann = _ann("node-a", workers=(gw.state.workers[1].url,), sent_at=gw.wall_clock())
        body, sig = _signed(ann)
        async with env.http.post(reg + "/control/agents", data=body) as r:  # unsigned
            assert r.status == 401, await r.text()
        forged = sign(node_key(SECRET, "node-b"), body)  # signed by another agent's key
        async with env.http.post(reg + "/control/agents", data=body, headers={SIGNATURE_HEADER: forged}) as r:
            assert r.status in (401, 403), await r.text()
        async with env.http.post(reg + "/control/agents", data=body, headers={SIGNATURE_HEADER: sig}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["workers"] == ["w1"]
        assert gw.replicator.agent_names() == [None, "node-a"]
        auth = {"Authorization": f"Bearer {gw.token}"}
        for method, path in [("GET", "/control/fleet"), ("PUT", "/control/constants"), ("GET", "/control/agents")]:
            async with env.http.request(method, reg + path, json={"threshold": 9}) as r:
                assert r.status == 401, (method, path, r.status)
            async with env.http.request(method, reg + path, json={"threshold": 9}, headers=auth) as r:
                assert r.status in (404, 405), (method, path, r.status)
        assert gw.constants.threshold != 9
        # a body over the control API's limit is refused before it is read whole, and nothing is registered
        from btbctl.engine.gateway.control_api import MAX_CONTROL_BODY

        big = b"{" + b" " * (MAX_CONTROL_BODY + 10) + b"}"
        async with env.http.post(reg + "/control/agents", data=big, headers={SIGNATURE_HEADER: sig}) as r:
            assert r.status == 413, r.status
        assert gw.replicator.agent_names() == [None, "node-a"]


def test_a_registration_listener_needs_l3_with_the_fleet_secret_and_a_fixed_port_for_several_addresses():
    from btbctl.engine.gateway.config import GatewayConfig

    base = {"workers": ["http://127.0.0.1:1"], "register_hosts": ["127.0.0.1"]}
    with pytest.raises(ValueError, match="register_hosts needs replication l3 with agent_secret_file"):
        GatewayConfig(**base)
    l3 = {"replication": "l3", "agent_secret_file": "/x"}
    with pytest.raises(ValueError, match="register_port must be fixed"):
        GatewayConfig(**{**base, **l3, "register_hosts": ["127.0.0.1", "10.0.0.1"]})
    with pytest.raises(ValueError, match="is not a host name or IP address"):
        GatewayConfig(**{**base, **l3, "register_hosts": ["-oProxy"]})
    cfg = GatewayConfig(**{**base, **l3, "register_hosts": ["127.0.0.1", "10.0.0.1"], "register_port": 9000})
    assert cfg.register_port == 9000


async def test_a_gateway_without_the_fleet_secret_takes_no_registrations():
    async with GatewayEnv(1) as env:
        body, sig = _signed(_ann(sent_at=env.gw.wall_clock()))
        async with env.http.post(env.control + "/control/agents", data=body, headers={SIGNATURE_HEADER: sig}) as r:
            assert r.status == 404 and "takes no agent registrations" in await r.text()


def test_l3_without_agents_needs_the_fleet_secret():
    from btbctl.engine.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="agent_secret_file for agents that register"):
        GatewayConfig(workers=["http://127.0.0.1:1"], replication="l3")
    cfg = GatewayConfig(workers=["http://127.0.0.1:1"], replication="l3", agent_secret_file="/x")
    assert cfg.agents == [] and cfg.worker_agents == []


async def test_an_agent_registers_the_workers_connected_to_its_socket_and_is_dropped_when_it_stops(tmp_path, caplog):
    """A real agent (in process) registers with a live gateway every 0.2 s: a worker whose store says hello with its
    URL gets that agent; when the store disconnects, the next announcement takes it back; when the agent stops,
    the gateway drops it after its ttl (3 periods)."""
    from btbctl.engine.agent.agent import Agent, AgentConfig
    from btbctl.sglang_l3.client import AgentClient

    caplog.set_level(logging.INFO, logger="btbctl")
    secret = tmp_path / "fleet-secret"
    secret.write_bytes(SECRET)
    async with GatewayEnv(2, page_size=16, replication="l3", agent_secret_file=str(secret)) as env:
        gw = env.gw
        agent = Agent(
            AgentConfig(
                socket_path=str(tmp_path / "a.sock"),
                arena_bytes=4 << 20,
                secret=SECRET,
                agent_id="node-a",
                gateways=(gw.control_url,),
                register_interval_s=0.2,
            )
        )
        await agent.start()
        stopped = False
        try:
            await until(lambda: any("event=agent_registered" in r.getMessage() for r in caplog.records))
            assert gw.replicator.agent_names() == [None, None]  # no worker connected yet
            w1 = gw.state.workers[1].url
            store = AgentClient(str(tmp_path / "a.sock"), 2.0, None, w1 + "/")
            await asyncio.to_thread(store.hold)
            await until(lambda: gw.replicator.agent_names() == [None, "node-a"])
            a = gw.replicator.agents[gw.replicator.worker_agents[1]]
            assert a["peer_addr"] == f"127.0.0.1:{agent.peer_port}"
            assert a["control_url"] == f"http://127.0.0.1:{agent.control_port}"
            store.close()
            await until(lambda: gw.replicator.agent_names() == [None, None])
            await asyncio.to_thread(store.hold)
            await until(lambda: gw.replicator.agent_names() == [None, "node-a"])
            await agent.close()
            stopped = True
            await until(lambda: gw.replicator.agent_names() == [None, None], timeout_s=3.0)
            assert any(
                "event=agent_dropped" in r.getMessage() and "agent=node-a" in r.getMessage() for r in caplog.records
            )
            store.close()
        finally:
            if not stopped:
                await agent.close()


def test_an_agent_that_registers_must_announce_addresses_other_nodes_reach():
    from btbctl.engine.agent.agent import Agent, AgentConfig
    from btbctl.engine.errors import ConfigError

    with pytest.raises(ConfigError, match="--peer must be an address other nodes reach"):
        Agent(
            AgentConfig(
                socket_path="/tmp/unused.sock",
                arena_bytes=4 << 20,
                secret=SECRET,
                agent_id="node-a",
                peer_host="0.0.0.0",
                gateways=("http://127.0.0.1:1",),
            )
        )
