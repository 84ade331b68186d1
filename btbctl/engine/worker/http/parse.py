"""Parsing and checking request bodies: each helper returns the field in the shape the routes use or raises
:class:`~btbctl.engine.worker.http.errors.ApiError` (400) with a one-line message naming the field."""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from btbctl.engine.limits import MAX_PROMPT_TOKENS
from btbctl.engine.worker.http.errors import ApiError
from btbctl.sglang_l3.frames import MAX_COPY_PAGES

#: Most stop strings accepted.
MAX_STOP = 16


async def json_body(request: web.Request) -> dict:
    """The request body as a JSON object. Raises :class:`ApiError` (400: empty, malformed, not an object)."""
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


def int_field(d: dict, key: str, default: int | None, lo: int, hi: int, where: str = "") -> int | None:
    """``d[key]`` as an integer in ``[lo, hi]``, ``default`` when absent or null (``where`` prefixes the key in
    the error). Raises :class:`ApiError` (400)."""
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"{where}{key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def bool_field(d: dict, key: str, default: bool = False) -> bool:
    """``d[key]`` as a boolean, ``default`` when absent or null. Raises :class:`ApiError` (400)."""
    v = d.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{key} must be true or false, got {v!r}")
    return v


def token_ids(v: Any, key: str) -> list[int]:
    """A prompt of token ids (a list, or a one-element batch of one), 1..``MAX_PROMPT_TOKENS`` ids in
    ``[0, 2^32)``. Raises :class:`ApiError` (400)."""
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


def text_field(v: Any, key: str) -> str:
    """A non-empty text prompt (a string, or a one-element batch of one) that encodes as UTF-8. Raises
    :class:`ApiError` (400)."""
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


def request_id(v: Any) -> str:
    """The request id ``rid`` (1..256 characters), a fresh hex id when absent. Raises :class:`ApiError` (400)."""
    if v is None:
        return uuid.uuid4().hex
    if not isinstance(v, str) or not 1 <= len(v) <= 256:
        raise ApiError(400, "rid must be a string of 1..256 characters")
    return v


def chain_field(body: dict) -> list[str]:
    """The body's ``chain``: at most ``MAX_COPY_PAGES`` block hashes, lower-case hex of 1..64 digits. Raises
    :class:`ApiError` (400)."""
    chain = body.get("chain")
    if not isinstance(chain, list) or len(chain) > MAX_COPY_PAGES:
        raise ApiError(400, f"chain must be a list of at most {MAX_COPY_PAGES} block hashes (hex strings)")
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


def render_chat(msgs: Any) -> str:
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


def salt_field(body: dict | None, key: str) -> str | None:
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


def stop_strings(v: Any, key: str) -> list[str]:
    """Stop strings (a string or a list of at most :data:`MAX_STOP`), empty ones dropped. Raises
    :class:`ApiError` (400)."""
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ApiError(400, f"'{key}' must be a string or a list of strings")
    if len(v) > MAX_STOP:
        raise ApiError(400, f"'{key}' has {len(v)} strings; at most {MAX_STOP}")
    return [x for x in v if x]


__all__ = [
    "MAX_STOP",
    "bool_field",
    "chain_field",
    "int_field",
    "json_body",
    "render_chat",
    "request_id",
    "salt_field",
    "stop_strings",
    "text_field",
    "token_ids",
]
