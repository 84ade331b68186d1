"""The frames every btbctl KV page protocol speaks: their header layout, kinds and size limits, in one place.

Every frame is ``u8 kind | u32 length (big-endian) | body``:

* kind ``J`` (:data:`KIND_JSON`): the body is one UTF-8 JSON object;
* kind ``P`` (:data:`KIND_PAGE`): the body is ``u32 index | u64 xxh3_64(payload) | payload`` (:data:`PAGE_HEAD`).

Spoken by the worker-to-worker push (:mod:`btbctl.engine.replication.tcp`), the agent-to-agent copies
(:mod:`btbctl.engine.agent.peer`), both through :mod:`btbctl.engine.replication.wire`, and the local socket between
SGLang's backend and its node agent (:mod:`btbctl.sglang_l3.wire`, JSON frames only). Only the standard library is
imported here: this module runs inside SGLang's scheduler process.
"""

from __future__ import annotations

import json
import struct

#: Frame header: kind (u8), body length in bytes (u32).
FRAME_HEAD = struct.Struct(">BI")
#: Page frame body header: index in the copy (u32), xxh3_64 of the payload (u64).
PAGE_HEAD = struct.Struct(">IQ")
KIND_JSON = ord("J")
KIND_PAGE = ord("P")

#: Largest JSON frame read before the peer authenticated, bytes (hellos, challenges, proofs are about 200 bytes).
MAX_PREAUTH_BYTES = 4096
#: Largest JSON frame after authentication, bytes (an offer of 65,536 page names of 81 characters is about 6 MB;
#: the local protocol's largest, a batch of SGLang's STORAGE_BATCH_SIZE = 128 keys, is about 10 KB).
MAX_JSON_BYTES = 16 << 20
#: Most pages in one copy: 65,536 pages (of 64 tokens = 4M tokens; of 256 = 16.7M), beyond any model's context.
MAX_COPY_PAGES = 1 << 16
#: Largest page on the wire, bytes (Llama-3.3-70B at 256 tokens per page and full size is 80 MiB).
MAX_PAGE_BYTES = 1 << 30


class FrameError(Exception):
    """A malformed, oversized or unexpected frame (one line)."""


def json_frame(obj: dict) -> bytes:
    """One ``J`` frame carrying ``obj`` (compact JSON)."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    return FRAME_HEAD.pack(KIND_JSON, len(body)) + body


def page_frame_head(index: int, payload_bytes: int, digest: int) -> bytes:
    """The first ``FRAME_HEAD.size + PAGE_HEAD.size`` bytes of a ``P`` frame; the payload follows."""
    return FRAME_HEAD.pack(KIND_PAGE, PAGE_HEAD.size + payload_bytes) + PAGE_HEAD.pack(index, digest)


def check_json_head(kind: int, length: int, max_bytes: int = MAX_JSON_BYTES) -> int:
    """The body length of a frame that must be a JSON frame of at most ``max_bytes``. Raises :class:`FrameError`."""
    if kind != KIND_JSON:
        raise FrameError(f"expected a control frame, got kind {kind}")
    if length > max_bytes:
        raise FrameError(f"control frame of {length} bytes exceeds {max_bytes}")
    return length


def parse_json_body(body: bytes | bytearray) -> dict:
    """Parse a ``J`` frame's body. Raises :class:`FrameError`."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        raise FrameError("malformed control frame (not JSON)") from None
    if not isinstance(obj, dict):
        raise FrameError("control frame must be a JSON object")
    return obj


__all__ = [
    "FRAME_HEAD",
    "KIND_JSON",
    "KIND_PAGE",
    "MAX_COPY_PAGES",
    "MAX_JSON_BYTES",
    "MAX_PAGE_BYTES",
    "MAX_PREAUTH_BYTES",
    "PAGE_HEAD",
    "FrameError",
    "check_json_head",
    "json_frame",
    "page_frame_head",
    "parse_json_body",
]
