"""The control-API client, sync and async: answers validated into the schema, every failure one line, http(s)
only, proxies ignored, the event stream parsed; and the CLI's steering built on it."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from btbctl.engine.control import schema
from btbctl.engine.control.client import AsyncControlClient, ControlApiError, ControlClient
from btbctl.engine.control.steering import replicate_and_wait
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.launcher.local import health_ok
from gateway_fakes import GatewayEnv

CONSTANTS = {
    "policy": "btb",
    "policies": ["btb"],
    "page_size": 16,
    "prefix_tokens": 128,
    "constants": {"prefix_blocks": 8, "threshold": 2, "window_s": 1.0, "warm_replicas": 4},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """An aiohttp app on a loopback port, served from a thread of its own (the sync client blocks this one).
    ``routes``: ``(method, path) -> handler``; every request is recorded in ``seen`` as ``(method, path_qs,
    Authorization header)``."""

    def __init__(self, routes: dict) -> None:
        self.routes = routes
        self.seen: list[tuple[str, str, str | None]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @web.middleware
    async def _record(self, request, handler):
        self.seen.append((request.method, request.path_qs, request.headers.get("Authorization")))
        return await handler(request)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(middlewares=[self._record])
        for (method, path), handler in self.routes.items():
            app.router.add_route(method, path, handler)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", 0).start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _answer(body, status: int = 200, text: str | None = None):
    async def h(request):
        if text is not None:
            return web.Response(text=text, status=status, content_type="text/html")
        return web.json_response(body, status=status)

    return h


def test_only_http_and_https_urls():
    for bad in ("file:///etc/passwd", "ftp://127.0.0.1:8001", "127.0.0.1:8001", "http://", "javascript:alert(1)"):
        with pytest.raises(BtbctlError, match="http or https only"):
            ControlClient(bad)
    assert ControlClient("https://gw.example:8001/").base_url == "https://gw.example:8001"
    for bad in ("http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://[::1"):
        with pytest.raises(BtbctlError, match="http or https only"):
            ControlClient(bad)
    # credentials in the URL would replace the bearer token (and show in messages): refused, not echoed
    with pytest.raises(BtbctlError, match="must not carry credentials") as e:
        ControlClient("http://user:s3cret@127.0.0.1:8001")
    assert "s3cret" not in str(e.value)


async def test_the_time_limit_bounds_an_answer_that_dribbles_in():
    async def dribble(request):
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for _ in range(30):  # one byte every 0.1 s: each wait for data is short, the whole answer is not
            await resp.write(b" ")
            await asyncio.sleep(0.1)
        return resp

    with ThreadServer({("GET", "/control/fleet"): dribble}) as srv:
        too_slow = r"^control API GET /control/fleet: no answer within 0.5 s$"
        with ControlClient(srv.url, timeout_s=0.5) as sync_api, pytest.raises(ControlApiError, match=too_slow):
            await asyncio.to_thread(sync_api.fleet)
        async with AsyncControlClient(srv.url, timeout_s=0.5) as async_api:
            with pytest.raises(ControlApiError, match=too_slow):
                await async_api.fleet()


def test_answers_are_validated_into_the_schema_and_the_token_goes_along():
    with ThreadServer(
        {("GET", "/control/constants"): _answer(CONSTANTS), ("PUT", "/control/constants"): _answer(CONSTANTS)}
    ) as srv:
        with ControlClient(srv.url, token="tok") as api:
            c = api.constants()
            assert isinstance(c, schema.ConstantsAnswer) and c.constants.warm_replicas == 4
            api.set_constants({"threshold": 3, "replicas": 2})
        put = next(s for s in srv.seen if s[0] == "PUT")
        assert all(s[2] == "Bearer tok" for s in srv.seen)
        assert put[1] == "/control/constants"


def test_every_failure_is_one_line():
    port = _free_port()
    with pytest.raises(ControlApiError) as ei:
        with ControlClient(f"http://127.0.0.1:{port}") as api:
            api.fleet()
    assert str(ei.value).startswith(f"cannot reach the control API at http://127.0.0.1:{port}: ")
    assert ei.value.status is None

    async def slow(request):
        await asyncio.sleep(1.0)
        return web.json_response(CONSTANTS)

    routes = {
        ("PUT", "/control/constants"): _answer(
            {
                "error": {
                    "message": "threshold: must be an integer in [1, 1048576], got 0",
                    "key": "threshold",
                    "valid": "an integer in [1, 1048576]",
                }
            },
            400,
        ),
        ("GET", "/control/fleet"): _answer(None, 502, text="<html>\n<h1>502 Bad Gateway</h1>\n</html>"),
        ("GET", "/control/constants"): _answer({"policy": "btb"}),
        ("GET", "/control/transfers"): _answer(None, text="not json at all"),
        ("GET", "/control/ttft"): slow,
    }
    with ThreadServer(routes) as srv, ControlClient(srv.url, token="t", timeout_s=0.3) as api:
        with pytest.raises(ControlApiError) as ei:
            api.set_constants({"threshold": 0})
        e = ei.value
        assert str(e) == (
            "control API PUT /control/constants: HTTP 400: threshold: must be an integer in [1, 1048576], got 0"
        )
        assert e.status == 400 and e.key == "threshold" and e.detail.valid == "an integer in [1, 1048576]"
        with pytest.raises(
            ControlApiError,
            match=r"^control API GET /control/fleet: HTTP 502: <html> <h1>502 Bad "
            r"Gateway</h1> </html>$",
        ):
            api.fleet()
        with pytest.raises(
            ControlApiError,
            match=r"^control API GET /control/constants: unexpected answer: "
            r"policies: Field required$",
        ):
            api.constants()
        with pytest.raises(ControlApiError, match=r"^control API GET /control/transfers: the answer is not JSON$"):
            api.transfers()
        with pytest.raises(ControlApiError, match=r"^control API GET /control/ttft: no answer within 0.3 s$"):
            api.ttft()
        # checked before anything is sent
        with pytest.raises(ConfigError, match="speed"):
            api.set_constants({"speed": 2})
        with pytest.raises(ConfigError, match="threshold"):
            api.set_constants({"threshold": "3"})


def test_proxy_variables_never_see_the_request(monkeypatch):
    proxied: list = []

    async def proxy(request):
        proxied.append((request.method, str(request.url), request.headers.get("Authorization")))
        return web.json_response({"error": {"message": "proxy"}}, status=502)

    with (
        ThreadServer(
            {("GET", "/control/constants"): _answer(CONSTANTS), ("GET", "/health"): _answer({"status": "ok"})}
        ) as srv,
        ThreadServer({("GET", "/{tail:.*}"): proxy}) as prx,
    ):
        for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(var, prx.url)
        for var in ("NO_PROXY", "no_proxy"):
            monkeypatch.delenv(var, raising=False)
        with ControlClient(srv.url, token="secret") as api:
            assert api.constants().policy == "btb"
        assert health_ok(srv.url)  # the launcher's readiness probe (urllib honoured http_proxy even for loopback)
    assert proxied == []
    assert srv.seen == [("GET", "/control/constants", "Bearer secret"), ("GET", "/health", None)]


async def test_event_stream_parsing():
    fleet_event = {
        "now_s": 1.0,
        "policy": "btb",
        "page_size": 16,
        "constants": CONSTANTS["constants"],
        "healthy": 0,
        "total": 0,
        "replication": "supported on all workers",
        "workers": [],
    }

    async def events(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": connected\n\n")
        await resp.write(b"event: constants\ndata: " + json.dumps(CONSTANTS).encode() + b"\n\n")
        await resp.write(b"event: future_kind\ndata: {}\n\n")  # a type this client does not know: skipped
        text = json.dumps(fleet_event, indent=1)  # data split over several lines, CRLF line ends
        await resp.write("".join(f"data: {ln}\r\n" for ln in text.splitlines()).encode() + b"event: fleet\r\n\r\n")
        await resp.write(b": keepalive\n\n")
        if request.query.get("bad"):
            await resp.write(b'event: ttft\ndata: {"now_s": 1}\n\n')
        await resp.write_eof()
        return resp

    async def bad_events(request):
        return await events(request.clone(rel_url=request.rel_url.with_query(bad="1")))

    app = web.Application()
    app.router.add_get("/control/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with AsyncControlClient(url) as api:
            got = [e async for e in api.events()]
        assert [e.kind for e in got] == ["constants", "fleet"]
        assert isinstance(got[0].payload, schema.ConstantsAnswer)
        assert got[1].payload == schema.FleetAnswer.model_validate(fleet_event)
        app2 = web.Application()
        app2.router.add_get("/control/events", bad_events)
        runner2 = web.AppRunner(app2)
        await runner2.setup()
        await web.TCPSite(runner2, "127.0.0.1", 0).start()
        async with AsyncControlClient(f"http://127.0.0.1:{runner2.addresses[0][1]}") as api:
            with pytest.raises(ControlApiError, match=r"^control API event 'ttft': unexpected payload: last_10s"):
                [e async for e in api.events()]
        await runner2.cleanup()
        async with AsyncControlClient(f"http://127.0.0.1:{_free_port()}") as api:
            with pytest.raises(ControlApiError, match=r"cannot reach|event stream broke"):
                [e async for e in api.events()]
    finally:
        await runner.cleanup()


async def test_replicate_and_wait_through_the_sync_client():
    async with GatewayEnv(
        3, policy="round_robin", constants={"prefix_blocks": 4, "threshold": 100, "window_s": 5.0}
    ) as env:
        text = "manual prefix " * 10
        assert (await env.post("/generate", {"text": text}))[0] == 200
        pid = env.fleet[0].chain_of("/generate", {"text": text})[3]
        progress: list[list[dict]] = []

        def work() -> dict:
            with ControlClient(env.control, token="test-token") as api:
                return replicate_and_wait(api, pid[:10], 2, poll_s=0.02, on_progress=progress.append)

        res = await asyncio.to_thread(work)
        assert res["status"] == "done" and res["prefix"] == pid and len(res["targets"]) == 2
        assert set(res["holders"]) == {res["source"], *res["targets"]} and res["bytes"] > 0
        assert progress[-1][0]["state"] == "done" and progress[-1][0]["copy_id"] in {
            c["copy_id"] for c in res["copies"]
        }

        def refused(prefix: str) -> None:
            with ControlClient(env.control, token="test-token") as api:
                replicate_and_wait(api, prefix, 1)

        with pytest.raises(BtbctlError, match=r"^--prefix: "):
            refused("xyz")
        with pytest.raises(ControlApiError, match="HTTP 404: unknown prefix"):
            await asyncio.to_thread(refused, "0123456789abcdef")


def test_both_clients_send_the_one_definition_of_each_endpoint():
    """The sync and the async client have the same methods, with the same signatures, and each builds the same
    request (method, path, query, body, answer model, time limit) from the one :class:`Endpoints` definition."""
    import inspect

    from btbctl.engine.control.client import Endpoint, Endpoints

    public = {n for n in vars(ControlClient) if not n.startswith("_") and n not in ("close", "send")}
    assert public == {n for n in vars(Endpoints) if not n.startswith("_")}
    assert public <= set(vars(AsyncControlClient))
    for name in public:
        sync_sig = inspect.signature(getattr(ControlClient, name))
        assert sync_sig == inspect.signature(getattr(AsyncControlClient, name)), name
    calls = {
        "fleet": {},
        "agents": {},
        "prefixes": {"top": 7},
        "transfers": {"limit": 9},
        "ttft": {"window_s": 30.0, "step_s": 0.5},
        "constants": {},
        "replication": {"prefix": "ab/c"},
        "set_constants": {"updates": {"threshold": 3}},
        "replicate": {"prefix": "abcd", "n": 2},
        "prewarm": {"text": "hi", "n": 1, "timeout_s": 5.0},
        "flush": {},
    }
    assert set(calls) == public
    sent: list[tuple[str, Endpoint]] = []

    async def async_send(call):
        sent.append(("async", call))

    sync_api, async_api = ControlClient("http://127.0.0.1:1"), AsyncControlClient("http://127.0.0.1:1")
    sync_api.send = lambda call: sent.append(("sync", call))
    async_api.send = async_send
    for name, kwargs in calls.items():
        getattr(sync_api, name)(**kwargs)
        asyncio.run(getattr(async_api, name)(**kwargs))
        (k1, sync_call), (k2, async_call) = sent[-2:]
        assert (k1, k2) == ("sync", "async") and sync_call == async_call, name
    by_name = {name: sent[2 * i][1] for i, name in enumerate(calls)}
    assert by_name["replication"].path == "/control/replications/ab%2Fc"
    assert by_name["ttft"].params == {"window_s": "30", "step_s": "0.5"}
    assert by_name["prewarm"].timeout_s == 5.0 and by_name["prewarm"].body == {"text": "hi", "n": 1}
    assert (by_name["flush"].method, by_name["flush"].body) == ("POST", {})


def test_backoff_doubles_up_to_its_ceiling_and_starts_over_after_a_success():
    from btbctl.engine.control.backoff import Backoff

    b = Backoff(0.5, 3.0)
    assert [b.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.failed() == 0.5 and b.next_s == 1.0
    for first_s, max_s in ((0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="0 < first_s <= max_s"):
            Backoff(first_s, max_s)
