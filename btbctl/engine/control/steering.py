"""Operations built on the control API for the CLI: ``btbctl tune``'s arguments, ``btbctl replicate``'s and
``btbctl prewarm``'s start-and-wait, and ``prewarm``'s prompt file."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import BinaryIO

from btbctl.engine.chains import check_prefix_id
from btbctl.engine.constants import WARM_REPLICAS_ALIAS, BtbConstants
from btbctl.engine.control.client import ControlClient
from btbctl.engine.control.schema import ReplicateAnswer
from btbctl.engine.copies import FINAL_STATES
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.fileio import ReadRefused, read_bounded
from btbctl.engine.limits import MAX_REQUEST_BODY_BYTES
from btbctl.engine.policies import POLICIES, live_policy_error

#: What ``btbctl tune`` sets besides the four constants.
POLICY_KEY = "policy"
#: Copy states after which a copy changes no more (as the answers spell them).
FINAL_COPY_STATES = tuple(str(s) for s in FINAL_STATES)


def tune_keys() -> tuple[str, ...]:
    """Keys ``btbctl tune`` accepts: the four constants (:class:`~btbctl.engine.constants.BtbConstants`) and the
    routing policy."""
    return (*BtbConstants.keys(), POLICY_KEY)


def parse_tune_args(args: list[str]) -> dict:
    """Turn ``["prefix_blocks=16", "policy=btb", ...]`` into a validated partial update.

    Each constant is checked by :class:`~btbctl.engine.constants.BtbConstants` (the same bounds as a config file
    and the control API; ``replicas`` is read as ``warm_replicas``) and the policy against the registry, so a typo
    never reaches the fleet.

    Raises:
        ConfigError: a malformed argument, an unknown key (the valid ones are listed), a repeated key or a bad
            value (``btbctl tune`` and the key are named).
    """
    where = "btbctl tune"
    out: dict = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip().replace("-", "_")
        raw = raw.strip()
        if not sep or not key or not raw:
            raise ConfigError(arg, "expected KEY=VALUE, e.g. threshold=3", where)
        if key == WARM_REPLICAS_ALIAS:
            key = "warm_replicas"
        if key not in tune_keys():
            raise ConfigError(key, f"unknown key; valid: {', '.join(tune_keys())}", where)
        if key in out:
            raise ConfigError(key, "given twice", where)
        if key == POLICY_KEY and raw not in POLICIES:
            raise ConfigError(key, live_policy_error(raw) or "", where)
        out[key] = raw
    consts = {k: v for k, v in out.items() if k != POLICY_KEY}
    if consts:
        parsed = BtbConstants.parse(consts, where=where, from_text=True)
        out.update({k: getattr(parsed, k) for k in consts})
    return out


#: ``status`` of a replicate or prewarm that copied nothing because every eligible worker already holds the prefix.
HELD = "held"


def replicate_and_wait(
    client: ControlClient,
    prefix: str,
    n: int,
    *,
    timeout_s: float = 120.0,
    poll_s: float = 0.2,
    on_progress: Callable[[list[dict]], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Copy one prefix to ``n`` more workers and wait for the copies to finish.

    ``POST /control/replicate {"prefix", "n"}`` starts the copies; then :func:`follow_copies`.

    Returns:
        ``{"prefix", "source", "targets": [URL], "status", "bytes", "copies": [row], "holders": [URL],
        "skipped"}``: ``status`` is ``done`` (every copy arrived and was verified), ``held`` (nothing to copy: every
        eligible worker already holds it; ``holders`` names them), ``partial`` (some failed), ``failed`` (all
        failed) or ``timeout``; ``bytes`` is the sum of bytes sent by the copies that arrived.

    Raises:
        BtbctlError: bad prefix or ``n`` (checked here first), unknown or ambiguous prefix, no holder or no target
            (the gateway's message), or an unreachable control API.
    """
    try:
        p = check_prefix_id(prefix)
    except ValueError as e:
        raise BtbctlError(f"--prefix: {e}") from None
    check_replicas(n)
    started = client.replicate(p, n)
    return follow_copies(client, started, timeout_s=timeout_s, poll_s=poll_s, on_progress=on_progress, sleep=sleep)


