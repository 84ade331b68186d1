"""SGLang's KV events on the wire (SGLang 0.5.23 ``srt/disaggregation/kv_events.py``), one definition for both
ends: the gateway's subscribers (:mod:`btbctl.engine.gateway.kv_events`) and the emulated worker's publisher.

* **Payload.** A :class:`KVEventBatch` ``[ts, events, attn_dp_rank]`` (a msgpack array; ``ts`` Unix seconds) whose
  events are tagged msgpack maps (key ``type`` = the class name, defaults left out): :class:`BlockStored`
  (``block_hashes``: int64 per page; ``parent_block_hash``: the page before the first one, None at the root;
  ``token_ids``: the pages' tokens, ``len(block_hashes) * block_size`` of them; ``block_size``: tokens per page;
  ``medium``: ``GPU``, ``CPU_PINNED`` ...), :class:`BlockRemoved` (``block_hashes``) and :class:`AllBlocksCleared`.
* **Live stream.** A ZMQ PUB socket sends each batch as three frames ``[topic, seq, payload]``; ``seq`` counts
  batches from 0, 8 bytes big-endian.
* **Replay.** An optional ROUTER socket: a DEALER sends ``[b"", start_seq]`` (8 bytes big-endian) and receives
  every batch still in the publisher's buffer (the last ``buffer_steps``) with ``seq >= start_seq`` as
  ``[b"", topic, seq, payload]``, then ``[b"", b"", END_SEQ, b""]`` (``END_SEQ``: -1 as 8 signed bytes).
* **Configuration.** The JSON of SGLang's ``--kv-events-config`` (:class:`KvEventsConfig`): the emulated worker takes
  the same option.

msgspec and pyzmq are imported by this module, which is imported only where KV events are configured.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from btbctl.engine.logfmt import log_event

log = logging.getLogger("btbctl.kvevents")

#: The replay socket's end-of-replay sequence number (-1 as 8 signed big-endian bytes).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Batches a publisher keeps for replay by default (SGLang's ``buffer_steps`` default).
DEFAULT_BUFFER_STEPS = 10_000


class EventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """``[ts, events, attn_dp_rank]``: ``ts`` Unix seconds when the batch was taken."""

    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events: tagged msgpack maps (``type`` = class name)."""


class BlockStored(KVCacheEvent):
    """Pages entered the cache: ``block_hashes`` (int64 each), after ``parent_block_hash`` (None: at the root),
    holding ``token_ids`` (``block_size`` tokens per page)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages left the cache (of ``medium``; None: the device)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole cache was emptied (``/flush_cache``)."""


class KVEventBatch(EventBatch):
    """A batch of :class:`BlockStored` / :class:`BlockRemoved` / :class:`AllBlocksCleared`."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of ``batch`` (as SGLang's publisher encodes it)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """The batch of a payload. Raises ValueError (one line) for a payload that is not one."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(f"not a KV event batch: {e}") from None


