"""A small fake SGLang/BTB worker for the gateway tests (aiohttp app on a real loopback socket).

It speaks the routes the gateway uses, with controllable delays and failures, and records what it saw:
``requests`` (path, parsed body), ``pushes`` (bodies of ``/btb/push``), ``matches``. Prompts become chains with
the shared :mod:`btbctl.engine.hashing` (not the gateway's fast path), so a test also checks that both agree.
"""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from btbctl.engine import hashing
from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES

#: Fake transfer addresses: names in a fleet's registry (nothing listens there), unique in this process.
_transfer_ports = itertools.count(40000)


@dataclass
class FakeWorker:
    """Knobs (change them at any time):

    * ``first_byte_delay_s``: wait before the answer (non-stream) or the first chunk (stream).
    * ``first_byte_gate``: an :class:`asyncio.Event` to wait for before the answer or the first chunk (the
      prompt's blocks count as computing meanwhile), so a test decides when the first byte goes out.
    * ``chunks`` / ``chunk_delay_s``: stream shape (``chunks`` data events then ``[DONE]``).
    * ``chunk_gate``: an :class:`asyncio.Event` the stream waits for after its first chunk.
    * ``fail``: None, ``"500"`` (answer 500 at once), ``"abort_before"`` (drop the connection before any byte),
      ``"abort_after_first"`` (send the first stream chunk, then drop the connection).
    * ``btb``: serve the ``/btb`` routes (False: 404 like a plain SGLang server).
    * ``copy_outcome``: ``"done"`` or ``"failed"`` for pushes from this worker; ``copy_polls``: progress answers
      (``sending``) before the outcome.
    * ``health_status``: status of ``/health``; ``health_delay_s``: wait before answering it (generation
      unaffected).
    * ``waiting_reqs`` / ``max_tokens``: what ``/v1/loads`` reports as ``num_waiting_reqs`` and
      ``max_total_num_tokens`` (default 2 and 100: a busy worker with a full cache; 0 and a large capacity for an
      idle one; ``waiting_reqs=None``: the requests it holds before their first byte, as a worker reports them).
    * :meth:`restart`: kill it and listen again on the same port (a restarted worker, empty cache).
    """

    page_size: int = 4
    first_byte_delay_s: float = 0.0
    first_byte_gate: asyncio.Event | None = None
    chunks: int = 3
    chunk_delay_s: float = 0.0
    chunk_gate: asyncio.Event | None = None
    fail: str | None = None
    btb: bool = True
    copy_outcome: str = "done"
    copy_polls: int = 2
    health_status: int = 200
    health_delay_s: float = 0.0
    waiting_reqs: int | None = 2
    max_tokens: int = 100
    block_bytes: int = 1000
    tokenizer: str | None = None  # what /btb/info declares as its tokenizer (None: nothing, like SGLang)
    hash_prompts: bool = True  # False: skip hashing the prompt (a big one would stall the test's event loop)
    registry: dict = field(default_factory=dict)  # transfer_addr -> FakeWorker (shared by a fleet)
    requests: list = field(default_factory=list)
    pushes: list = field(default_factory=list)
    matches: list = field(default_factory=list)
    expects: dict = field(default_factory=dict)
    held: set = field(default_factory=set)
    computing: dict = field(default_factory=dict)  # block -> requests computing it (before their first byte)
    before_first_byte: int = 0
    copies: dict = field(default_factory=dict)
    url: str = ""
    port: int = 0  # 0: the OS picks one at the first start; kept for a restart
    transfer_addr: str = ""
    runner: web.AppRunner | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def start(self) -> FakeWorker:
        app = web.Application(client_max_size=MAX_REQUEST_BODY_BYTES)  # the emulated worker's limit
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/v1/models", self.models)
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.generate)
        r.add_post("/v1/chat/completions", self.generate)
        r.add_post("/btb/match", self.match)
        r.add_get("/btb/info", self.info)
        r.add_post("/btb/push", self.push)
        r.add_post("/btb/expect", self.expect)
        r.add_get("/btb/copies/{copy_id}", self.copy)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.transfer_addr = f"127.0.0.1:{next(_transfer_ports)}"
        self.registry[self.transfer_addr] = self
        return self

    async def kill(self) -> None:
        """Stop listening and drop every open connection (like a killed process)."""
        if self.runner is not None:
            server = self.runner.server
            for site in list(self.runner.sites):
                await site.stop()
            if server is not None:
                for conn in list(server.connections):
                    if conn.transport is not None:
                        conn.transport.abort()
            await self.runner.cleanup()
            self.runner = None

    async def restart(self) -> None:
        """Kill it, then listen again on the same port with an empty cache."""
        await self.kill()
        self.held.clear()
        await self.start()

    # -- helpers ---------------------------------------------------------------------------------------------------

    def chain_of(self, path: str, body: dict) -> list[str]:
        if path == "/generate":
            toks = body["input_ids"] if body.get("input_ids") is not None else hashing.text_to_tokens(body["text"])
        elif path == "/v1/completions":
            p = body["prompt"]
            toks = p if isinstance(p, list) else hashing.text_to_tokens(p)
        else:
            text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in body["messages"])
            toks = hashing.text_to_tokens(text)
        return hashing.chain_hashes(toks, self.page_size)

    # -- routes ----------------------------------------------------------------------------------------------------

    async def health(self, request):
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.json_response({}, status=self.health_status)

    async def loads(self, request):
        return web.json_response(
            {
                "loads": [
                    {
                        "num_running_reqs": 1,
                        "num_waiting_reqs": (
                            self.waiting_reqs if self.waiting_reqs is not None else self.before_first_byte
                        ),
                        "num_used_tokens": 30,
                        "max_total_num_tokens": self.max_tokens,
                        "token_usage": 30 / self.max_tokens,
                    }
                ]
            }
        )

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def generate(self, request):
        body = await request.json()
        self.requests.append((request.path, body))
        if self.fail == "500":
            return web.json_response({"error": "boom"}, status=500)
        if self.fail == "400":  # the prompt's fault (e.g. token ids out of the model's vocabulary)
            return web.json_response({"error": "token id out of vocabulary"}, status=400)
        if self.fail == "abort_before":
            request.transport.abort()
            await asyncio.sleep(0.05)
            return web.Response()
        chain = self.chain_of(request.path, body) if self.hash_prompts else []
        if self.first_byte_delay_s or self.first_byte_gate is not None:
            for h in chain:
                self.computing[h] = self.computing.get(h, 0) + 1
            self.before_first_byte += 1
            try:
                await asyncio.sleep(self.first_byte_delay_s)
                if self.first_byte_gate is not None:
                    await self.first_byte_gate.wait()
            finally:
                self.before_first_byte -= 1
                for h in chain:
                    self.computing[h] -= 1
                    if not self.computing[h]:
                        del self.computing[h]
        self.held.update(chain)
        n = len(self.requests)
        if not body.get("stream"):
            return web.json_response({"text": f"answer {n}", "meta_info": {"id": str(n), "chain": chain}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            await resp.write(f"data: {json.dumps({'text': f'chunk{i}', 'n': n})}\n\n".encode())
            if i == 0 and self.fail == "abort_after_first":
                await asyncio.sleep(0.02)
                request.transport.abort()
                return resp
            if i == 0 and self.chunk_gate is not None:
                await self.chunk_gate.wait()
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def match(self, request):
        if not self.btb:
            raise web.HTTPNotFound()
        chain = (await request.json())["chain"]
        self.matches.append(chain)
        k = 0
        while k < len(chain) and chain[k] in self.held:
            k += 1
        p = k
        while p < len(chain) and chain[p] in self.computing:
            p += 1
        return web.json_response({"cached_blocks": k, "pending_blocks": p})

    async def info(self, request):
        if not self.btb:
            raise web.HTTPNotFound()
        return web.json_response(
            {
                "transfer_addr": self.transfer_addr,
                "page_size": self.page_size,
                "kv_bytes_per_token": 10,
                "block_bytes": self.block_bytes,
                "model": "fake",
                "gpu": "h100",
                "tp_size": 1,
                "capacity_tokens": 100000,
                **({"tokenizer": self.tokenizer} if self.tokenizer else {}),
            }
        )

    async def push(self, request):
        if not self.btb:
            raise web.HTTPNotFound()
        body = await request.json()
        self.pushes.append({"body": body, "auth": request.headers.get("Authorization")})
        chain = body["chain"]
        if not all(h in self.held or h in self.computing for h in chain):
            return web.json_response({"error": "not held"}, status=409)
        total = len(chain) * self.block_bytes
        self.copies[body["copy_id"]] = {
            "polls": 0,
            "chain": chain,
            "target": body["target"],
            "total": total,
            "token": body.get("token"),
        }
        return web.json_response({"copy_id": body["copy_id"], "blocks": len(chain), "bytes": total}, status=202)

    async def expect(self, request):
        """Authorize an inbound copy (recorded; a copy lands here only with the token it was expected with)."""
        if not self.btb:
            raise web.HTTPNotFound()
        body = await request.json()
        self.expects[body["copy_id"]] = {
            "chain": body["chain"],
            "token": body["token"],
            "auth": request.headers.get("Authorization"),
        }
        return web.json_response({"copy_id": body["copy_id"], "blocks": len(body["chain"])}, status=201)

    async def copy(self, request):
        c = self.copies.get(request.match_info["copy_id"])
        if c is None:
            raise web.HTTPNotFound()
        c["polls"] += 1
        total = c["total"]
        if c["polls"] <= self.copy_polls:
            sent = total * c["polls"] // (self.copy_polls + 1)
            state, err = "running", None
        else:
            state = self.copy_outcome
            sent = total if state == "done" else total // 2
            err = None if state == "done" else "checksum mismatch on block 1"
            if state == "done" and not c.get("committed"):
                c["committed"] = True
                target = self.registry.get(c["target"])
                exp = target.expects.get(request.match_info["copy_id"]) if target is not None else None
                if exp is not None and exp["token"] == c["token"] and exp["chain"] == c["chain"]:
                    target.held.update(c["chain"])
                else:  # the real target refuses a copy it was not told to expect with this token
                    state, sent, err = "failed", 0, "copy not expected by the target"
        return web.json_response(
            {
                "copy_id": request.match_info["copy_id"],
                "role": "source",
                "state": state,
                "bytes_sent": sent,
                "bytes_total": total,
                "blocks_verified": 0,
                "error": err,
                "started_s": 0.0,
                "finished_s": None,
            }
        )


async def start_fleet(n: int, **kw) -> list[FakeWorker]:
    registry: dict = {}
    return [await FakeWorker(registry=registry, **kw).start() for _ in range(n)]


async def stop_fleet(fleet: list[FakeWorker]) -> None:
    for w in fleet:
        await w.kill()


class GatewayEnv:
    """A fake fleet plus a gateway in front of it (``async with GatewayEnv(3, policy="btb") as env``)."""

    def __init__(self, n: int = 3, worker_kw: dict | None = None, client_connections: int = 100, **config) -> None:
        self.n = n
        self.worker_kw = worker_kw or {}
        self.client_connections = client_connections  # the test client's pool (aiohttp's default: 100; 0: no limit)
        self.config = config
        self.fleet: list[FakeWorker] = []
        self.gw = None
        self.http = None

    async def __aenter__(self) -> GatewayEnv:
        import aiohttp

        from btbctl.engine.gateway import GatewayConfig, serve_gateway

        self.fleet = await start_fleet(self.n, **self.worker_kw)
        cfg = {"port": 0, "control_port": 0, "token": "test-token", "health_interval_s": 0.2, "poll_interval_s": 0.02}
        cfg.update(self.config)
        self.gw = await serve_gateway(GatewayConfig(workers=[w.url for w in self.fleet], **cfg))
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.client_connections))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()
        await self.gw.stop()
        await stop_fleet(self.fleet)

    @property
    def url(self) -> str:
        return self.gw.data_url

    @property
    def control(self) -> str:
        return self.gw.control_url

    def auth(self, token: str = "test-token") -> dict:
        return {"Authorization": f"Bearer {token}"}

    async def post(self, path: str, body, headers: dict | None = None, **kw) -> tuple[int, object]:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with self.http.post(self.url + path, data=data, headers=headers, **kw) as r:
            text = await r.text()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text

    async def put_control(self, path: str, body: dict) -> tuple[int, object]:
        """An authenticated control write (as the dashboard and ``btbctl tune`` send it)."""
        async with self.http.put(self.control + path, json=body, headers=self.auth()) as r:
            return r.status, await r.json()

    async def get_control(self, path: str, **kw) -> tuple[int, object]:
        async with self.http.get(self.control + path, **kw) as r:
            return r.status, await r.json()

    async def metrics(self) -> str:
        async with self.http.get(self.url + "/metrics") as r:
            return await r.text()


