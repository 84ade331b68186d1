"""Authorization of KV copies: per-copy tokens, the challenge-response that proves one, and a target's table of the
copies it expects.

Only a copy the gateway authorized is received. For each copy the gateway mints a random token
(:func:`new_token`) and hands it to both ends over their bearer-token control APIs: to the target with the copy id
and the chain (``POST /btb/expect``, stored here as an :class:`Expected`), to the source with the push. The token
never travels on the transfer connection; the sender proves it knows it:

The handshake is the shared one of :mod:`btbctl.engine.replication.wire` (mutual HMAC challenge-response), with the
token as key, :data:`COPY_AUTH_LABEL` as label and ``bind = (copy_id, chain digest, blocks, block_bytes)``:

1. sender -> target ``hello``: ``{"copy_id", "blocks", "block_bytes", "nonce": n_s}`` (:meth:`CopyAuth.hello`);
2. target -> sender: the challenge with its nonce ``n_t``, or a refusal (copy not expected, expired, already
   received, another block count or size) -- nothing is reserved yet;
3. sender -> target: its proof ``HMAC(token, label | "client" | n_t | n_s | bind)`` (:meth:`CopyAuth.proof`),
   checked in constant time (:meth:`Expectations.verify`); a wrong proof is refused and leaves the expectation
   usable by the real sender;
4. target -> sender: its proof ``HMAC(token, label | "server" | n_s | n_t | bind)`` (:meth:`Expectations.answer`;
   the sender checks it, so a target that does not know the token is not believed either). Only now does the
   target claim the expectation (once: a second connection with the same copy id is refused without touching the
   first), reserve room and count the blocks as arriving.

The chain digest (:func:`chain_digest`) binds the proof to exactly the chain and block count the gateway authorized;
the target receives each block against the authorized chain. The node agents' fleet-secret handshake
(:mod:`btbctl.engine.agent.peer`) is the same handshake under another label and key.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from btbctl.engine.replication.transport import TransferError, check_copy_id
from btbctl.engine.replication.wire import (
    CLIENT,
    SERVER,
    ClientHandshake,
    HandshakeError,
    check_hex,
    check_nonce,
    mac,
    macs_equal,
    new_nonce,
    proof_mac,
)
from btbctl.sglang_l3.frames import MAX_COPY_PAGES

#: Label mixed into every copy MAC (a version bump changes every MAC).
COPY_AUTH_LABEL = b"btbctl-copy-auth-v2"
#: Version of the copy handshake (the ``v`` of its hello).
COPY_AUTH_VERSION = 3
#: Default time an expectation waits for its sender, seconds (the source connects as soon as it gets the push).
DEFAULT_EXPECT_TTL_S = 60.0
#: Longest allowed expectation lifetime, seconds.
MAX_EXPECT_TTL_S = 3600.0
#: Most copies a target expects at once (each costs its chain, at most a few MB for the longest chains).
MAX_EXPECTED = 4096
#: A claimed copy id is remembered this long after its expiry so it cannot be replayed, seconds.
REPLAY_WINDOW_S = 600.0


_HASH = re.compile(r"^[0-9a-f]{1,64}\Z")


class AuthError(HandshakeError):
    """A copy that is not authorized (unknown, expired, used, wrong proof) or a malformed authorization.
    ``status`` is the HTTP status a control API answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time comparison)."""
    return (
        header is not None
        and header.startswith("Bearer ")
        and hmac.compare_digest(header[7:].strip().encode(), token.encode())
    )


def new_token() -> str:
    """A fresh per-copy token (256 random bits, hex)."""
    return secrets.token_hex(32)


def check_token(token: object) -> str:
    """A token must be 32..128 lowercase hex digits. Raises :class:`AuthError`."""
    try:
        return check_hex(token, "token")
    except HandshakeError as e:
        raise AuthError(str(e)) from None


def chain_digest(chain: Sequence[str]) -> str:
    """SHA-256 (hex) of the chain's block hashes, newline-separated."""
    return hashlib.sha256("\n".join(chain).encode("ascii", "replace")).hexdigest()


def copy_bind(copy_id: str, digest: str, blocks: int, block_bytes: int) -> tuple[str, ...]:
    """What both proofs of a copy's handshake are bound to."""
    return (copy_id, digest, str(blocks), str(block_bytes))


