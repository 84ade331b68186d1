"""The HTTP clients btbctl makes, all of them blind to proxy settings.

Every request btbctl sends goes to an endpoint of its own fleet: the gateway's control API, workers, node agents,
SGLang servers, on loopback or fleet-internal addresses. None may go through ``HTTP_PROXY``/``HTTPS_PROXY``/
``ALL_PROXY`` (either case): a proxy cannot reach 127.0.0.1 or a private fleet address, so a user's ``http_proxy``
would fail ``btbctl up``'s readiness checks (often set without a ``NO_PROXY`` entry for loopback, and fleet addresses
are arbitrary), and it would see the bearer tokens. ``.netrc`` is not read either.

* :func:`client_session`: an :class:`aiohttp.ClientSession` with ``trust_env=False`` (the gateway's upstream
  session, the control-API client, ``bench``).
* :func:`urlopen`: urllib's ``urlopen`` through an opener with no proxy handler (the launcher's readiness probes).

Every client in ``btbctl`` is built here; ``tests/test_no_proxy.py`` checks that no other module builds one.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import aiohttp

#: urllib without proxies: an empty :class:`~urllib.request.ProxyHandler` replaces the default one, which reads
#: the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def client_session(**kwargs: Any) -> aiohttp.ClientSession:
    """An :class:`aiohttp.ClientSession` that ignores proxy variables and ``.netrc`` (``kwargs`` as for the
    class, except ``trust_env``, which is always False)."""
    if "trust_env" in kwargs:
        raise TypeError("client_session() never trusts the environment: drop trust_env")
    return aiohttp.ClientSession(trust_env=False, **kwargs)


def urlopen(url: str | urllib.request.Request, timeout: float) -> Any:
    """``urllib.request.urlopen(url, timeout=timeout)`` without proxies (the response, a context manager)."""
    return _OPENER.open(url, timeout=timeout)


__all__ = ["client_session", "urlopen"]
