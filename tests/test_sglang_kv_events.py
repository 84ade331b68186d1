"""The gateway's holdings from a real SGLang 0.5.23 server's KV events (pytest marker ``sglang_server``): one stock
server on this CPU with the tiny model and ``--kv-events-config`` (ZMQ PUB + replay ROUTER), a gateway in this
process with its own routing inference switched off (``routing_holdings = false``), so whatever it records as held
came from the events.

* a request through the gateway: the worker's record then holds the prompt's chain (the gateway's own hashes of
  the 16-token pages, recomputed from the events' token ids);
* a second gateway started after that request: it asks the replay socket for every batch from sequence 0 (SGLang
  keeps the last ``buffer_steps`` batches, 10,000 by default) and holds the chain without any request of its own;
* ``/flush_cache`` on the server: ``AllBlocksCleared`` empties the record (the worker is no longer a holder).

Run alone (one server holds about 4 GB and starts in about a minute on 2 cores):
``pytest -m sglang_server tests/test_sglang_kv_events.py``; skips where the harness venv is not built
(``scripts/sglang-venv.sh``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import aiohttp
import pytest

from btbctl.engine.gateway.config import GatewayConfig, KvEventsRef
from btbctl.engine.gateway.server import serve_gateway
from btbctl.engine.hashing import chain_hashes
from sglang_cpu.harness import cpu_env, missing, venv_dir

pytestmark = [pytest.mark.sglang_server, pytest.mark.timeout(900)]

PAGE = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One SGLang server publishing KV events; yields ``(url, KvEventsRef)``."""
    venv = venv_dir()
    why = missing(venv)
    if why is not None:
        pytest.skip(why)
    port, pub, replay = _port(), _port(), _port()
    kv = {
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "bind": True,
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
    }
    log = tmp_path_factory.mktemp("sglang-kv") / "server.log"
    argv = [
        str(venv / "bin" / "python"),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(venv / "tiny-llama"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--max-total-tokens",
        "8192",
        "--sleep-on-idle",
        "--page-size",
        str(PAGE),
        "--kv-events-config",
        json.dumps(kv),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **cpu_env(venv)}, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"SGLang exited: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "SGLang did not become healthy in 600 s"
            time.sleep(1)
        yield url, KvEventsRef(endpoint=kv["endpoint"], replay_endpoint=kv["replay_endpoint"], topic="kv")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _config(url: str, ref: KvEventsRef) -> GatewayConfig:
    return GatewayConfig(
        workers=[url],
        port=0,
        control_port=0,
        page_size=PAGE,
        replication="none",
        policy="round_robin",
        metrics_interval_s=0,
        kv_events=[ref],
        routing_holdings=False,
    )


async def _until(cond, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


IDS = [(i * 37 + 11) % 30000 + 1 for i in range(4 * PAGE)]  # 4 pages, below the tiny model's vocabulary


async def test_holdings_come_from_the_servers_events_and_a_late_gateway_replays(server):
    url, ref = server
    chain = chain_hashes(IDS, PAGE)
    gw = await serve_gateway(_config(url, ref))
    try:
        w = gw.state.workers[0]
        assert w.healthy and not w.routing_holdings
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        async with aiohttp.ClientSession() as s, s.post(f"{gw.data_url}/generate", json=body) as r:
            assert r.status == 200, await r.text()
        await _until(lambda: w.held_blocks(chain) == len(chain), "the prompt's pages from the events")
        feed = gw.kv_subscribers[0].feed
        assert feed.stored_blocks >= len(chain) and gw.state.holders(chain[0]) == [0]
    finally:
        await gw.stop()

    late = await serve_gateway(_config(url, ref))  # after the request: nothing new is published for it
    try:
        w = late.state.workers[0]
        sub = late.kv_subscribers[0]
        await _until(lambda: w.held_blocks(chain) == len(chain), "the chain replayed from sequence 0")
        assert sub.replayed >= 1 and sub.feed.resyncs == 0
        async with aiohttp.ClientSession() as s, s.post(f"{url}/flush_cache") as r:
            assert r.status == 200, await r.text()
        await _until(lambda: not w.holdings, "the cleared cache")
        assert late.state.holders(chain[0]) == []
    finally:
        await late.stop()
