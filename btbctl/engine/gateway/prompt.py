"""From a request body to the prompt's block-hash chain (the gateway's hot path).

How a prompt maps to blocks (the same mapping as :mod:`btbctl.engine.hashing`, which the emulated worker,
``btbctl bench`` and ``btbctl replicate`` use; a test checks that both give identical chains):

* **Which field is the prompt.** ``POST /generate`` (SGLang native): ``input_ids`` (a list of token ids) when
  present, else ``text``. ``POST /v1/completions``: ``prompt`` as a string or a list of token ids.
  ``POST /v1/chat/completions``: ``messages`` rendered to text by :func:`render_chat`. A batch (a list of strings
  or a list of token-id lists) is routed by its first element.
* **Tokens.** Token ids are used as given. Text is cut into pseudo-tokens of
  :data:`~btbctl.engine.hashing.BYTES_PER_TOKEN` (4) UTF-8 bytes, the last one zero-padded: the gateway has no
  tokenizer, and equal text gives equal tokens, which is all prefix matching needs.
* **Blocks and hashes.** Tokens are grouped in blocks of ``page_size`` tokens (the workers' ``--page-size``);
  only full blocks are hashed. ``h[k] = xxh3_64(h[k-1] || block k's tokens as little-endian uint32)``, as
  16 hex digits. Here the hashing runs over the packed bytes directly (for text the UTF-8 bytes *are* the packed
  pseudo-tokens), so a 64k-token prompt costs one pass of xxh3 in C, not a Python loop per token.
"""

from __future__ import annotations

import json
from typing import Any

from btbctl.engine import hashing
from btbctl.engine.hashing import BYTES_PER_TOKEN


class PromptError(ValueError):
    """A request body without a usable prompt; ``str()`` is the message for the 400 answer."""


class PromptTooLong(PromptError):
    """A prompt over the gateway's ``max_prompt_tokens``; ``str()`` is the message for the 413 answer."""


def parse_json_object(body: bytes) -> dict:
    """The JSON object a request body holds (the data plane's and the control API's bodies alike).

    Raises:
        PromptError: the body is not valid JSON or not an object (``str()`` is the message for the 400 answer).
    """
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise PromptError(f"malformed JSON: {e}") from None
    except RecursionError:
        raise PromptError("malformed JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise PromptError("the body must be a JSON object")
    return obj


def render_chat(messages: Any) -> str:
    """Text of a chat ``messages`` list, for hashing only: ``"role: content\\n"`` per message, joined (the
    emulated worker renders chats the same way, so both sides agree on the chain). ``content`` may be a string or
    a list of OpenAI content parts (the ``text`` of the ``text`` parts is joined; other parts are skipped).

    Raises:
        PromptError: ``messages`` is not a non-empty list of objects with a string ``role``.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' must be a non-empty list")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"'messages[{i}]' must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise PromptError(f"'messages[{i}].role' must be a string")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            )
        else:
            raise PromptError(f"'messages[{i}].content' must be a string or a list of parts")
        parts.append(f"{role}: {text}\n")
    return "".join(parts)


def ids_to_bytes(ids: Any, field: str) -> bytes:
    """Token ids packed as little-endian uint32 (the shared :func:`~btbctl.engine.hashing.pack_tokens`, with its
    errors worded for the client).

    Raises:
        PromptError: ``ids`` is not a list of integers in [0, 2^32) (``field`` names it in the message): an id
            outside cannot be a token, and taken modulo 2^32 it would count as another prompt's arrival.
    """
    if not isinstance(ids, list):
        raise PromptError(f"'{field}' must be a list of integers")
    try:
        return hashing.pack_tokens(ids, strict=True)
    except TypeError:
        raise PromptError(f"'{field}' must be a list of integers") from None
    except OverflowError:
        raise PromptError(f"'{field}' must be token ids in [0, 2^32)") from None


def text_to_bytes(text: str) -> bytes:
    """UTF-8 bytes of ``text`` zero-padded to a whole number of pseudo-tokens."""
    return hashing.pack_text(text, errors="surrogatepass")


def chain_from_packed(data: bytes, page_size: int) -> tuple[str, ...]:
    """Chain hashes (16 hex digits each) of the full ``page_size``-token blocks of packed uint32 tokens.

    Equal to ``btbctl.engine.hashing.chain_hashes(tokens, page_size)`` for the tokens ``data`` packs.
    """
    return tuple(hashing.chain_from_packed(data, page_size))


def prompt_of(route: str, body: dict) -> tuple[bytes, int]:
    """The prompt of a parsed request body as packed tokens, and its length in tokens.

    Args:
        route: ``generate``, ``completions`` or ``chat``.
        body: the parsed JSON object.

    Raises:
        PromptError: the prompt field is missing or has the wrong shape (the message names the field).
    """
    if route == "generate":
        ids = body.get("input_ids")
        if ids is not None:
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                ids = ids[0]
            data = ids_to_bytes(ids, "input_ids")
            return data, len(data) // BYTES_PER_TOKEN
        text = body.get("text")
        if text is None:
            raise PromptError("missing 'text' or 'input_ids'")
        if isinstance(text, list) and text and isinstance(text[0], str):
            text = text[0]
        if not isinstance(text, str):
            raise PromptError("'text' must be a string or a list of strings")
    elif route == "completions":
        prompt = body.get("prompt")
        if prompt is None:
            raise PromptError("missing 'prompt'")
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str):
                prompt = first
            elif isinstance(first, list):
                data = ids_to_bytes(first, "prompt")
                return data, len(data) // BYTES_PER_TOKEN
            else:
                data = ids_to_bytes(prompt, "prompt")
                return data, len(data) // BYTES_PER_TOKEN
        if not isinstance(prompt, str):
            raise PromptError("'prompt' must be a string, a list of strings or a list of token ids")
        text = prompt
    elif route == "chat":
        if "messages" not in body:
            raise PromptError("missing 'messages'")
        text = render_chat(body["messages"])
    else:  # pragma: no cover - routes are fixed by the app
        raise PromptError(f"unknown route {route!r}")
    data = text_to_bytes(text)
    return data, len(data) // BYTES_PER_TOKEN


def output_tokens_of(route: str, body: dict) -> int:
    """Tokens the request asks for (informational, for the policy's ``Request``): ``sampling_params.
    max_new_tokens`` (SGLang default 128) or ``max_tokens``/``max_completion_tokens`` (OpenAI; default 16 for
    completions and 128 for chat here). Non-integers count as the default; the worker validates them."""
    if route == "generate":
        sp = body.get("sampling_params")
        v = sp.get("max_new_tokens", 128) if isinstance(sp, dict) else 128
    elif route == "completions":
        v = body.get("max_tokens", 16)
    else:
        v = body.get("max_completion_tokens", body.get("max_tokens", 128))
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else 1
