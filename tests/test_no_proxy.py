"""No request btbctl makes goes through a proxy: every endpoint it talks to (gateway, control API, workers, node
agents, SGLang servers) is loopback or fleet-internal, so ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` (either
case, with no ``NO_PROXY``) must change nothing. The proxy variables name a loopback catcher that counts the
connections it gets; every check ends with it having seen none. Also: every HTTP client in ``btbctl`` is built by
:mod:`btbctl.engine.httpclient` (a static check), and ``up`` in replication mode l3 (the node agent's readiness
check) works with the variables set."""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import btbctl
from btbctl.engine.control.client import AsyncControlClient, ControlClient
from btbctl.engine.httpclient import async_http_client, client_session, http_client, urlopen
from btbctl.engine.launcher import agents
from btbctl.engine.launcher.bench import BenchOptions, replay_async
from btbctl.engine.launcher.local import health_ok, spawn, stop_group
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.trace.model import Request, Trace
from gateway_fakes import GatewayEnv
from launcher_helpers import FREE_PORTS, cli, cli_json, wait_gone

STANDIN = Path(__file__).with_name("_standin.py")
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class ProxyCatcher:
    """A loopback TCP listener standing in for a proxy: it counts the connections it accepts (and what arrived
    first on each), then closes them, so a request that went through it fails."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.seen: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(0.5)
                try:
                    self.seen.append(conn.recv(200))
                except OSError:
                    self.seen.append(b"")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def proxy(monkeypatch) -> Iterator[ProxyCatcher]:
    """Every proxy variable names the catcher, and nothing is exempt from it."""
    catcher = ProxyCatcher()
    for var in PROXY_VARS:
        monkeypatch.setenv(var, catcher.url)
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    yield catcher
    catcher.close()


def test_the_local_agent_readiness_check_ignores_proxy_variables(tmp_path, proxy):
    """`up` in mode l3 waits for the node agent's ready line and its control API's /health
    (:func:`agents.wait_local_ready`); that probe once went through ``http_proxy`` and never saw the agent."""
    argv = [sys.executable, str(STANDIN), "-m", "btbctl", "agent", "--control", "127.0.0.1:0"]
    proc = spawn("agent-local", argv, tmp_path / "agent.log")
    try:
        info = agents.wait_local_ready(proc, timeout_s=10.0)
    finally:
        stop_group(proc.popen.pid, grace_s=2.0, popen=proc.popen)
    assert info["control_url"].startswith("http://127.0.0.1:") and proc.url == info["control_url"]
    assert proxy.seen == []


def _serve_health() -> tuple[str, threading.Thread, ThreadingHTTPServer]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.server_address[1]}", thread, server


async def test_the_client_builders_ignore_proxy_variables(proxy):
    url, thread, server = _serve_health()
    try:
        assert health_ok(url)  # the one readiness probe: workers, agents and the gateway, here and on hosts
        with urlopen(url + "/health", timeout=5) as resp:
            assert resp.status == 200
        async with client_session() as http, http.get(url + "/health") as resp:
            assert resp.status == 200
        async with async_http_client() as ahttpx:
            assert (await ahttpx.get(url + "/health")).status_code == 200
        with http_client() as shttpx:
            assert (await asyncio.to_thread(shttpx.get, url + "/health")).status_code == 200
        for builder in (client_session, http_client, async_http_client):
            with pytest.raises(TypeError, match="trust_env"):
                builder(trust_env=True)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert proxy.seen == []


async def test_the_gateway_control_client_and_bench_ignore_proxy_variables(proxy):
    """The gateway's upstream session (health probes, forwarded requests), the control-API client (sync and async)
    and `bench`'s replay, all with every proxy variable set."""
    async with GatewayEnv(2, policy="round_robin") as env:
        status, _ = await env.post("/generate", {"text": "hello there"})
        assert status == 200
        async with AsyncControlClient(env.control, token="test-token") as api:
            assert (await api.constants()).policy == "round_robin"

        def sync_fleet() -> int:
            with ControlClient(env.control, token="test-token") as api:
                return api.fleet().total

        assert await asyncio.to_thread(sync_fleet) == 2
        reqs = [Request(f"r{i}", i * 0.01, 16, 1, (f"p{i}",), "burst") for i in range(2)]
        rep = await replay_async(Trace(reqs, block_tokens=16, format="generated"), BenchOptions(env.url))
        assert rep.as_dict()["ok"] == 2
    assert proxy.seen == []


