"""The emulated worker's HTTP API (aiohttp): SGLang 0.5's routes plus the ``/btb/*`` replication routes.

Shapes follow SGLang 0.5 (REFERENCE.md s5) and OpenAI; errors are JSON
``{"object": "error", "message", "type", "param": null, "code"}`` with a 4xx status for bad input (413 above
:data:`MAX_BODY_BYTES`, 400 for malformed JSON or fields, 404 unknown route, 405 wrong method, 401/403 token) and
500 without a traceback for bugs. See :mod:`btbctl.engine.worker` for the route list.

Times in responses and metrics are wall-clock seconds as a client sees them; with ``time_scale`` s, model seconds
are wall seconds x s (``/server_info`` reports ``time_scale``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from btbctl import __version__
from btbctl.engine.aiotasks import cancel_all
from btbctl.engine.replication.tcp import MAX_CHAIN_BLOCKS, FaultPlan, TcpReceiver, TcpTransport
from btbctl.engine.replication.transport import (
    CopyRefused,
    TransferError,
    Transport,
    check_copy_id,
    parse_address,
)
from btbctl.engine.worker.config import WorkerConfig
from btbctl.engine.sim.replica import IncomingCopy
from btbctl.engine.worker.model import BlocksLost, LiveRequest, ModelDriver, NoRoom, TooLarge
from btbctl.engine.worker.prompt import ids_chain, text_chain
from btbctl.engine.worker.store import BlockStore

log = logging.getLogger("btbctl.worker")

#: Largest request body accepted, bytes (8 MiB: a 2M-token text prompt; larger bodies get 413).
MAX_BODY_BYTES = 8 << 20
#: Longest prompt accepted, tokens (above any preset's KV capacity per request anyway).
MAX_PROMPT_TOKENS = 4 << 20
#: Default ``max_new_tokens`` of ``/generate`` (SGLang's sampling-params default, 128).
DEFAULT_MAX_NEW_TOKENS = 128
#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's default, 16).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Default ``max_tokens`` of ``/v1/chat/completions``. SGLang generates until EOS or the context limit; an emulated
#: worker has no EOS, so a fixed 128 (SGLang's ``max_new_tokens`` default) stands in.
DEFAULT_CHAT_MAX_TOKENS = 128
#: Synthetic text of one generated token.
TOKEN_TEXT = " tok"
#: Copy records kept for ``/btb/copies`` (oldest finished ones dropped first).
MAX_COPY_RECORDS = 1024
#: Copies this worker sends at once; more pushes get 429 (bounds tasks and sockets).
MAX_OUTBOUND_COPIES = 64
#: Longest a sender waits for its source to compute the next block of a copy, seconds. Below the receiver's
#: idle timeout (30 s, :class:`~btbctl.engine.replication.tcp.TcpReceiver`), which drops a copy that goes quiet;
#: a 8192-token prefill chunk of any preset takes far less.
SOURCE_BLOCK_WAIT_S = 25.0
#: Longest ``/btb/push`` waits for the target to accept the copy before answering 202, seconds (the target then
#: counts the blocks as arriving, so a request routed there right after the push waits for them). A product
#: choice: loopback and LAN handshakes take milliseconds.
PUSH_ACCEPT_WAIT_S = 2.0
#: Longest wait of a long poll ``GET /btb/copies/{id}?wait_s=``, seconds.
MAX_COPY_POLL_WAIT_S = 10.0
#: Largest copy this worker receives, bytes of its block store (a copy is held in memory until it verifies;
#: 1 GiB is 800k blocks of Llama-3.3-70B at the default scale, far beyond its KV capacity).
MAX_INBOUND_COPY_BYTES = 1 << 30
#: Latency histogram buckets, seconds (a spread like SGLang's collector: milliseconds to minutes).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 30.0, 60.0, 120.0, 300.0)
E2E_BUCKETS = (0.01, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.5, 1.0, 2.0)

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
          405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestTooLarge", 429: "TooManyRequests",
          500: "InternalServerError", 503: "ServiceUnavailable"}


class ApiError(Exception):
    """An error answer: HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        self.status = status
        self.message = message
        self.headers = headers
        super().__init__(message)


