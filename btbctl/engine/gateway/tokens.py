"""Token ids for SGLang fleets (replication mode ``l3``): prompts become SGLang's page keys.

In ``l3`` mode a prompt's chain is SGLang's storage page keys of its token ids
(:func:`btbctl.sglang_l3.keys.page_keys`), so the pages the gateway asks agents about, copies and proves are the
ones the workers' HiCache stores under those keys:

* ``input_ids`` (``/generate``) and a list of token ids (``/v1/completions``) are the tokens as given;
* text (``/generate``, ``/v1/completions``) and chat ``messages`` (``/v1/chat/completions``, the worker's own chat
  template) are tokenized by a worker's tokenizer endpoint, SGLang's ``POST /v1/tokenize`` (``{"prompt"}`` or
  ``{"messages"}`` -> ``{"tokens"}``; text is packed here instead when every worker declares btbctl's
  pseudo-tokenizer, as emulated workers do: the same ids without a round trip), exactly as the worker tokenizes
  the request itself; a prompt is tokenized once: answers are cached per prompt (:class:`Tokenizer`, an LRU bounded
  in tokens);
* a request's ``extra_key`` and ``cache_salt`` strings seed its pages as SGLang seeds them.

:class:`PrefixTokens` keeps, for every page key the gateway saw, the token ids of the prefix that ends with that
page (shared buffers, bounded in bytes): a warm-up request of a prefix sends exactly those ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from btbctl.engine.gateway.prompt import PromptError, PromptTooLong
from btbctl.engine.hashing import BYTES_PER_TOKEN, PSEUDO_TOKENIZER, pack_text, pack_tokens
from btbctl.sglang_l3.keys import page_keys, page_keys_packed

log = logging.getLogger(__name__)

#: Tokens of tokenized prompts kept in the cache (a product choice: 16M tokens are 64 MB of packed ids).
TOKEN_CACHE_TOKENS = 1 << 24
#: Prompts kept in the cache, whatever their size (a product choice: each entry costs ~250 bytes of its own, so tiny
#: prompts cannot grow it past ~16 MB where the token bound alone would let 16M of them in).
TOKEN_CACHE_ENTRIES = 1 << 16

#: Runs a function off the event loop (the data plane's prompt pool) and returns its result.
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]


async def _inline(fn: Callable[[], Any]) -> Any:
    """An :data:`Offload` that runs ``fn`` here (small prompts: a thread hop costs more than the work)."""
    return fn()


#: Largest ``/v1/tokenize`` answer read, bytes (the gateway's largest body, 8 MiB of text, is at most 8M tokens of up
#: to 8 characters each in JSON; a product choice).
MAX_TOKENIZE_ANSWER_BYTES = 64 << 20
#: Bytes of prompts whose prefix tokens are kept for warm-ups (a product choice, 256 MiB).
PREFIX_TOKEN_BYTES = 256 << 20


class TokenizeError(Exception):
    """No worker could tokenize the prompt (one line)."""


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids (packed little-endian uint32, or a list for ids beyond 32 bits) and its page
    seeds."""

    data: bytes
    n_tokens: int
    extra_key: str | None = None
    cache_salt: str | None = None
    wide: tuple[int, ...] | None = None

    def pages(self, page_size: int, max_tokens: int | None = None) -> tuple[str, ...]:
        """SGLang's page keys of the prompt's whole pages (of its first ``max_tokens`` tokens, when given)."""
        n = self.n_tokens if max_tokens is None else min(self.n_tokens, max_tokens)
        full = n // page_size * page_size
        if self.wide is not None:
            return tuple(page_keys(self.wide[:full], page_size, self.extra_key, self.cache_salt))
        return tuple(page_keys_packed(self.data[: full * BYTES_PER_TOKEN], page_size, self.extra_key, self.cache_salt))

    def ids(self, n: int) -> list[int]:
        """The first ``n`` token ids."""
        if self.wide is not None:
            return list(self.wide[:n])
        mv = memoryview(self.data)[: n * BYTES_PER_TOKEN].cast("I")
        return mv.tolist()


def _seed(body: dict, key: str) -> str | None:
    v = body.get(key)
    if isinstance(v, list) and len(v) == 1:
        v = v[0]
    if v is None or v == "":
        return None
    if not isinstance(v, str):
        raise PromptError(f"'{key}' must be a string")
    return v