#: Names whose use builds an HTTP client or a proxy-aware opener.
_CLIENT_CALLS = {"ClientSession", "urlopen", "build_opener", "ProxyHandler", "HTTPConnection", "HTTPSConnection"}
_CLIENT_CALLS |= {"Client", "AsyncClient", "HTTPTransport", "AsyncHTTPTransport"}  # httpx
#: Modules that bring their own HTTP client (and read proxy variables).
_CLIENT_MODULES = ("urllib.request", "http.client", "httpx", "requests", "urllib3", "pycurl")


#: Text without any of these words holds none of the constructs :func:`_client_uses` looks for (skips parsing it).
_WORDS = re.compile(
    r"ClientSession|urlopen|build_opener|ProxyHandler|HTTPS?Connection|trust_env|aiohttp|urllib|"
    r"http\.client|from http import|httpx|requests|pycurl"
)


def _client_uses(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if not _WORDS.search(text):
        return []
    tree = ast.parse(text)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            # ``module.Name(...)``: a bare name can only be imported, and the imports are checked below
            f = node.func
            full = ast.unparse(f)
            if isinstance(f, ast.Attribute) and (f.attr in _CLIENT_CALLS or full == "aiohttp.request"):
                found.append(f"{node.lineno}: {full}(...)")
            for kw in node.keywords:
                if kw.arg == "trust_env":
                    found.append(f"{node.lineno}: trust_env={ast.unparse(kw.value)}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(_CLIENT_MODULES)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(_CLIENT_MODULES) or (
                node.module in ("urllib", "http", "aiohttp")
                and any(a.name in ("request", "client", *_CLIENT_CALLS) for a in node.names)
            ):
                found.append(f"{node.lineno}: from {node.module} import ...")
    return found


def test_every_http_client_in_btbctl_is_built_by_the_one_helper():
    """A client built anywhere but :mod:`btbctl.engine.httpclient` could trust the environment again."""
    root = Path(btbctl.__file__).parent
    helper = root / "engine" / "httpclient.py"
    offenders = {}
    for path in sorted(root.rglob("*.py")):
        if path != helper and (uses := _client_uses(path)):
            offenders[str(path.relative_to(root.parent))] = uses
    assert offenders == {}
    # the check sees what it looks for: the helper itself builds both kinds
    assert any("ClientSession(" in u for u in _client_uses(helper))
    assert any("ProxyHandler(" in u for u in _client_uses(helper))
    assert any("httpx.Client(" in u for u in _client_uses(helper))
    assert any("httpx.AsyncClient(" in u for u in _client_uses(helper))


@pytest.mark.slow
def test_up_in_mode_l3_works_with_proxy_variables_set(tmp_path, run_dir, proxy):
    """`up -d` of SGLang workers (replication mode l3: a node agent first) through a stand-in interpreter, then
    `status`, `tune` and `down`, every proxy variable set for all of them."""
    exe = tmp_path / "python-standin"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STANDIN)!r}\n"
        f"runpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    cfg = tmp_path / "sglang.toml"
    cfg.write_text(f"""
[replication]
python = "{exe}"

[[workers]]
kind = "sglang"
name = "sg"
count = 1
model = "m"
model_preset = "tiny-llama"
python = "{exe}"
""")
    st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS, timeout=60)
    assert st["replication"] == "l3" and [a["alive"] for a in st["agents"]] == [True]
    assert all(w["healthy"] for w in st["workers"])
    assert cli_json("status", "--run-dir", str(run_dir))["replication"] == "l3"
    cli("tune", "threshold=3", "--run-dir", str(run_dir))
    pids = [p.pid for p in RunDir(run_dir).load().processes]
    down = cli_json("down", "--run-dir", str(run_dir))
    assert sorted(down["stopped"] + down["killed"]) == ["agent-local", "gateway", "sg-0"]
    assert wait_gone(pids) == []
    assert proxy.seen == []