def error_response(status: int, message: str, headers: dict | None = None) -> web.Response:
    body = {"object": "error", "message": message, "type": _TYPES.get(status, "Error"), "param": None,
            "code": status}
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message, e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"no route {request.method} {request.path}", 405: f"method {request.method} not allowed on "
               f"{request.path}", 413: f"request body larger than {MAX_BODY_BYTES} bytes"}.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, msg, headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal error (see the worker's log)")


# -- request parsing ----------------------------------------------------------------------------------------------
async def _json_body(request: web.Request) -> dict:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "empty body; expected a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:  # includes UnicodeDecodeError
        raise ApiError(400, f"malformed JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object")
    return body


def _int(d: dict, key: str, default: int | None, lo: int, hi: int, where: str = "") -> int | None:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{where}{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _bool(d: dict, key: str, default: bool = False) -> bool:
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be true or false, got {v!r}")
    return v


def _token_ids(v: Any, key: str) -> list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], list):
        v = v[0]
    if not isinstance(v, list) or not v or len(v) > MAX_PROMPT_TOKENS:
        raise ApiError(400, f"{key} must be a non-empty list of at most {MAX_PROMPT_TOKENS} token ids "
                            "(batches are not supported)")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2 ** 32:
            raise ApiError(400, f"{key} entries must be integers in [0, 2^32), got {t!r}")
    return v


def _text(v: Any, key: str) -> str:
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if not isinstance(v, str):
        raise ApiError(400, f"{key} must be a string (batches are not supported)")
    if not v:
        raise ApiError(400, f"{key} must not be empty")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{key} is not valid Unicode (lone surrogate)") from None
    return v


def _rid(v: Any) -> str:
    if v is None:
        return uuid.uuid4().hex
    if not isinstance(v, str) or not 1 <= len(v) <= 256:
        raise ApiError(400, "rid must be a string of 1..256 characters")
    return v


def _chain(body: dict) -> list[str]:
    chain = body.get("chain")
    if not isinstance(chain, list) or len(chain) > MAX_CHAIN_BLOCKS:
        raise ApiError(400, f"chain must be a list of at most {MAX_CHAIN_BLOCKS} block hashes (hex strings)")
    out = []
    for h in chain:
        if not isinstance(h, str) or not 1 <= len(h) <= 64:
            raise ApiError(400, "chain entries must be hex strings of 1..64 digits")
        h = h.lower()
        try:
            int(h, 16)
        except ValueError:
            raise ApiError(400, f"chain entry {h!r} is not hexadecimal") from None
        out.append(h)
    return out


# -- copy records -------------------------------------------------------------------------------------------------
@dataclass
class CopyRecord:
    """One copy as seen by this worker. ``started_s``/``finished_s`` are Unix times (seconds); bytes are bytes of
    the scaled block store. ``blocks_available`` (source side): leading blocks the source has computed and
    released to the sender so far (less than ``blocks`` while the copy trails the source's prefill)."""

    copy_id: str
    role: str  # "source" | "target"
    state: str  # "sending" | "done" | "failed"
    bytes_sent: int
    bytes_total: int
    blocks_verified: int
    error: str | None
    started_s: float
    finished_s: float | None
    peer: str
    blocks: int
    chain: tuple = ()
    blocks_available: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("chain")
        return d