def _ids_prompt(ids: Any, field: str, body: dict) -> Prompt:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PromptError(f"'{field}' must be a list of integers")
    if any(t < 0 or t >= 1 << 63 for t in ids):
        raise PromptError(f"'{field}' entries must be in 0..2**63-1")
    wide = tuple(ids) if any(t >= 1 << 32 for t in ids) else None
    return Prompt(
        pack_tokens(ids) if wide is None else b"", len(ids), _seed(body, "extra_key"), _seed(body, "cache_salt"), wide
    )


def direct_prompt(route: str, body: dict) -> Prompt | None:
    """The prompt of a body that carries token ids (``input_ids``; a completion's id list), else None (text or
    chat: ask the tokenizer). Raises :class:`PromptError`."""
    if route == "generate":
        ids = body.get("input_ids")
        if ids is not None:
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                ids = ids[0]
            return _ids_prompt(ids, "input_ids", body)
        return None
    if route == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p:
            if isinstance(p[0], list):
                return _ids_prompt(p[0], "prompt", body)
            if not isinstance(p[0], str):
                return _ids_prompt(p, "prompt", body)
    return None


def _has_ids(route: str, body: dict) -> bool:
    """Whether the body carries token ids (``input_ids``, a completion's id list) rather than text."""
    if route == "generate":
        return body.get("input_ids") is not None
    p = body.get("prompt") if route == "completions" else None
    return isinstance(p, list) and bool(p) and not isinstance(p[0], str)


def tokenize_body(route: str, body: dict) -> dict:
    """The ``/v1/tokenize`` body for a text or chat request. Raises :class:`PromptError` for a missing prompt."""
    if route == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise PromptError("'messages' must be a non-empty list")
        out: dict = {"messages": msgs}
        for k in ("tools", "chat_template_kwargs", "reasoning_effort", "continue_final_message"):
            if k in body:
                out[k] = body[k]
        return out
    key = "text" if route == "generate" else "prompt"
    text = body.get(key)
    if isinstance(text, list) and text and isinstance(text[0], str):
        text = text[0]
    if not isinstance(text, str):
        raise PromptError(f"missing '{key}'" if text is None else f"'{key}' must be a string or a list of strings")
    return {"prompt": text}


