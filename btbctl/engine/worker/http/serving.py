"""Serving routes of the worker's HTTP API: SGLang's ``/generate``, OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (whole answers or server-sent events, ``n`` choices, stop strings, logprobs, cached-token
details) and ``/tokenize``. A request is admitted (HiCache tiers first when on), run by the model driver, and
counted and logged once when it finishes, whether or not its client is still there."""

from __future__ import annotations

import math
import time

from aiohttp import web

from btbctl.engine.costmodel import model_preset
from btbctl.engine.hashing import BYTES_PER_TOKEN, pack_text, pack_tokens, text_to_tokens
from btbctl.engine.limits import MAX_PROMPT_TOKENS
from btbctl.engine.worker.hicache import STORAGE_BACKEND_NAME
from btbctl.engine.worker.http.base import Routes
from btbctl.engine.worker.http.errors import ApiError
from btbctl.engine.worker.http.output import Output, openai_logprobs, sglang_logprobs
from btbctl.engine.worker.http.parse import (
    bool_field,
    int_field,
    json_body,
    render_chat,
    request_id,
    salt_field,
    stop_strings,
    text_field,
    token_ids,
)
from btbctl.engine.worker.http.stream import merge, progress, sse_send, sse_start
from btbctl.engine.worker.model import LiveRequest, TooLarge
from btbctl.engine.worker.prompt import ids_chain, text_chain
from btbctl.sglang_l3.keys import page_keys_packed

#: Default ``max_new_tokens`` of ``/generate`` (SGLang's sampling-params default, 128).
DEFAULT_MAX_NEW_TOKENS = 128
#: Default ``max_tokens`` of ``/v1/completions`` (OpenAI's default, 16).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: Default ``max_tokens`` of ``/v1/chat/completions``. SGLang generates until EOS or the context limit; an emulated
#: worker has no EOS, so a fixed 128 (SGLang's ``max_new_tokens`` default) stands in.
DEFAULT_CHAT_MAX_TOKENS = 128
#: Most choices per request (``n``) accepted.
MAX_N = 16
#: Most ``top_logprobs`` (OpenAI chat) / ``top_logprobs_num`` (SGLang) accepted.
MAX_TOP_LOGPROBS = 20