class Worker:
    """State of one emulated worker: the live model, the block store, copies, metrics, transports.

    Args:
        cfg: settings.
        transport: the sender transport (default: TCP with the fault plan of ``BTBCTL_REPLICATION_FAULT``, tests
            only).
    """

    def __init__(self, cfg: WorkerConfig, transport: Transport | None = None) -> None:
        self.cfg = cfg
        self.model = ModelDriver(cfg)
        self.block_bytes = cfg.block_bytes()
        self.store = BlockStore(self.block_bytes)
        self.model.on_evict.append(self.store.drop)
        self.transport = transport or TcpTransport(fault=FaultPlan.from_env())
        self.receiver = TcpReceiver(_Sink(self), cfg.host, cfg.transfer_port)
        self.copies: OrderedDict[tuple[str, str], CopyRecord] = OrderedDict()
        self.tasks: set[asyncio.Task] = set()
        self.ready = False
        self.http_port = cfg.port
        self.metrics = _Metrics(cfg.served_name)
        self.started_unix = time.time()
        self.incoming: dict[str, IncomingCopy] = {}
        self._copy_changed = asyncio.Event()
        self.copy_version = 0

    # -- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the model driver and the transfer receiver (raises OSError when the port is taken)."""
        self.store.expected("0")  # loads the payload generator now rather than during the first copy
        self.model.start()
        await self.receiver.start()

    async def stop(self) -> None:
        self.ready = False
        await self.receiver.close()
        await cancel_all(self.tasks)
        await self.model.stop()

    @property
    def transfer_addr(self) -> str:
        host = self.cfg.host
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{self.receiver.port}"

    # -- copies -----------------------------------------------------------------------------------------------
    def copy_changed(self) -> None:
        """A copy record changed: wake the long polls of ``/btb/copies/{id}``."""
        self.copy_version += 1
        self._copy_changed.set()
        self._copy_changed = asyncio.Event()

    async def wait_copy_change(self, timeout_s: float) -> None:
        """Wait until some copy record changes, at most ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._copy_changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def record(self, rec: CopyRecord) -> CopyRecord:
        """Keep ``rec`` (replacing a record of the same id and role); forget the oldest finished records beyond
        :data:`MAX_COPY_RECORDS`."""
        key = (rec.copy_id, rec.role)
        self.copies.pop(key, None)
        self.copies[key] = rec
        if len(self.copies) > MAX_COPY_RECORDS:
            for k, old in list(self.copies.items()):
                if len(self.copies) <= MAX_COPY_RECORDS:
                    break
                if old.state != "sending":
                    del self.copies[k]
        return rec

    def outbound_in_flight(self) -> int:
        return sum(1 for r in self.copies.values() if r.role == "source" and r.state == "sending")

    def inbound_pending(self, chain: Sequence[str]) -> int:
        """Longest leading part of ``chain`` covered by a copy arriving now."""
        best = 0
        for rec in self.copies.values():
            if rec.role == "target" and rec.state == "sending":
                n = 0
                for a, b in zip(chain, rec.chain):
                    if a != b:
                        break
                    n += 1
                best = max(best, n)
        return best

    def start_push(self, chain: list[str], target: str, copy_id: str) -> tuple[CopyRecord, asyncio.Future]:
        """Start sending ``chain`` to ``target`` in the background. The chain must be resident here or planned
        (being computed, or a request queued here will compute it): blocks are sent as the model commits them.
        Returns the record and a future resolved when the target accepted the copy or the copy ended."""
        n = len(chain)
        rec = self.record(CopyRecord(copy_id=copy_id, role="source", state="sending", bytes_sent=0,
                                     bytes_total=n * self.block_bytes, blocks_verified=0, error=None,
                                     started_s=time.time(), finished_s=None, peer=target, blocks=n,
                                     chain=tuple(chain)))
        accepted = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self._push(rec, chain, target, accepted))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.copy_changed()
        return rec, accepted

    async def _push(self, rec: CopyRecord, chain: list[str], target: str, accepted: asyncio.Future) -> None:
        def progress(sent: int, total: int) -> None:
            rec.bytes_sent = sent
            self.copy_changed()

        def accept() -> None:
            if not accepted.done():
                accepted.set_result(True)

        blocks = _SourceBlocks(self, rec, chain)
        try:
            await self.transport.send(target, rec.copy_id, chain, blocks, progress, block_bytes=self.block_bytes,
                                      on_accept=accept)
            rec.blocks_verified = rec.blocks
            rec.state = "done"
        except TransferError as e:
            rec.state, rec.error = "failed", str(e)
        except asyncio.CancelledError:
            rec.state, rec.error = "failed", "worker shutting down"
            raise
        except Exception as e:  # a bug: report it on the record rather than lose it
            log.exception("copy %s failed", rec.copy_id)
            rec.state, rec.error = "failed", f"internal error: {type(e).__name__}"
        finally:
            blocks.release()
            rec.finished_s = time.time()
            if not accepted.done():
                accepted.set_result(False)
            self.copy_changed()


class _SourceBlocks:
    """The blocks of an outgoing copy, yielded as the source's model commits them (async iterator of
    ``(hash, bytes)``). Blocks handed out are pinned until :meth:`release`, so they cannot be evicted while the
    copy is in flight. Raises :class:`TransferError` when a block is evicted or no longer computed here, or is not
    computed within :data:`SOURCE_BLOCK_WAIT_S`."""

    def __init__(self, worker: Worker, rec: CopyRecord, chain: list[str]) -> None:
        self.w = worker
        self.rec = rec
        self.chain = tuple(chain)
        self.k = 0
        self.pinned = 0

    def __aiter__(self) -> "_SourceBlocks":
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        k = self.k
        if k >= len(self.chain):
            raise StopAsyncIteration
        if k >= self.pinned:
            model = self.w.model
            try:
                have = await model.wait_blocks(self.chain, k + 1, SOURCE_BLOCK_WAIT_S)
            except BlocksLost as e:
                raise TransferError(f"source lost the prefix at block {k}: {e}", k) from None
            model.pin(self.chain, self.pinned, have)
            self.pinned = have
            self.rec.blocks_available = have
            self.w.copy_changed()
        self.k = k + 1
        h = self.chain[k]
        return h, self.w.store.get(h)

    def release(self) -> None:
        """Unpin the blocks handed out (idempotent)."""
        n, self.pinned = self.pinned, 0
        self.w.model.unpin(self.chain, n)


class _Sink:
    """The worker as a :class:`~btbctl.engine.replication.transport.CopySink`."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.block_bytes = worker.block_bytes
        self.max_blocks = max(1, min(worker.model.capacity_tokens // worker.cfg.page_size,
                                     MAX_INBOUND_COPY_BYTES // worker.block_bytes))

    def begin(self, copy_id: str, chain: Sequence[str], peer: str) -> None:
        old = self.w.copies.get((copy_id, "target"))
        if old is not None and old.state == "sending":
            raise CopyRefused(f"copy {copy_id} is already arriving")
        n = len(chain)
        self.w.record(CopyRecord(copy_id=copy_id, role="target", state="sending", bytes_sent=0,
                                 bytes_total=n * self.block_bytes, blocks_verified=0, error=None,
                                 started_s=time.time(), finished_s=None, peer=peer, blocks=n, chain=tuple(chain)))
        self.w.copy_changed()
        if n * self.w.cfg.page_size > self.w.model.capacity_tokens:
            raise CopyRefused(f"{n} blocks do not fit in this worker's KV cache")
        try:
            # from now on the model counts the blocks as arriving: requests needing them wait for this copy
            self.w.incoming[copy_id] = self.w.model.begin_copy(chain)
        except NoRoom as e:
            raise CopyRefused(str(e)) from None

    def check_block(self, index: int, block_hash: str, data: bytes) -> None:
        if data != self.w.store.expected(block_hash):
            raise CopyRefused(f"block {index} ({block_hash}): content does not match its hash", index)

    def progress(self, copy_id: str, blocks_verified: int, bytes_received: int) -> None:
        rec = self.w.copies.get((copy_id, "target"))
        if rec is not None:
            rec.blocks_verified, rec.bytes_sent = blocks_verified, bytes_received
            self.w.copy_changed()

    def commit(self, copy_id: str, chain: Sequence[str], blocks: list[bytes]) -> None:
        inc = self.w.incoming.pop(copy_id, None)
        ok = self.w.model.end_copy(inc, True) if inc is not None else self.w.model.insert(chain)
        if not ok:
            raise CopyRefused(f"no room in the KV cache for {len(chain)} blocks (in use by running requests)")
        self.w.store.put_many(chain, blocks)
        rec = self.w.copies.get((copy_id, "target"))
        if rec is not None:
            rec.state, rec.finished_s = "done", time.time()
        self.w.copy_changed()

    def fail(self, copy_id: str, error: str) -> None:
        inc = self.w.incoming.pop(copy_id, None)
        if inc is not None:
            self.w.model.end_copy(inc, False)  # nothing becomes warm; waiting requests compute the blocks
        rec = self.w.copies.get((copy_id, "target"))
        if rec is not None and rec.state == "sending":
            rec.state, rec.error, rec.finished_s = "failed", error, time.time()
        self.w.copy_changed()


class _Metrics:
    """SGLang-named Prometheus metrics in a registry of this worker's own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in "
                             "seconds", ["model_name"], buckets=E2E_BUCKETS, registry=r)
        self.itl = Histogram("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ["model_name"], buckets=ITL_BUCKETS, registry=r)
        # counters (exposed with the _total suffix, as SGLang's)
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens processed.", ["model_name"],
                                     registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Number of generation tokens processed.",
                                         ["model_name"], registry=r)
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens.", ["model_name"],
                                     registry=r)
        self.num_requests = Counter("sglang:num_requests", "Number of requests processed.", ["model_name"],
                                    registry=r)
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        self.gauges = {
            name: Gauge(f"sglang:{name}", doc, labels, registry=r)
            for name, doc in (
                ("num_running_reqs", "The number of running requests."),
                ("num_queue_reqs", "The number of requests in the waiting queue."),
                ("num_used_tokens", "The number of used tokens."),
                ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
                ("token_usage", "The token usage."),
                ("cache_hit_rate", "The prefix cache hit rate."),
            )
        }
        self.lv = (model_name, "unified", "0", "0")

    def observe(self, lr: LiveRequest) -> None:
        """Record one finished request (latencies in wall seconds)."""
        name = self.model_name
        self.num_requests.labels(name).inc()
        self.prompt_tokens.labels(name).inc(lr.prompt_tokens)
        self.generation_tokens.labels(name).inc(lr.max_new_tokens)
        self.cached_tokens.labels(name).inc(lr.cached_tokens)
        if not math.isnan(lr.first_wall):
            self.ttft.labels(name).observe(max(0.0, lr.first_wall - lr.arrival_wall))
        if not math.isnan(lr.finish_wall):
            self.e2e.labels(name).observe(max(0.0, lr.finish_wall - lr.arrival_wall))
            if lr.max_new_tokens > 1 and not math.isnan(lr.first_wall):
                self.itl.labels(name).observe(max(0.0, (lr.finish_wall - lr.first_wall) / (lr.max_new_tokens - 1)))

    def render(self, model: ModelDriver) -> bytes:
        st = model.state()
        cap = st.capacity_tokens
        vals = {"num_running_reqs": st.running, "num_queue_reqs": st.waiting,
                "num_used_tokens": st.used_tokens, "max_total_num_tokens": cap,
                "token_usage": st.used_tokens / cap if cap else 0.0, "cache_hit_rate": model.cache_hit_rate()}
        for k, v in vals.items():
            self.gauges[k].labels(*self.lv).set(v)
        return generate_latest(self.registry)


# -- the application ----------------------------------------------------------------------------------------------
#: Where the application keeps its :class:`Worker`.
WORKER_KEY = web.AppKey("worker", Worker)


def build_app(worker: Worker) -> web.Application:
    """The aiohttp application of ``worker`` (routes listed in :mod:`btbctl.engine.worker`)."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    h = _Handlers(worker)
    r = app.router
    r.add_get("/health", h.health)
    r.add_get("/health_generate", h.health_generate)
    for p in ("/server_info", "/get_server_info"):
        r.add_get(p, h.server_info)
    for p in ("/model_info", "/get_model_info"):
        r.add_get(p, h.model_info)
    r.add_get("/version", h.version)
    r.add_get("/v1/models", h.models)
    r.add_get("/v1/loads", h.loads)
    r.add_get("/metrics", h.metrics)
    r.add_route("GET", "/flush_cache", h.flush_cache)
    r.add_route("POST", "/flush_cache", h.flush_cache)
    r.add_post("/generate", h.generate)
    r.add_post("/v1/completions", h.completions)
    r.add_post("/v1/chat/completions", h.chat)
    r.add_post("/btb/match", h.btb_match)
    r.add_get("/btb/prefixes", h.btb_prefixes)
    r.add_get("/btb/info", h.btb_info)
    r.add_post("/btb/push", h.btb_push)
    r.add_get("/btb/copies", h.btb_copies)
    r.add_get("/btb/copies/{copy_id}", h.btb_copy)
    app[WORKER_KEY] = worker
    return app


class _Handlers:
    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.model = worker.model
        self.cfg = worker.cfg

    # -- auth -------------------------------------------------------------------------------------------------
    def _auth(self, request: web.Request) -> None:
        tok = self.cfg.btb_token
        if tok is None:
            return
        h = request.headers.get("Authorization", "")
        if not h.startswith("Bearer "):
            raise ApiError(401, "this route needs 'Authorization: Bearer <token>'",
                           {"WWW-Authenticate": 'Bearer realm="btbctl-worker"'})
        if not hmac.compare_digest(h[7:].strip().encode(), tok.encode()):
            raise ApiError(403, "invalid bearer token")

    # -- health and info --------------------------------------------------------------------------------------
    def _is_ready(self) -> bool:
        return self.w.ready and self.model.alive

    async def health(self, request: web.Request) -> web.Response:
        if not self._is_ready():
            raise ApiError(503, "starting or stopping")
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if not self._is_ready():
            raise ApiError(503, "starting or stopping")
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"btbctl-emulated-{__version__}"})

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.cfg
        st = self.model.state()
        return web.json_response({
            "model_path": c.model_path, "served_model_name": c.served_name, "tp_size": c.tp_size,
            "host": c.host, "port": self.w.http_port, "mem_fraction_static": c.mem_fraction_static,
            "page_size": c.page_size,
            "chunked_prefill_size": (c.chunked_prefill_size if c.chunked_prefill_size is not None
                                     else self.model.cluster.chunk_tokens()),
            "max_running_requests": c.max_running_requests, "enable_metrics": c.enable_metrics,
            "max_total_num_tokens": st.capacity_tokens, "version": f"btbctl-emulated-{__version__}",
            "internal_states": [{"num_running_reqs": st.running, "num_waiting_reqs": st.waiting}],
            "btb": {"emulated": True, "model_preset": c.preset_name(), "gpu": c.gpu, "time_scale": c.time_scale,
                    "zero_delay": c.zero, "kv_bytes_scale": c.kv_bytes_scale, "block_bytes": self.w.block_bytes,
                    "transfer_addr": self.w.transfer_addr, "token_required": c.btb_token is not None},
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.cfg.model_path, "tokenizer_path": self.cfg.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": self.cfg.preset_name(), "architectures": None,
        })

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.cfg.served_name, "object": "model", "created": int(self.w.started_unix),
            "owned_by": "sglang", "root": self.cfg.model_path, "max_model_len": self.model.capacity_tokens,
        }]})

    async def loads(self, request: web.Request) -> web.Response:
        st = self.model.state()
        cap = st.capacity_tokens
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": st.running, "num_waiting_reqs": st.waiting,
            "num_used_tokens": st.used_tokens, "max_total_num_tokens": cap,
            "token_usage": st.used_tokens / cap if cap else 0.0, "cache_hit_rate": self.model.cache_hit_rate(),
        }]})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_metrics:
            raise ApiError(404, "metrics are off; start the worker with --enable-metrics")
        body = self.w.metrics.render(self.model)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self._auth(request)
        if self.model.busy() or any(r.state == "sending" for r in self.w.copies.values()):
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests or "
                                                 "copies in flight.\n")
        dropped = self.model.flush()
        self.w.store.clear()
        return web.Response(status=200, text=f"Cache flushed. {dropped} blocks dropped.\n")

    # -- generation -------------------------------------------------------------------------------------------
    def _prompt(self, text: str | None = None, ids: list[int] | None = None) -> tuple[int, list[str]]:
        """``(prompt tokens, chain)`` of a text or token-id prompt (as :mod:`btbctl.engine.hashing` defines)."""
        n, chain = ids_chain(ids, self.cfg.page_size) if ids is not None else text_chain(text, self.cfg.page_size)
        if n > MAX_PROMPT_TOKENS:
            raise ApiError(400, f"prompt of {n} tokens exceeds {MAX_PROMPT_TOKENS}")
        return n, chain

    def _submit(self, prompt: tuple[int, list[str]], max_new: int, rid: str) -> LiveRequest:
        if not self._is_ready():
            raise ApiError(503, "worker is starting or stopping")
        n_tokens, chain = prompt
        try:
            lr = self.model.submit(chain, n_tokens, max_new, rid)
        except TooLarge as e:
            raise ApiError(400, str(e)) from None
        metrics = self.w.metrics
        if lr.done.done():
            metrics.observe(lr)
        else:  # observed when the model finishes it, whether or not the client is still there
            lr.done.add_done_callback(lambda _f: metrics.observe(lr))
        return lr

    async def _progress(self, lr: LiveRequest):
        """Yield ``(tokens_out, finished)`` as tokens come out: the first at the first token, the rest spread at
        the estimated decode pace, whatever remains when the model says the request finished."""
        n = lr.max_new_tokens
        await lr.first
        if n <= 1:
            await lr.done
            yield n, True
            return
        yield 1, False
        i = 1
        clock = self.model.clock
        while i < n - 1 and not lr.done.done():
            delay = lr.first_wall + i * lr.itl_wall_s - clock()
            if delay > 0:
                try:
                    await asyncio.wait_for(asyncio.shield(lr.done), delay)
                except asyncio.TimeoutError:
                    pass
                if lr.done.done():
                    break
            i += 1
            yield i, False
        await lr.done
        yield n, True

    def _meta(self, lr: LiveRequest, tokens_out: int, finished: bool) -> dict:
        now = self.model.clock()
        end = lr.finish_wall if finished and not math.isnan(lr.finish_wall) else now
        return {
            "id": lr.rid, "prompt_tokens": lr.prompt_tokens, "completion_tokens": tokens_out,
            "cached_tokens": lr.cached_tokens,
            "cached_tokens_details": {"device": lr.cached_tokens, "host": 0},
            "finish_reason": {"type": "length", "length": lr.max_new_tokens} if finished else None,
            "e2e_latency": end - lr.arrival_wall,
        }

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _sse(resp: web.StreamResponse, obj) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise ApiError(400, "give exactly one of 'text' or 'input_ids'")
        prompt = (self._prompt(ids=_token_ids(body["input_ids"], "input_ids")) if has_ids
                  else self._prompt(text=_text(body["text"], "text")))
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object")
        max_new = _int(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0, 1 << 20, "sampling_params.")
        stream = _bool(body, "stream")
        lr = self._submit(prompt, max_new, _rid(body.get("rid")))
        if not stream:
            await lr.done
            return web.json_response({"text": TOKEN_TEXT * max_new, "meta_info": self._meta(lr, max_new, True)})
        resp = await self._sse_start(request)
        try:
            async for k, fin in self._progress(lr):
                await self._sse(resp, {"text": TOKEN_TEXT * k, "meta_info": self._meta(lr, k, fin), "index": 0})
            await self._sse(resp, "[DONE]")
        except ConnectionError:
            self.model.abort(lr)  # the client went away: abort it, as SGLang does
        return resp

    def _usage(self, lr: LiveRequest, completion: int) -> dict:
        return {"prompt_tokens": lr.prompt_tokens, "completion_tokens": completion,
                "total_tokens": lr.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": lr.cached_tokens}}

    async def _openai(self, request: web.Request, body: dict, prompt: tuple[int, list[str]], max_new: int,
                      chat: bool):
        _int(body, "n", 1, 1, 1)  # one choice per request only
        stream = _bool(body, "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object")
        include_usage = _bool(so, "include_usage")
        rid = _rid(body.get("rid"))
        lr = self._submit(prompt, max_new, rid)
        created = int(time.time())
        oid = ("chatcmpl-" if chat else "cmpl-") + lr.rid
        model = self.cfg.served_name
        obj = "chat.completion" if chat else "text_completion"
        if not stream:
            await lr.done
            text = TOKEN_TEXT * max_new
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            return web.json_response({"id": oid, "object": obj, "created": created, "model": model,
                                      "choices": [choice], "usage": self._usage(lr, max_new)})
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        resp = await self._sse_start(request)

        def chunk(delta_tokens: int, finish: str | None, first: bool = False) -> dict:
            text = TOKEN_TEXT * delta_tokens
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return {"id": oid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}

        try:
            sent = 0
            first = True
            async for k, fin in self._progress(lr):
                await self._sse(resp, chunk(k - sent, "length" if fin else None, first))
                first = False
                sent = k
            if include_usage:
                await self._sse(resp, {"id": oid, "object": chunk_obj, "created": created, "model": model,
                                       "choices": [], "usage": self._usage(lr, max_new)})
            await self._sse(resp, "[DONE]")
        except ConnectionError:
            self.model.abort(lr)  # the client went away: abort it, as SGLang does
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "missing field 'prompt'")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], int) or isinstance(prompt[0], list)):
            parsed = self._prompt(ids=_token_ids(prompt, "prompt"))
        else:
            parsed = self._prompt(text=_text(prompt, "prompt"))
        max_new = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, parsed, max_new, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
        parts = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a string 'role'")
            content = m.get("content")
            if content is None:
                content = ""
            elif isinstance(content, list):
                texts = []
                for p in content:
                    if not isinstance(p, dict):
                        raise ApiError(400, f"messages[{i}].content parts must be objects")
                    if p.get("type") == "text":
                        if not isinstance(p.get("text"), str):
                            raise ApiError(400, f"messages[{i}].content text parts need a string 'text'")
                        texts.append(p["text"])
                content = "".join(texts)
            elif not isinstance(content, str):
                raise ApiError(400, f"messages[{i}].content must be a string or a list of parts")
            parts.append(f"{m['role']}: {content}\n")
        prompt = self._prompt(text=_text("".join(parts), "messages"))
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _int({"max_tokens": max_new}, "max_tokens", DEFAULT_CHAT_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, prompt, max_new, chat=True)

    # -- BTB extension routes ---------------------------------------------------------------------------------
    async def btb_match(self, request: web.Request) -> web.Response:
        chain = _chain(await _json_body(request))
        cached = self.model.cached_blocks(chain)
        pending = max(self.model.planned_blocks(chain), self.w.inbound_pending(chain), cached)
        return web.json_response({"cached_blocks": cached, "pending_blocks": pending})

    async def btb_prefixes(self, request: web.Request) -> web.Response:
        raw = request.query.get("limit", "20")
        if not raw.isdigit() or not 1 <= int(raw) <= 10000:
            raise ApiError(400, "limit must be an integer in [1, 10000]")
        return web.json_response({"prefixes": self.model.prefixes(int(raw))})

    async def btb_info(self, request: web.Request) -> web.Response:
        c = self.cfg
        addr = self.w.transfer_addr
        if c.host in ("0.0.0.0", "::", "") and request.url.host:
            # bound to every interface: advertise the address this client reached us on
            h = request.url.host
            addr = f"[{h}]:{self.w.receiver.port}" if ":" in h else f"{h}:{self.w.receiver.port}"
        return web.json_response({
            "transfer_addr": addr, "page_size": c.page_size,
            "kv_bytes_per_token": self.model.cost.model.kv_bytes_per_token, "block_bytes": self.w.block_bytes,
            "model": c.served_name, "model_preset": c.preset_name(), "gpu": c.gpu, "tp_size": c.tp_size,
            "capacity_tokens": self.model.capacity_tokens, "transport": self.w.transport.name,
            "time_scale": c.time_scale, "zero_delay": c.zero,
        })

    async def btb_push(self, request: web.Request) -> web.Response:
        self._auth(request)
        body = await _json_body(request)
        chain = _chain(body)
        if not chain:
            raise ApiError(400, "chain must not be empty")
        target = body.get("target")
        if not isinstance(target, str):
            raise ApiError(400, "missing field 'target' (host:port of the target's transfer port)")
        try:
            parse_address(target)
            copy_id = check_copy_id(body["copy_id"]) if body.get("copy_id") is not None else uuid.uuid4().hex
        except TransferError as e:
            raise ApiError(400, str(e)) from None
        if target == self.w.transfer_addr:
            raise ApiError(400, "target is this worker's own transfer port")
        old = self.w.copies.get((copy_id, "source"))
        if old is not None and old.state == "sending":
            raise ApiError(409, f"copy {copy_id} is already in progress")
        if self.w.outbound_in_flight() >= MAX_OUTBOUND_COPIES:
            raise ApiError(429, f"{MAX_OUTBOUND_COPIES} copies are already being sent; retry later")
        have = self.model.cached_blocks(chain)
        if have < len(chain):
            planned = self.model.planned_blocks(chain)
            if planned < len(chain):
                raise ApiError(409, f"this worker holds {have} of the chain's {len(chain)} blocks and computes "
                                    f"{planned - have} more")
        rec, accepted = self.w.start_push(chain, target, copy_id)
        try:
            await asyncio.wait_for(asyncio.shield(accepted), PUSH_ACCEPT_WAIT_S)
        except asyncio.TimeoutError:
            pass  # answered anyway; the record tells how the copy goes
        return web.json_response({"copy_id": rec.copy_id, "blocks": rec.blocks, "bytes": rec.bytes_total,
                                  "blocks_available": rec.blocks_available}, status=202)

    async def btb_copies(self, request: web.Request) -> web.Response:
        return web.json_response({"copies": [r.as_dict() for r in reversed(self.w.copies.values())]})

    async def btb_copy(self, request: web.Request) -> web.Response:
        cid = request.match_info["copy_id"]
        raw = request.query.get("wait_s")
        wait_s = 0.0
        if raw is not None:
            try:
                wait_s = float(raw)
            except ValueError:
                wait_s = -1.0
            if not 0.0 <= wait_s <= MAX_COPY_POLL_WAIT_S:
                raise ApiError(400, f"wait_s must be a number of seconds in [0, {MAX_COPY_POLL_WAIT_S:g}]")
        since = request.query.get("since")
        for role in ("source", "target"):
            rec = self.w.copies.get((cid, role))
            if rec is not None:
                headers = {}
                if wait_s > 0:
                    # long poll: answer at the next change of any copy (progress, outcome) after version
                    # ``since`` (at once when there was one already), or after wait_s
                    if rec.state == "sending" and since == str(self.w.copy_version):
                        await self.w.wait_copy_change(wait_s)
                    headers = {"X-BTB-Long-Poll": "1", "X-BTB-Copy-Version": str(self.w.copy_version)}
                return web.json_response(rec.as_dict(), headers=headers)
        raise ApiError(404, f"no copy {cid!r} on this worker")


__all__ = ["ApiError", "MAX_BODY_BYTES", "WORKER_KEY", "Worker", "build_app", "error_response"]
