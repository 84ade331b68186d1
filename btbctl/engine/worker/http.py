"""The emulated worker's HTTP API (aiohttp): SGLang 0.5's routes plus the ``/btb/*`` replication routes.

Shapes follow SGLang 0.5 (REFERENCE.md s5) and OpenAI; errors are JSON
``{"error": {"message", "type", "param": null, "code"}}`` (the gateway's shape,
:func:`btbctl.engine.errors.api_error_body`) with a 4xx status for bad input (413 above
:data:`MAX_BODY_BYTES`, 400 for malformed JSON or fields, 404 unknown route, 405 wrong method, 401/403 token) and
500 without a traceback for bugs. See :mod:`btbctl.engine.worker` for the route list.

Times in responses and metrics are wall-clock seconds as a client sees them; with ``time_scale`` s, model seconds
are wall seconds x s (``/server_info`` reports ``time_scale``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from btbctl import __version__
from btbctl.engine.costmodel import model_preset
from btbctl.engine.errors import api_error_body
from btbctl.engine.hashing import BYTES_PER_TOKEN, PSEUDO_TOKENIZER, pack_text, pack_tokens, text_to_tokens
from btbctl.engine.limits import MAX_PROMPT_TOKENS, MAX_REQUEST_BODY_BYTES
from btbctl.engine.logfmt import log_event
from btbctl.engine.replication.auth import AuthError, bearer_ok
from btbctl.engine.replication.tcp import MAX_CHAIN_BLOCKS
from btbctl.engine.replication.transport import TransferError, check_copy_id, parse_address
from btbctl.engine.worker.copies import MAX_OUTBOUND_COPIES
from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.hicache import STORAGE_BACKEND_NAME
from btbctl.engine.worker.model import LiveRequest, TooLarge
from btbctl.engine.worker.prompt import ids_chain, text_chain
from btbctl.sglang_l3.keys import page_keys_packed

log = logging.getLogger("btbctl.worker")

#: Largest request body accepted, bytes (the gateway's default limit too: :mod:`btbctl.engine.limits`).
MAX_BODY_BYTES = MAX_REQUEST_BODY_BYTES
#: Default ``max_new_tokens`` of ``/generate`` (SGLang's sampling-params default, 128).
DEFAULT_MAX_NEW_TOKENS = 128
#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's default, 16).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Default ``max_tokens`` of ``/v1/chat/completions``. SGLang generates until EOS or the context limit; an emulated
#: worker has no EOS, so a fixed 128 (SGLang's ``max_new_tokens`` default) stands in.
DEFAULT_CHAT_MAX_TOKENS = 128
#: Synthetic text of one generated token.
TOKEN_TEXT = " tok"
#: Token id reported for :data:`TOKEN_TEXT` in logprobs (SGLang's ``output_token_logprobs``).
TOKEN_ID = 11059
#: Runner-up tokens of the synthetic ``top_logprobs`` (text, id), most likely first.
ALT_TOKENS = ((" the", 279), (" a", 264), (" to", 311), (" and", 323), (" of", 315), (" in", 304), (" is", 374))
#: Most choices per request (``n``) and stop strings accepted.
MAX_N = 16
MAX_STOP = 16
#: Most ``top_logprobs`` (OpenAI chat) / ``top_logprobs_num`` (SGLang) accepted.
MAX_TOP_LOGPROBS = 20
#: Longest ``/btb/push`` waits for the target to accept the copy before answering 202, seconds (the target then
#: counts the blocks as arriving, so a request routed there right after the push waits for them). A product
#: choice: loopback and LAN handshakes take milliseconds.
PUSH_ACCEPT_WAIT_S = 2.0
#: Longest wait of a long poll ``GET /btb/copies/{id}?wait_s=``, seconds.
MAX_COPY_POLL_WAIT_S = 10.0


class ApiError(Exception):
    """An error answer: HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        self.status = status
        self.message = message
        self.headers = headers
        super().__init__(message)