class CopyAuth:
    """The sender's side of one copy's handshake: the hello, the proof for the target's nonce, the check of the
    target's answer. The token stays in this object; nothing derived from it but MACs goes on the wire."""

    def __init__(self, token: str, copy_id: str, chain: Sequence[str], block_bytes: int) -> None:
        self.token = check_token(token)
        self.copy_id = copy_id
        self.blocks = len(chain)
        self.block_bytes = block_bytes
        self.digest = chain_digest(chain)
        self.handshake = ClientHandshake(COPY_AUTH_LABEL, COPY_AUTH_VERSION)
        self.nonce = self.handshake.nonce
        self.bind = copy_bind(copy_id, self.digest, self.blocks, block_bytes)

    @classmethod
    def for_copy(cls, token: str | None, copy_id: str, chain: Sequence[str], block_bytes: int) -> CopyAuth:
        """A sender's handshake for copy ``copy_id``. Raises :class:`TransferError` without a token (every copy
        must be authorized by the gateway) or with a malformed one."""
        if token is None:
            raise TransferError(f"copy {copy_id}: no token (every copy must be authorized by the gateway)")
        try:
            return cls(token, copy_id, chain, block_bytes)
        except AuthError as e:
            raise TransferError(f"copy {copy_id}: {e}") from None

    def hello(self) -> dict[str, object]:
        """Step 1: what the sender announces (no secret in it)."""
        return self.handshake.hello(copy_id=self.copy_id, blocks=self.blocks, block_bytes=self.block_bytes)

    def proof(self, target_nonce: object) -> str:
        """Step 3: the MAC answering the target's challenge. Raises :class:`AuthError` for a malformed nonce."""
        try:
            return self.handshake.proof(target_nonce, self.token.encode(), self.bind)
        except HandshakeError as e:
            raise AuthError(str(e)) from None

    def challenge(self, msg: dict) -> dict:
        """Step 3 on the wire: the ``auth`` frame answering a ``challenge`` frame. Raises :class:`HandshakeError`."""
        return self.handshake.answer(msg, self.token.encode(), self.bind)

    def target_ok(self, target_nonce: str, answer: object) -> bool:
        """Step 4: whether the target's MAC (for ``target_nonce``, the one :meth:`proof` answered) shows it knows
        the token."""
        return self.handshake.server_ok(answer)


@dataclass
class Expected:
    """One copy a target expects: its id, token, chain (and its digest), expiry (clock seconds), and whether an
    authenticated sender claimed it."""

    copy_id: str
    token: str
    chain: tuple[str, ...]
    digest: str
    expires: float
    claimed: bool = False


@dataclass(frozen=True)
class Hello:
    """A parsed step-1 hello."""

    copy_id: str
    blocks: int
    block_bytes: int
    nonce: str


def parse_hello(obj: object) -> Hello:
    """Validate a step-1 hello. Raises :class:`AuthError` naming the bad field."""
    if not isinstance(obj, dict):
        raise AuthError("hello must be a JSON object")
    try:
        copy_id = check_copy_id(obj.get("copy_id"))
    except TransferError as e:
        raise AuthError(str(e)) from None
    blocks, block_bytes = obj.get("blocks"), obj.get("block_bytes")
    if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
        raise AuthError("hello.blocks must be a positive integer")
    if not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes < 1:
        raise AuthError("hello.block_bytes must be a positive integer")
    try:
        return Hello(copy_id, blocks, block_bytes, check_nonce(obj.get("nonce")))
    except HandshakeError as e:
        raise AuthError(str(e)) from None


