"""Every listener has a connection cap, a request-head timeout and an idle timeout; the agent's copy port survives
failed accepts and says when it is down; connections with the control token are never starved by ones without.

Caps and timeouts are configured small here; waits are bounded, nothing asserts a wall time.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import re
import socket
import threading
from pathlib import Path

import aiohttp
import pytest

from agent_helpers import SECRET, wait_for
from btbctl.engine import netguard
from btbctl.engine.agent.pages import PageStore
from btbctl.engine.agent.peer import AUTH_LABEL, PROTOCOL_VERSION, Conn, PeerService, client_auth
from btbctl.engine.gateway import GatewayConfig, serve_gateway
from btbctl.engine.replication.wire import ClientHandshake
from btbctl.sglang_l3.frames import json_frame
from gateway_fakes import start_fleet, stop_fleet

ROOT = Path(__file__).resolve().parent.parent / "btbctl"


async def _gateway(fleet, **kw):
    """A served gateway in front of ``fleet`` on free ports, control token ``t``, with ``kw`` for its config."""
    return await serve_gateway(GatewayConfig(workers=[w.url for w in fleet], port=0, control_port=0, token="t", **kw))


def _host_port(url: str) -> tuple[str, str]:
    """``(host, port)`` of ``http://host:port``."""
    host, _, port = url.rsplit("/", 1)[1].rpartition(":")
    return host, port


class _Node:
    def __init__(self, **kw) -> None:
        self.events: list[tuple[str, dict]] = []
        self.store = PageStore(16 << 20, on_event=lambda e, f: None)
        self.peers = PeerService(self.store, SECRET, "n", lambda e, f: self.events.append((e, f)), **kw)
        self.port = self.peers.start()

    def close(self) -> None:
        self.peers.close()
        self.store.close()