def seq_bytes(seq: int) -> bytes:
    """Sequence number ``seq`` (>= 0) as its 8-byte frame."""
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """Sequence number of an 8-byte frame (-1 for :data:`END_SEQ`). Raises ValueError for another length."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


@dataclass(frozen=True)
class KvEventsConfig:
    """The part of SGLang's ``--kv-events-config`` JSON both ends use.

    Attributes:
        endpoint: PUB address (``tcp://*:5557`` binds; a concrete host connects unless ``bind``).
        replay_endpoint: ROUTER address for replays, or None (no replay: a gap means a resync).
        topic: topic frame of every message ("" by default).
        buffer_steps: batches kept for replay.
        bind: bind (True) or connect (False) the PUB socket; None: bind wildcard, ipc and inproc addresses.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = DEFAULT_BUFFER_STEPS
    bind: bool | None = None

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse the option's JSON. Raises ValueError (one line) for bad JSON, a publisher other than ``zmq`` or a
        missing or malformed endpoint."""
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if obj.get("publisher", "null") != "zmq":
            raise ValueError("--kv-events-config: only publisher 'zmq' is supported")
        endpoint = obj.get("endpoint", "tcp://*:5557")
        replay = obj.get("replay_endpoint")
        for name, v in (("endpoint", endpoint), ("replay_endpoint", replay)):
            if v is not None and (not isinstance(v, str) or "://" not in v):
                raise ValueError(f"--kv-events-config: {name} must be a ZMQ address like tcp://host:port")
        steps = obj.get("buffer_steps", DEFAULT_BUFFER_STEPS)
        if not isinstance(steps, int) or steps < 1:
            raise ValueError("--kv-events-config: buffer_steps must be an integer >= 1")
        topic = obj.get("topic", "")
        bind = obj.get("bind")
        if not isinstance(topic, str) or (bind is not None and not isinstance(bind, bool)):
            raise ValueError("--kv-events-config: topic must be a string and bind a boolean")
        return cls(endpoint, replay, topic, steps, bind)

    def to_json(self) -> str:
        """The option's JSON (SGLang accepts it as is)."""
        obj: dict[str, Any] = {"publisher": "zmq", "endpoint": self.endpoint, "topic": self.topic}
        if self.replay_endpoint:
            obj["replay_endpoint"] = self.replay_endpoint
        if self.buffer_steps != DEFAULT_BUFFER_STEPS:
            obj["buffer_steps"] = self.buffer_steps
        if self.bind is not None:
            obj["bind"] = self.bind
        return json.dumps(obj, separators=(",", ":"))

    def binds(self) -> bool:
        """Whether the PUB socket binds (SGLang's rule)."""
        if self.bind is not None:
            return self.bind
        e = self.endpoint
        return "*" in e or "::" in e or "0.0.0.0" in e or e.startswith(("ipc://", "inproc://"))


def subscriber_address(endpoint: str) -> str:
    """The address a subscriber connects to for a publisher bound at ``endpoint`` (a wildcard host becomes
    loopback)."""
    for wild in ("*", "0.0.0.0"):
        if endpoint.startswith(f"tcp://{wild}:"):
            return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    if endpoint.startswith("tcp://[::]:"):
        return "tcp://[::1]:" + endpoint.rsplit(":", 1)[1]
    return endpoint


class Publisher:
    """SGLang's ZMQ publisher, on an asyncio loop (the emulated worker's): :meth:`publish` sends a batch at once
    (``[topic, seq, payload]``; PUB never blocks, a slow subscriber loses messages past the high-water mark) and
    keeps it for replay; a task answers replay requests. ``logger`` gets its one ``kv_events_publishing`` line.

    Raises (``start``): ``zmq.ZMQError`` when an address cannot be bound.
    """

    def __init__(self, cfg: KvEventsConfig, name: str = "worker", logger: logging.Logger = log) -> None:
        self.cfg = cfg
        self.name = name
        self.log = logger
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode()
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.cfg.binds():
            self._pub.bind(self.cfg.endpoint)
        else:
            self._pub.connect(self.cfg.endpoint)
        if self.cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.cfg.replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        log_event(
            self.log,
            "kv_events_publishing",
            worker=self.name,
            endpoint=self.cfg.endpoint,
            replay_endpoint=self.cfg.replay_endpoint,
            topic=self.cfg.topic or None,
        )

    def publish(self, events: Sequence[BlockStored | BlockRemoved | AllBlocksCleared]) -> int:
        """Send one batch of ``events`` now; returns its sequence number."""
        seq = self.seq
        self.seq += 1
        payload = encode_batch(KVEventBatch(ts=time.time(), events=list(events)))
        self._buffer.append((seq, payload))
        if self._pub is not None:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        return seq

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                continue  # SGLang ignores malformed requests too
            client, _, start = frames
            try:
                first = seq_of(start)
            except ValueError:
                continue
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