def metric_value(text: str, name: str, **labels) -> float:
    """The value of sample ``name{labels}`` in Prometheus text (0.0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


#: A prompt of 8 full blocks of 4 pseudo-tokens (130 bytes) and the constants that make two of it a burst.
BURST_TEXT = "burst prefix " * 10
BURST_CONSTANTS = {"prefix_blocks": 4, "threshold": 2, "window_s": 5.0, "replicas": 3}


async def burst(env: GatewayEnv, n: int = 2) -> None:
    """``n`` requests sharing :data:`BURST_TEXT` through ``env``'s gateway, each answered 200."""
    for i in range(n):
        status, _ = await env.post("/generate", {"text": BURST_TEXT + str(i)})
        assert status == 200


async def until(pred, timeout_s: float = 3.0) -> None:
    """Wait until ``pred()`` holds (polling every 10 ms); fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


#: Answers of a real SGLang 0.5.23 server (two CPU workers after a 16-request burst; tests/data/sglang-0.5.23).
SGLANG_RECORDED = Path(__file__).resolve().parent / "data" / "sglang-0.5.23"


@dataclass
class RecordedSglang:
    """A fake SGLang server answering with the recorded bodies of :data:`SGLANG_RECORDED`: ``/health``,
    ``/v1/loads``, ``/metrics``, ``/server_info``, ``/model_info``; 404 on the ``/btb`` routes
    (stock SGLang). Knobs: ``metrics_status`` (another status for ``/metrics``), ``metrics_body`` (bytes instead of
    the recorded text), ``metrics_delay_s`` (wait before answering ``/metrics``), ``enable_metrics`` (what
    ``/server_info`` says), ``metrics_gzip`` (gzip ``/metrics``: None when the client accepts it, like SGLang's
    prometheus_client; True always). ``hits`` counts the requests per path."""

    metrics_status: int = 200
    metrics_body: bytes | None = None
    metrics_delay_s: float = 0.0
    enable_metrics: bool = True
    metrics_gzip: bool | None = None
    hits: dict = field(default_factory=dict)
    url: str = ""
    runner: web.AppRunner | None = None

    def _body(self, name: str) -> bytes:
        return (SGLANG_RECORDED / name).read_bytes()

    async def start(self) -> RecordedSglang:
        app = web.Application(middlewares=[self._count])
        r = app.router
        for path, name in (("/v1/loads", "v1-loads.json"), ("/model_info", "model_info.json")):
            r.add_get(path, self._recorded_json(name))
        r.add_get("/health", self.health)
        r.add_get("/server_info", self.server_info)
        r.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @web.middleware
    async def _count(self, request, handler):
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        return await handler(request)

    def _recorded_json(self, name: str):
        async def answer(request):
            return web.Response(body=self._body(name), content_type="application/json")

        return answer

    async def health(self, request):
        return web.Response(status=200)

    async def server_info(self, request):
        info = json.loads(self._body("server_info.json"))
        info["enable_metrics"] = self.enable_metrics
        return web.json_response(info)

    async def metrics(self, request):
        if self.metrics_delay_s:
            await asyncio.sleep(self.metrics_delay_s)
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status, text="no\n")
        body = self.metrics_body if self.metrics_body is not None else self._body("metrics.txt")
        if self.metrics_gzip or (self.metrics_gzip is None and "gzip" in request.headers.get("Accept-Encoding", "")):
            # as prometheus_client's exposition does when the client accepts gzip (SGLang serves it so)
            return web.Response(
                body=gzip.compress(body), content_type="text/plain", headers={"Content-Encoding": "gzip"}
            )
        return web.Response(body=body, content_type="text/plain")
