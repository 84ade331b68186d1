"""Address checks shared by every listener and client: which hosts reach only this machine."""

from __future__ import annotations

import functools
import ipaddress
import re

#: DNS names (RFC 1123 labels) or IP literals; nothing a shell or ssh option parser could read as anything else.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}\Z){_LABEL}(?:\.{_LABEL})*\.?\Z")


@functools.lru_cache(maxsize=1024)  # asked on every request of a listener, of a handful of distinct names
def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP literal, bracketed or not, or ``localhost``) reaches only this machine
    (127.0.0.0/8, ::1). A name other than ``localhost`` is not assumed to be local."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_address(value: str) -> bool:
    """Whether ``value`` is an IP literal (v4 or v6, optionally in brackets) or ``localhost``."""
    if value in ("localhost", ""):
        return True
    try:
        ipaddress.ip_address(value.strip("[]"))
        return True
    except ValueError:
        return False


def check_hostname(value: str) -> str:
    """Return ``value`` if it is an IP literal or a DNS host name; raise ``ValueError`` otherwise (so that an
    address can never carry shell metacharacters or start with ``-``)."""
    if is_address(value) and value:
        return value
    if not _HOSTNAME.match(value):
        raise ValueError(f"{value!r} is not a host name or IP address (letters, digits, '-' and '.' only)")
    return value


def source_address(host: str, port: int) -> str:
    """The address this machine sends from towards ``host`` (a name or IP literal) on ``port``: what a process
    there reaches this machine at, short of a NAT in between. Learnt from the routing table (a UDP socket is
    connected, nothing is sent). Raises ``OSError`` when ``host`` does not resolve or has no route."""
    import socket

    target = host.strip("[]")
    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    infos = socket.getaddrinfo(target, port, 0 if not is_address(target) else family, socket.SOCK_DGRAM)
    af, _, _, _, addr = infos[0]
    with socket.socket(af, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal bracketed (``[fd00::1]:7500``; one given bracketed stays so), as a URL's
    authority or a copy address."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def local_url(url: str) -> str:
    """``url`` (``http://host:port``) as this machine reaches it: a wildcard bind address (``0.0.0.0``, ``::``)
    becomes the loopback address of its family; any other host stays."""
    from urllib.parse import urlsplit, urlunsplit

    p = urlsplit(url)
    host = (p.hostname or "").strip("[]")
    if host not in ("0.0.0.0", "::"):
        return url
    local = "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return urlunsplit((p.scheme, f"{local}:{p.port}" if p.port else local, p.path, p.query, p.fragment))


#: Methods a web page may send cross-origin without asking first; a write among them is refused when its
#: ``Origin`` is another site.
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def _host_of(authority: str) -> str:
    """The host of ``host[:port]`` or ``[v6]:port``, lower case, brackets removed."""
    a = authority.strip().lower()
    if a.startswith("["):
        return a[1 : a.find("]")] if "]" in a else a[1:]
    return a.rsplit(":", 1)[0] if a.count(":") == 1 else a


@functools.lru_cache(maxsize=1024)  # on every request; a pure function of a few header values
def browser_refusal(host: str | None, origin: str | None, method: str, bind_host: str) -> str | None:
    """Why an HTTP request to a listener bound to ``bind_host`` is refused, or None. ``host``, ``origin``: its
    ``Host`` and ``Origin`` headers (None when absent).

    * ``host``: on a loopback bind, a ``Host`` that is neither a loopback name or address nor ``bind_host`` (a web
      page that renamed itself to 127.0.0.1 by DNS rebinding);
    * ``origin``: a write whose ``Origin`` is not the site it is sent to (a cross-site form or ``text/plain``
      POST). Clients outside a browser send no ``Origin``.
    """
    if host and is_loopback(bind_host):
        h = _host_of(host)
        if not (is_loopback(h) or h == _host_of(bind_host)):
            return "host"
    if origin is not None and method.upper() not in _SAFE_METHODS:
        _, sep, rest = origin.partition("://")
        if not sep or not host or rest.rstrip("/").lower() != host.strip().lower():
            return "origin"
    return None


__all__ = ["browser_refusal", "hostport", "is_loopback"]
