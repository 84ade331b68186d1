"""Random JSON at every POST route of an in-process worker: always an answer below 500, and the worker keeps
serving."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from btbctl.engine.worker.config import make_config
from btbctl.engine.worker.core import Worker
from btbctl.engine.worker.http import build_app

ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/btb/match", "/btb/push", "/flush_cache")
KEYS = (
    "text",
    "input_ids",
    "sampling_params",
    "max_new_tokens",
    "stream",
    "rid",
    "prompt",
    "max_tokens",
    "messages",
    "role",
    "content",
    "type",
    "chain",
    "target",
    "copy_id",
    "stream_options",
    "include_usage",
    "n",
    "max_completion_tokens",
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["127.0.0.1:1", "ab12", "user", "text"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20,
)
bodies = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


class _Harness:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        cfg = make_config(model_path="qwen3-8b", tp_size=1, zero_delay=True, port=0, page_size=16)
        self.worker = Worker(cfg)
        self.client = TestClient(TestServer(build_app(self.worker), loop=self.loop), loop=self.loop)
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        await self.worker.start()
        self.worker.ready = True
        await self.client.start_server()

    def post(self, path: str, raw: bytes) -> tuple[int, bytes]:
        async def go():
            async with self.client.post(path, data=raw, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.read()

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        async def stop():
            await self.client.close()
            await self.worker.stop()

        self.loop.run_until_complete(stop())
        self.loop.close()


_H: _Harness | None = None


def _h() -> _Harness:
    global _H
    if _H is None:
        _H = _Harness()
    return _H


def teardown_module(module) -> None:
    global _H
    if _H is not None:
        _H.close()
        _H = None


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ROUTES), bodies)
def test_random_bodies_never_get_5xx(route, body):
    status, raw = _h().post(route, json.dumps(body).encode())
    assert status < 500, (route, body, raw[:300])
    if status >= 400:
        assert json.loads(raw)["error"]["code"] == status or route == "/flush_cache"


def test_worker_still_serves_after_fuzzing():
    status, raw = _h().post(
        "/generate", json.dumps({"text": "hello " * 20, "sampling_params": {"max_new_tokens": 2}}).encode()
    )
    assert status == 200 and json.loads(raw)["meta_info"]["completion_tokens"] == 2


async def test_not_ready_answers_503_on_health_and_generation():
    cfg = make_config(model_path="qwen3-8b", tp_size=1, zero_delay=True, port=0)
    worker = Worker(cfg)
    client = TestClient(TestServer(build_app(worker)))
    await client.start_server()
    try:
        out = []
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/health_generate", None),
            ("POST", "/generate", {"text": "hi"}),
        ):
            async with client.request(method, path, json=body) as r:
                out.append(r.status)
        worker.ready = True
        async with client.get("/health_generate") as r:
            out.append(r.status)
    finally:
        await client.close()
        await worker.stop()
    assert out == [503, 503, 503, 200]
