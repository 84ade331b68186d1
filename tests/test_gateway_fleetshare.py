"""Several gateways in front of one fleet, sharing burst detection, copy orders and tuning through a real
redis-server (``[gateway] redis_url``; :mod:`btbctl.engine.gateway.fleetshare`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter

import aiohttp
import pytest

from btbctl.engine.gateway import GatewayConfig, serve_gateway
from gateway_fakes import BURST_CONSTANTS, BURST_TEXT, start_fleet, stop_fleet, until
from redis_fixture import RedisServer, free_port, needs_redis, redis_server  # noqa: F401 (fixture)

FLEETSHARE_LOG = "btbctl.engine.gateway.fleetshare"


def _events(caplog, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"event={event} ")]


@contextlib.asynccontextmanager
async def _gateways(urls: list[str], n: int, redis_url: str | None, **cfg):
    base = {
        "port": 0,
        "control_port": 0,
        "token": "test-token",
        "health_interval_s": 0.2,
        "poll_interval_s": 0.02,
        "policy": "btb",
        "constants": BURST_CONSTANTS,
        "redis_url": redis_url,
    }
    base.update(cfg)
    gws = []
    try:
        for _ in range(n):
            gws.append(await serve_gateway(GatewayConfig(workers=urls, **base)))
        yield gws
    finally:
        for gw in gws:
            await gw.stop()


async def _send(http: aiohttp.ClientSession, gw, i: int) -> str:
    async with http.post(gw.data_url + "/generate", json={"text": BURST_TEXT + str(i)}) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-BTB-Worker"]


async def _connected(*gws) -> None:
    await until(lambda: all(gw.fleet is not None and gw.fleet.connected for gw in gws), timeout_s=10)


def _bare_share(url: str, prefix: str = "t", **kw):
    """A started :class:`FleetShare` on ``url`` whose callbacks do nothing."""
    from btbctl.engine.gateway.fleetshare import FleetShare

    def nop(*_a):
        return None

    share = FleetShare(url, prefix, on_arrivals=nop, on_copy_done=nop, on_tune=nop, **kw)
    share.start()
    return share


async def _stops_within(share, timeout_s: float = 5.0) -> bool:
    """Whether ``share.stop()`` returns within ``timeout_s``."""
    done, _ = await asyncio.wait({asyncio.ensure_future(share.stop())}, timeout=timeout_s)
    return bool(done)


@needs_redis
async def test_a_burst_split_over_two_gateways_fires_as_on_one_and_copies_once(redis_server):  # noqa: F811
    fleet = await start_fleet(4)
    urls = [w.url for w in fleet]
    try:
        async with _gateways(urls, 2, redis_server.url) as (a, b), aiohttp.ClientSession() as http:
            await _connected(a, b)
            await _send(http, a, 0)
            # a's arrival reaches b's detector before b's own (the news travels faster than the burst)
            await until(lambda: b.fleet.folded_arrivals == 1)
            assert b.detector.stats()["fires"] == 0
            await _send(http, b, 1)
            # the fleet's second arrival fires on b, as the second arrival at one gateway would
            assert b.detector.stats()["fires"] == 1
            await until(lambda: a.fleet.folded_arrivals == 1)
            await _send(http, a, 2)
            assert a.detector.stats()["fires"] == 1  # hot on a too, on its next arrival
            for i in range(3, 9):
                await _send(http, (a, b)[i % 2], i)
            await until(lambda: not a.state.transfers.active and not b.state.transfers.active, timeout_s=10)
            # each target got one copy, ordered by one gateway; the other waited for its outcome
            pushes = [(p["body"]["target"], p["body"]["chain"][-1]) for w in fleet for p in w.pushes]
            assert pushes and all(n == 1 for n in Counter(pushes).values()), pushes
            own = [t for gw in (a, b) for t in gw.state.transfers.recent if t.ordered_by is None]
            assert len(own) == len(pushes) and all(t.state == "done" for t in own)
            key = own[0].chain[-1]
            # both gateways know every warm replica, and both send the burst's rest over them
            # (a worker that computed the prefix is known to the gateway that sent it the request only)
            targets = {t.target for t in own}
            assert targets <= set(a.state.holders(key)) and targets <= set(b.state.holders(key))
            assert len(a.state.holders(key)) >= 3 and len(b.state.holders(key)) >= 3
            before = [len(w.requests) for w in fleet]
            await asyncio.gather(*(_send(http, (a, b)[i % 2], i) for i in range(10, 22)))
            used = {i for i, w in enumerate(fleet) if len(w.requests) > before[i]}
            assert used <= set(a.state.holders(key)) | set(b.state.holders(key)) and len(used) >= 3
    finally:
        await stop_fleet(fleet)


@needs_redis
async def test_a_copy_one_gateway_runs_is_in_flight_on_the_other_until_done(redis_server):  # noqa: F811
    fleet = await start_fleet(2, copy_polls=6)
    urls = [w.url for w in fleet]
    try:
        async with _gateways(urls, 2, redis_server.url) as (a, b), aiohttp.ClientSession() as http:
            await _connected(a, b)
            await _send(http, a, 0)
            await _send(http, a, 1)  # fires on a: a claims and runs the copy
            await until(lambda: bool(a.state.transfers.active))
            ta = next(iter(a.state.transfers.active.values()))
            # b learnt of it at once and records it in flight, awaiting a's outcome
            await until(lambda: bool(b.state.transfers.active))
            tb = next(iter(b.state.transfers.active.values()))
            assert b.state.copy_in_flight(tb.target, tb.chain)
            # ordering it by hand on b too makes no second copy
            assert b.replicator.request_copy(ta.chain, ta.source, ta.target, source_confirmed=True) is None
            assert tb.ordered_by == a.fleet.gateway_id and tb.target not in b.state.holders(tb.key)
            await until(lambda: not tb.active, timeout_s=10)
            assert tb.state == "done" and tb.target in b.state.holders(tb.key)
            assert sum(len(w.pushes) for w in fleet) == 1
    finally:
        await stop_fleet(fleet)


@needs_redis
async def test_tuning_one_gateway_reaches_the_other(redis_server, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    fleet = await start_fleet(2)
    try:
        async with _gateways([w.url for w in fleet], 2, redis_server.url) as (a, b), aiohttp.ClientSession() as http:
            await _connected(a, b)
            async with http.put(
                a.control_url + "/control/constants",
                json={"threshold": 5, "policy": "cache_aware"},
                headers={"Authorization": "Bearer test-token"},
            ) as r:
                assert r.status == 200, await r.text()
            await until(lambda: b.constants.threshold == 5 and b.policy.name == "cache_aware")
            lines = _events(caplog, "fleet_tuned")
            assert len(lines) == 1
            assert "threshold=2" in lines[0] and "threshold=5" in lines[0] and "policy=btb" in lines[0]
            assert a.constants.threshold == 5  # and nothing came back to a
    finally:
        await stop_fleet(fleet)


async def test_without_redis_each_gateway_detects_alone_and_says_so_once(caplog, tmp_path):
    caplog.set_level(logging.INFO)
    fleet = await start_fleet(2)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    try:
        async with _gateways([w.url for w in fleet], 2, url) as (a, b), aiohttp.ClientSession() as http:
            for gw in (a, b):
                gw.fleet.retry_s = 0.05
            await until(lambda: a.fleet.connected is False and b.fleet.connected is False)
            await asyncio.sleep(0.3)  # several failed reconnections
            assert len(_events(caplog, "fleet_share_down")) == 2  # one line per gateway, not per attempt
            await _send(http, a, 0)
            await _send(http, b, 1)
            assert a.detector.stats()["fires"] == b.detector.stats()["fires"] == 0  # one arrival each: alone
            await _send(http, a, 2)
            assert a.detector.stats()["fires"] == 1
            await until(lambda: not a.state.transfers.active)
            assert all(t.state == "done" and t.ordered_by is None for t in a.state.transfers.recent)
    finally:
        await stop_fleet(fleet)


@needs_redis
async def test_a_gateway_falls_back_when_redis_goes_and_returns_with_it(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    srv = RedisServer(tmp_path)
    srv.start()
    fleet = await start_fleet(2)
    try:
        async with _gateways([w.url for w in fleet], 2, srv.url) as (a, b), aiohttp.ClientSession() as http:
            for gw in (a, b):
                gw.fleet.retry_s = 0.05
            await _connected(a, b)
            srv.stop()
            await until(lambda: not a.fleet.connected and not b.fleet.connected, timeout_s=10)
            await asyncio.sleep(0.3)
            assert len(_events(caplog, "fleet_share_down")) == 2
            await _send(http, a, 0)
            await _send(http, b, 1)
            assert a.detector.stats()["fires"] == b.detector.stats()["fires"] == 0
            srv.start()
            await _connected(a, b)
            assert len(_events(caplog, "fleet_share_up")) == 4  # at start and back, each gateway
            await _send(http, a, 2)
            await until(lambda: b.fleet.folded_arrivals == 1)
            await _send(http, b, 3)
            assert b.detector.stats()["fires"] == 1  # b's 2nd + a's 2nd in the window: shared again
    finally:
        srv.stop()
        await stop_fleet(fleet)


@needs_redis
async def test_claims_are_set_once_per_prefix_and_target(redis_server):  # noqa: F811
    from btbctl.engine.gateway.fleetshare import FleetShare

    def nop(*_a):
        return None

    x = FleetShare(redis_server.url, "t", on_arrivals=nop, on_copy_done=nop, on_tune=nop, gateway_id="x")
    y = FleetShare(redis_server.url, "t", on_arrivals=nop, on_copy_done=nop, on_tune=nop, gateway_id="y")
    x.start()
    y.start()
    try:
        await until(lambda: x.connected and y.connected, timeout_s=10)
        cx, cy = await asyncio.gather(x.claim("k", "http://w1"), y.claim("k", "http://w1"))
        assert sorted([cx.owner, cy.owner]) == ["self", "x" if cy.owner == "x" else "y"]
        loser, winner = (y, x) if cx.owner == "self" else (x, y)
        waiting = asyncio.ensure_future(loser.wait_outcome("k", "http://w1", 5.0))
        await asyncio.sleep(0.05)
        await winner.publish_outcome("k", "http://w1", ("a", "k"), True)
        state, why = await waiting
        assert state == "done" and winner.gateway_id in why
        later = await loser.claim("k", "http://w1")
        assert later.owner == winner.gateway_id and later.done
        assert (await x.claim("k", "http://w2")).owner == "self"
        await x.publish_outcome("k", "http://w2", ("a", "k"), False)  # a failed copy may be ordered again
        assert (await y.claim("k", "http://w2")).owner == "self"
    finally:
        await x.stop()
        await y.stop()


def test_a_copy_message_whose_chain_is_not_block_hashes_is_dropped_with_one_line(caplog):
    """A peer's copy announcement is applied only with a chain of block hashes (strings): numbers, or anything but a
    list, is a ``fleet_share_bad_message`` line and neither a copy in flight nor holdings."""
    from btbctl.engine.gateway.fleetshare import FleetShare

    started, done = [], []
    share = FleetShare(
        "redis://127.0.0.1:1/0",
        "t",
        on_arrivals=lambda k, n: None,
        on_copy_done=lambda *a: done.append(a),
        on_tune=lambda *a: None,
        on_copy_started=lambda *a: started.append(a),
        gateway_id="me",
    )
    msg = {"gw": "other", "key": "c", "target": "http://w1", "source": "http://w0"}
    caplog.set_level(logging.WARNING, logger="btbctl.engine.gateway.fleetshare")
    for chain in ([1, 2, 3], "abc", [["a"]], {"a": 1}):
        for state in ("copying", "done"):
            share._on_message(share.chan_copies, json.dumps({**msg, "state": state, "chain": chain}))
    assert started == [] and done == []
    assert sum("fleet_share_bad_message" in r.getMessage() for r in caplog.records) == 8
    share._on_message(share.chan_copies, json.dumps({**msg, "state": "copying", "chain": ["a", "b", "c"]}))
    share._on_message(share.chan_copies, json.dumps({**msg, "state": "done", "chain": ["a", "b", "c"]}))
    assert started == [(("a", "b", "c"), "http://w0", "http://w1", "other")]
    assert done == [(("a", "b", "c"), "http://w1", "other")]


def test_bad_redis_url_is_one_clear_error():
    with pytest.raises(ValueError, match="redis://host:port"):
        GatewayConfig(workers=["http://127.0.0.1:1"], redis_url="http://127.0.0.1:6379")
    assert json.dumps(GatewayConfig(workers=["http://127.0.0.1:1"], redis_url="redis://h:1/0").redis_url)


@needs_redis
async def test_stop_ends_the_link_even_while_it_is_closing_a_lost_connection(tmp_path, monkeypatch):
    """A stop that lands while the link cleans up after losing Redis ends it (it once swallowed the cancel and
    reconnected for ever, so the gateway's stop never returned)."""
    import redis.asyncio.client as rclient

    srv = RedisServer(tmp_path)
    srv.start()
    closing = asyncio.Event()
    aclose = rclient.PubSub.aclose

    async def slow_aclose(self, *a, **k):
        closing.set()
        await asyncio.sleep(0.5)
        return await aclose(self, *a, **k)

    x = _bare_share(srv.url, retry_s=0.05)
    try:
        await until(lambda: x.connected, timeout_s=10)
        monkeypatch.setattr(rclient.PubSub, "aclose", slow_aclose)
        srv.stop()
        await asyncio.wait_for(closing.wait(), 10)
        assert await _stops_within(x), "stop() did not return while the link was closing"
        assert x.connected is False and x._task is None
    finally:
        srv.stop()


@needs_redis
async def test_stop_ends_the_link_even_when_the_redis_client_swallows_the_cancel(redis_server, monkeypatch):  # noqa: F811
    """redis-py can swallow a cancel that lands inside a command (seen under load): the link's loop and its
    flusher then carry on as if nothing happened. stop() must end them all the same, and promptly."""
    import redis.asyncio.client as rclient

    get_message = rclient.PubSub.get_message
    swallowed = []

    async def swallowing_get_message(self, *a, **k):
        try:
            return await get_message(self, *a, **k)
        except asyncio.CancelledError:
            swallowed.append("get_message")
            return None

    x = _bare_share(redis_server.url, retry_s=0.05)
    try:
        await until(lambda: x.connected, timeout_s=10)
        monkeypatch.setattr(rclient.PubSub, "get_message", swallowing_get_message)
        await asyncio.sleep(0.6)  # the loop is inside the patched get_message now
        task = x._task
        assert await _stops_within(x), "stop() did not return after the client swallowed its cancel"
        assert swallowed == ["get_message"] and task is not None and task.done()
    finally:
        await x.stop()


@needs_redis
async def test_two_gateways_ordering_the_same_l3_copy_make_one_and_both_count_it_done(tmp_path, redis_server):  # noqa: F811
    """Replication mode l3 claims its copies through the same orders as push: two gateways (two l3 executors over
    the same node agents) ordering one prefix to one target at once make one agent-to-agent copy with one warm-up
    proof; the other waits for that outcome and counts the target warm too."""
    from test_gateway_l3 import _L3Bed

    async with _L3Bed(tmp_path) as bed, aiohttp.ClientSession() as session:
        bed.write(0, 0x21)  # the source's node holds the prefix
        warmups = []
        bed.during_warmup = lambda: warmups.append(1)
        other = bed.replicator(session)
        shares = [_bare_share(redis_server.url, "l3t", gateway_id=g) for g in ("gw-a", "gw-b")]
        for share, rep in zip(shares, (bed.rep, other), strict=True):
            rep.orders = share
            rep.order_wait_s = 20.0
        try:
            await until(lambda: all(s.connected for s in shares), timeout_s=10)
            ta = bed.rep.request_copy(bed.chain, 0, 1)
            tb = other.request_copy(bed.chain, 0, 1)
            assert ta is not None and tb is not None
            await until(lambda: not ta.active and not tb.active, timeout_s=30)
            assert ta.state == tb.state == "done", (ta.state, ta.reason, tb.state, tb.reason)
            owners = sorted(t.ordered_by or "self" for t in (ta, tb))
            assert owners in (["gw-a", "self"], ["gw-b", "self"]), owners  # one ran it, one waited for it
            assert len(warmups) == 1  # one proof, by the gateway that ran the copy
            assert bed.read(1) == bed.read(0)  # the pages crossed once, intact
        finally:
            for s in shares:
                await s.stop()
            await other.close()
