"""Control API: reads, authenticated writes, validation, manual replicate by short id, and the event stream."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest
from pydantic import BaseModel

from btbctl.engine.control import schema
from btbctl.engine.gateway import GatewayConfig
from btbctl.engine.gateway.control_api import build_control_app
from btbctl.engine.gateway.events import EventBus
from btbctl.engine.gateway.health import summarize_loads
from btbctl.engine.gateway.server import Gateway, load_token
from gateway_fakes import GatewayEnv, until

TEXT = "manual prefix " * 10  # 140 bytes: 35 pseudo-tokens, 8 blocks of 4
CONSTANTS = {"prefix_blocks": 4, "threshold": 100, "window_s": 5.0, "replicas": 3}


async def test_fleet_and_constants_reads():
    async with GatewayEnv(2, policy="least_load") as env:
        status, fleet = await env.get_control("/control/fleet")
        assert status == 200 and fleet["healthy"] == 2 and fleet["policy"] == "least_load"
        w = fleet["workers"][0]
        assert w["url"] == env.fleet[0].url and w["healthy"] and w["load"] == 0
        assert (w["running"], w["waiting"], w["kv_used_tokens"], w["kv_capacity_tokens"]) == (1, 2, 30, 100)
        assert w["kv_use"] == pytest.approx(0.3) and w["replication"] is True
        assert w["transfer_addr"] == env.fleet[0].transfer_addr and w["page_size"] == 4
        status, c = await env.get_control("/control/constants")
        assert c["policy"] == "least_load" and "btb" in c["policies"]
        assert c["constants"] == {"prefix_blocks": 256, "threshold": 2, "window_s": 1.0, "warm_replicas": 4}
        async with env.http.get(env.control + "/control/nothing") as r:
            assert r.status == 404
        status, err = await env.get_control("/control/prefixes?top=0")
        assert status == 400 and err["error"]["key"] == "top"


async def test_put_constants_needs_the_token_and_validates_every_key():
    async with GatewayEnv(2, policy="btb") as env:
        url = env.control + "/control/constants"
        async with env.http.put(url, json={"threshold": 3}) as r:
            assert r.status == 401
        async with env.http.put(url, json={"threshold": 3}, headers=env.auth("wrong")) as r:
            assert r.status == 401
        bad = [
            ({"threshold": 0}, "threshold"),
            ({"window_s": -1}, "window_s"),
            ({"replicas": "4"}, "replicas"),
            ({"warm_replicas": 0}, "warm_replicas"),
            ({"prefix_blocks": True}, "prefix_blocks"),
            ({"policy": "nope"}, "policy"),
            ({"policy": ["btb"]}, "policy"),  # not a string: 400, not a 500
            ({"policy": {"a": 1}}, "policy"),
            ({"speed": 2}, "speed"),
            ({"threshold": 3, "window_s": 0}, "window_s"),
        ]
        for obj, key in bad:
            async with env.http.put(url, json=obj, headers=env.auth()) as r:
                assert r.status == 400, obj
                err = (await r.json())["error"]
                assert err["key"] == key and err["valid"]
        assert env.gw.constants.threshold == 2  # nothing half-applied
        for data in (b"{oops", b"[" * 5000 + b"]" * 5000, b"[1]"):
            async with env.http.put(url, data=data, headers=env.auth()) as r:
                assert r.status == 400
        async with env.http.put(url, data=b" " * 70000, headers=env.auth()) as r:
            assert r.status == 413
        async with env.http.put(
            url, json={"threshold": 3, "window_s": 2.5, "policy": "cache_aware"}, headers=env.auth()
        ) as r:
            assert r.status == 200
            now = await r.json()
        assert now["constants"]["threshold"] == 3 and now["constants"]["window_s"] == 2.5
        assert now["policy"] == "cache_aware" and env.gw.policy.name == "cache_aware"
        assert env.gw.detector.constants.threshold == 3
        async with env.http.put(url, json={"policy": "btb", "prefix_blocks": 2}, headers=env.auth()) as r:
            assert r.status == 200
        assert env.gw.policy.detector is env.gw.detector  # one detector across swaps
        assert env.gw.policy.constants.prefix_blocks == 2


async def test_manual_replicate_by_short_id_and_status():
    async with GatewayEnv(4, policy="round_robin", constants=CONSTANTS) as env:
        status, _ = await env.post("/generate", {"text": TEXT})
        assert status == 200
        holder = next(w for w in env.fleet if w.requests)
        chain = env.fleet[0].chain_of("/generate", {"text": TEXT})
        pid = chain[3]
        url = env.control + "/control/replicate"
        async with env.http.post(url, json={"prefix": pid[:10], "n": 2}) as r:
            assert r.status == 401
        async with env.http.post(url, json={"prefix": pid[:10], "n": 2}, headers=env.auth()) as r:
            assert r.status == 202, await r.text()
            ans = await r.json()
        assert ans["prefix"] == pid and ans["source"] == holder.url and len(ans["targets"]) == 2
        assert len(ans["copy_ids"]) == 2 and ans["skipped"] == 0
        assert holder.pushes[0]["body"]["chain"] == chain[:4]
        for _ in range(200):
            status, st = await env.get_control(f"/control/replications/{pid[:12]}")
            if len(st["holders"]) == 3:
                break
            await asyncio.sleep(0.02)
        assert set(st["holders"]) == {holder.url, *ans["targets"]}
        assert {c["copy_id"] for c in st["copies"]} == set(ans["copy_ids"])
        assert all(c["state"] == "done" for c in st["copies"])
        # asking again: one worker left that lacks it
        async with env.http.post(url, json={"prefix": pid, "n": 5}, headers=env.auth()) as r:
            ans2 = await r.json()
            assert r.status == 202 and len(ans2["targets"]) == 1 and ans2["skipped"] == 4
        errors = [
            ({"prefix": "zz"}, 400),
            ({"prefix": "abc"}, 400),
            ({"prefix": "0123456789abcdef"}, 404),
            ({"n": 2}, 400),
            ({"prefix": pid, "n": 0}, 400),
            ({"prefix": chain[0][:8], "n": "x"}, 400),
        ]
        for obj, want in errors:
            async with env.http.post(url, json=obj, headers=env.auth()) as r:
                assert r.status == want, obj


async def test_manual_replicate_without_a_holder_is_409():
    async with GatewayEnv(2, policy="round_robin", constants=CONSTANTS) as env:
        await env.post("/generate", {"text": TEXT})
        chain = env.fleet[0].chain_of("/generate", {"text": TEXT})
        for w in env.fleet:
            w.held.clear()  # the workers evicted it; the gateway's record is stale
        async with env.http.post(
            env.control + "/control/replicate", json={"prefix": chain[-1]}, headers=env.auth()
        ) as r:
            assert r.status == 409
            assert "no healthy worker holds" in (await r.json())["error"]["message"]
        assert all(not w.pushes for w in env.fleet)


async def _replicated(env: GatewayEnv, pid: str, holders: int) -> dict:
    """The replication answer of ``pid`` once ``holders`` workers hold it and no copy of it is in flight."""
    for _ in range(250):
        _, st = await env.get_control(f"/control/replications/{pid}")
        if len(st["holders"]) == holders and all(c["state"] in ("done", "failed") for c in st["copies"]):
            return st
        await asyncio.sleep(0.02)
    raise AssertionError(f"{pid}: {st}")


async def test_replicate_of_a_prefix_every_worker_holds_answers_200_with_the_holders():
    async with GatewayEnv(3, policy="round_robin", constants=CONSTANTS) as env:
        assert (await env.post("/generate", {"text": TEXT}))[0] == 200
        pid = env.fleet[0].chain_of("/generate", {"text": TEXT})[3]
        url = env.control + "/control/replicate"
        async with env.http.post(url, json={"prefix": pid, "n": 2}, headers=env.auth()) as r:
            assert r.status == 202
        await _replicated(env, pid, 3)
        async with env.http.post(url, json={"prefix": pid[:10], "n": 3}, headers=env.auth()) as r:
            assert r.status == 200, await r.text()  # nothing to copy is not an error
            ans = await r.json()
        assert ans["prefix"] == pid and ans["targets"] == [] and ans["copies"] == [] and ans["skipped"] == 3
        assert sorted(ans["holders"]) == sorted(w.url for w in env.fleet) and ans["source"] in ans["holders"]
        _same_after_validation(schema.ReplicateAnswer, ans)
        assert sum(len(w.pushes) for w in env.fleet) == 2  # no copy started


async def test_prewarm_computes_the_prompt_on_one_worker_then_copies_it():
    async with GatewayEnv(4, policy="round_robin", constants=CONSTANTS) as env:
        url = env.control + "/control/prewarm"
        async with env.http.post(url, json={"text": TEXT, "n": 2}) as r:
            assert r.status == 401
        async with env.http.post(url, json={"text": TEXT, "n": 2}, headers=env.auth()) as r:
            assert r.status == 202, await r.text()
            ans = await r.json()
        _same_after_validation(schema.PrewarmAnswer, ans)
        computer = next(w for w in env.fleet if w.requests)
        path, body = computer.requests[-1]
        assert path == "/generate" and body["text"] == TEXT and body["sampling_params"]["max_new_tokens"] == 1
        chain = computer.chain_of("/generate", {"text": TEXT})
        assert ans["computed_by"] == computer.url and ans["source"] == computer.url
        assert ans["prefix"] == chain[-1] and ans["prefix_blocks"] == len(chain) and ans["prompt_tokens"] == 35
        assert len(ans["targets"]) == 2 and computer.url not in ans["targets"]
        assert computer.pushes[0]["body"]["chain"] == chain  # the prompt's whole blocks
        st = await _replicated(env, chain[-1], 3)
        assert set(st["holders"]) == {computer.url, *ans["targets"]}
        # the same prompt for more workers than are left: the last one, then nothing to do (200, the holders)
        async with env.http.post(url, json={"text": TEXT, "n": 5}, headers=env.auth()) as r:
            again = await r.json()
            assert r.status == 202 and len(again["targets"]) == 1 and again["skipped"] == 4
        await _replicated(env, chain[-1], 4)
        async with env.http.post(url, json={"text": TEXT, "n": 1}, headers=env.auth()) as r:
            held = await r.json()
            assert r.status == 200 and held["targets"] == [] and len(held["holders"]) == 4


async def test_prewarm_takes_chats_and_token_ids_and_refuses_bad_prompts():
    async with GatewayEnv(2, policy="round_robin", constants=CONSTANTS) as env:
        url = env.control + "/control/prewarm"
        chat = [{"role": "system", "content": "You are a careful batch summarizer. " * 3}]
        async with env.http.post(url, json={"messages": chat}, headers=env.auth()) as r:
            assert r.status == 202, await r.text()
            ans = await r.json()
        computer = next(w for w in env.fleet if w.requests)
        path, body = computer.requests[-1]
        assert path == "/v1/chat/completions" and body["max_tokens"] == 1 and body["messages"] == chat
        assert ans["prefix"] == computer.chain_of(path, body)[-1]
        ids = list(range(100, 140))
        async with env.http.post(url, json={"input_ids": ids}, headers=env.auth()) as r:
            assert r.status == 202, await r.text()
            ans = await r.json()
        assert ans["prefix_blocks"] == 10 and ans["prompt_tokens"] == 40
        bad = [
            ({}, 400, "prompt"),
            ({"text": "a b", "input_ids": [1]}, 400, "prompt"),
            ({"text": TEXT, "n": 0}, 400, "n"),
            ({"input_ids": ["x"]}, 400, "input_ids"),
            ({"input_ids": [-1] * 40}, 400, "input_ids"),  # token ids are in [0, 2^32)
            ({"input_ids": [2**32] * 40}, 400, "input_ids"),
            ({"text": TEXT, "speed": 1}, 400, "speed"),
            ({"text": "abc"}, 400, None),  # shorter than one block
        ]
        for obj, status, key in bad:
            async with env.http.post(url, json=obj, headers=env.auth()) as r:
                err = (await r.json())["error"]
                assert r.status == status and err.get("key") == key, (obj, err)
        assert "shorter than one block" in err["message"]
        for w in env.fleet:  # the worker refuses the prompt: the caller's fault, 400 (not a gateway's 502)
            w.fail = "400"
        async with env.http.post(url, json={"input_ids": [999_999] * 40}, headers=env.auth()) as r:
            assert r.status == 400 and "HTTP 400" in (await r.json())["error"]["message"]
        for w in env.fleet:
            w.fail = "500"
        async with env.http.post(url, json={"text": "another prompt " * 5}, headers=env.auth()) as r:
            assert r.status == 502 and "computing the prompt failed" in (await r.json())["error"]["message"]


async def test_event_stream_delivers_coalesced_snapshots():
    async with GatewayEnv(2, policy="btb", constants={**CONSTANTS, "threshold": 2}) as env:
        seen: dict[str, list] = {}
        async with env.http.get(env.control + "/control/events") as r:
            assert r.headers["Content-Type"] == "text/event-stream"

            async def reader():
                kind = None
                async for line in r.content:
                    line = line.decode().rstrip("\n")
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        seen.setdefault(kind, []).append(json.loads(line[6:]))

            def last(kind: str) -> dict:
                return seen[kind][-1] if seen.get(kind) else {}

            def settled() -> bool:
                return (
                    last("constants").get("constants", {}).get("warm_replicas") == 2
                    and last("ttft").get("last_10s", {}).get("n") == 20
                    and last("transfers").get("totals", {}).get("done") == 1
                )

            task = asyncio.ensure_future(reader())
            await until(lambda: "fleet" in seen, timeout_s=10.0)  # subscribed: the first full picture arrived
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(20):
                await env.post("/generate", {"text": TEXT + str(i)})
            async with env.http.put(
                env.control + "/control/constants", json={"replicas": 2}, headers=env.auth()
            ) as resp:
                assert resp.status == 200
            await until(settled, timeout_s=10.0)
            elapsed = loop.time() - t0
            task.cancel()
        assert {"fleet", "prefixes", "transfers", "ttft", "constants"} <= set(seen)
        assert last("fleet")["total"] == 2
        # coalesced: at most one ttft event per tick of the bus (0.1 s), however long the 20 requests took, plus
        # the full picture a new listener gets
        assert len(seen["ttft"]) <= 2 + elapsed / env.gw.bus.interval_s


class _Tick(BaseModel):
    n: int


def test_the_event_bus_coalesces_marks_into_one_event_per_tick():
    bus = EventBus()
    built = []
    bus.register("ttft", lambda: built.append(1) or _Tick(n=len(built)))
    bus.mark("ttft")  # nobody listens yet: nothing is built
    bus.flush()
    assert built == []
    q = bus.subscribe()
    for _ in range(20):
        bus.mark("ttft")
    bus.flush()
    bus.flush()  # nothing marked since
    assert len(built) == 1 and q.qsize() == 1 and q.get_nowait()[0] == "ttft"
    bus.close()
    assert q.get_nowait() == (None, None)


def _same_after_validation(model, obj) -> None:
    """``obj`` (a decoded answer) validates as ``model`` and dumps back unchanged: the schema defines exactly the
    shape the gateway sends."""
    assert model.model_validate(obj).model_dump(mode="json") == obj


async def test_every_answer_and_event_is_its_schema_model():
    async with GatewayEnv(3, policy="round_robin", constants=CONSTANTS) as env:
        seen: dict[str, list] = {}
        async with env.http.get(env.control + "/control/events") as stream:

            async def reader():
                kind = None
                async for line in stream.content:
                    line = line.decode().rstrip("\n")
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        seen.setdefault(kind, []).append(json.loads(line[6:]))

            task = asyncio.ensure_future(reader())
            assert (await env.post("/generate", {"text": TEXT, "stream": True}))[0] == 200
            pid = env.fleet[0].chain_of("/generate", {"text": TEXT})[3]
            async with env.http.post(
                env.control + "/control/replicate", json={"prefix": pid, "n": 1}, headers=env.auth()
            ) as r:
                assert r.status == 202
                _same_after_validation(schema.ReplicateAnswer, await r.json())
            for _ in range(200):
                if env.gw.state.transfers.recent:
                    break
                await asyncio.sleep(0.02)
            reads = [
                ("/control/fleet", schema.FleetAnswer),
                ("/control/prefixes?top=5", schema.PrefixesAnswer),
                ("/control/transfers", schema.TransfersAnswer),
                ("/control/ttft?window_s=5&step_s=0.5", schema.TtftAnswer),
                ("/control/constants", schema.ConstantsAnswer),
                (f"/control/replications/{pid[:10]}", schema.ReplicationAnswer),
            ]
            for path, model in reads:
                status, ans = await env.get_control(path)
                assert status == 200, (path, ans)
                _same_after_validation(model, ans)
            _, prefixes = await env.get_control("/control/prefixes")
            _, transfers = await env.get_control("/control/transfers")
            assert prefixes["prefixes"] and transfers["transfers"][0]["state"] == "done"
            async with env.http.put(env.control + "/control/constants", json={"threshold": 7}, headers=env.auth()) as r:
                _same_after_validation(schema.ConstantsAnswer, await r.json())
            await until(
                lambda: set(seen) == set(schema.EVENT_MODELS) and seen["constants"][-1]["constants"]["threshold"] == 7,
                timeout_s=10.0,
            )
            task.cancel()
        assert set(seen) == set(schema.EVENT_MODELS)
        for kind, payloads in seen.items():
            for data in payloads:
                _same_after_validation(schema.EVENT_MODELS[kind], data)
        # error bodies: refused value, ambiguous/unknown prefix, no token, unknown route, bad query
        c = env.control
        errors = [
            lambda: env.http.put(c + "/control/constants", json={"threshold": 0}, headers=env.auth()),
            lambda: env.http.put(c + "/control/constants", json={"speed": 1}, headers=env.auth()),
            lambda: env.http.post(c + "/control/replicate", json={"prefix": "0" * 16}, headers=env.auth()),
            lambda: env.http.post(c + "/control/replicate", json={"prefix": pid}),
            lambda: env.http.get(c + "/control/nothing"),
            lambda: env.http.get(c + "/control/ttft?step_s=x"),
        ]
        for call in errors:
            async with call() as r:
                assert 400 <= r.status < 500
                err = await r.json()
                _same_after_validation(schema.ErrorAnswer, err)
                assert err["error"]["message"]


def test_the_control_api_page_documents_every_route_model_and_field():
    page = (Path(__file__).resolve().parents[1] / "docs" / "control-api.md").read_text(encoding="utf-8")
    app = build_control_app(None, None, EventBus(), open_reads=True)  # only the routing table is read
    routes = {f"{r.method} {r.resource.canonical}" for r in app.router.routes() if r.method != "HEAD"}
    assert len(routes) == 13
    for route in routes:
        assert f"`{route}" in page, route
    models = [
        m
        for m in vars(schema).values()
        if isinstance(m, type)
        and issubclass(m, BaseModel)
        and m.__module__ == schema.__name__
        and m not in (schema.Answer, schema.Body)
    ]
    assert len(models) >= 18
    for m in models:
        assert f"`{m.__name__}`" in page, m.__name__
        for name in m.model_fields:
            assert f"| `{name}` |" in page, f"{m.__name__}.{name}"
    for kind in schema.EVENT_MODELS:
        assert f"| `{kind}` |" in page, kind


async def test_reads_need_the_token_off_loopback():
    async with GatewayEnv(1, control_host="0.0.0.0") as env:
        url = env.control.replace("0.0.0.0", "127.0.0.1") + "/control/fleet"
        async with env.http.get(url) as r:
            assert r.status == 401
        async with env.http.get(url, headers=env.auth()) as r:
            assert r.status == 200


def test_token_file_is_created_0600_and_reused(tmp_path):
    path = tmp_path / "token"
    cfg = GatewayConfig(workers=["http://127.0.0.1:1"], token_file=str(path))
    tok = load_token(cfg)
    assert len(tok) >= 32 and path.read_text().strip() == tok
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_token(cfg) == tok
    assert Gateway(cfg).check_token(f"Bearer {tok}") and not Gateway(cfg).check_token("Bearer x")


def test_loads_summary_shapes():
    rank = {"num_running_reqs": 2, "num_waiting_reqs": 1, "num_used_tokens": 50, "max_total_num_tokens": 200}
    assert summarize_loads([rank, rank]) == {
        "running": 4,
        "waiting": 2,
        "used_tokens": 100,
        "max_tokens": 400,
        "token_usage": 0.25,
    }
    assert summarize_loads({"loads": [rank]})["running"] == 2
    assert summarize_loads(rank)["waiting"] == 1
    assert summarize_loads({"x": 1}) is None and summarize_loads("x") is None
    # JSON's NaN and Infinity (Python's json reads both) count as absent, never fail the probe
    odd = json.loads(
        '{"num_running_reqs": NaN, "num_waiting_reqs": Infinity, "num_used_tokens": 5, "token_usage": NaN}'
    )
    assert summarize_loads(odd) == {"running": 0, "waiting": 0, "used_tokens": 5, "max_tokens": 0, "token_usage": None}
