"""KV-cache replication: moving a prefix's blocks from the worker that holds them to other workers.

Pieces:

* :mod:`~btbctl.engine.replication.transport`: the :class:`~btbctl.engine.replication.transport.Transport` protocol a
  source uses to push blocks, the receiving side's :class:`~btbctl.engine.replication.transport.CopySink`, the
  errors, and the registry of transports by name (``tcp``, ``rdma``).
* :mod:`~btbctl.engine.replication.wire`: the one copy wire the TCP push and the node agents' copies share: frames
  (defined in :mod:`btbctl.sglang_l3.frames`), the mutual HMAC handshake, the xxh3_64 page check, and the
  :class:`~btbctl.engine.replication.wire.PageChannel` seam another page transport plugs in at.
* :mod:`~btbctl.engine.replication.tcp`: the always-available TCP transport (sender and receiver) on that wire;
  every block is checked with xxh3_64 on arrival.
* :mod:`~btbctl.engine.replication.credentials`: the node agents' per-node keys and control tokens, derived from the
  fleet secret.
* :mod:`~btbctl.engine.replication.rdma`: the RDMA transport (pyverbs, imported lazily); raises
  ``BtbctlError("RDMA unavailable: <reason>")`` where no device exists.

A target serves copied blocks as cached only after *all* blocks of the copy arrived and verified; a copy that
breaks off part-way leaves nothing behind.
"""

from btbctl.engine.errors import ConfigError
from btbctl.engine.replication.rdma import RdmaTransport
from btbctl.engine.replication.tcp import TcpTransport
from btbctl.engine.replication.transport import (
    CopyRefused,
    CopySink,
    TransferError,
    Transport,
    parse_address,
)

#: Transport classes by name.
TRANSPORTS: dict[str, type] = {"tcp": TcpTransport, "rdma": RdmaTransport}


def make_transport(name: str, **kwargs) -> Transport:
    """A transport by registry name. Raises :class:`ConfigError` for an unknown name and
    ``BtbctlError("RDMA unavailable: ...")`` for ``rdma`` on a host without RDMA."""
    cls = TRANSPORTS.get(name)
    if cls is None:
        raise ConfigError("transport", f"unknown transport {name!r}; valid: {', '.join(TRANSPORTS)}")
    return cls(**kwargs)


__all__ = [
    "TRANSPORTS",
    "CopyRefused",
    "CopySink",
    "RdmaTransport",
    "TcpTransport",
    "Transport",
    "TransferError",
    "make_transport",
    "parse_address",
]