def error_response(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response(api_error_body(status, message), status=status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.message, e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {
            404: f"no route {request.method} {request.path}",
            405: f"method {request.method} not allowed on {request.path}",
            413: f"request body larger than {MAX_BODY_BYTES} bytes",
        }.get(e.status, e.reason)
        headers = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        return error_response(e.status, msg, headers)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "internal error (see the worker's log)")


# -- the synthetic output: stop strings and logprobs --------------------------------------------------------------
class Output:
    """The text one choice produces: :data:`TOKEN_TEXT` repeated, cut at the first stop string as SGLang does.

    Attributes:
        tokens: tokens decoded (``max_new``, or fewer when a stop string completed earlier).
        cut: characters of the text kept (the stop string itself is trimmed), None when no stop string matched.
        matched: the stop string that ended the text (SGLang's ``matched_stop`` / ``finish_reason.matched``).
    """

    def __init__(self, max_new: int, stops: list[str]) -> None:
        self.tokens = max_new
        self.cut: int | None = None
        self.matched: str | None = None
        full = TOKEN_TEXT * max_new
        best: tuple[int, int, str] | None = None  # (tokens decoded when it completed, position, stop)
        step = len(TOKEN_TEXT)
        for stop in stops:
            i = full.find(stop)
            if i >= 0:
                done = -(-(i + len(stop)) // step)
                if best is None or (done, i) < best[:2]:
                    best = (done, i, stop)
        if best is not None:
            self.tokens, self.cut, self.matched = best

    def text(self, k: int) -> str:
        """The text after ``k`` tokens."""
        t = TOKEN_TEXT * k
        return t if self.cut is None else t[: self.cut]

    @property
    def finish_reason(self) -> str:
        """OpenAI's ``finish_reason``."""
        return "length" if self.matched is None else "stop"

    def sglang_finish(self) -> dict:
        """SGLang's ``meta_info.finish_reason``."""
        if self.matched is None:
            return {"type": "length", "length": self.tokens}
        return {"type": "stop", "matched": self.matched}


def token_logprob(i: int) -> float:
    """Deterministic, plausible logprob of the ``i``-th generated token (probability 0.6 to 0.98)."""
    p = 0.6 + 0.38 * ((i * 0.6180339887) % 1.0)
    return round(math.log(p), 6)


def top_logprobs(i: int, n: int) -> list[tuple[str, int, float]]:
    """``n`` most likely tokens at position ``i`` as ``(text, id, logprob)``: the generated one, then runners-up
    sharing the rest of the probability (halving each), so the probabilities never sum above 1."""
    lp = token_logprob(i)
    out = [(TOKEN_TEXT, TOKEN_ID, lp)]
    rest = 1.0 - math.exp(lp)
    for j, (t, tid) in enumerate(ALT_TOKENS[: max(0, n - 1)]):
        out.append((t, tid, round(math.log(rest * 0.5 ** (j + 1)), 6)))
    return out[:n]


def _stops(v: Any, key: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ApiError(400, f"'{key}' must be a string or a list of strings")
    if len(v) > MAX_STOP:
        raise ApiError(400, f"'{key}' has {len(v)} strings; at most {MAX_STOP}")
    return [x for x in v if x]


def _openai_logprobs(lo: int, hi: int, top: int, chat: bool, offset: int) -> dict:
    """OpenAI's ``logprobs`` of tokens ``lo..hi-1`` (chat: ``{"content": [...]}``; completions: ``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""
    if chat:
        content = []
        for i in range(lo, hi):
            tops = top_logprobs(i, top)
            content.append(
                {
                    "token": TOKEN_TEXT,
                    "logprob": token_logprob(i),
                    "bytes": list(TOKEN_TEXT.encode()),
                    "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, _, lp in tops],
                }
            )
        return {"content": content}
    n = hi - lo
    return {
        "tokens": [TOKEN_TEXT] * n,
        "token_logprobs": [token_logprob(i) for i in range(lo, hi)],
        "top_logprobs": [{t: lp for t, _, lp in top_logprobs(i, top)} for i in range(lo, hi)] if top else None,
        "text_offset": [offset + (i - lo) * len(TOKEN_TEXT) for i in range(lo, hi)],
    }


def _sglang_logprobs(lo: int, hi: int, top: int, with_text: bool) -> dict:
    """SGLang's ``meta_info`` logprob fields of output tokens ``lo..hi-1`` (``[logprob, token_id, text|None]``);
    no input-token logprobs (the emulated worker has no model to score the prompt with)."""

    def entry(t: str, tid: int, lp: float) -> list:
        return [lp, tid, t if with_text else None]

    return {
        "input_token_logprobs": [],
        "output_token_logprobs": [entry(TOKEN_TEXT, TOKEN_ID, token_logprob(i)) for i in range(lo, hi)],
        "input_top_logprobs": [],
        "output_top_logprobs": [[entry(*x) for x in top_logprobs(i, top)] for i in range(lo, hi)] if top else [],
    }


async def _merge(gens: list) -> Any:
    """Yield ``(index, item)`` from several async generators as items come."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g) -> None:
        try:
            async for x in g:
                await q.put((i, x))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    left = len(tasks)
    try:
        while left:
            i, x = await q.get()
            if x is None:
                left -= 1
                continue
            yield i, x
    finally:
        for t in tasks:
            t.cancel()


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
        raise ApiError(
            400, f"{key} must be a non-empty list of at most {MAX_PROMPT_TOKENS} token ids (batches are not supported)"
        )
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32:
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


def _render_chat(msgs: Any) -> str:
    """The emulated chat template: ``"role: content\n"`` per message (text parts of a list content joined), the
    rendering the gateway's :func:`btbctl.engine.gateway.prompt.render_chat` mirrors. Raises :class:`ApiError`."""
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
    return "".join(parts)


def _salt(body: dict | None, key: str) -> str | None:
    """A request's ``extra_key`` / ``cache_salt`` (a string, or the first of a one-element list), None when absent
    or empty (SGLang treats an empty one as none)."""
    v = None if body is None else body.get(key)
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise ApiError(400, f"{key} must be a string")
    return v


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
    for p in ("/tokenize", "/v1/tokenize"):
        r.add_post(p, h.tokenize)
    r.add_post("/btb/match", h.btb_match)
    r.add_get("/btb/prefixes", h.btb_prefixes)
    r.add_get("/btb/info", h.btb_info)
    r.add_post("/btb/push", h.btb_push)
    r.add_post("/btb/expect", h.btb_expect)
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
            self._refused(request, "no_token")
            raise ApiError(
                401,
                "this route needs 'Authorization: Bearer <token>'",
                {"WWW-Authenticate": 'Bearer realm="btbctl-worker"'},
            )
        if not bearer_ok(h, tok):
            self._refused(request, "wrong_token")
            raise ApiError(403, "invalid bearer token")

    def _refused(self, request: web.Request, reason: str) -> None:
        """Count a request refused for its token (``btbctl_worker_auth_failures_total{reason}``) and log it at
        most once per reason and interval."""
        self.w.metrics.auth_failures.labels(reason).inc()
        ok, held = self.w.refusal_limiter.allow(reason)
        if ok:
            log_event(
                log,
                "auth_failed",
                logging.WARNING,
                peer=request.remote,
                path=request.path,
                reason=reason,
                repeats_held=held or None,
            )

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
        return web.json_response(
            {
                "model_path": c.model_path,
                "served_model_name": c.served_name,
                "tp_size": c.tp_size,
                "host": c.host,
                "port": self.w.http_port,
                "mem_fraction_static": c.mem_fraction_static,
                "page_size": c.page_size,
                "chunked_prefill_size": (
                    c.chunked_prefill_size if c.chunked_prefill_size is not None else self.model.cluster.chunk_tokens()
                ),
                "max_running_requests": c.max_running_requests,
                "enable_metrics": c.enable_metrics,
                "max_total_num_tokens": st.capacity_tokens,
                "enable_hierarchical_cache": c.enable_hierarchical_cache,
                "hicache_storage_backend": c.hicache_storage_backend,
                "hicache_storage_prefetch_policy": c.hicache_storage_prefetch_policy,
                "hicache_write_policy": c.hicache_write_policy,
                "hicache_mem_layout": c.hicache_mem_layout,
                "kv_cache_dtype": c.kv_cache_dtype,
                "version": f"btbctl-emulated-{__version__}",
                "internal_states": [{"num_running_reqs": st.running, "num_waiting_reqs": st.waiting}],
                "btb": {
                    "emulated": True,
                    "model_preset": c.preset_name(),
                    "gpu": c.gpu,
                    "time_scale": c.time_scale,
                    "zero_delay": c.zero,
                    "kv_bytes_scale": c.kv_bytes_scale,
                    "block_bytes": self.w.block_bytes,
                    "transfer_addr": self.w.transfer_addr,
                    "token_required": c.btb_token is not None,
                    "hicache": self.w.hicache.describe() if self.w.hicache is not None else None,
                },
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": self.cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.cfg.preset_name(),
                "architectures": None,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.cfg.served_name,
                        "object": "model",
                        "created": int(self.w.started_unix),
                        "owned_by": "sglang",
                        "root": self.cfg.model_path,
                        "max_model_len": model_preset(self.cfg.preset_name()).context_tokens,
                    }
                ],
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        st = self.model.state()
        cap = st.capacity_tokens
        return web.json_response(
            {
                "timestamp": time.time(),
                "dp_rank_count": 1,
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": st.running,
                        "num_waiting_reqs": st.waiting,
                        "num_used_tokens": st.used_tokens,
                        "max_total_num_tokens": cap,
                        "token_usage": st.used_tokens / cap if cap else 0.0,
                        "cache_hit_rate": self.model.cache_hit_rate(),
                    }
                ],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_metrics:
            raise ApiError(404, "metrics are off; start the worker with --enable-metrics")
        body = self.w.metrics.render(self.model, self.w.hicache)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self._auth(request)
        if self.model.busy() or self.w.copies.any_in_flight():
            return web.Response(
                status=400, text="Cache not flushed: there are running or waiting requests or copies in flight.\n"
            )
        dropped = self.model.flush()
        self.w.store.clear()
        if self.w.hicache is not None:
            self.w.hicache.flush()
        return web.Response(status=200, text=f"Cache flushed. {dropped} blocks dropped.\n")

    # -- generation -------------------------------------------------------------------------------------------
    def _prompt(
        self, text: str | None = None, ids: list[int] | None = None, body: dict | None = None
    ) -> tuple[int, list[str]]:
        """``(prompt tokens, chain)`` of a text or token-id prompt (as :mod:`btbctl.engine.hashing` defines; with
        HiCache the chain is SGLang's page keys of the token ids, seeded by the body's ``extra_key`` and
        ``cache_salt`` strings)."""
        if self.w.hicache is not None:
            data = pack_tokens(ids) if ids is not None else pack_text(text or "")
            n = len(data) // BYTES_PER_TOKEN
            if n > MAX_PROMPT_TOKENS:
                raise ApiError(400, f"prompt of {n} tokens exceeds {MAX_PROMPT_TOKENS}")
            extra_key, salt = _salt(body, "extra_key"), _salt(body, "cache_salt")
            full = n // self.cfg.page_size * self.cfg.page_size
            return n, page_keys_packed(data[: full * BYTES_PER_TOKEN], self.cfg.page_size, extra_key, salt)
        n, chain = ids_chain(ids, self.cfg.page_size) if ids is not None else text_chain(text, self.cfg.page_size)
        if n > MAX_PROMPT_TOKENS:
            raise ApiError(400, f"prompt of {n} tokens exceeds {MAX_PROMPT_TOKENS}")
        return n, chain

    def _details(self, lr: LiveRequest) -> dict | None:
        """SGLang's ``meta_info.cached_tokens_details`` of ``lr`` (null when nothing was cached)."""
        hc = self.w.hicache
        if hc is not None and lr.tiers is not None:
            return lr.tiers.details(lr.cached_tokens, self.cfg.page_size, hc.storage)  # type: ignore[attr-defined]
        if lr.cached_tokens <= 0:
            return None
        out: dict = {"device": lr.cached_tokens, "host": 0}
        if hc is not None and hc.storage:
            out.update(storage=0, storage_backend=STORAGE_BACKEND_NAME)
        return out

    async def _submit(self, prompt: tuple[int, list[str]], max_new: int, rid: str) -> LiveRequest:
        if not self._is_ready():
            raise ApiError(503, "worker is starting or stopping")
        n_tokens, chain = prompt
        try:
            self.model.check_fits(n_tokens, len(chain), max_new)
        except TooLarge as e:
            raise ApiError(400, str(e)) from None
        tiers = None
        if self.w.hicache is not None:
            tiers = await self.w.hicache.admit(chain, n_tokens)
            if not self._is_ready():
                raise ApiError(503, "worker is starting or stopping")
        try:
            lr = self.model.submit(chain, n_tokens, max_new, rid)
        except TooLarge as e:
            raise ApiError(400, str(e)) from None
        lr.tiers = tiers
        if lr.done.done():
            self._finished(lr)
        else:  # observed when the model finishes it, whether or not the client is still there
            lr.done.add_done_callback(lambda _f: self._finished(lr))
        return lr

    def _finished(self, lr: LiveRequest) -> None:
        """Count a finished request in the metrics and write its request line (:meth:`Worker.log_request`)."""
        details = self._details(lr)
        self.w.metrics.observe(lr, details)
        self.w.log_request(lr, details)

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

    def _meta(self, lr: LiveRequest, tokens_out: int, finished: bool, out: Output | None = None) -> dict:
        now = self.model.clock()
        end = lr.finish_wall if finished and not math.isnan(lr.finish_wall) else now
        finish = (
            (out.sglang_finish() if out is not None else {"type": "length", "length": lr.max_new_tokens})
            if finished
            else None
        )
        return {
            "id": lr.rid,
            "prompt_tokens": lr.prompt_tokens,
            "completion_tokens": tokens_out,
            "cached_tokens": lr.cached_tokens,
            "cached_tokens_details": self._details(lr),
            "finish_reason": finish,
            "e2e_latency": end - lr.arrival_wall,
        }

    async def _submit_n(self, prompt: tuple[int, list[str]], max_new: int, rid: str, n: int) -> list[LiveRequest]:
        """Submit ``n`` samples of one prompt (SGLang's parallel sampling: ids ``<rid>`` or ``<rid>-<i>``)."""
        if n == 1:
            return [await self._submit(prompt, max_new, rid)]
        lrs: list[LiveRequest] = []
        try:
            for i in range(n):
                lrs.append(await self._submit(prompt, max_new, f"{rid}-{i}"))
        except ApiError:
            for lr in lrs:
                self.model.abort(lr)
            raise
        return lrs

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
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
        prompt = (
            self._prompt(ids=_token_ids(body["input_ids"], "input_ids"), body=body)
            if has_ids
            else self._prompt(text=_text(body["text"], "text"), body=body)
        )
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object")
        max_new = _int(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0, 1 << 20, "sampling_params.")
        n = _int(sp, "n", 1, 1, MAX_N, "sampling_params.") or 1
        out = Output(max_new or 0, _stops(sp.get("stop"), "sampling_params.stop"))
        want_lp = _bool(body, "return_logprob")
        top = (_int(body, "top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS) or 0) if want_lp else 0
        with_text = _bool(body, "return_text_in_logprobs")
        stream = _bool(body, "stream")
        lrs = await self._submit_n(prompt, out.tokens, _rid(body.get("rid")), n)

        def answer(lr: LiveRequest, k: int, fin: bool) -> dict:
            meta = self._meta(lr, k, fin, out)
            if want_lp:
                meta.update(_sglang_logprobs(0, k, top, with_text))
            return {"text": out.text(k), "meta_info": meta}

        if not stream:
            for lr in lrs:
                await lr.done
            answers = [answer(lr, out.tokens, True) for lr in lrs]
            return web.json_response(answers[0] if n == 1 else answers)
        resp = await self._sse_start(request)
        try:
            async for i, (k, fin) in _merge([self._progress(lr) for lr in lrs]):
                await self._sse(resp, {**answer(lrs[i], k, fin), "index": i})
            await self._sse(resp, "[DONE]")
        except ConnectionError:
            for lr in lrs:
                self.model.abort(lr)  # the client went away: abort it, as SGLang does
        return resp

    def _usage(self, lr: LiveRequest, completion: int) -> dict:
        return {
            "prompt_tokens": lr.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": lr.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": lr.cached_tokens},
        }

    async def _openai(self, request: web.Request, body: dict, prompt: tuple[int, list[str]], max_new: int, chat: bool):
        n = _int(body, "n", 1, 1, MAX_N) or 1
        out = Output(max_new, _stops(body.get("stop"), "stop"))
        if chat:  # chat: logprobs true/false and top_logprobs 0..20
            want_lp = _bool(body, "logprobs")
            top = (_int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0) if want_lp else 0
        else:  # completions: logprobs = how many top tokens (0..5), null for none
            lp = _int(body, "logprobs", None, 0, 5)
            want_lp, top = lp is not None, lp or 0
        stream = _bool(body, "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object")
        include_usage = _bool(so, "include_usage")
        want_details = _bool(body, "return_cached_tokens_details")
        rid = _rid(body.get("rid"))
        lrs = await self._submit_n(prompt, out.tokens, rid, n)
        lr = lrs[0]
        created = int(time.time())
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        model = self.cfg.served_name
        obj = "chat.completion" if chat else "text_completion"
        completion = out.tokens * n

        def logprobs(lo: int, hi: int) -> dict | None:
            return _openai_logprobs(lo, hi, top, chat, len(out.text(lo))) if want_lp else None

        if not stream:
            for x in lrs:
                await x.done
            text = out.text(out.tokens)
            fin = out.finish_reason
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": logprobs(0, out.tokens),
                    "finish_reason": fin,
                    "matched_stop": out.matched,
                }
                if chat
                else {
                    "index": i,
                    "text": text,
                    "logprobs": logprobs(0, out.tokens),
                    "finish_reason": fin,
                    "matched_stop": out.matched,
                }
                for i in range(n)
            ]
            answer = {
                "id": oid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
                "usage": self._usage(lr, completion),
            }
            details = self._details(lr) if want_details else None
            if details is not None:  # SGLang: response-level ``sglext`` (serving_completions.py:548-570)
                answer["sglext"] = {"cached_tokens_details": details}
            return web.json_response(answer)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        resp = await self._sse_start(request)

        def chunk(i: int, lo: int, hi: int, fin: bool, first: bool) -> dict:
            text = out.text(hi)[len(out.text(lo)) :]
            finish = out.finish_reason if fin else None
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                choice = {"index": i, "delta": delta, "logprobs": logprobs(lo, hi), "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": logprobs(lo, hi), "finish_reason": finish}
            if fin:
                choice["matched_stop"] = out.matched
            return {"id": oid, "object": chunk_obj, "created": created, "model": model, "choices": [choice]}

        try:
            sent = [0] * n
            first = [True] * n
            async for i, (k, fin) in _merge([self._progress(x) for x in lrs]):
                await self._sse(resp, chunk(i, sent[i], k, fin, first[i]))
                first[i] = False
                sent[i] = k
            empty = {"id": oid, "object": chunk_obj, "created": created, "model": model, "choices": []}
            details = self._details(lr) if want_details else None
            if details is not None:  # SGLang: a chunk without choices carrying ``sglext`` before the usage chunk
                await self._sse(resp, {**empty, "sglext": {"cached_tokens_details": details}})
            if include_usage:
                await self._sse(resp, {**empty, "usage": self._usage(lr, completion)})
            await self._sse(resp, "[DONE]")
        except ConnectionError:
            for x in lrs:
                self.model.abort(x)  # the client went away: abort it, as SGLang does
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "missing field 'prompt'")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], int) or isinstance(prompt[0], list)):
            parsed = self._prompt(ids=_token_ids(prompt, "prompt"), body=body)
        else:
            parsed = self._prompt(text=_text(prompt, "prompt"), body=body)
        max_new = _int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, parsed, max_new, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        msgs = body.get("messages")
        prompt = self._prompt(text=_text(_render_chat(msgs), "messages"), body=body)
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = _int({"max_tokens": max_new}, "max_tokens", DEFAULT_CHAT_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, prompt, max_new, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/tokenize`` (``/tokenize``): ``{"prompt": str | [str]}`` or ``{"messages": [...]}`` ->
        ``{"tokens", "count", "max_model_len"}`` with the emulated tokenizer (4 UTF-8 bytes per token, chats
        rendered as the chat route renders them)."""
        body = await _json_body(request)
        prompt, msgs = body.get("prompt"), body.get("messages")
        if (prompt is None) == (msgs is None):
            raise ApiError(400, "Exactly one of 'prompt' or 'messages' must be provided.")

        ids = text_to_tokens
        if msgs is not None:
            tokens: list = ids(_render_chat(msgs))
            count: int | list[int] = len(tokens)
        elif isinstance(prompt, str):
            tokens = ids(prompt)
            count = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [ids(p) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise ApiError(400, f"Invalid prompt type: {type(prompt).__name__}. Expected str or List[str].")
        return web.json_response(
            {"tokens": tokens, "count": count, "max_model_len": model_preset(self.cfg.preset_name()).context_tokens}
        )

    # -- BTB extension routes ---------------------------------------------------------------------------------
    async def btb_match(self, request: web.Request) -> web.Response:
        chain = _chain(await _json_body(request))
        cached = self.model.cached_blocks(chain)
        pending = max(self.model.planned_blocks(chain), self.w.copies.inbound_pending(chain), cached)
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
        return web.json_response(
            {
                "transfer_addr": addr,
                "page_size": c.page_size,
                "kv_bytes_per_token": self.model.cost.model.kv_bytes_per_token,
                "block_bytes": self.w.block_bytes,
                "model": c.served_name,
                "model_preset": c.preset_name(),
                "gpu": c.gpu,
                "tp_size": c.tp_size,
                "capacity_tokens": self.model.capacity_tokens,
                "kv_bytes_scale": c.kv_bytes_scale,
                "weight_bytes": self.model.cost.model.weight_bytes,
                "hbm_total_bytes": self.model.cost.hbm_bytes,
                "transport": self.w.transport.name,
                "time_scale": c.time_scale,
                "zero_delay": c.zero,
                "tokenizer": PSEUDO_TOKENIZER,
            }
        )

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
        old = self.w.copies.get(copy_id, "source")
        if old is not None and old.in_flight:
            raise ApiError(409, f"copy {copy_id} is already in progress")
        if self.w.copies.outbound_in_flight() >= MAX_OUTBOUND_COPIES:
            raise ApiError(429, f"{MAX_OUTBOUND_COPIES} copies are already being sent; retry later")
        have = self.model.cached_blocks(chain)
        if have < len(chain):
            planned = self.model.planned_blocks(chain)
            if planned < len(chain):
                raise ApiError(
                    409,
                    f"this worker holds {have} of the chain's {len(chain)} blocks and computes {planned - have} more",
                )
        token = body.get("token")
        if token is not None and not isinstance(token, str):
            raise ApiError(400, "token must be a string (the copy's token from the gateway)")
        rec, accepted = self.w.sender.start_push(chain, target, copy_id, token)
        try:
            await asyncio.wait_for(asyncio.shield(accepted), PUSH_ACCEPT_WAIT_S)
        except asyncio.TimeoutError:
            pass  # answered anyway; the record tells how the copy goes
        return web.json_response(
            {
                "copy_id": rec.copy_id,
                "blocks": rec.blocks,
                "bytes": rec.bytes_total,
                "blocks_available": rec.blocks_available,
            },
            status=202,
        )

    async def btb_expect(self, request: web.Request) -> web.Response:
        """Authorize one inbound copy (the gateway's call; see :mod:`btbctl.engine.replication.auth`)."""
        self._auth(request)
        body = await _json_body(request)
        chain = _chain(body)
        try:
            exp = self.w.sink.expect(body.get("copy_id"), chain, body.get("token"), body.get("ttl_s"))
        except AuthError as e:
            raise ApiError(e.status, str(e)) from None
        return web.json_response({"copy_id": exp.copy_id, "blocks": len(exp.chain)}, status=201)

    async def btb_copies(self, request: web.Request) -> web.Response:
        return web.json_response({"copies": [r.as_dict() for r in self.w.copies.newest_first()]})

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
            rec = self.w.copies.get(cid, role)
            if rec is not None:
                headers = {}
                if wait_s > 0:
                    # long poll: answer at the next change of any copy (progress, outcome) after version
                    # ``since`` (at once when there was one already), or after wait_s
                    if rec.in_flight and since == str(self.w.copies.version):
                        await self.w.copies.wait_change(wait_s)
                    headers = {"X-BTB-Long-Poll": "1", "X-BTB-Copy-Version": str(self.w.copies.version)}
                return web.json_response(rec.as_dict(), headers=headers)
        raise ApiError(404, f"no copy {cid!r} on this worker")


__all__ = ["ApiError", "MAX_BODY_BYTES", "WORKER_KEY", "build_app", "error_response"]
