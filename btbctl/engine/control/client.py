"""The one client of the gateway's control API: :class:`AsyncControlClient` (httpx's ``AsyncClient``; the
dashboard, tests) and :class:`ControlClient` (httpx's ``Client``; the CLI), with the same methods, answers and
errors. Each endpoint (method, path, request and answer models) is defined once, as an :class:`Endpoint` built by
:class:`Endpoints`; the two clients only send it.

Every answer is validated into its :mod:`~btbctl.engine.control.schema` model, and every failure becomes a one-line
:class:`ControlApiError` (a :class:`~btbctl.engine.errors.BtbctlError`):

* the API cannot be reached: ``cannot reach the control API at URL: <reason>``;
* no answer in time: ``control API GET /control/fleet: no answer within 10 s``;
* an HTTP error: ``control API PUT /control/constants: HTTP 400: <the server's message>`` (``status`` and the
  server's :class:`~btbctl.engine.control.schema.ErrorDetail` are attributes);
* an answer that is not JSON, or not the documented shape.

The bearer token, when given, goes with every request (reads need it too when the control API listens off
loopback). The HTTP clients ignore proxy environment variables (:func:`~btbctl.engine.httpclient.http_client`):
the token never travels through a proxy the user did not name for this. Base URLs must be ``http://`` or
``https://``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ValidationError

from btbctl.engine.control.schema import (
    EVENT_MODELS,
    AgentsAnswer,
    Answer,
    ConstantsAnswer,
    ConstantsUpdate,
    ErrorAnswer,
    ErrorDetail,
    FleetAnswer,
    FlushAnswer,
    PrefixesAnswer,
    PrewarmAnswer,
    PrewarmRequest,
    ReplicateAnswer,
    ReplicateRequest,
    ReplicationAnswer,
    TransfersAnswer,
    TtftAnswer,
)
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.httpclient import aiter_sse, async_http_client, http_client, request_failures

if TYPE_CHECKING:
    from btbctl.engine.httpclient import AsyncHttpClient, HttpClient

#: Seconds one control-API call may take (a product choice: the API answers from memory in milliseconds;
#: replication runs in the background and is polled).
DEFAULT_TIMEOUT_S = 10.0
#: Longest wait for ``POST /control/prewarm``'s answer, seconds: a worker computes the whole prompt first (the
#: gateway's ``first_byte_timeout_s`` is 300 s by default), then the copies are accepted (10 s).
PREWARM_TIMEOUT_S = 330.0
#: Longest silence on the event stream before it counts as broken, seconds: three of the gateway's 15-second
#: keep-alive periods.
EVENT_SILENCE_S = 45.0
#: Characters of a non-JSON error body quoted in a message.
_ERROR_TEXT_CHARS = 300

M = TypeVar("M", bound=BaseModel)


class ControlApiError(BtbctlError):
    """A control-API call that failed; ``str()`` is one line.

    Attributes:
        status: the HTTP status of an error answer (None when there was no answer).
        detail: the server's error object, when it sent one.
    """

    def __init__(self, message: str, *, status: int | None = None, detail: ErrorDetail | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail

    @property
    def key(self) -> str | None:
        """The request field the server refused (``threshold``, ``prefix``), if it named one."""
        return self.detail.key if self.detail is not None else None


def check_base_url(url: str) -> str:
    """``url`` without a trailing slash, when it is an ``http://`` or ``https://`` URL with a host.

    Raises:
        BtbctlError: another scheme (``file:``, ``ftp:``, none), no host, a port that is not a number in 0-65535,
            or credentials in the URL (they would replace the bearer token and show in messages).
    """
    shape = f"control API URL {url!r} must look like http://host:port (http or https only)"
    try:
        p = urlsplit(url)
        p.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    except ValueError:
        raise BtbctlError(shape) from None
    if p.scheme not in ("http", "https") or not p.hostname:
        raise BtbctlError(shape)
    if p.username is not None or p.password is not None:
        raise BtbctlError(f"control API URL of host {p.hostname!r} must not carry credentials: give the token instead")
    return url.rstrip("/")


@dataclass(frozen=True)
class ControlEvent:
    """One event of ``GET /control/events``: its type and its payload (the model of
    :data:`~btbctl.engine.control.schema.EVENT_MODELS` for that type)."""

    kind: str
    payload: Answer


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _reason(e: BaseException) -> str:
    """Why a request failed, in a few words: the operating system's reason when one caused it (``Connection
    refused``), else the exception's type and text."""
    cause: BaseException | None = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror
        cause = cause.__cause__ or cause.__context__
    text = str(e)
    return _one_line(f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _validation_text(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    return _one_line(f"{loc}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid"))


def _http_error(method: str, path: str, status: int, raw: bytes) -> ControlApiError:
    detail = None
    try:
        detail = ErrorAnswer.model_validate(json.loads(raw)).error
        text = detail.message
    except (ValueError, ValidationError):
        text = raw.decode("utf-8", "replace").strip()[:_ERROR_TEXT_CHARS] or "no message"
    return ControlApiError(
        f"control API {method} {path}: HTTP {status}: {_one_line(text)}", status=status, detail=detail
    )


def _event(kind: str, text: str) -> ControlEvent | None:
    model = EVENT_MODELS.get(kind)
    if model is None:
        return None
    try:
        return ControlEvent(kind, model.model_validate_json(text))
    except ValidationError as e:
        raise ControlApiError(f"control API event {kind!r}: unexpected payload: {_validation_text(e)}") from None


# -- the endpoints ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint(Generic[M]):
    """One control-API call, ready to send: ``method`` and ``path`` (without the query, as errors name it), the
    answer's ``model``, the JSON ``body`` (None: none), the query ``params`` and a time limit of its own in seconds
    (None: the client's)."""

    method: str
    path: str
    model: type[M]
    body: Any = None
    params: Mapping[str, str] | None = None
    timeout_s: float | None = None

    def answer(self, status: int, raw: bytes) -> M:
        """The answer ``raw`` (HTTP ``status``) as :attr:`model`. Raises :class:`ControlApiError`: an HTTP error,
        not JSON, not the documented shape."""
        if status >= 400:
            raise _http_error(self.method, self.path, status, raw)
        try:
            data = json.loads(raw)
        except ValueError:
            raise ControlApiError(f"control API {self.method} {self.path}: the answer is not JSON") from None
        try:
            return self.model.model_validate(data)
        except ValidationError as e:
            raise ControlApiError(
                f"control API {self.method} {self.path}: unexpected answer: {_validation_text(e)}", status=status
            ) from None


class Endpoints:
    """Every endpoint of the control API, each defined once; both clients send what these build. Arguments are
    checked here, before anything is sent."""

    @staticmethod
    def fleet() -> Endpoint[FleetAnswer]:
        return Endpoint("GET", "/control/fleet", FleetAnswer)

    @staticmethod
    def agents() -> Endpoint[AgentsAnswer]:
        return Endpoint("GET", "/control/agents", AgentsAnswer)

    @staticmethod
    def prefixes(top: int) -> Endpoint[PrefixesAnswer]:
        return Endpoint("GET", "/control/prefixes", PrefixesAnswer, params={"top": str(top)})

    @staticmethod
    def transfers(limit: int) -> Endpoint[TransfersAnswer]:
        return Endpoint("GET", "/control/transfers", TransfersAnswer, params={"limit": str(limit)})

    @staticmethod
    def ttft(window_s: float, step_s: float) -> Endpoint[TtftAnswer]:
        params = {"window_s": f"{window_s:g}", "step_s": f"{step_s:g}"}
        return Endpoint("GET", "/control/ttft", TtftAnswer, params=params)

    @staticmethod
    def constants() -> Endpoint[ConstantsAnswer]:
        return Endpoint("GET", "/control/constants", ConstantsAnswer)

    @staticmethod
    def replication(prefix: str) -> Endpoint[ReplicationAnswer]:
        return Endpoint("GET", f"/control/replications/{quote(prefix, safe='')}", ReplicationAnswer)

    @staticmethod
    def set_constants(updates: Mapping[str, Any] | ConstantsUpdate) -> Endpoint[ConstantsAnswer]:
        """Raises :class:`ConfigError`: a key the schema does not know or a value of the wrong type."""
        if not isinstance(updates, ConstantsUpdate):
            try:
                updates = ConstantsUpdate.model_validate(dict(updates))
            except ValidationError as e:
                err = e.errors()[0]
                key = str(err["loc"][0]) if err.get("loc") else "constants"
                raise ConfigError(key, _one_line(err.get("msg", "invalid")), "control API") from None
        return Endpoint("PUT", "/control/constants", ConstantsAnswer, body=updates.dump())

    @staticmethod
    def replicate(prefix: str, n: int) -> Endpoint[ReplicateAnswer]:
        """Raises :class:`BtbctlError`: a bad ``prefix`` or ``n``."""
        try:
            body = ReplicateRequest(prefix=prefix, n=n)
        except ValidationError as e:
            raise BtbctlError(f"replicate: {_validation_text(e)}") from None
        return Endpoint("POST", "/control/replicate", ReplicateAnswer, body=body.model_dump(mode="json"))

    @staticmethod
    def prewarm(
        text: str | None, messages: list[dict[str, Any]] | None, input_ids: list[int] | None, n: int, timeout_s: float
    ) -> Endpoint[PrewarmAnswer]:
        """Raises :class:`BtbctlError`: not exactly one prompt, or a bad ``n``."""
        try:
            body = PrewarmRequest(text=text, messages=messages, input_ids=input_ids, n=n)
        except ValidationError as e:
            raise BtbctlError(f"prewarm: {_validation_text(e).removeprefix('Value error, ')}") from None
        return Endpoint(
            "POST",
            "/control/prewarm",
            PrewarmAnswer,
            body=body.model_dump(mode="json", exclude_none=True),
            timeout_s=timeout_s,
        )

    @staticmethod
    def flush() -> Endpoint[FlushAnswer]:
        return Endpoint("POST", "/control/flush", FlushAnswer, body={})


#: The path of the event stream (``GET``).
EVENTS_PATH = "/control/events"


class _Base:
    """What both clients hold: the base URL, the token, the time limit and the headers of every request."""

    def __init__(self, base_url: str, token: str | None, timeout_s: float) -> None:
        self.base_url = check_base_url(base_url)
        self.token = token
        self.timeout_s = timeout_s

    def _headers(self, accept: str = "application/json") -> dict[str, str]:
        h = {"Accept": accept}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    def _request(self, call: Endpoint[Any]) -> tuple[dict[str, Any], float]:
        """The keyword arguments of httpx's ``request`` for ``call``, and its time limit in seconds."""
        limit = self.timeout_s if call.timeout_s is None else call.timeout_s
        kwargs = {
            "method": call.method,
            "url": self.base_url + call.path,
            "json": call.body,
            "params": call.params,
            "headers": self._headers(),
            "timeout": limit,
        }
        return kwargs, limit

    def _too_slow(self, call: Endpoint[Any], limit: float) -> ControlApiError:
        return ControlApiError(f"control API {call.method} {call.path}: no answer within {limit:g} s")

    def _unreachable(self, e: BaseException) -> ControlApiError:
        return ControlApiError(f"cannot reach the control API at {self.base_url}: {_reason(e)}")


class AsyncControlClient(_Base):
    """Calls ``<base_url>/control/...`` from a running event loop.

    Use as ``async with AsyncControlClient(url, token) as api: fleet = await api.fleet()``, or call
    :meth:`close` when done. The HTTP client is opened on the first call.

    Args:
        base_url: the control API's base URL (``http://127.0.0.1:8001``).
        token: bearer token (None: reads only, and only while the API listens on loopback).
        timeout_s: per-call limit, seconds, on the whole call (the event stream waits up to
            :data:`EVENT_SILENCE_S` for data).

    Raises:
        BtbctlError: ``base_url`` is not an http(s) URL.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(base_url, token, timeout_s)
        self._client: AsyncHttpClient | None = None

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP client (a later call opens a new one)."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    def _http(self) -> AsyncHttpClient:
        if self._client is None or self._client.is_closed:
            self._client = async_http_client(timeout=self.timeout_s)
        return self._client

    async def send(self, call: Endpoint[M]) -> M:
        """Send ``call``; its answer as its model. Raises :class:`ControlApiError` (see the module)."""
        kwargs, limit = self._request(call)
        too_slow, failed = request_failures()
        try:
            # the limit bounds the whole call, also against an answer that dribbles in
            resp = await asyncio.wait_for(self._http().request(**kwargs), limit)
        except (too_slow, asyncio.TimeoutError):
            raise self._too_slow(call, limit) from None
        except (failed, OSError) as e:
            raise self._unreachable(e) from None
        return call.answer(resp.status_code, resp.content)

    # -- reads --------------------------------------------------------------------------------------------------

    async def fleet(self) -> FleetAnswer:
        """``GET /control/fleet``."""
        return await self.send(Endpoints.fleet())

    async def agents(self) -> AgentsAnswer:
        """``GET /control/agents``."""
        return await self.send(Endpoints.agents())

    async def prefixes(self, top: int = 10) -> PrefixesAnswer:
        """``GET /control/prefixes?top=N`` (1..1000)."""
        return await self.send(Endpoints.prefixes(top))

    async def transfers(self, limit: int = 100) -> TransfersAnswer:
        """``GET /control/transfers?limit=N`` (1..10000)."""
        return await self.send(Endpoints.transfers(limit))

    async def ttft(self, window_s: float = 60.0, step_s: float = 1.0) -> TtftAnswer:
        """``GET /control/ttft?window_s=&step_s=`` (at most 10,000 buckets)."""
        return await self.send(Endpoints.ttft(window_s, step_s))

    async def constants(self) -> ConstantsAnswer:
        """``GET /control/constants``."""
        return await self.send(Endpoints.constants())

    async def replication(self, prefix: str) -> ReplicationAnswer:
        """``GET /control/replications/{prefix}`` (a full id or an unambiguous leading part)."""
        return await self.send(Endpoints.replication(prefix))

    # -- writes -------------------------------------------------------------------------------------------------

    async def set_constants(self, updates: Mapping[str, Any] | ConstantsUpdate) -> ConstantsAnswer:
        """``PUT /control/constants`` with any of the four constants and/or ``policy``; returns what the gateway
        holds now.

        Raises:
            ConfigError: a key the schema does not know or a value of the wrong type (checked before sending).
            ControlApiError: the gateway refused (400 names the key; 401 without the right token).
        """
        return await self.send(Endpoints.set_constants(updates))

    async def replicate(self, prefix: str, n: int = 1) -> ReplicateAnswer:
        """``POST /control/replicate``: copy ``prefix`` to ``n`` more workers (answers once the copies were
        accepted; follow them with :meth:`replication`)."""
        return await self.send(Endpoints.replicate(prefix, n))

    async def prewarm(
        self,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        n: int = 1,
        timeout_s: float = PREWARM_TIMEOUT_S,
    ) -> PrewarmAnswer:
        """``POST /control/prewarm``: one worker computes the prompt (exactly one of ``text``, ``messages``,
        ``input_ids``), then it is copied to ``n`` more workers; answers once the copies were accepted (follow them
        with :meth:`replication`). ``timeout_s`` covers the computation.

        Raises:
            BtbctlError: not exactly one prompt, or a bad ``n`` (checked before sending).
            ControlApiError: the gateway refused (400 prompt, 409 nothing to copy from or to, 502 the computing
                request failed).
        """
        return await self.send(Endpoints.prewarm(text, messages, input_ids, n, timeout_s))

    async def flush(self) -> FlushAnswer:
        """``POST /control/flush``: empty every worker's cache and the gateway's records of them."""
        return await self.send(Endpoints.flush())

    # -- the event stream ---------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[ControlEvent]:
        """Follow ``GET /control/events``: yields each event, validated, as it arrives; ends when the gateway closes
        the stream. Event types this client does not know, and events without data, are skipped. The first events
        after connecting give the full picture (one of each type).

        Raises:
            ControlApiError: the stream cannot be opened, breaks, stays silent for :data:`EVENT_SILENCE_S`, or
                carries a payload that is not the documented shape.
        """
        path = EVENTS_PATH
        # (connect, read, write, pool) seconds: the read limit is the longest silence between events
        timeout = (self.timeout_s, EVENT_SILENCE_S, self.timeout_s, self.timeout_s)
        too_slow, failed = request_failures()
        try:
            async with self._http().stream(
                "GET", self.base_url + path, headers=self._headers("text/event-stream"), timeout=timeout
            ) as resp:
                if resp.status_code >= 400:
                    raise _http_error("GET", path, resp.status_code, await resp.aread())
                ctype = resp.headers.get("Content-Type", "")
                if not ctype.startswith("text/event-stream"):
                    raise ControlApiError(f"control API GET {path}: not an event stream ({ctype or 'no type'})")
                async for sse in aiter_sse(resp):
                    event = _event(sse.event, sse.data) if sse.data else None
                    if event is not None:
                        yield event
        except too_slow:
            raise ControlApiError(f"control API GET {path}: silent for {EVENT_SILENCE_S:g} s") from None
        except (failed, OSError) as e:
            raise ControlApiError(f"control API GET {path}: the event stream broke: {_reason(e)}") from None


class ControlClient(_Base):
    """The synchronous client (same methods, same answers, same errors as :class:`AsyncControlClient`) for code
    that has no event loop, such as the CLI. Each call blocks its thread until the answer is in; inside a running
    event loop use :class:`AsyncControlClient`. The time limit bounds the whole answer once its head is in; the
    head itself is bounded per wait for data (httpx's synchronous client has no overall limit).

    Use as ``with ControlClient(url, token) as api: api.fleet()``, or call :meth:`close`.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(base_url, token, timeout_s)
        self._client: HttpClient | None = None

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP client (a later call opens a new one)."""
        if self._client is not None:
            client, self._client = self._client, None
            client.close()

    def _http(self) -> HttpClient:
        if self._client is None or self._client.is_closed:
            self._client = http_client(timeout=self.timeout_s)
        return self._client

    def send(self, call: Endpoint[M]) -> M:
        """Send ``call``; its answer as its model. Raises :class:`ControlApiError` (see the module)."""
        kwargs, limit = self._request(call)
        too_slow, failed = request_failures()
        deadline = time.monotonic() + limit
        try:
            with self._http().stream(**kwargs) as resp:
                body = bytearray()
                for chunk in resp.iter_bytes():  # the limit bounds the whole answer, not only each wait for data
                    body += chunk
                    if time.monotonic() > deadline:
                        raise self._too_slow(call, limit)
                status = resp.status_code
        except too_slow:
            raise self._too_slow(call, limit) from None
        except (failed, OSError) as e:
            raise self._unreachable(e) from None
        if time.monotonic() > deadline:
            raise self._too_slow(call, limit)
        return call.answer(status, bytes(body))

    def fleet(self) -> FleetAnswer:
        """``GET /control/fleet``."""
        return self.send(Endpoints.fleet())

    def agents(self) -> AgentsAnswer:
        """``GET /control/agents``."""
        return self.send(Endpoints.agents())

    def prefixes(self, top: int = 10) -> PrefixesAnswer:
        """``GET /control/prefixes?top=N``."""
        return self.send(Endpoints.prefixes(top))

    def transfers(self, limit: int = 100) -> TransfersAnswer:
        """``GET /control/transfers?limit=N``."""
        return self.send(Endpoints.transfers(limit))

    def ttft(self, window_s: float = 60.0, step_s: float = 1.0) -> TtftAnswer:
        """``GET /control/ttft``."""
        return self.send(Endpoints.ttft(window_s, step_s))

    def constants(self) -> ConstantsAnswer:
        """``GET /control/constants``."""
        return self.send(Endpoints.constants())

    def replication(self, prefix: str) -> ReplicationAnswer:
        """``GET /control/replications/{prefix}``."""
        return self.send(Endpoints.replication(prefix))

    def set_constants(self, updates: Mapping[str, Any] | ConstantsUpdate) -> ConstantsAnswer:
        """``PUT /control/constants`` (see :meth:`AsyncControlClient.set_constants`)."""
        return self.send(Endpoints.set_constants(updates))

    def replicate(self, prefix: str, n: int = 1) -> ReplicateAnswer:
        """``POST /control/replicate``."""
        return self.send(Endpoints.replicate(prefix, n))

    def prewarm(
        self,
        *,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        n: int = 1,
        timeout_s: float = PREWARM_TIMEOUT_S,
    ) -> PrewarmAnswer:
        """``POST /control/prewarm`` (see :meth:`AsyncControlClient.prewarm`)."""
        return self.send(Endpoints.prewarm(text, messages, input_ids, n, timeout_s))

    def flush(self) -> FlushAnswer:
        """``POST /control/flush``."""
        return self.send(Endpoints.flush())


__all__ = [
    "AsyncControlClient",
    "ControlApiError",
    "ControlClient",
    "ControlEvent",
    "DEFAULT_TIMEOUT_S",
    "EVENTS_PATH",
    "EVENT_SILENCE_S",
    "Endpoint",
    "Endpoints",
    "PREWARM_TIMEOUT_S",
    "check_base_url",
]
