"""The transport protocol a source worker pushes KV blocks through, and the receiving side's sink.

A *copy* moves the blocks of one prefix chain (a list of block hashes, each identifying its whole prefix, see
:mod:`btbctl.engine.hashing`) from a source worker to one target worker, under a caller-chosen ``copy_id``.

Sender side (:class:`Transport`)::

    await transport.send(target="127.0.0.1:41000", copy_id="c1", chain=[h0, h1, ...],
                         blocks=[(h0, b0), (h1, b1), ...], on_progress=lambda sent, total: ...)

``send`` returns only when the target acknowledged that every block arrived, verified and was committed (the
target now serves the chain as cached). Any other outcome raises :class:`TransferError` whose message says what
went wrong (refused by the target, a block that failed its check, connection lost after k of n blocks, timeout).

Receiver side (:class:`CopySink`): a transport's receiver calls ``begin`` when a copy announces itself,
``check_block`` on each block as it arrives, ``commit`` once all arrived, and ``fail`` when a copy breaks off (its
partial data is dropped; nothing becomes warm).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from btbctl.engine.errors import BtbctlError

#: Blocks handed to :meth:`Transport.send`: ``(block hash, block bytes)`` in chain order.
Blocks = Iterable[tuple[str, bytes]] | AsyncIterator[tuple[str, bytes]]

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*\Z")


class TransferError(BtbctlError):
    """A copy failed. ``str()`` is one line naming the target and the reason; ``block`` is the 0-based index of
    the offending block when one block is to blame (else None)."""

    def __init__(self, message: str, block: int | None = None) -> None:
        self.block = block
        super().__init__(message)


class CopyRefused(Exception):
    """Raised by a :class:`CopySink` to refuse a copy or a block; the message goes back to the sender."""

    def __init__(self, message: str, block: int | None = None) -> None:
        self.block = block
        super().__init__(message)


class Transport(Protocol):
    """Pushes a prefix's blocks to a target worker.

    Attributes:
        name: registry name (``tcp``, ``rdma``).
    """

    name: str

    async def send(
        self,
        target: str,
        copy_id: str,
        chain: list[str],
        blocks: Blocks,
        on_progress: Callable[[int, int], None],
        *,
        block_bytes: int | None = None,
        on_accept: Callable[[], None] | None = None,
    ) -> None:
        """Send every block of ``chain`` to ``target`` (``host:port`` of the target's transfer endpoint).

        Args:
            target: ``host:port`` (see :func:`parse_address`).
            copy_id: the caller's id for this copy (at most 128 printable ASCII characters).
            chain: block hashes, in order.
            blocks: ``(hash, bytes)`` pairs in chain order, one per chain entry, all the same length. An async
                iterator may wait between blocks (a source still computing the prefix yields each block once it
                is computed).
            on_progress: called with ``(bytes_sent, bytes_total)`` as blocks go out.
            block_bytes: size of every block, bytes, when known up front: a transport that can announce the copy
                before the first block exists does so (TCP); None = learnt from the first block.
            on_accept: called once when the target has accepted the copy (it then counts the blocks as arriving).

        Raises:
            TransferError: refused, integrity failure reported by the target, connection lost, timeout.
        """


class CopySink(Protocol):
    """What a transport's receiver delivers into (the emulated worker implements it).

    Attributes:
        block_bytes: the only block size this sink accepts, bytes.
        max_blocks: the most blocks one copy may carry (bounds the memory a copy in progress can take).
    """

    block_bytes: int
    max_blocks: int

    def begin(self, copy_id: str, chain: Sequence[str], peer: str) -> None:
        """A copy of ``chain`` is starting. Raise :class:`CopyRefused` to refuse it (no room, incompatible)."""

    def check_block(self, index: int, block_hash: str, data: bytes) -> None:
        """Content check of one block (after the wire digest matched). Raise :class:`CopyRefused` on mismatch."""

    def progress(self, copy_id: str, blocks_verified: int, bytes_received: int) -> None:
        """Progress of an inbound copy."""

    def commit(self, copy_id: str, chain: Sequence[str], blocks: list[bytes]) -> None:
        """All blocks arrived and verified: make them resident. Raise :class:`CopyRefused` if that fails."""

    def fail(self, copy_id: str, error: str) -> None:
        """The copy broke off or was refused; its partial data is already dropped."""


def parse_address(addr: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6) into ``(host, port)``.

    The host must be an IP literal or a DNS hostname (letters, digits, dots, hyphens); the port 1..65535. Nothing
    else is accepted (no URLs, no spaces), and the address is only ever handed to a socket connect.

    Raises:
        TransferError: a malformed address.
    """
    if not isinstance(addr, str) or not addr or len(addr) > 300:
        raise TransferError(f"bad target address {addr!r}: expected host:port")
    if addr.startswith("["):
        end = addr.find("]")
        if end < 0 or addr[end + 1 : end + 2] != ":":
            raise TransferError(f"bad target address {addr!r}: expected [ipv6]:port")
        host, port_s = addr[1:end], addr[end + 2 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TransferError(f"bad target address {addr!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_s = addr.rpartition(":")
        if not sep or not host:
            raise TransferError(f"bad target address {addr!r}: expected host:port")
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            if not _HOSTNAME.match(host):
                raise TransferError(f"bad target address {addr!r}: {host!r} is not an IP address or hostname") from None
    if not port_s.isdigit() or not 1 <= int(port_s) <= 65535:
        raise TransferError(f"bad target address {addr!r}: port must be 1..65535")
    return host, int(port_s)


def check_copy_id(copy_id: str) -> str:
    """Validate a copy id: 1..128 characters from ``[A-Za-z0-9._:-]``. Raises :class:`TransferError`."""
    if not isinstance(copy_id, str) or not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", copy_id):
        raise TransferError(f"bad copy id {copy_id!r}: 1..128 characters of letters, digits, '.', '_', ':', '-'")
    return copy_id


_F = TypeVar("_F", bound="FaultSpec")


class FaultSpec:
    """Base of a sender's fault plan (tests only): a frozen dataclass whose fields are the faults, ``int | None``
    (a block or page number) or ``float`` (seconds), read from ``"name=value,..."`` text or the environment
    variable :attr:`ENV`."""

    ENV: ClassVar[str] = ""

    @classmethod
    def parse(cls: type[_F], spec: str) -> _F:
        """Parse ``"corrupt_wire=3,delay_s=0.01"``. Raises ValueError naming the bad item and the valid ones."""
        kinds = {f.name: float if f.type == "float" else int for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            key, sep, val = item.partition("=")
            if not sep or key not in kinds:
                valid = ", ".join(f"{k}={'X' if t is float else 'K'}" for k, t in kinds.items())
                raise ValueError(f"bad fault item {item!r}; valid: {valid}")
            try:
                kw[key] = kinds[key](val)
            except ValueError:
                raise ValueError(f"bad fault item {item!r}: {val!r} is not a number") from None
        return cls(**kw)

    @classmethod
    def from_env(cls: type[_F]) -> _F | None:
        """The plan in :attr:`ENV`, or None when unset or empty."""
        spec = os.environ.get(cls.ENV, "").strip()
        return cls.parse(spec) if spec else None


@dataclasses.dataclass(frozen=True)
class CopyFaults(FaultSpec):
    """The faults every copy sender can inject (tests only): ``corrupt_wire=K`` (flip a byte of page K after its
    digest is computed: the receiver's digest check must catch it), ``close_after=K`` (drop the connection after K
    pages, as a dying source would), ``delay_s=X`` (sleep X seconds after each page). ``None`` injects nothing;
    each transport's plan adds its own."""

    corrupt_wire: int | None = None
    close_after: int | None = None
    delay_s: float = 0.0
