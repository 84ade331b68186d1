"""Replay a trace against any SGLang-compatible endpoint (the BTB gateway, SGLang's router, one SGLang server) and
measure time to first token on the client side.

**Timing.** Request ``i`` is sent at ``(arrival_s[i] - arrival_s[0]) / time_scale`` seconds after the replay starts:
``time_scale`` is trace seconds per wall-clock second, the same meaning as the emulated worker's ``--time-scale`` (10
replays ten times faster; run the workers at the same scale and the whole experiment is compressed evenly). With
``concurrency`` set, a request whose turn comes while that many are in flight waits for a slot; its TTFT still counts
from the moment it is actually sent, and the wait is reported as ``late_s``. TTFT is the time from sending to the first
streamed chunk that carries output (``stream: true``); e2e is the time to the end of the stream.

**Prompts.** A trace gives each request a chain of block hashes, not text, so the text is synthesised from the
hashes: block ``k`` becomes ``4 x block_tokens`` printable ASCII characters drawn from ``xxh3_128`` of the block's
hash (:func:`block_text`), and the prompt is the concatenation of its blocks, cut to ``input_tokens`` tokens.
Equal hashes give equal text, so requests that share a prefix in the trace share it character for character, and
the gateway's pseudo-tokens (4 UTF-8 bytes each, :mod:`btbctl.engine.hashing`) map them back to equal block chains
at any page size that divides the trace's block size. Prompt tokens the hashes do not cover (traces without hashes)
are filled from the request id, so they are unique. ``prompt_mode="ids"`` sends ``input_ids`` instead (ids below
:data:`IDS_VOCAB`, for real SGLang servers whose tokenizer would re-cut the text).

**Which worker served it.** Read from the :data:`WORKER_HEADER` response header when the endpoint sends it;
otherwise, when the target is a BTB gateway whose control API is known, from the gateway's per-worker ``served``
counters before and after the replay (``by_worker_source`` says which: ``header`` or ``gateway_counters``; the
counters include any other traffic during the replay); otherwise every request counts under ``unknown``.

**Result** (:meth:`BenchReport.as_dict`, keys stable)::

    {"target", "endpoint", "requests", "ok", "errors", "errors_by_status": {KIND: n},
     "ttft_s": {"mean", "p50", "p95", "p99", "max"}, "e2e_s": {...}, "by_worker": {URL: n}, "by_worker_source",
     "duration_s", "requests_per_s", "time_scale", "late_s_max", "prompt_tokens", "cached_tokens",
     "served_prompt_tokens", "cached_fraction"}

``prompt_tokens`` is the trace's count; ``cached_tokens`` and ``served_prompt_tokens`` are the server's own
(``meta_info``/``usage``), and ``cached_fraction`` is their ratio (null unless every answer that reported cached
tokens also reported its prompt tokens): a real tokenizer cuts synthesised text into other tokens than the trace
counts, so the trace's count is never the denominator.

``errors_by_status`` counts failed requests by :meth:`RequestResult.error_kind` (an HTTP status such as ``"503"``, or
``connection``, ``timeout``, ``stream``). Percentiles are linear-interpolated (:func:`btbctl.engine.stats.summarize`),
over successful requests only; a summary with no successful request holds nulls.

When the target is a BTB gateway whose control API is known, the result also has ``copies``: the copies that
finished (``done`` or ``failed``) during the replay, oldest first, each ``{"copy_id", "prefix", "hot_prefix",
"source", "target", "mode", "state", "outcome", "bytes", "duration_s", "transfer_s", "usable_s", "phases_s",
"overlap_s", "send_s", "proof_storage_tokens", "covered_tokens", "error"}`` (:func:`copies_during`; ``prefix``: the
chain copied, ``hot_prefix``: the hot prefix it is for, as ``btbctl prefixes`` lists it; ``usable_s``: planned until
the target could serve the prefix; ``l3`` mode only: ``phases_s`` ``{"source", "transfer", "proof"}`` seconds,
``overlap_s`` the seconds pages moved while the source was still prefilling, ``send_s`` the source agent's seconds of
sending, ``proof_storage_tokens`` the tokens the target's warm-up loaded from L3, ``covered_tokens`` the prefix).
Without a control API ``copies`` is null.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import xxhash

from btbctl.engine.errors import BtbctlError
from btbctl.engine.hashing import BYTES_PER_TOKEN
from btbctl.engine.httpclient import client_session
from btbctl.engine.stats import summarize
from btbctl.engine.trace.model import Request, Trace

#: Response header in which the gateway names the worker (its base URL) that answered.
WORKER_HEADER = "X-BTB-Worker"
#: Token ids of ``prompt_mode="ids"`` prompts are below this (Llama 2's 32,000-token vocabulary, the smallest
#: common one, so the ids are valid for any current model).
IDS_VOCAB = 32000
#: Endpoints :func:`replay` can drive.
ENDPOINTS = ("generate", "completions")
#: Seconds a single request may take before it counts as an error (``timeout``). A product choice: a cold
#: 65,536-token prefill of Llama-3.3-70B on 4 x H100 takes about 5 s by the cost model, so 300 s only runs out
#: behind a queue of dozens of them, or on a hung endpoint.
DEFAULT_REQUEST_TIMEOUT_S = 300.0

# bytes -> printable ASCII ('!'..'~', 94 characters), so every pseudo-token is 4 one-byte UTF-8 characters
_PRINTABLE = bytes(0x21 + (b % 94) for b in range(256))


def block_text(block_hash, block_tokens: int) -> str:
    """``4 x block_tokens`` printable ASCII characters determined by ``block_hash`` alone (any hashable value; its
    ``str()`` is what counts)."""
    key = str(block_hash).encode("utf-8", "surrogatepass")
    nbytes = block_tokens * BYTES_PER_TOKEN
    chunks = [xxhash.xxh3_128_digest(key + b"/" + i.to_bytes(4, "little")) for i in range(-(-nbytes // 16))]
    return b"".join(chunks)[:nbytes].translate(_PRINTABLE).decode("ascii")


def _text_to_ids(text: str) -> list[int]:
    data = text.encode("ascii")
    return [int.from_bytes(data[i : i + 4], "little") % IDS_VOCAB for i in range(0, len(data), 4)]


class PromptSynth:
    """Builds prompts for a trace's requests, caching block text (a burst's shared prefix is built once)."""

    def __init__(self, block_tokens: int, cache_blocks: int = 65536) -> None:
        if block_tokens < 1:
            raise BtbctlError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._cache: dict = {}
        self._cache_blocks = cache_blocks

    def _block(self, h) -> str:
        s = self._cache.get(h)
        if s is None:
            s = block_text(h, self.block_tokens)
            if len(self._cache) >= self._cache_blocks:
                self._cache.clear()
            self._cache[h] = s
        return s

    def text(self, req: Request) -> str:
        """The prompt of ``req``: exactly ``input_tokens x 4`` ASCII characters (see the module docstring)."""
        bt = self.block_tokens
        need = req.input_tokens
        parts = []
        have = 0
        for h in req.block_hashes:
            if have >= need:
                break
            take = min(bt, need - have)
            blk = self._block(h)
            parts.append(blk if take == bt else blk[: take * BYTES_PER_TOKEN])
            have += take
        k = 0
        while have < need:
            take = min(bt, need - have)
            parts.append(block_text(f"unique:{req.request_id}:{k}", bt)[: take * BYTES_PER_TOKEN])
            have += take
            k += 1
        return "".join(parts)

    def ids(self, req: Request) -> list[int]:
        """The prompt of ``req`` as ``input_tokens`` token ids below :data:`IDS_VOCAB`."""
        return _text_to_ids(self.text(req))


@dataclass
class BenchOptions:
    """How to replay.

    Attributes:
        target: base URL of the endpoint (``http://127.0.0.1:30080``).
        time_scale: trace seconds per wall-clock second (> 0; 10 = ten times faster).
        max_requests: replay only the first this many requests (None: all).
        concurrency: most requests in flight at once (None: no limit).
        endpoint: ``generate`` (SGLang native ``POST /generate``) or ``completions`` (``POST /v1/completions``).
        prompt_mode: ``text`` or ``ids`` (see the module docstring).
        model: ``model`` field for ``completions`` (None: the first id of ``GET /v1/models``, else ``default``).
        timeout_s: per-request limit, seconds.
        extra_headers: sent with every request.
    """

    target: str
    time_scale: float = 1.0
    max_requests: int | None = None
    concurrency: int | None = None
    endpoint: str = "generate"
    prompt_mode: str = "text"
    model: str | None = None
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    extra_headers: dict = field(default_factory=dict)

    def check(self) -> None:
        """Raises :class:`BtbctlError` for a bad option."""
        if not (self.target.startswith("http://") or self.target.startswith("https://")):
            raise BtbctlError(f"--target must be an http:// or https:// URL, got {self.target!r}")
        if not (isinstance(self.time_scale, (int, float)) and math.isfinite(self.time_scale) and self.time_scale > 0):
            raise BtbctlError(f"--time-scale must be a number > 0, got {self.time_scale!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise BtbctlError(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.concurrency is not None and self.concurrency < 1:
            raise BtbctlError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.endpoint not in ENDPOINTS:
            raise BtbctlError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.prompt_mode not in ("text", "ids"):
            raise BtbctlError(f"--prompt must be text or ids, got {self.prompt_mode!r}")
        if not self.timeout_s > 0:
            raise BtbctlError(f"--timeout-s must be > 0, got {self.timeout_s!r}")


@dataclass
class RequestResult:
    """What happened to one request.

    Attributes:
        request_id: the trace's id.
        kind: the trace's kind (``burst``, ``decoy``, ``background``).
        scheduled_s: when it was due, seconds from the replay start.
        sent_s: when it was sent, seconds from the replay start.
        status: ``ok`` or ``error``.
        http_status: the HTTP status, or None when no response came.
        error: a one-line reason for errors (``HTTP 503: ...``, ``connection: ...``, ``timeout``).
        ttft_s: time to the first output chunk, seconds (None on error).
        e2e_s: time to the end of the answer, seconds (None on error).
        worker: the worker that answered (:data:`WORKER_HEADER`), or ``unknown``.
        prompt_tokens: prompt length in tokens (the trace's ``input_tokens``).
        cached_tokens: ``meta_info.cached_tokens`` / ``usage.prompt_tokens_details.cached_tokens`` of the answer,
            when the endpoint reports it.
        served_prompt_tokens: ``meta_info.prompt_tokens`` / ``usage.prompt_tokens`` of the answer: the prompt as
            the server tokenized it (a real tokenizer cuts synthesised text differently from the trace's count).
    """

    request_id: str
    kind: str
    scheduled_s: float
    sent_s: float = 0.0
    status: str = "error"
    http_status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    worker: str = "unknown"
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    served_prompt_tokens: int | None = None

    def error_kind(self) -> str | None:
        """None when ok; else the HTTP status for non-200 answers (``"503"``), ``connection`` (no answer or the
        connection broke), ``timeout``, or ``stream`` (a 200 answer whose stream failed or ended early)."""
        if self.status == "ok":
            return None
        if self.http_status is not None and self.http_status != 200:
            return str(self.http_status)
        err = self.error or ""
        if err.startswith("connection"):
            return "connection"
        if err == "timeout":
            return "timeout"
        return "stream"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class BenchReport:
    """All results of one replay plus its wall time."""

    target: str
    endpoint: str
    time_scale: float
    results: list[RequestResult]
    duration_s: float
    served_by: dict | None = None
    """Requests each worker served during the replay by the gateway's own counters (``GET /control/fleet``
    ``served`` after minus before), used for ``by_worker`` when no answer named its worker."""
    copies: list[dict] | None = None
    """Copies that finished during the replay (:func:`copies_during`), or None without a control API."""

    def as_dict(self) -> dict:
        """The stable JSON summary (see the module docstring)."""
        ok = [r for r in self.results if r.status == "ok"]
        errors: dict[str, int] = {}
        for r in self.results:
            if r.status != "ok":
                key = r.error_kind()
                errors[key] = errors.get(key, 0) + 1
        by_worker: dict[str, int] = {}
        for r in ok:
            by_worker[r.worker] = by_worker.get(r.worker, 0) + 1
        source = "header"
        if set(by_worker) <= {"unknown"} and self.served_by is not None:
            by_worker = {url: n for url, n in self.served_by.items() if n > 0}
            source = "gateway_counters"
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        # the share served from cache counts the server's own tokens on both sides (never the trace's nominal ones)
        both = [(r.cached_tokens, r.served_prompt_tokens) for r in ok if r.cached_tokens is not None]
        served = sum(p for _, p in both if p is not None) if both and all(p for _, p in both) else None
        ttft = _clean(summarize(r.ttft_s for r in ok))
        e2e = _clean(summarize(r.e2e_s for r in ok))
        return {
            "target": self.target,
            "endpoint": self.endpoint,
            "requests": len(self.results),
            "ok": len(ok),
            "errors": len(self.results) - len(ok),
            "errors_by_status": dict(sorted(errors.items())),
            "ttft_s": ttft,
            "e2e_s": e2e,
            "by_worker": dict(sorted(by_worker.items())),
            "by_worker_source": source,
            "duration_s": self.duration_s,
            "requests_per_s": (len(ok) / self.duration_s) if self.duration_s > 0 else None,
            "time_scale": self.time_scale,
            "late_s_max": max((r.sent_s - r.scheduled_s for r in self.results), default=0.0),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(cached) if cached else None,
            "served_prompt_tokens": served,
            "cached_fraction": (sum(cached) / served) if served else None,
            "copies": self.copies,
        }


def _clean(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def select_requests(trace: Trace, max_requests: int | None) -> list[Request]:
    """The requests a replay sends: the first ``max_requests`` by arrival (all when None)."""
    reqs = trace.requests
    return list(reqs if max_requests is None else reqs[:max_requests])


async def _discover_model(session, target: str) -> str:
    import aiohttp

    try:
        async with session.get(target + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status == 200:
                data = await resp.json(content_type=None)
                items = data.get("data") if isinstance(data, dict) else None
                if items and isinstance(items[0], dict) and items[0].get("id"):
                    return str(items[0]["id"])
    except Exception:  # noqa: BLE001 - any failure here just means "use the default name"
        pass
    return "default"


def _body(opts: BenchOptions, req: Request, synth: PromptSynth, model: str) -> dict:
    if opts.endpoint == "generate":
        body: dict = {
            "sampling_params": {"max_new_tokens": req.output_tokens, "temperature": 0.0},
            "stream": True,
            "rid": req.request_id,
        }
        if opts.prompt_mode == "ids":
            body["input_ids"] = synth.ids(req)
        else:
            body["text"] = synth.text(req)
        return body
    prompt = synth.ids(req) if opts.prompt_mode == "ids" else synth.text(req)
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _prompt_from(chunk: dict) -> int | None:
    """The prompt tokens the server counted (``meta_info.prompt_tokens`` or ``usage.prompt_tokens``)."""
    meta = chunk.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("prompt_tokens"), int):
        return meta["prompt_tokens"]
    usage = chunk.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        return usage["prompt_tokens"]
    return None


def _cached_from(chunk: dict) -> int | None:
    meta = chunk.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return meta["cached_tokens"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        det = usage.get("prompt_tokens_details")
        if isinstance(det, dict) and isinstance(det.get("cached_tokens"), int):
            return det["cached_tokens"]
    return None


async def _one(session, opts: BenchOptions, url: str, body: dict, res: RequestResult, t0: float) -> None:
    import aiohttp

    sent = time.perf_counter()
    res.sent_s = sent - t0
    try:
        async with session.post(url, json=body, headers=opts.extra_headers or None) as resp:
            res.http_status = resp.status
            res.worker = resp.headers.get(WORKER_HEADER, "unknown")
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:300].replace("\n", " ").strip()
                res.error = f"HTTP {resp.status}" + (f": {text}" if text else "")
                return
            first = None
            done = False
            buf = b""
            async for raw in resp.content.iter_any():
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(payload)
                    except ValueError:
                        res.error = "bad stream chunk"
                        return
                    if isinstance(chunk, dict) and chunk.get("error"):
                        err = chunk["error"]
                        msg = err.get("message", err) if isinstance(err, dict) else err
                        res.error = f"stream error: {str(msg)[:200]}"
                        return
                    if first is None:
                        first = time.perf_counter()
                    if isinstance(chunk, dict):
                        c, p = _cached_from(chunk), _prompt_from(chunk)
                        if c is not None:
                            res.cached_tokens = c
                        if p is not None:
                            res.served_prompt_tokens = p
                if done:
                    break
            end = time.perf_counter()
            if first is None:
                res.error = "no output in the stream"
                return
            if not done:
                res.error = "stream ended without [DONE]"
                return
            res.ttft_s = first - sent
            res.e2e_s = end - sent
            res.status = "ok"
    except asyncio.TimeoutError:
        res.error = "timeout"
    except aiohttp.ClientResponseError as e:
        res.error = f"connection: {e.message}"
    except aiohttp.ClientError as e:
        res.error = f"connection: {type(e).__name__}: {str(e)[:200]}"
    except OSError as e:
        res.error = f"connection: {e.strerror or e}"


async def replay_async(
    trace: Trace, opts: BenchOptions, on_result: Callable[[RequestResult], None] | None = None
) -> BenchReport:
    """Replay ``trace`` against ``opts.target`` (see the module docstring). Every request gets exactly one
    :class:`RequestResult`; ``on_result`` is called as each one finishes. Raises :class:`BtbctlError` for bad
    options or an empty selection."""
    import aiohttp

    opts.check()
    reqs = select_requests(trace, opts.max_requests)
    if not reqs:
        raise BtbctlError("the trace has no requests to replay")
    target = opts.target.rstrip("/")
    url = target + ("/generate" if opts.endpoint == "generate" else "/v1/completions")
    synth = PromptSynth(trace.block_tokens)
    base = reqs[0].arrival_s
    results = [
        RequestResult(r.request_id, r.kind, (r.arrival_s - base) / opts.time_scale, prompt_tokens=r.input_tokens)
        for r in reqs
    ]
    limit = opts.concurrency or 0
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    timeout = aiohttp.ClientTimeout(total=opts.timeout_s)
    sem = asyncio.Semaphore(opts.concurrency) if opts.concurrency else None
    async with client_session(connector=connector, timeout=timeout) as session:
        model = opts.model or (await _discover_model(session, target) if opts.endpoint == "completions" else "")
        # build bodies up front so prompt synthesis does not delay sends
        bodies = [_body(opts, r, synth, model) for r in reqs]
        t0 = time.perf_counter()

        async def run(i: int) -> None:
            res = results[i]
            delay = t0 + res.scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                async with sem:
                    await _one(session, opts, url, bodies[i], res, t0)
            else:
                await _one(session, opts, url, bodies[i], res, t0)
            if on_result is not None:
                on_result(res)

        await asyncio.gather(*(run(i) for i in range(len(reqs))))
        duration = time.perf_counter() - t0
    return BenchReport(
        target=target, endpoint=opts.endpoint, time_scale=opts.time_scale, results=results, duration_s=duration
    )


def replay(trace: Trace, opts: BenchOptions, on_result: Callable[[RequestResult], None] | None = None) -> BenchReport:
    """Synchronous wrapper of :func:`replay_async` (runs its own event loop)."""
    return asyncio.run(replay_async(trace, opts, on_result))


def default_burst_trace(
    seed: int = 42, burst_size: int = 64, prefix_blocks: int = 256, spread_s: float = 1.0, block_tokens: int = 256
) -> Trace:
    """A small Bursted burst for ``btbctl bench`` without ``--trace``: one burst of ``burst_size`` requests sharing
    a ``prefix_blocks x block_tokens``-token prefix (256 x 256 = 65,536 tokens, the published prefix), each with a
    unique 256-token suffix and 1 output token, arriving evenly over ``spread_s`` seconds (1 s = the adversarial
    Bursted variant, REFERENCE.md s3); no decoys, no background."""
    from btbctl.engine.trace.generate import BurstedParams, generate_bursted

    params = BurstedParams(
        bursts=1,
        burst_size=burst_size,
        first_burst_s=0.0,
        jitter_s=0.0,
        spread_s=spread_s,
        prefix_tokens=prefix_blocks * block_tokens,
        suffix_tokens=block_tokens,
        output_tokens=1,
        decoys=0,
        block_tokens=block_tokens,
    )
    return generate_bursted(params, seed=seed)


def short_prefix_warning(prefix_blocks: int, block_tokens: int, constants: dict | None) -> str | None:
    """Why the gateway's detector cannot fire on the default burst, or None when it can (or is unknown).

    Args:
        prefix_blocks / block_tokens: the burst's shared prefix (``--prefix-blocks`` x 256 tokens).
        constants: a ``GET /control/constants`` answer (``constants.prefix_blocks``, ``prefix_tokens``), or None.
    """
    if not constants:
        return None
    need = constants.get("prefix_tokens")
    fleet_blocks = (constants.get("constants") or {}).get("prefix_blocks")
    have = prefix_blocks * block_tokens
    if not isinstance(need, int) or have >= need:
        return None
    return (
        f"the burst's shared prefix is {have:,} tokens (--prefix-blocks {prefix_blocks}), shorter than the "
        f"{need:,} tokens the gateway matches (prefix_blocks {fleet_blocks}): its detector cannot fire on it; "
        f"`btbctl tune prefix_blocks=...` lower, or raise --prefix-blocks"
    )


def served_counts(fleet: dict | None) -> dict[str, int] | None:
    """``{worker URL: served}`` from a ``GET /control/fleet`` answer (None when it has no worker rows)."""
    if not isinstance(fleet, dict) or not isinstance(fleet.get("workers"), list):
        return None
    out = {}
    for w in fleet["workers"]:
        if isinstance(w, dict) and isinstance(w.get("url"), str) and isinstance(w.get("served"), int):
            out[w["url"]] = w["served"]
    return out


def served_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """Per-worker ``after - before`` of :func:`served_counts` (None when either is unknown)."""
    if before is None or after is None:
        return None
    return {url: n - before.get(url, 0) for url, n in after.items()}


def copies_during(before: dict | None, after: dict | None) -> list[dict] | None:
    """The copies of a ``GET /control/transfers`` answer ``after`` that finished since the answer ``before`` (by
    the gateway's clock ``now_s``), oldest first, in the shape of the bench result's ``copies``; None when either
    answer is missing."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    t0 = before.get("now_s")
    if not isinstance(t0, (int, float)):
        return None
    rows = []
    for t in after.get("transfers") or []:
        fin = t.get("finished_s")
        if not isinstance(fin, (int, float)) or fin < t0 or t.get("state") not in ("done", "failed"):
            continue
        rows.append(
            {
                "copy_id": t.get("copy_id"),
                "prefix": t.get("prefix"),
                "hot_prefix": t.get("hot_prefix") or t.get("prefix"),
                "source": t.get("source"),
                "target": t.get("target"),
                "mode": t.get("mode", "push"),
                "state": t.get("state"),
                "bytes": t.get("bytes_total") or t.get("bytes_sent") or 0,
                "duration_s": t.get("duration_s"),
                "transfer_s": t.get("transfer_s"),
                "proof_storage_tokens": t.get("proof_storage_tokens"),
                "covered_tokens": t.get("covered_tokens"),
                "outcome": t.get("outcome"),
                "usable_s": t.get("usable_s"),
                "phases_s": {k: t.get(f"phase_{k}_s") for k in ("source", "transfer", "proof")},
                "overlap_s": t.get("overlap_s"),
                "send_s": t.get("send_s"),
                "error": t.get("error"),
                "finished_s": fin,
            }
        )
    rows.sort(key=lambda r: r["finished_s"])
    return rows


def write_results_jsonl(results: Iterable[RequestResult], path) -> int:
    """Write one JSON object per request (:meth:`RequestResult.as_dict`); returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r.as_dict()) + "\n")
            n += 1
    return n


__all__ = [
    "BenchOptions",
    "BenchReport",
    "ENDPOINTS",
    "PromptSynth",
    "RequestResult",
    "WORKER_HEADER",
    "block_text",
    "copies_during",
    "default_burst_trace",
    "replay",
    "replay_async",
    "select_requests",
    "served_counts",
    "served_delta",
    "write_results_jsonl",
]
