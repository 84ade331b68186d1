"""The one client of the gateway's control API: :class:`AsyncControlClient` (aiohttp; the dashboard, tests) and
:class:`ControlClient`, a synchronous facade over it (the CLI).

Every answer is validated into its :mod:`~btbctl.engine.control.schema` model, and every failure becomes a one-line
:class:`ControlApiError` (a :class:`~btbctl.engine.errors.BtbctlError`):

* the API cannot be reached: ``cannot reach the control API at URL: <reason>``;
* no answer in time: ``control API GET /control/fleet: no answer within 10 s``;
* an HTTP error: ``control API PUT /control/constants: HTTP 400: <the server's message>`` (``status`` and the
  server's :class:`~btbctl.engine.control.schema.ErrorDetail` are attributes);
* an answer that is not JSON, or not the documented shape.

The bearer token, when given, goes with every request (reads need it too when the control API listens off
loopback). The HTTP session ignores proxy environment variables (:func:`~btbctl.engine.httpclient.client_session`):
the token never travels through a proxy the user did not name for this. Base URLs must be ``http://`` or
``https://``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import aiohttp
from pydantic import BaseModel, ValidationError

from btbctl.engine.control.schema import (
    EVENT_MODELS,
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
from btbctl.engine.httpclient import client_session

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
T = TypeVar("T")


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
        BtbctlError: another scheme (``file:``, ``ftp:``, none) or no host.
    """
    p = urlsplit(url)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise BtbctlError(f"control API URL {url!r} must look like http://host:port (http or https only)")
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
    os_error = getattr(e, "os_error", None)  # aiohttp.ClientConnectorError
    if isinstance(os_error, OSError) and os_error.strerror:
        return os_error.strerror
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


