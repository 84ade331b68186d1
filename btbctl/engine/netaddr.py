"""Address checks shared by every listener and client: which hosts reach only this machine."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed or not, or ``localhost``) reaches only this machine
    (127.0.0.0/8, ::1). A name other than ``localhost`` is not assumed to be local."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["is_loopback"]