class Expectations:
    """A target's table of expected copies (what ``/btb/expect`` fills).

    Args:
        clock: monotonic seconds (injectable for tests).
        max_expected: most expectations held at once.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_expected: int = MAX_EXPECTED) -> None:
        self.clock = clock
        self.max_expected = max_expected
        self._by_id: dict[str, Expected] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def _prune(self, now: float) -> None:
        # unclaimed ones go at their expiry; claimed ones (kept so that their id cannot be replayed) a window later
        for cid in [
            c
            for c, e in self._by_id.items()
            if e.expires < now and (not e.claimed or e.expires + REPLAY_WINDOW_S < now)
        ]:
            del self._by_id[cid]

    def expect(
        self, copy_id: str, chain: Sequence[str], token: object, ttl_s: float = DEFAULT_EXPECT_TTL_S
    ) -> Expected:
        """Allow one inbound copy ``copy_id`` of exactly ``chain`` within ``ttl_s`` seconds, from a sender that
        proves it knows ``token``. Raises :class:`AuthError` (409 for an id already expected or used, 429 when full,
        400 for malformed values)."""
        tok = check_token(token)
        if not chain or len(chain) > MAX_COPY_PAGES:
            raise AuthError(f"chain must have 1..{MAX_COPY_PAGES} blocks")
        if not all(isinstance(h, str) and _HASH.match(h) for h in chain):
            raise AuthError("chain entries must be 1..64 lowercase hex digits")
        if not (isinstance(ttl_s, (int, float)) and not isinstance(ttl_s, bool) and 0 < ttl_s <= MAX_EXPECT_TTL_S):
            raise AuthError(f"ttl_s must be a number of seconds in (0, {MAX_EXPECT_TTL_S:g}]")
        now = self.clock()
        self._prune(now)
        if copy_id in self._by_id:
            raise AuthError(f"copy {copy_id} is already expected or was received", 409)
        if len(self._by_id) >= self.max_expected:
            raise AuthError(f"{len(self._by_id)} copies are expected already (limit {self.max_expected})", 429)
        exp = Expected(copy_id, tok, tuple(chain), chain_digest(chain), now + float(ttl_s))
        self._by_id[copy_id] = exp
        return exp

    def lookup(self, hello: Hello, block_bytes: int) -> Expected:
        """Step 2: the expectation a hello names. Raises :class:`AuthError` when the copy is not expected, expired,
        already claimed, or announces another block count or size than authorized."""
        exp = self._by_id.get(hello.copy_id)
        if exp is None:
            raise AuthError(f"copy {hello.copy_id} is not expected here (not authorized by the gateway)", 403)
        if exp.claimed:
            raise AuthError(f"copy {hello.copy_id} is already arriving or was received", 409)
        if exp.expires < self.clock():
            raise AuthError(f"copy {hello.copy_id} expired before it arrived", 403)
        if hello.blocks != len(exp.chain):
            raise AuthError(f"copy {hello.copy_id} announces {hello.blocks} blocks; {len(exp.chain)} were authorized")
        if hello.block_bytes != block_bytes:
            raise AuthError(
                f"block size {hello.block_bytes} differs from this receiver's {block_bytes} bytes "
                "(model, page size and kv-bytes-scale must match)"
            )
        return exp

    def verify(self, exp: Expected, hello: Hello, target_nonce: str, proof: object) -> None:
        """Step 3: check the sender's MAC (constant time). Raises :class:`AuthError` on a wrong proof."""
        bind = copy_bind(exp.copy_id, exp.digest, len(exp.chain), hello.block_bytes)
        want = proof_mac(exp.token.encode(), COPY_AUTH_LABEL, CLIENT, target_nonce, hello.nonce, bind)
        if not macs_equal(proof, want):
            raise AuthError(f"copy {exp.copy_id}: authentication failed (wrong proof of the copy's token)", 403)

    def claim(self, exp: Expected) -> None:
        """After authentication: take the expectation (once). Raises :class:`AuthError` when another connection
        claimed it first or it expired meanwhile."""
        if exp.claimed or self._by_id.get(exp.copy_id) is not exp:
            raise AuthError(f"copy {exp.copy_id} is already arriving or was received", 409)
        if exp.expires < self.clock():
            raise AuthError(f"copy {exp.copy_id} expired before it arrived", 403)
        exp.claimed = True

    def answer(self, exp: Expected, hello: Hello, target_nonce: str) -> str:
        """Step 4: the target's MAC."""
        bind = copy_bind(exp.copy_id, exp.digest, len(exp.chain), hello.block_bytes)
        return proof_mac(exp.token.encode(), COPY_AUTH_LABEL, SERVER, hello.nonce, target_nonce, bind)


__all__ = [
    "COPY_AUTH_LABEL",
    "COPY_AUTH_VERSION",
    "DEFAULT_EXPECT_TTL_S",
    "MAX_EXPECTED",
    "MAX_EXPECT_TTL_S",
    "AuthError",
    "CopyAuth",
    "Expectations",
    "Expected",
    "Hello",
    "chain_digest",
    "copy_bind",
    "check_nonce",
    "check_token",
    "mac",
    "macs_equal",
    "new_nonce",
    "new_token",
    "parse_hello",
]