class AsyncControlClient:
    """Calls ``<base_url>/control/...`` from a running event loop.

    Use as ``async with AsyncControlClient(url, token) as api: fleet = await api.fleet()``, or call
    :meth:`close` when done. The HTTP session is opened on the first call, in the loop that makes it.

    Args:
        base_url: the control API's base URL (``http://127.0.0.1:8001``).
        token: bearer token (None: reads only, and only while the API listens on loopback).
        timeout_s: per-call limit, seconds (the event stream has no total limit; see :data:`EVENT_SILENCE_S`).

    Raises:
        BtbctlError: ``base_url`` is not an http(s) URL.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = check_base_url(base_url)
        self.token = token
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = client_session(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._session

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        return h

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> M:
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            async with self._http().request(
                method,
                self.base_url + path,
                json=body,
                params=params,
                headers=self._headers(),
                timeout=aiohttp.ClientTimeout(total=limit),
            ) as resp:
                status = resp.status
                raw = await resp.read()
        except asyncio.TimeoutError:
            raise ControlApiError(f"control API {method} {path}: no answer within {limit:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise ControlApiError(f"cannot reach the control API at {self.base_url}: {_reason(e)}") from None
        if status >= 400:
            raise _http_error(method, path, status, raw)
        try:
            data = json.loads(raw)
        except ValueError:
            raise ControlApiError(f"control API {method} {path}: the answer is not JSON") from None
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise ControlApiError(
                f"control API {method} {path}: unexpected answer: {_validation_text(e)}", status=status
            ) from None

    # -- reads --------------------------------------------------------------------------------------------------

    async def fleet(self) -> FleetAnswer:
        """``GET /control/fleet``."""
        return await self._call("GET", "/control/fleet", FleetAnswer)

    async def prefixes(self, top: int = 10) -> PrefixesAnswer:
        """``GET /control/prefixes?top=N`` (1..1000)."""
        return await self._call("GET", "/control/prefixes", PrefixesAnswer, params={"top": str(top)})

    async def transfers(self, limit: int = 100) -> TransfersAnswer:
        """``GET /control/transfers?limit=N`` (1..10000)."""
        return await self._call("GET", "/control/transfers", TransfersAnswer, params={"limit": str(limit)})

    async def ttft(self, window_s: float = 60.0, step_s: float = 1.0) -> TtftAnswer:
        """``GET /control/ttft?window_s=&step_s=`` (at most 10,000 buckets)."""
        return await self._call(
            "GET", "/control/ttft", TtftAnswer, params={"window_s": f"{window_s:g}", "step_s": f"{step_s:g}"}
        )

    async def constants(self) -> ConstantsAnswer:
        """``GET /control/constants``."""
        return await self._call("GET", "/control/constants", ConstantsAnswer)

    async def replication(self, prefix: str) -> ReplicationAnswer:
        """``GET /control/replications/{prefix}`` (a full id or an unambiguous leading part)."""
        return await self._call("GET", f"/control/replications/{quote(prefix, safe='')}", ReplicationAnswer)

    # -- writes -------------------------------------------------------------------------------------------------

    async def set_constants(self, updates: Mapping[str, Any] | ConstantsUpdate) -> ConstantsAnswer:
        """``PUT /control/constants`` with any of the four constants and/or ``policy``; returns what the gateway
        holds now.

        Raises:
            ConfigError: a key the schema does not know or a value of the wrong type (checked before sending).
            ControlApiError: the gateway refused (400 names the key; 401 without the right token).
        """
        if not isinstance(updates, ConstantsUpdate):
            try:
                updates = ConstantsUpdate.model_validate(dict(updates))
            except ValidationError as e:
                err = e.errors()[0]
                key = str(err["loc"][0]) if err.get("loc") else "constants"
                raise ConfigError(key, _one_line(err.get("msg", "invalid")), "control API") from None
        return await self._call("PUT", "/control/constants", ConstantsAnswer, body=updates.dump())

    async def replicate(self, prefix: str, n: int = 1) -> ReplicateAnswer:
        """``POST /control/replicate``: copy ``prefix`` to ``n`` more workers (answers once the copies were
        accepted; follow them with :meth:`replication`)."""
        try:
            body = ReplicateRequest(prefix=prefix, n=n)
        except ValidationError as e:
            raise BtbctlError(f"replicate: {_validation_text(e)}") from None
        return await self._call("POST", "/control/replicate", ReplicateAnswer, body=body.model_dump(mode="json"))

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
        try:
            body = PrewarmRequest(text=text, messages=messages, input_ids=input_ids, n=n)
        except ValidationError as e:
            raise BtbctlError(f"prewarm: {_validation_text(e).removeprefix('Value error, ')}") from None
        return await self._call(
            "POST",
            "/control/prewarm",
            PrewarmAnswer,
            body=body.model_dump(mode="json", exclude_none=True),
            timeout_s=timeout_s,
        )

    async def flush(self) -> FlushAnswer:
        """``POST /control/flush``: empty every worker's cache and the gateway's records of them."""
        return await self._call("POST", "/control/flush", FlushAnswer, body={})

    # -- the event stream ---------------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[ControlEvent]:
        """Follow ``GET /control/events``: yields each event, validated, as it arrives; ends when the gateway closes
        the stream. Event types this client does not know are skipped. The first events after connecting give the
        full picture (one of each type).

        Raises:
            ControlApiError: the stream cannot be opened, breaks, stays silent for :data:`EVENT_SILENCE_S`, or
                carries a payload that is not the documented shape.
        """
        path = "/control/events"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=EVENT_SILENCE_S)
        headers = {**self._headers(), "Accept": "text/event-stream"}
        try:
            async with self._http().get(self.base_url + path, headers=headers, timeout=timeout) as resp:
                if resp.status >= 400:
                    raise _http_error("GET", path, resp.status, await resp.read())
                ctype = resp.headers.get("Content-Type", "")
                if not ctype.startswith("text/event-stream"):
                    raise ControlApiError(f"control API GET {path}: not an event stream ({ctype or 'no type'})")
                kind, data = "message", []
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line:
                        if data:
                            event = _event(kind, "\n".join(data))
                            if event is not None:
                                yield event
                        kind, data = "message", []
                        continue
                    if line.startswith(":"):
                        continue
                    name, _, value = line.partition(":")
                    value = value[1:] if value.startswith(" ") else value
                    if name == "event":
                        kind = value
                    elif name == "data":
                        data.append(value)
        except asyncio.TimeoutError:
            raise ControlApiError(f"control API GET {path}: silent for {EVENT_SILENCE_S:g} s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise ControlApiError(f"control API GET {path}: the event stream broke: {_reason(e)}") from None


def _event(kind: str, text: str) -> ControlEvent | None:
    model = EVENT_MODELS.get(kind)
    if model is None:
        return None
    try:
        return ControlEvent(kind, model.model_validate_json(text))
    except ValidationError as e:
        raise ControlApiError(f"control API event {kind!r}: unexpected payload: {_validation_text(e)}") from None


class ControlClient:
    """The synchronous facade of :class:`AsyncControlClient` (same methods, same answers, same errors) for code
    that has no event loop, such as the CLI. It runs the async client on an event loop of its own; call it from
    one thread, never from inside a running event loop (use :class:`AsyncControlClient` there).

    Use as ``with ControlClient(url, token) as api: api.fleet()``, or call :meth:`close`.
    """

    def __init__(self, base_url: str, token: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.aio = AsyncControlClient(base_url, token, timeout_s=timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_url(self) -> str:
        return self.aio.base_url

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP session and the private event loop."""
        if self._loop is not None:
            self._loop.run_until_complete(self.aio.close())
            self._loop.close()
            self._loop = None

    def _run(self, call: Awaitable[T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(call)

    def fleet(self) -> FleetAnswer:
        """``GET /control/fleet``."""
        return self._run(self.aio.fleet())

    def prefixes(self, top: int = 10) -> PrefixesAnswer:
        """``GET /control/prefixes?top=N``."""
        return self._run(self.aio.prefixes(top))

    def transfers(self, limit: int = 100) -> TransfersAnswer:
        """``GET /control/transfers?limit=N``."""
        return self._run(self.aio.transfers(limit))

    def ttft(self, window_s: float = 60.0, step_s: float = 1.0) -> TtftAnswer:
        """``GET /control/ttft``."""
        return self._run(self.aio.ttft(window_s, step_s))

    def constants(self) -> ConstantsAnswer:
        """``GET /control/constants``."""
        return self._run(self.aio.constants())

    def replication(self, prefix: str) -> ReplicationAnswer:
        """``GET /control/replications/{prefix}``."""
        return self._run(self.aio.replication(prefix))

    def set_constants(self, updates: Mapping[str, Any] | ConstantsUpdate) -> ConstantsAnswer:
        """``PUT /control/constants`` (see :meth:`AsyncControlClient.set_constants`)."""
        return self._run(self.aio.set_constants(updates))

    def replicate(self, prefix: str, n: int = 1) -> ReplicateAnswer:
        """``POST /control/replicate``."""
        return self._run(self.aio.replicate(prefix, n))

    def prewarm(self, **prompt: Any) -> PrewarmAnswer:
        """``POST /control/prewarm`` (see :meth:`AsyncControlClient.prewarm`)."""
        return self._run(self.aio.prewarm(**prompt))

    def flush(self) -> FlushAnswer:
        """``POST /control/flush``."""
        return self._run(self.aio.flush())


__all__ = [
    "AsyncControlClient",
    "ControlApiError",
    "ControlClient",
    "ControlEvent",
    "DEFAULT_TIMEOUT_S",
    "EVENT_SILENCE_S",
    "PREWARM_TIMEOUT_S",
    "check_base_url",
]
