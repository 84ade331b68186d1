"""Node agents announcing themselves to the gateway (``POST /control/agents``): the wire shape, the signature, the
checks. One definition, used by the agent that sends and the gateway that receives.

An announcement is a JSON object (:class:`Announcement`)::

    {"agent": "node-a", "node": "node-a", "peer_addr": "10.0.0.5:7500", "control_url": "http://10.0.0.5:7501",
     "workers": ["http://w0:30000", ...], "ttl_s": 15.0, "sent_at": 1733270400.0, "instance": "9f3c0a1b2c3d4e5f"}

``workers``: the URLs of the workers whose HiCache L3 tier is this agent (the worker URLs the gateway knows);
``ttl_s``: how long the gateway keeps the announcement without a new one, seconds; ``sent_at``: the sender's Unix
time; ``instance`` (optional): the agent process's incarnation (:data:`MAX_INSTANCE_CHARS` characters at most, new
at every start; ``GET /v1/info`` names it too): a new one under the same name means the agent restarted with an
empty page store.

Signature: header :data:`SIGNATURE_HEADER` = ``HMAC(register_key(N), "btbctl-agent-register-v1" | body)`` (hex) over
the exact body bytes, where ``register_key(N) = HMAC(node_key(N), "btbctl-agent-register-v1")`` and ``node_key(N)``
is :func:`~btbctl.engine.replication.credentials.node_key` of the announcing agent ``N``: the agent proves it holds
its node's key, which only the fleet secret derives (the gateway holds it: ``agent_secret_file``), and can speak only
as itself. The gateway refuses a body whose ``sent_at`` is more than :data:`MAX_CLOCK_SKEW_S` from its own clock, so
a recorded announcement cannot be replayed later to bring a dropped agent back.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from urllib.parse import urlsplit

from btbctl.engine.replication.auth import mac, macs_equal
from btbctl.engine.replication.credentials import MAX_AGENT_ID_CHARS, node_key

#: Label of the registration key and of every announcement's MAC (a version bump changes both).
REGISTER_LABEL = b"btbctl-agent-register-v1"
#: Header carrying an announcement's signature (hex).
SIGNATURE_HEADER = "X-BTB-Agent-Signature"
#: Path of the gateway's control API that takes announcements.
REGISTER_PATH = "/control/agents"
#: Largest |sent_at - gateway clock| accepted, seconds (a product choice: NTP keeps nodes within milliseconds).
MAX_CLOCK_SKEW_S = 60.0
#: Most worker URLs in one announcement (a node runs a handful of workers).
MAX_ANNOUNCED_WORKERS = 256
#: Bounds of ``ttl_s``, seconds.
MIN_TTL_S, MAX_TTL_S = 0.1, 3600.0
#: Keys of an announcement, in the order they are written.
FIELDS = ("agent", "node", "peer_addr", "control_url", "workers", "ttl_s", "sent_at", "instance")
#: Longest ``instance``, characters (an agent sends 16 hex digits).
MAX_INSTANCE_CHARS = 64


class AnnouncementError(ValueError):
    """An announcement that is malformed or not signed by its agent (one line; ``status`` is the HTTP answer)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Announcement:
    """One agent's announcement (see the module docstring for the fields)."""

    agent: str
    node: str
    peer_addr: str
    control_url: str
    workers: tuple[str, ...]
    ttl_s: float
    sent_at: float
    instance: str | None = None

    def body(self) -> bytes:
        """The JSON body that is signed and sent (``instance`` only when set)."""
        d = {k: getattr(self, k) for k in FIELDS if k != "instance" or self.instance is not None}
        d["workers"] = list(self.workers)
        return json.dumps(d, separators=(",", ":")).encode()


def register_key(agent_node_key: bytes) -> bytes:
    """The key agent announcements are signed with (32 bytes), from the agent's node key."""
    return bytes.fromhex(mac(agent_node_key, REGISTER_LABEL))


def sign(agent_node_key: bytes, body: bytes) -> str:
    """The :data:`SIGNATURE_HEADER` value of ``body`` sent by the agent whose node key is ``agent_node_key``."""
    return mac(register_key(agent_node_key), REGISTER_LABEL, body)