@pytest.fixture
def node():
    made: list[_Node] = []

    def make(**kw) -> _Node:
        n = _Node(**kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def _open(port: int) -> socket.socket:
    """A connection that said hello and read the copy port's challenge (so it was accepted), then sends nothing."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(json_frame(ClientHandshake(AUTH_LABEL, PROTOCOL_VERSION).hello(agent="idle")))
    assert s.recv(1) == b"J"
    return s


def _closed(s: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the agent closed ``s`` (EOF or reset) within ``within_s``."""
    s.settimeout(within_s)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _authenticates(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        return bool(client_auth(Conn(s, 5.0), SECRET, "legit"))


# -- item 1: the agent's copy port ----------------------------------------------------------------------------


class _FlakyAccept:
    """The listening socket, with ``accept()`` failing with EMFILE while ``failing`` is set."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.failing = threading.Event()
        self.failures = 0

    def accept(self):
        if self.failing.is_set():
            self.failures += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_copy_port_survives_failed_accepts_and_says_it_is_down(node):
    n = node()
    flaky = _FlakyAccept(n.peers._sock)
    flaky.failing.set()
    n.peers._sock = flaky  # the accept loop, blocked in the real accept now, uses it from its next call on
    _open(n.port).close()
    wait_for(lambda: flaky.failures >= 2, 5.0, "accept failing")
    down = n.peers.port_down()
    assert down is not None and "Too many open files" in down, down
    flaky.failing.clear()
    assert _authenticates(n.port)  # the port came back once descriptors did
    assert n.peers.port_down() is None
    names = [e for e, _ in n.events]
    assert names.count("copy_port_down") == 1 and names.count("copy_port_up") == 1, names


def test_copy_port_caps_unauthenticated_connections_oldest_first(node):
    n = node(max_unauthenticated=4, max_per_peer=100, auth_timeout_s=30.0)
    socks = [_open(n.port) for _ in range(8)]
    try:
        assert all(_closed(s) for s in socks[:4])
        assert not any(_closed(s, 0.3) for s in socks[4:])
        assert _authenticates(n.port)  # a real peer still gets in
    finally:
        for s in socks:
            s.close()


def test_copy_port_caps_connections_per_peer(node):
    n = node(max_unauthenticated=100, max_per_peer=3, auth_timeout_s=30.0)
    socks = [_open(n.port) for _ in range(5)]
    try:
        assert all(_closed(s) for s in socks[:2])
        assert not any(_closed(s, 0.3) for s in socks[2:])
    finally:
        for s in socks:
            s.close()


# -- item 4: the operator is never locked out -------------------------------------------------------------------


async def test_the_token_gets_through_half_sent_control_connections():
    fleet = await start_fleet(1)
    gw = await _gateway(
        fleet,
        control_max_connections=4,
        header_timeout_s=30.0,  # the half-sent ones stay too young to evict
        health_interval_s=0.2,
    )
    host, port = _host_port(gw.control_url)
    writers = []
    try:
        for _ in range(12):
            _, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET /control/fleet HTTP/1.1\r\nHost: x\r\n")
            writers.append(w)
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            statuses = []
            for _ in range(5):
                async with http.get(gw.control_url + "/control/fleet", headers={"Authorization": "Bearer t"}) as r:
                    statuses.append(r.status)
            assert statuses == [200] * 5, statuses
            async with http.get(gw.control_url + "/control/fleet") as r:  # without the token: still capped
                assert r.status == 503
    finally:
        for w in writers:
            w.close()
        await gw.stop()
        await stop_fleet(fleet)


# -- every listener: a cap, a head timeout, an idle timeout ------------------------------------------------------

_LISTEN = re.compile(r"TCPSite\(|start_server\(|start_unix_server\(|\.listen\(|serve_forever\(|make_server\(")


def test_every_listener_is_registered_with_its_three_limits():
    opened: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if _LISTEN.search(text):
            mod = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
            opened[mod] = _LISTEN.findall(text)
    # aiohttp listeners are opened by listen_http only, which takes a guard (a guard requires all three limits)
    assert [m for m, calls in opened.items() if "TCPSite(" in calls] == ["btbctl.engine.netguard"]
    modules = {e["module"] for e in netguard.LISTENERS.values()}
    for mod in opened:
        if mod != "btbctl.engine.netguard":
            assert mod in modules, f"{mod} listens without an entry in netguard.LISTENERS"
    for name, entry in netguard.LISTENERS.items():
        src = (ROOT.parent / (entry["module"].replace(".", "/") + ".py")).read_text()
        if entry["opener"] == "listen_http":
            assert "listen_http(" in src and "ConnectionGuard(" in src, name
            continue
        mod = __import__(entry["module"], fromlist=["_"])
        if "exempt" in entry:
            assert getattr(mod, entry["cap"]) > 0, name
            continue
        params = inspect.signature(getattr(mod, entry["opener"])).parameters
        for limit in ("cap", "header_timeout", "idle_timeout"):
            default = params[entry[limit]].default
            assert isinstance(default, (int, float)) and default > 0, (name, limit)
    sig = inspect.signature(netguard.ConnectionGuard).parameters
    for limit in ("max_connections", "header_timeout_s", "idle_timeout_s"):
        assert sig[limit].default is inspect.Parameter.empty, limit  # required, never forgotten
    with pytest.raises(ValueError, match="header timeout"):
        netguard.ConnectionGuard(
            "x",
            max_connections=1,
            header_timeout_s=0,
            idle_timeout_s=1,
            retry_after_s=1,
            limiter=netguard.RateLimiter(),
        )


async def test_live_listeners_close_half_sent_connections():
    """The gateway's two listeners and the agent's copy port, each with a small head timeout: a half-sent
    connection is closed (the cap's push-out is tested above)."""
    fleet = await start_fleet(1)
    gw = await _gateway(fleet, header_timeout_s=0.5)
    store = PageStore(16 << 20, on_event=lambda e, f: None)
    peers = PeerService(store, SECRET, "n", lambda e, f: None, auth_timeout_s=0.5)
    copy_port = peers.start()
    try:
        for url in (gw.data_url, gw.control_url):
            host, port = _host_port(url)
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET / HTTP/1.1\r\n")
            assert await asyncio.wait_for(r.read(), 10) == b""  # closed by the guard, well before 10 s
            w.close()
        s = await asyncio.to_thread(_open, copy_port)
        assert await asyncio.to_thread(_closed, s, 10.0)  # closed by the guard, well before 10 s
        s.close()
    finally:
        peers.close()
        store.close()
        await gw.stop()
        await stop_fleet(fleet)


async def test_agent_health_says_when_its_copy_port_is_down(tmp_path):
    from btbctl.engine.agent.agent import Agent, AgentConfig

    agent = Agent(AgentConfig(socket_path=str(tmp_path / "a.sock"), arena_bytes=4 << 20, secret=SECRET))
    await agent.start()
    try:
        url = f"http://127.0.0.1:{agent.control_port}/health"
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as r:
                assert r.status == 200
            assert agent.peers is not None
            flaky = _FlakyAccept(agent.peers._sock)
            flaky.failing.set()
            agent.peers._sock = flaky
            await asyncio.to_thread(lambda: _open(agent.peer_port).close())
            await asyncio.to_thread(wait_for, lambda: flaky.failures >= 1, 5.0, "accept failing")
            async with http.get(url) as r:
                assert r.status == 503
                assert "copy port" in await r.text()
            flaky.failing.clear()
            assert await asyncio.to_thread(_authenticates, agent.peer_port)
            async with http.get(url) as r:
                assert r.status == 200
    finally:
        await agent.close()


async def test_control_connections_are_capped_per_peer():
    fleet = await start_fleet(1)
    gw = await _gateway(fleet, control_max_per_peer=3, header_timeout_s=2.0)  # pushed out once 1 s old
    host, port = _host_port(gw.control_url)
    conns = []
    try:
        for _ in range(3):
            conns.append(await asyncio.open_connection(host, int(port)))
            conns[-1][1].write(b"GET /control/fleet HTTP/1.1\r\n")
        await asyncio.sleep(1.2)
        for _ in range(3):
            conns.append(await asyncio.open_connection(host, int(port)))
        for r, _ in conns[:3]:
            assert await asyncio.wait_for(r.read(), 1.5) == b""  # pushed out, before their head timeout
        assert gw.guards[1].closed["per_peer"] == 3
    finally:
        for _, w in conns:
            w.close()
        await gw.stop()
        await stop_fleet(fleet)


def test_idle_connections_past_the_descriptor_limit_do_not_kill_the_copy_port(tmp_path):
    """The field report scaled down: an agent at ``ulimit -n 128`` (soft and hard), 300 idle connections to its copy
    port, then all closed: a real peer authenticates during the flood and after it."""
    import resource
    import subprocess
    import sys

    sec = tmp_path / "sec"
    sec.write_bytes(SECRET)
    cmd = [sys.executable, "-m", "btbctl", "agent", "--secret-file", str(sec), "--arena-mib", "8"]
    cmd += ["--socket", str(tmp_path / "a.sock"), "--agent-id", "a"]
    log = open(tmp_path / "agent.log", "w")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=log,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)),
        text=True,
        cwd=ROOT.parent,
    )
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line[:1] == ["ready"], (tmp_path / "agent.log").read_text()
        port = int(line[2].rsplit(":", 1)[1])
        for _ in range(300):
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                pass
        assert _authenticates(port)
        for s in socks:
            s.close()
        assert _authenticates(port)
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(10)
        log.close()