def check_replicas(n: object) -> int:
    """``n`` when it is an integer >= 1 (``-n``/``--replicas``); raises BtbctlError otherwise."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BtbctlError(f"-n/--replicas must be an integer >= 1, got {n!r}")
    return n


def follow_copies(
    client: ControlClient,
    started: ReplicateAnswer,
    *,
    timeout_s: float = 120.0,
    poll_s: float = 0.2,
    on_progress: Callable[[list[dict]], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Wait for the copies a replicate (or prewarm) answer started: ``GET /control/replications/{prefix}`` is polled
    every ``poll_s`` until every copy is ``done`` or ``failed`` or ``timeout_s`` passes. ``on_progress`` gets the
    copies' rows (:class:`~btbctl.engine.control.schema.TransferEntry` as JSON objects; a copy the gateway no longer
    lists is ``{"copy_id", "state": "planned"}``) whenever a state or a byte count changes. An answer without
    copies (every eligible worker holds the prefix) returns at once with ``status`` :data:`HELD`.

    Returns: as :func:`replicate_and_wait`.
    """
    ids = list(started.copy_ids)
    deadline = time.monotonic() + timeout_s
    last = None
    rows: list[dict] = []
    holders: list[str] = list(started.holders)
    status = HELD if not ids else "timeout"
    while ids:
        rep = client.replication(started.prefix)
        holders = list(rep.holders)
        by_id = {c.copy_id: c.model_dump(mode="json") for c in rep.copies}
        rows = [by_id.get(i, {"copy_id": i, "state": "planned"}) for i in ids]
        snapshot = [(r.get("state"), r.get("bytes_sent")) for r in rows]
        if snapshot != last:
            last = snapshot
            if on_progress is not None:
                on_progress(rows)
        if all(r.get("state") in FINAL_COPY_STATES for r in rows):
            done = sum(1 for r in rows if r.get("state") == "done")
            status = "done" if done == len(rows) else ("failed" if done == 0 else "partial")
            break
        if time.monotonic() >= deadline:
            break
        sleep(poll_s)
    return {
        "prefix": started.prefix,
        "source": started.source,
        "targets": list(started.targets),
        "status": status,
        "bytes": sum(int(r.get("bytes_sent") or 0) for r in rows if r.get("state") == "done"),
        "copies": rows,
        "holders": holders,
        "skipped": started.skipped,
    }


#: How ``btbctl prewarm`` may read its prompt (``auto``: by the JSON shape, else text).
PROMPT_KINDS = ("auto", "text", "chat", "ids")


def read_prompt(path: str, kind: str = "auto", stdin: BinaryIO | None = None) -> dict:
    """The prompt of ``btbctl prewarm`` from a file (``-``: ``stdin``, default the process's), as the keyword
    arguments of :meth:`~btbctl.engine.control.client.ControlClient.prewarm`: ``{"text"}``, ``{"messages"}`` or
    ``{"input_ids"}``.

    ``kind`` ``text`` sends the file verbatim; ``chat`` wants a JSON list of messages (or ``{"messages": [...]}``);
    ``ids`` a JSON list of integers (or ``{"input_ids": [...]}``); ``auto`` takes those JSON shapes and
    ``{"text": "..."}``, and anything that is not JSON as text. At most ``MAX_REQUEST_BODY_BYTES`` are read.

    Raises:
        BtbctlError: unreadable, too big, not UTF-8, empty, or not the shape ``kind`` asks for (one line naming the
            file).
    """
    where = "stdin" if path == "-" else path
    limit = MAX_REQUEST_BODY_BYTES
    try:
        if path == "-":
            data = (stdin or sys.stdin.buffer).read(limit + 1)
            if len(data) > limit:
                raise ReadRefused(f"over the limit of {limit} bytes")
        else:
            data = read_bounded(path, limit_bytes=limit)
        text = data.decode("utf-8")
    except ReadRefused as e:
        raise BtbctlError(f"prompt {where}: {e}") from None
    except OSError as e:
        raise BtbctlError(f"prompt {where}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise BtbctlError(f"prompt {where}: not UTF-8 text") from None
    if not text.strip():
        raise BtbctlError(f"prompt {where}: empty")
    if kind == "text":
        return {"text": text}
    try:
        obj = json.loads(text)
    except ValueError:
        if kind == "auto":
            return {"text": text}
        raise BtbctlError(f"prompt {where}: --as {kind} wants JSON, and this is not JSON") from None
    if isinstance(obj, dict) and len(obj) == 1:
        key, obj = next(iter(obj.items()))
        shapes = {"messages": "chat", "input_ids": "ids", "text": "text"}
        if shapes.get(key) not in (kind, None) and kind != "auto":
            raise BtbctlError(f"prompt {where}: --as {kind}, but the file holds {key!r}")
        if key == "text" and isinstance(obj, str):
            return {"text": obj}
    is_ids = isinstance(obj, list) and obj and all(isinstance(t, int) and not isinstance(t, bool) for t in obj)
    is_chat = isinstance(obj, list) and obj and all(isinstance(m, dict) and "role" in m for m in obj)
    if is_ids and kind in ("auto", "ids"):
        return {"input_ids": obj}
    if is_chat and kind in ("auto", "chat"):
        return {"messages": obj}
    want = {
        "auto": 'a chat (a list of {"role", "content"}), token ids (a list of integers) or {"text": ...} '
        "(--as text sends the file verbatim)",
        "chat": 'a chat: a list of {"role", "content"} messages, or {"messages": [...]}',
        "ids": 'token ids: a list of integers, or {"input_ids": [...]}',
    }[kind]
    raise BtbctlError(f"prompt {where}: JSON that is not {want}")


__all__ = [
    "FINAL_COPY_STATES",
    "HELD",
    "POLICY_KEY",
    "PROMPT_KINDS",
    "check_replicas",
    "follow_copies",
    "parse_tune_args",
    "read_prompt",
    "replicate_and_wait",
    "tune_keys",
]