def _url(v: object, what: str) -> str:
    if not isinstance(v, str) or len(v) > 2048:
        raise AnnouncementError(f"{what} must be a URL string (http://host:port)")
    p = urlsplit(v)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise AnnouncementError(f"{what} {v!r} must look like http://host:port")
    return v.rstrip("/")


def verify(body: bytes, signature: str | None, fleet_secret: bytes, now_s: float) -> Announcement:
    """The announcement in ``body`` once its signature (by the agent it names) and its freshness check out.

    Args:
        body: the request body, as received.
        signature: the :data:`SIGNATURE_HEADER` value (None: missing).
        fleet_secret: the fleet secret (derives every agent's node key).
        now_s: the receiver's Unix time.

    Raises:
        AnnouncementError: 400 malformed (names the field and what is valid); 401 missing or wrong signature;
            403 ``sent_at`` beyond :data:`MAX_CLOCK_SKEW_S`.
    """
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise AnnouncementError(f"the announcement is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise AnnouncementError("the announcement must be a JSON object")
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise AnnouncementError(f"unknown key {extra[0]!r}; valid: {', '.join(FIELDS)}")
    agent = obj.get("agent")
    if not isinstance(agent, str) or not 1 <= len(agent) <= MAX_AGENT_ID_CHARS:
        raise AnnouncementError(f"agent must be a string of 1..{MAX_AGENT_ID_CHARS} characters")
    if signature is None or not macs_equal(signature.strip(), sign(node_key(fleet_secret, agent), body)):
        raise AnnouncementError(
            f"missing or wrong {SIGNATURE_HEADER} for agent {agent!r} (signed with its node key)", 401
        )
    node = obj.get("node", agent)
    if not isinstance(node, str) or not 1 <= len(node) <= 253:
        raise AnnouncementError("node must be a string of 1..253 characters")
    peer = obj.get("peer_addr")
    host, _, port = peer.rpartition(":") if isinstance(peer, str) else ("", "", "")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535 or host in ("0.0.0.0", "[::]", "::"):
        raise AnnouncementError("peer_addr must be HOST:PORT other agents can reach (port 1..65535, not 0.0.0.0)")
    control_url = _url(obj.get("control_url"), "control_url")
    workers = obj.get("workers")
    if not isinstance(workers, list) or len(workers) > MAX_ANNOUNCED_WORKERS:
        raise AnnouncementError(f"workers must be a list of at most {MAX_ANNOUNCED_WORKERS} worker URLs")
    urls = tuple(dict.fromkeys(_url(u, "a worker") for u in workers))
    ttl = obj.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not MIN_TTL_S <= ttl <= MAX_TTL_S:
        raise AnnouncementError(f"ttl_s must be a number of seconds in {MIN_TTL_S:g}..{MAX_TTL_S:g}")
    sent = obj.get("sent_at")
    if isinstance(sent, bool) or not isinstance(sent, (int, float)) or not math.isfinite(sent):
        raise AnnouncementError("sent_at must be the sender's Unix time, seconds")
    if abs(sent - now_s) > MAX_CLOCK_SKEW_S:
        raise AnnouncementError(
            f"sent_at is {sent - now_s:+.0f} s from the gateway's clock (at most {MAX_CLOCK_SKEW_S:g} s): "
            "a replay, or a node clock out of sync",
            403,
        )
    instance = obj.get("instance")
    if instance is not None and (not isinstance(instance, str) or not 1 <= len(instance) <= MAX_INSTANCE_CHARS):
        raise AnnouncementError(f"instance must be a string of 1..{MAX_INSTANCE_CHARS} characters")
    return Announcement(agent, node, str(peer), control_url, urls, float(ttl), float(sent), instance)


__all__ = [
    "Announcement",
    "AnnouncementError",
    "FIELDS",
    "MAX_INSTANCE_CHARS",
    "MAX_ANNOUNCED_WORKERS",
    "MAX_CLOCK_SKEW_S",
    "REGISTER_LABEL",
    "REGISTER_PATH",
    "SIGNATURE_HEADER",
    "register_key",
    "sign",
    "verify",
]