class ServingRoutes(Routes):
    """``/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/tokenize`` (``/v1/tokenize``)."""

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
            extra_key, salt = salt_field(body, "extra_key"), salt_field(body, "cache_salt")
            full = n // self.cfg.page_size * self.cfg.page_size
            keys = page_keys_packed(data[: full * BYTES_PER_TOKEN], self.cfg.page_size, extra_key, salt)
            self._learn(keys, text, ids)
            return n, keys
        n, chain = ids_chain(ids, self.cfg.page_size) if ids is not None else text_chain(text, self.cfg.page_size)
        if n > MAX_PROMPT_TOKENS:
            raise ApiError(400, f"prompt of {n} tokens exceeds {MAX_PROMPT_TOKENS}")
        self._learn(chain, text, ids)
        return n, chain

    def _learn(self, chain: list[str], text: str | None, ids: list[int] | None) -> None:
        """With KV events on, the prompt's pages' tokens (what a ``BlockStored`` of them carries)."""
        ev = self.w.kv_events
        if ev is not None and chain:
            ev.learn(chain, ids if ids is not None else text_to_tokens(text or ""))

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
        if not self.is_ready():
            raise ApiError(503, "worker is starting or stopping")
        n_tokens, chain = prompt
        try:
            self.model.check_fits(n_tokens, len(chain), max_new)
        except TooLarge as e:
            raise ApiError(400, str(e)) from None
        tiers = None
        if self.w.hicache is not None:
            tiers = await self.w.hicache.admit(chain, n_tokens)
            if not self.is_ready():
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

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
        if has_text == has_ids:
            raise ApiError(400, "give exactly one of 'text' or 'input_ids'")
        prompt = (
            self._prompt(ids=token_ids(body["input_ids"], "input_ids"), body=body)
            if has_ids
            else self._prompt(text=text_field(body["text"], "text"), body=body)
        )
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError(400, "sampling_params must be an object")
        max_new = int_field(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, 0, 1 << 20, "sampling_params.")
        n = int_field(sp, "n", 1, 1, MAX_N, "sampling_params.") or 1
        out = Output(max_new or 0, stop_strings(sp.get("stop"), "sampling_params.stop"))
        want_lp = bool_field(body, "return_logprob")
        top = (int_field(body, "top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS) or 0) if want_lp else 0
        with_text = bool_field(body, "return_text_in_logprobs")
        stream = bool_field(body, "stream")
        lrs = await self._submit_n(prompt, out.tokens, request_id(body.get("rid")), n)

        def answer(lr: LiveRequest, k: int, fin: bool) -> dict:
            meta = self._meta(lr, k, fin, out)
            if want_lp:
                meta.update(sglang_logprobs(0, k, top, with_text))
            return {"text": out.text(k), "meta_info": meta}

        if not stream:
            for lr in lrs:
                await lr.done
            answers = [answer(lr, out.tokens, True) for lr in lrs]
            return web.json_response(answers[0] if n == 1 else answers)
        resp = await sse_start(request)
        try:
            async for i, (k, fin) in merge([progress(lr, self.model.clock) for lr in lrs]):
                await sse_send(resp, {**answer(lrs[i], k, fin), "index": i})
            await sse_send(resp, "[DONE]")
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
        n = int_field(body, "n", 1, 1, MAX_N) or 1
        out = Output(max_new, stop_strings(body.get("stop"), "stop"))
        if chat:  # chat: logprobs true/false and top_logprobs 0..20
            want_lp = bool_field(body, "logprobs")
            top = (int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0) if want_lp else 0
        else:  # completions: logprobs = how many top tokens (0..5), null for none
            lp = int_field(body, "logprobs", None, 0, 5)
            want_lp, top = lp is not None, lp or 0
        stream = bool_field(body, "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object")
        include_usage = bool_field(so, "include_usage")
        want_details = bool_field(body, "return_cached_tokens_details")
        rid = request_id(body.get("rid"))
        lrs = await self._submit_n(prompt, out.tokens, rid, n)
        lr = lrs[0]
        created = int(time.time())
        oid = ("chatcmpl-" if chat else "cmpl-") + rid
        model = self.cfg.served_name
        obj = "chat.completion" if chat else "text_completion"
        completion = out.tokens * n

        def logprobs(lo: int, hi: int) -> dict | None:
            return openai_logprobs(lo, hi, top, chat, len(out.text(lo))) if want_lp else None

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
        resp = await sse_start(request)

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
            async for i, (k, fin) in merge([progress(x, self.model.clock) for x in lrs]):
                await sse_send(resp, chunk(i, sent[i], k, fin, first[i]))
                first[i] = False
                sent[i] = k
            empty = {"id": oid, "object": chunk_obj, "created": created, "model": model, "choices": []}
            details = self._details(lr) if want_details else None
            if details is not None:  # SGLang: a chunk without choices carrying ``sglext`` before the usage chunk
                await sse_send(resp, {**empty, "sglext": {"cached_tokens_details": details}})
            if include_usage:
                await sse_send(resp, {**empty, "usage": self._usage(lr, completion)})
            await sse_send(resp, "[DONE]")
        except ConnectionError:
            for x in lrs:
                self.model.abort(x)  # the client went away: abort it, as SGLang does
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "missing field 'prompt'")
        if isinstance(prompt, list) and prompt and (isinstance(prompt[0], int) or isinstance(prompt[0], list)):
            parsed = self._prompt(ids=token_ids(prompt, "prompt"), body=body)
        else:
            parsed = self._prompt(text=text_field(prompt, "prompt"), body=body)
        max_new = int_field(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, parsed, max_new, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await json_body(request)
        msgs = body.get("messages")
        prompt = self._prompt(text=text_field(render_chat(msgs), "messages"), body=body)
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        max_new = int_field({"max_tokens": max_new}, "max_tokens", DEFAULT_CHAT_MAX_TOKENS, 0, 1 << 20)
        return await self._openai(request, body, prompt, max_new, chat=True)

    async def tokenize(self, request: web.Request) -> web.Response:
        """SGLang's ``/v1/tokenize`` (``/tokenize``): ``{"prompt": str | [str]}`` or ``{"messages": [...]}`` ->
        ``{"tokens", "count", "max_model_len"}`` with the emulated tokenizer (4 UTF-8 bytes per token, chats
        rendered as the chat route renders them)."""
        body = await json_body(request)
        prompt, msgs = body.get("prompt"), body.get("messages")
        if (prompt is None) == (msgs is None):
            raise ApiError(400, "Exactly one of 'prompt' or 'messages' must be provided.")

        ids = text_to_tokens
        if msgs is not None:
            tokens: list = ids(render_chat(msgs))
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


__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_N",
    "MAX_TOP_LOGPROBS",
    "ServingRoutes",
]