class Tokenizer:
    """Tokenizes prompts through the workers' ``POST /v1/tokenize``, caching answers per prompt.

    Args:
        session: returns the shared :class:`aiohttp.ClientSession`.
        urls: returns the base URLs of the workers to ask, best first (healthy, least loaded).
        timeout_s: bound of one call.
        max_tokens / max_entries: tokens / prompts kept in the cache (the oldest go first).
    """

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        urls: Callable[[], Sequence[str]],
        timeout_s: float = 10.0,
        max_tokens: int = TOKEN_CACHE_TOKENS,
        max_entries: int = TOKEN_CACHE_ENTRIES,
    ) -> None:
        self._session = session
        self._urls = urls
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._tokens = 0
        self._inflight: dict[bytes, asyncio.Future] = {}
        self.calls = 0
        self.hits = 0
        #: set when every worker declares the pseudo-tokenizer (:data:`~btbctl.engine.hashing.PSEUDO_TOKENIZER`):
        #: text prompts are then packed here, exactly as the workers would tokenize them
        self.local = False
        self.local_hits = 0

    async def prompt(self, route: str, body: dict, offload: Offload | None = None) -> Prompt:
        """The :class:`Prompt` of a request body (token ids as given, else tokenized by a worker). ``offload``
        (a big body): the prompt's hashing, packing and the tokenizer's request and answer run off the event loop.

        Raises:
            PromptError: the body has no usable prompt.
            TokenizeError: no worker answered the tokenizer call.
        """
        direct = direct_prompt(route, body)
        if direct is not None:
            return direct
        tb = tokenize_body(route, body)
        run = offload or _inline
        if self.local and "prompt" in tb:  # the workers' tokenizer is the pseudo-tokenizer: no round trip
            text = tb["prompt"]
            data = await run(lambda: pack_text(text, "surrogatepass"))
            self.local_hits += 1
        else:
            data = await self._tokens_of(tb, run)
        return Prompt(data, len(data) // BYTES_PER_TOKEN, _seed(body, "extra_key"), _seed(body, "cache_salt"))

    async def _tokens_of(self, tb: dict, run: Offload = _inline) -> bytes:
        key = await run(lambda: hashlib.sha256(json.dumps(tb, sort_keys=True, separators=(",", ":")).encode()).digest())
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        fut = self._inflight.get(key)
        if fut is not None:  # the same prompt is being tokenized: share the answer
            self.hits += 1
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            data = await self._ask(tb, run)
            fut.set_result(data)
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            self._inflight.pop(key, None)
        self._cache[key] = data
        self._tokens += len(data) // BYTES_PER_TOKEN
        while (self._tokens > self.max_tokens or len(self._cache) > self.max_entries) and self._cache:
            _, old = self._cache.popitem(last=False)
            self._tokens -= len(old) // BYTES_PER_TOKEN
        return data

    async def _ask(self, tb: dict, run: Offload = _inline) -> bytes:
        errors = []
        payload = await run(lambda: json.dumps(tb).encode())
        headers = {"Content-Type": "application/json"}
        for url in self._urls():
            self.calls += 1
            try:
                async with self._session().post(
                    f"{url}/v1/tokenize", data=payload, headers=headers, timeout=self.timeout
                ) as resp:
                    if resp.status != 200:
                        errors.append(f"{url}: HTTP {resp.status}")
                        continue
                    raw = await resp.content.read(MAX_TOKENIZE_ANSWER_BYTES + 1)
                    if len(raw) > MAX_TOKENIZE_ANSWER_BYTES:
                        errors.append(f"{url}: /v1/tokenize answer over {MAX_TOKENIZE_ANSWER_BYTES} bytes")
                        continue
                packed = await run(lambda raw=raw: _packed_answer(raw))
                if packed is None:
                    errors.append(f"{url}: malformed /v1/tokenize answer")
                    continue
                return packed
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
                errors.append(f"{url}: {type(e).__name__}")
        raise TokenizeError("no worker tokenized the prompt: " + ("; ".join(errors) or "no healthy worker"))


def _packed_answer(raw: bytes) -> bytes | None:
    """The packed ids of a ``/v1/tokenize`` answer (``{"tokens": [...]}``), None when it is not one. Raises
    ValueError for bad JSON."""
    ans = json.loads(raw)
    tokens = ans.get("tokens") if isinstance(ans, dict) else None
    try:  # strict: array() checks every id is an integer in [0, 2**32) in C (a per-id Python check cost ~1.5 ms)
        return pack_tokens(tokens, strict=True) if isinstance(tokens, list) else None
    except (TypeError, OverflowError):
        return None


class PrefixTokens:
    """For every page key seen, the token ids of the prefix it ends (see the module docstring). Each prompt is kept
    up to the end of its chain (the pages hashed; what follows is never a prefix the gateway knows), shared by its
    keys; the oldest go once ``max_bytes`` are held."""

    def __init__(self, max_bytes: int = PREFIX_TOKEN_BYTES) -> None:
        self.max_bytes = max_bytes
        self._keys: dict[str, tuple[int, int]] = {}  # page key -> (prompt id, pages)
        self._prompts: OrderedDict[int, tuple[Prompt, list[str]]] = OrderedDict()
        self._bytes = 0
        self._next = 0

    def add(self, chain: Sequence[str], prompt: Prompt, page_size: int) -> None:
        """Record ``prompt`` (the first ``len(chain) * page_size`` of its tokens) for the keys of ``chain`` not
        known yet."""
        new = [k for k in chain if k not in self._keys]
        if not new:
            return
        n = len(chain) * page_size
        if prompt.n_tokens > n:
            prompt = replace(
                prompt,
                data=prompt.data[: n * BYTES_PER_TOKEN],
                n_tokens=n,
                wide=None if prompt.wide is None else prompt.wide[:n],
            )
        pid = self._next
        self._next += 1
        index = {k: i for i, k in enumerate(chain)} if len(new) < len(chain) else None
        for i, k in enumerate(new):
            self._keys[k] = (pid, (index[k] if index is not None else i) + 1)
        self._prompts[pid] = (prompt, new)
        self._bytes += max(len(prompt.data), 8 * len(prompt.wide or ()))
        while self._bytes > self.max_bytes and len(self._prompts) > 1:
            _, (old, keys) = self._prompts.popitem(last=False)
            self._bytes -= max(len(old.data), 8 * len(old.wide or ()))
            for k in keys:
                self._keys.pop(k, None)

    def get(self, chain: Sequence[str], page_size: int) -> tuple[list[int], str | None, str | None] | None:
        """``(token ids of the prefix, extra_key, cache_salt)`` of the prefix ``chain`` (its last key), or None
        when unknown."""
        if not chain:
            return None
        ref = self._keys.get(chain[-1])
        if ref is None or ref[0] not in self._prompts:
            return None
        prompt = self._prompts[ref[0]][0]
        n = ref[1] * page_size
        if n > prompt.n_tokens:
            return None
        return prompt.ids(n), prompt.extra_key, prompt.cache_salt


class L3Prompts:
    """The data plane's prompt handling in ``l3`` mode: :class:`Tokenizer` over the fleet's healthy workers (least
    loaded first) and :class:`PrefixTokens` for the warm-ups.

    Args:
        session: returns the shared session.
        state: the fleet state (:class:`~btbctl.engine.gateway.state.FleetState`; its workers are asked).
        timeout_s: bound of one tokenizer call.
    """

    def __init__(self, session: Callable[[], aiohttp.ClientSession], state: Any, timeout_s: float = 10.0) -> None:
        self.state = state
        self.tokenizer = Tokenizer(session, self._urls, timeout_s)
        self.prefixes = PrefixTokens()
        self.failures = 0

    def _urls(self) -> list[str]:
        ws = sorted((w for w in self.state.workers if w.healthy), key=lambda w: (w.inflight, w.index))
        return [w.url for w in ws]

    def worker_info(self) -> None:
        """A worker's ``/btb/info`` changed: text prompts are packed locally while every worker declares the
        pseudo-tokenizer (emulated workers; a real SGLang server declares nothing and is asked)."""
        ws = self.state.workers
        self.tokenizer.local = bool(ws) and all((w.info or {}).get("tokenizer") == PSEUDO_TOKENIZER for w in ws)

    async def chain(
        self,
        route: str,
        body: dict,
        page_size: int,
        *,
        max_tokens: int | None = None,
        max_blocks: int | None = None,
        offload: Offload | None = None,
    ) -> tuple[tuple[str, ...], int]:
        """``(page keys of the prompt's leading whole pages, prompt tokens)``: at most ``max_blocks`` pages are
        hashed, and ``offload`` (when given: a big body) runs the prompt's tokenization (packing, the tokenizer's
        request and answer), the ids' parsing and hashing off the event loop. A
        prompt no worker can tokenize is routed without a chain (logged; the request itself is not refused).

        Raises:
            PromptError: no usable prompt.
            PromptTooLong: over ``max_tokens`` (before anything is hashed).
        """
        try:
            if offload is not None and _has_ids(route, body):
                prompt = await offload(lambda: self._direct(route, body))
            else:
                prompt = await self.tokenizer.prompt(route, body, offload)
        except TokenizeError as e:
            self.failures += 1
            log.warning("routing a request without its prefix: %s", e)
            return (), 1
        if max_tokens is not None and prompt.n_tokens > max_tokens:
            raise PromptTooLong(f"prompt of {prompt.n_tokens} tokens exceeds the limit of {max_tokens} tokens")
        limit = None if max_blocks is None else max_blocks * page_size
        chain = await offload(lambda: prompt.pages(page_size, limit)) if offload else prompt.pages(page_size, limit)
        if chain:
            self.prefixes.add(chain, prompt, page_size)
        return chain, prompt.n_tokens

    @staticmethod
    def _direct(route: str, body: dict) -> Prompt:
        p = direct_prompt(route, body)
        assert p is not None
        return p


__all__ = [
    "L3Prompts",
    "PREFIX_TOKEN_BYTES",
    "PrefixTokens",
    "Prompt",
    "TOKEN_CACHE_ENTRIES",
    "TOKEN_CACHE_TOKENS",
    "TokenizeError",
    "Tokenizer",
    "direct_prompt",
    "tokenize_body",
]
