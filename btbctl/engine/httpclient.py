"""The HTTP clients btbctl makes, all of them blind to proxy settings.

Every request btbctl sends goes to an endpoint of its own fleet: the gateway's control API, workers, node agents,
SGLang servers, on loopback or fleet-internal addresses. None may go through ``HTTP_PROXY``/``HTTPS_PROXY``/
``ALL_PROXY`` (either case): a proxy cannot reach 127.0.0.1 or a private fleet address, so a user's ``http_proxy``
would fail ``btbctl up``'s readiness checks (often set without a ``NO_PROXY`` entry for loopback, and fleet addresses
are arbitrary), and it would see the bearer tokens. ``.netrc`` is not read either.

* :func:`client_session`: an :class:`aiohttp.ClientSession` with ``trust_env=False`` (the gateway's upstream
  session, ``bench``).
* :func:`http_client` and :func:`async_http_client`: an :class:`httpx.Client` or :class:`httpx.AsyncClient` with
  ``trust_env=False`` (the control-API client); :func:`request_failures` names what their requests raise and
  :func:`aiter_sse` reads a Server-Sent Events answer (httpx-sse). httpx is imported on first use: the gateway and
  the workers never need it.
* :func:`urlopen`: urllib's ``urlopen`` through an opener with no proxy handler (the launcher's readiness probes).

Every client in ``btbctl`` is built here; ``tests/test_no_proxy.py`` checks that no other module builds one.
"""

from __future__ import annotations

import urllib.request
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    import httpx
    from httpx_sse import ServerSentEvent

    #: The httpx types, for annotations in modules that may not import httpx (it would read as building a client).
    HttpClient = httpx.Client
    AsyncHttpClient = httpx.AsyncClient

#: urllib without proxies: an empty :class:`~urllib.request.ProxyHandler` replaces the default one, which reads
#: the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _never_trust_env(builder: str, kwargs: dict[str, Any]) -> None:
    if "trust_env" in kwargs:
        raise TypeError(f"{builder}() never trusts the environment: drop trust_env")


def client_session(**kwargs: Any) -> aiohttp.ClientSession:
    """An :class:`aiohttp.ClientSession` that ignores proxy variables and ``.netrc`` (``kwargs`` as for the
    class, except ``trust_env``, which is always False)."""
    _never_trust_env("client_session", kwargs)
    return aiohttp.ClientSession(trust_env=False, **kwargs)


def http_client(**kwargs: Any) -> httpx.Client:
    """An :class:`httpx.Client` that ignores proxy variables, ``.netrc`` and ``SSL_CERT_FILE`` (``kwargs`` as for
    the class, except ``trust_env``, which is always False)."""
    import httpx

    _never_trust_env("http_client", kwargs)
    return httpx.Client(trust_env=False, **kwargs)


def async_http_client(**kwargs: Any) -> httpx.AsyncClient:
    """An :class:`httpx.AsyncClient` that ignores proxy variables, ``.netrc`` and ``SSL_CERT_FILE`` (``kwargs`` as
    for the class, except ``trust_env``, which is always False)."""
    import httpx

    _never_trust_env("async_http_client", kwargs)
    return httpx.AsyncClient(trust_env=False, **kwargs)


def request_failures() -> tuple[type[Exception], type[Exception]]:
    """``(timeout, failure)``: what a request through :func:`http_client` or :func:`async_http_client` raises when
    a time limit passes (``httpx.TimeoutException``), and when it cannot be sent or its answer cannot be read
    (``httpx.RequestError``, which the first one also is: catch that first)."""
    import httpx

    return httpx.TimeoutException, httpx.RequestError


async def aiter_sse(response: httpx.Response) -> AsyncIterator[ServerSentEvent]:
    """The events of a ``text/event-stream`` answer of :func:`async_http_client` as they arrive (comments and
    keep-alives skipped, multi-line ``data`` joined, CRLF or LF line ends). Raises ``httpx_sse.SSEError`` when the
    answer is not an event stream."""
    from httpx_sse import EventSource

    async for event in EventSource(response).aiter_sse():
        yield event


def urlopen(url: str | urllib.request.Request, timeout: float) -> Any:
    """``urllib.request.urlopen(url, timeout=timeout)`` without proxies (the response, a context manager)."""
    return _OPENER.open(url, timeout=timeout)


__all__ = ["aiter_sse", "async_http_client", "client_session", "http_client", "request_failures", "urlopen"]
