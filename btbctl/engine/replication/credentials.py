"""Per-node credentials of the agents' copy port, derived from the fleet secret.

Each agent's control API has its own bearer token, ``control_token(N) = HMAC(fleet_secret, "btbctl-agent-control-v1"
| N)`` (:func:`control_token`), so a node's token drives only its own agent.

Keys (HMAC-SHA256, 32 bytes each; the fleet secret never leaves the machine that launches the fleet, except where
the operator chooses to hand it to every node, as the Kubernetes render does)::

    node_key(N)     = HMAC(fleet_secret, "btbctl-node-key-v1" | N)
    link_key(S, T)  = HMAC(node_key(T), "btbctl-link-key-v1" | S)      # sender S speaking to target T

A target ``T`` holds its own ``node_key(T)`` and derives ``link_key(S, T)`` for any sender id ``S`` it is shown; a
sender ``S`` holds ``link_key(S, T)`` for each target ``T`` of its fleet (written by the launcher, which knows the
fleet's agents). Both ends of a connection MAC the handshake with the link key, so a node's files let it speak
only as itself: node C holds ``node_key(C)`` and ``link_key(C, *)``, from which neither ``link_key(A, B)`` nor
``node_key(B)`` follow.

A credentials file is either the fleet secret itself (every key derivable: what a node whose set of peers is not
known at launch gets) or a JSON object :func:`node_credentials_text` writes::

    {"v": 1, "agent_id": "agent-h1", "node_key": "<hex>", "links": {"agent-h2": "<hex>", ...}}
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from btbctl.engine.replication.auth import mac

NODE_KEY_LABEL = b"btbctl-node-key-v1"
LINK_KEY_LABEL = b"btbctl-link-key-v1"
CONTROL_TOKEN_LABEL = b"btbctl-agent-control-v1"
#: Format version of a node credentials file.
CREDENTIALS_VERSION = 1
#: Longest agent id, characters (the handshake refuses longer ones).
MAX_AGENT_ID_CHARS = 128


class CredentialsError(ValueError):
    """A credentials file that cannot be used (one line naming what is wrong)."""


def node_key(fleet_secret: bytes, agent_id: str) -> bytes:
    """The node key of ``agent_id`` (32 bytes)."""
    return bytes.fromhex(mac(fleet_secret, NODE_KEY_LABEL, agent_id.encode()))


def control_token(fleet_secret: bytes, agent_id: str) -> str:
    """The bearer token of agent ``agent_id``'s control API (64 hex characters): the gateway, which holds the fleet
    secret, derives every agent's; an agent's files hold only its own."""
    return mac(fleet_secret, CONTROL_TOKEN_LABEL, agent_id.encode())


def link_key(target_node_key: bytes, sender_id: str) -> bytes:
    """The key sender ``sender_id`` and the target whose node key is ``target_node_key`` share (32 bytes)."""
    return bytes.fromhex(mac(target_node_key, LINK_KEY_LABEL, sender_id.encode()))


@dataclass
class Credentials:
    """What one agent knows. ``fleet_secret`` set: every key is derivable (fleet-secret mode); else ``node_key`` and
    the ``links`` (target id -> link key) of a node credentials file."""

    agent_id: str
    node_key: bytes
    links: dict[str, bytes] = field(default_factory=dict, repr=False)
    fleet_secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_fleet_secret(cls, secret: bytes, agent_id: str) -> Credentials:
        return cls(agent_id, node_key(secret, agent_id), fleet_secret=secret)

    def as_target(self, sender_id: str) -> bytes:
        """The key a connecting ``sender_id`` must prove."""
        return link_key(self.node_key, sender_id)

    def as_sender(self, target_id: str) -> bytes | None:
        """The key to speak to ``target_id`` with (None: this node has none for it)."""
        if self.fleet_secret is not None:
            return link_key(node_key(self.fleet_secret, target_id), self.agent_id)
        return self.links.get(target_id)


def node_credentials_text(fleet_secret: bytes, agent_id: str, peers: Iterable[str]) -> str:
    """The node credentials file of ``agent_id`` in a fleet of agents ``peers`` (JSON, one line)."""
    links = {p: link_key(node_key(fleet_secret, p), agent_id).hex() for p in sorted(set(peers)) if p != agent_id}
    return json.dumps(
        {
            "v": CREDENTIALS_VERSION,
            "agent_id": agent_id,
            "node_key": node_key(fleet_secret, agent_id).hex(),
            "links": links,
        },
        separators=(",", ":"),
    )


def parse_credentials(data: bytes, agent_id: str | None, where: str, default_id: str | None = None) -> Credentials:
    """The credentials in ``data`` (a file's contents: the fleet secret or a node credentials object). ``agent_id``:
    the id the agent was given (None: a credentials object names it; with the fleet secret, ``default_id`` stands
    in, and without one it is an error).

    Raises:
        CredentialsError: malformed object, or an ``agent_id`` other than the object's (message names ``where``).
    """
    if not data.lstrip().startswith(b"{"):
        agent_id = agent_id or default_id
        if agent_id is None:
            raise CredentialsError(f"{where}: a fleet secret needs --agent-id (peers derive this node's key from it)")
        return Credentials.from_fleet_secret(data, agent_id)
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.get("v") != CREDENTIALS_VERSION:
            raise ValueError(f"not a node credentials object of version {CREDENTIALS_VERSION}")
        aid, nk, links = obj.get("agent_id"), bytes.fromhex(obj["node_key"]), obj.get("links", {})
        if not isinstance(aid, str) or not 1 <= len(aid) <= MAX_AGENT_ID_CHARS or len(nk) != 32:
            raise ValueError("agent_id must be 1..128 characters and node_key 32 bytes (64 hex characters)")
        if not isinstance(links, dict):
            raise ValueError("links must map agent ids to keys")
        parsed = {str(k): bytes.fromhex(v) for k, v in links.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CredentialsError(f"{where}: bad node credentials: {e}") from None
    if agent_id is not None and agent_id != aid:
        raise CredentialsError(f"{where}: holds the credentials of {aid!r}, not of --agent-id {agent_id!r}")
    return Credentials(aid, nk, parsed)


__all__ = [
    "CONTROL_TOKEN_LABEL",
    "CREDENTIALS_VERSION",
    "Credentials",
    "CredentialsError",
    "LINK_KEY_LABEL",
    "MAX_AGENT_ID_CHARS",
    "NODE_KEY_LABEL",
    "link_key",
    "control_token",
    "node_credentials_text",
    "node_key",
    "parse_credentials",
]
