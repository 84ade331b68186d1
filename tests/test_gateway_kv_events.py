"""The gateway's holdings from KV events (btbctl.engine.gateway.kv_events): SGLang's wire format byte for byte, the
events applied to a worker's record, and real ZMQ PUB / ROUTER sockets in this process: stored, removed and cleared
blocks, a sequence gap with and without a replay endpoint, a gateway that starts late."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from btbctl.engine.gateway.kv_events import HoldingsFeed, KvEventsSubscriber, chain_keyer, l3_keyer
from btbctl.engine.gateway.state import FleetState, WorkerState
from btbctl.engine.hashing import chain_hashes
from btbctl.engine.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KvEventsConfig,
    Publisher,
    decode_batch,
    encode_batch,
    seq_bytes,
)
from btbctl.sglang_l3.keys import page_keys

PAGE = 4

#: ``msgspec.msgpack.Encoder().encode(b)`` of SGLang 0.5.23's own structs for the batch of
#: :func:`test_payload_is_sglangs_bytes` (made once with SGLang's ``sglang.srt.disaggregation.kv_events``).
SGLANG_PAYLOAD_HEX = (
    "93cb3ff00000000000009387a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920102b1706172656e745f"
    "626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756d"
    "a347505582a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910281a474797065b0416c6c426c6f636b"
    "73436c6561726564c0"
)


def stored(hashes, parent, tokens, medium="GPU", size=PAGE) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=size,
        lora_id=None,
        medium=medium,
    )


def batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))


def feed_for(keyer=chain_keyer) -> tuple[FleetState, HoldingsFeed]:
    st = FleetState(["http://a", "http://b"])
    for w in st.workers:
        w.healthy = True
    return st, HoldingsFeed(st.workers[0], keyer, lambda: PAGE)


TOKENS = list(range(100, 116))  # 4 pages of 4


def test_payload_is_sglangs_bytes():
    b = KVEventBatch(
        ts=1.0,
        events=[stored([1, 2], None, [1, 2, 3, 4], size=2), BlockRemoved(block_hashes=[2]), AllBlocksCleared()],
    )
    assert encode_batch(b).hex() == SGLANG_PAYLOAD_HEX
    assert decode_batch(bytes.fromhex(SGLANG_PAYLOAD_HEX)) == b
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(b"\x01\x02")


def test_stored_pages_become_the_gateways_chain_and_removed_ones_leave_it():
    st, feed = feed_for()
    chain = chain_hashes(TOKENS, PAGE)
    # SGLang merges consecutive pages into one event; a child of the second page comes in a later one
    feed.apply(batch(stored([11, 12], None, TOKENS[:8])))
    feed.apply(batch(stored([13, 14], 12, TOKENS[8:])))
    w = st.workers[0]
    assert w.held_blocks(chain) == 4 and st.holders(chain[0]) == [0] and st.cached_blocks(0, chain) == 4
    feed.apply(batch(BlockRemoved(block_hashes=[14, 13])))  # leaves first, as SGLang evicts
    assert w.held_blocks(chain) == 2 and st.holders(chain[3]) == []
    assert st.cached_blocks(0, chain) == 2  # the policies and the copy planner see 2 blocks there, no longer 4
    feed.apply(batch(BlockRemoved(block_hashes=[11, 12])))
    assert st.holders(chain[0]) == [] and not w.holdings and not feed.keys


def test_a_page_on_the_host_tier_stays_held_until_every_medium_dropped_it():
    st, feed = feed_for()
    chain = chain_hashes(TOKENS[:4], PAGE)
    feed.apply(batch(stored([1], None, TOKENS[:4]), stored([1], None, TOKENS[:4], medium="CPU_PINNED")))
    feed.apply(batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert st.workers[0].held_blocks(chain) == 1
    feed.apply(batch(BlockRemoved(block_hashes=[1], medium="CPU_PINNED")))
    assert st.workers[0].held_blocks(chain) == 0


def test_all_blocks_cleared_drops_the_record_and_the_routing_inference():
    st, feed = feed_for()
    w = st.workers[0]
    w.hold(["routed"])
    feed.apply(batch(stored([1, 2], None, TOKENS[:8])))
    feed.apply(batch(AllBlocksCleared()))
    assert not w.holdings and not feed.keys and not feed.parents


def test_unkeyable_pages_are_counted_and_skipped():
    st, feed = feed_for()
    feed.apply(batch(stored([5], 999, TOKENS[:4])))  # parent never seen
    feed.apply(batch(stored([6], None, TOKENS[:8], size=8)))  # another page size
    assert not st.workers[0].holdings and feed.unkeyed_blocks == 2


def test_l3_keys_are_sglangs_page_keys():
    st, feed = feed_for(l3_keyer)
    feed.apply(batch(stored([1, 2, 3, 4], None, TOKENS)))
    assert st.workers[0].held_blocks(page_keys(TOKENS, PAGE)) == 4


def test_routing_inference_can_be_switched_off():
    w = WorkerState(0, "http://a", "w0")
    w.routing_holdings = False
    w.hold_routed(["a"])
    assert not w.holdings
    w.routing_holdings = True
    w.hold_routed(["a"])
    assert list(w.holdings) == ["a"]


def test_config_parses_sglangs_option():
    cfg = KvEventsConfig.from_json('{"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}')
    assert cfg.binds() and KvEventsConfig.from_json(cfg.to_json()) == cfg
    for bad, why in (
        ("{", "not JSON"),
        ('{"publisher":"null"}', "only publisher"),
        ('{"publisher":"zmq","endpoint":5}', "endpoint"),
    ):
        with pytest.raises(ValueError, match=why):
            KvEventsConfig.from_json(bad)


# -- real sockets ------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(cond, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def publisher(replay: bool, buffer_steps: int = 100) -> Publisher:
    ep = f"tcp://127.0.0.1:{free_port()}"
    rep = f"tcp://127.0.0.1:{free_port()}" if replay else None
    pub = Publisher(KvEventsConfig(ep, rep, topic="kv", buffer_steps=buffer_steps, bind=True))
    pub.start()
    return pub


async def warm(pub: Publisher, sub: KvEventsSubscriber) -> None:
    """Send empty batches until the subscriber saw one live (ZMQ drops what a PUB sends before a SUB joined)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    start = sub.batches
    while sub.batches == start:
        assert loop.time() < end, "the subscriber never received a live batch"
        pub.publish([])
        await asyncio.sleep(0.05)


async def test_live_events_over_zmq_store_remove_and_clear():
    st, feed = feed_for()
    pub = publisher(replay=False)
    sub = KvEventsSubscriber(feed, pub.cfg.endpoint, None, topic="kv")
    sub.start()
    try:
        await warm(pub, sub)
        chain = chain_hashes(TOKENS, PAGE)
        pub.publish([stored([1, 2, 3, 4], None, TOKENS)])
        await until(lambda: st.workers[0].held_blocks(chain) == 4, "the stored blocks")
        pub.publish([BlockRemoved(block_hashes=[4])])
        await until(lambda: st.workers[0].held_blocks(chain) == 3, "the removed block")
        pub.publish([AllBlocksCleared()])
        await until(lambda: not st.workers[0].holdings, "the cleared cache")
        assert st.holders(chain[0]) == []
    finally:
        await sub.stop()
        await pub.close()


async def test_a_gap_without_replay_resyncs_and_rebuilds(caplog):
    st, feed = feed_for()
    pub = publisher(replay=False)
    sub = KvEventsSubscriber(feed, pub.cfg.endpoint, None, topic="kv")
    sub.start()
    try:
        await warm(pub, sub)
        old = chain_hashes(TOKENS[:4], PAGE)
        pub.publish([stored([1], None, TOKENS[:4])])
        await until(lambda: st.workers[0].held_blocks(old) == 1, "the first block")
        live, pub._pub = pub._pub, None  # this batch is lost on the way (the removal of block 1)
        pub.publish([BlockRemoved(block_hashes=[1])])
        pub._pub = live
        other = list(range(500, 504))
        with caplog.at_level(logging.WARNING, logger="btbctl.gateway"):
            pub.publish([stored([7], None, other)])
            await until(lambda: feed.resyncs == 1, "the resync")
        assert "event=kv_events_resync" in caplog.text and "missed sequences" in caplog.text
        w = st.workers[0]
        assert w.held_blocks(old) == 0  # dropped with the record: its removal was missed
        assert w.held_blocks(chain_hashes(other, PAGE)) == 1  # rebuilt from the batches after the gap
    finally:
        await sub.stop()
        await pub.close()


async def test_a_gap_with_replay_is_filled_without_a_resync():
    st, feed = feed_for()
    pub = publisher(replay=True)
    sub = KvEventsSubscriber(feed, pub.cfg.endpoint, pub.cfg.replay_endpoint, topic="kv")
    sub.start()
    try:
        await warm(pub, sub)
        chain = chain_hashes(TOKENS, PAGE)
        live, pub._pub = pub._pub, None
        pub.publish([stored([1, 2], None, TOKENS[:8])])  # lost live, still in the replay buffer
        pub._pub = live
        pub.publish([stored([3, 4], 2, TOKENS[8:])])
        await until(lambda: st.workers[0].held_blocks(chain) == 4, "the replayed and the live blocks")
        assert feed.resyncs == 0 and sub.replayed >= 1
    finally:
        await sub.stop()
        await pub.close()


async def test_a_late_gateway_replays_from_zero():
    st, feed = feed_for()
    pub = publisher(replay=True)
    try:
        pub.publish([stored([1, 2], None, TOKENS[:8])])
        pub.publish([stored([3, 4], 2, TOKENS[8:])])
        pub.publish([BlockRemoved(block_hashes=[4])])
        sub = KvEventsSubscriber(feed, pub.cfg.endpoint, pub.cfg.replay_endpoint, topic="kv")
        sub.start()
        try:
            chain = chain_hashes(TOKENS, PAGE)
            await until(lambda: st.workers[0].held_blocks(chain) == 3, "the replayed history")
            assert feed.resyncs == 0 and sub.expected == 3
        finally:
            await sub.stop()
    finally:
        await pub.close()


async def test_a_late_gateway_whose_publisher_forgot_the_start_begins_fresh(caplog):
    st, feed = feed_for()
    pub = publisher(replay=True, buffer_steps=1)
    try:
        pub.publish([stored([1], None, TOKENS[:4])])  # gone from the buffer: its child cannot be keyed
        pub.publish([stored([2], 1, TOKENS[4:8])])
        other = list(range(500, 504))
        pub.publish([stored([9], None, other)])
        sub = KvEventsSubscriber(feed, pub.cfg.endpoint, pub.cfg.replay_endpoint, topic="kv")
        with caplog.at_level(logging.INFO, logger="btbctl.gateway"):
            sub.start()
            await until(lambda: sub.expected == 3, "the replay")
        try:
            assert st.workers[0].held_blocks(chain_hashes(other, PAGE)) == 1
            assert "event=kv_events_late_start" in caplog.text
        finally:
            await sub.stop()
    finally:
        await pub.close()


def test_seq_frames():
    assert seq_bytes(3) == b"\0" * 7 + b"\3"


@pytest.mark.parametrize("replay", [False, True])
async def test_a_restarted_publisher_resyncs_the_worker(replay):
    st, feed = feed_for()
    pub = publisher(replay=replay)
    sub = KvEventsSubscriber(feed, pub.cfg.endpoint, pub.cfg.replay_endpoint, topic="kv")
    sub.start()
    try:
        await warm(pub, sub)
        pub.publish([stored([1], None, TOKENS[:4])])
        for _ in range(30):
            pub.publish([])
        await until(lambda: sub.expected == pub.seq, "the old publisher's batches")
        await pub.close()
        pub = Publisher(pub.cfg)  # the worker restarted: same addresses, sequence numbers from 0 again
        pub.start()
        other = list(range(500, 504))
        if replay:  # published before the subscriber reconnected: the replay brings it
            pub.publish([stored([9], None, other)])
        await warm(pub, sub)
        if not replay:
            pub.publish([stored([9], None, other)])
        w = st.workers[0]
        await until(lambda: w.held_blocks(chain_hashes(other, PAGE)) == 1, "the new publisher's block")
        assert feed.resyncs >= 1 and w.held_blocks(chain_hashes(TOKENS[:4], PAGE)) == 0
    finally:
        await sub.stop()
        await pub.close()


async def test_an_emulated_worker_publishes_what_its_cache_holds_and_the_gateway_follows():
    from aiohttp.test_utils import TestServer

    from btbctl.engine.gateway.config import GatewayConfig, KvEventsRef
    from btbctl.engine.gateway.server import serve_gateway
    from btbctl.engine.worker.config import make_config
    from btbctl.engine.worker.core import Worker
    from btbctl.engine.worker.http import build_app

    ev = KvEventsConfig(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", topic="kv", bind=True)
    cfg = make_config(
        model_path="qwen3-8b", tp_size=1, zero_delay=True, port=0, page_size=16, kv_events_config=ev.to_json()
    )
    worker = Worker(cfg)
    server = TestServer(build_app(worker), host="127.0.0.1")
    await server.start_server()
    await worker.start()
    worker.ready = True
    url = f"http://127.0.0.1:{server.port}"
    gw = await serve_gateway(
        GatewayConfig(
            workers=[url],
            port=0,
            control_port=0,
            metrics_interval_s=0,
            policy="round_robin",
            kv_events=[KvEventsRef(endpoint=ev.endpoint, replay_endpoint=ev.replay_endpoint, topic="kv")],
            routing_holdings=False,
        )
    )
    try:
        import aiohttp

        ids = list(range(1000, 1064))
        chain = chain_hashes(ids, 16)
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
            async with s.post(f"{gw.data_url}/generate", json=body) as r:
                assert r.status == 200
            w = gw.state.workers[0]
            await until(lambda: w.held_blocks(chain) == 4, "the worker's stored pages")
            async with s.get(f"{gw.data_url}/metrics") as r:
                text = await r.text()
            from prometheus_client.parser import text_string_to_metric_families

            got = {
                (m.name, tuple(sorted(m.labels.items()))): m.value
                for fam in text_string_to_metric_families(text)
                for m in fam.samples
                if m.name.startswith("btb_kv_events")
            }
            me = (("worker", w.name),)
            assert got[("btb_kv_events_blocks_total", (("kind", "stored"), *me))] >= 4, got
            live, replay = (got[("btb_kv_events_batches_total", (("via", v), *me))] for v in ("live", "replay"))
            assert live + replay >= 1, got  # the gateway's first batch may come through the replay socket
            assert got[("btb_kv_events_resyncs_total", me)] == 0 and got[("btb_kv_events_connected", me)] == 1, got
            async with s.post(f"{url}/flush_cache") as r:
                assert r.status == 200
            await until(lambda: not w.holdings, "the flushed cache")
    finally:
        await gw.stop()
        await worker.stop()
        await server.close()


def test_the_launcher_gives_each_worker_its_kv_events_ports_and_the_gateway_their_addresses():
    from btbctl.engine.launcher.cluster import ClusterFile, kv_events_args, kv_events_of, worker_argv

    cluster = ClusterFile.model_validate(
        {
            "workers": [
                {"kind": "emulated", "count": 2, "kv_events": "tcp://127.0.0.1:7000"},
                {
                    "kind": "sglang",
                    "model": "m",
                    "gpu": "h100",
                    "chunked_prefill_size": 256,
                    "kv_events": "tcp://h:9000",
                },
                {"kind": "emulated"},
            ]
        }
    )
    insts = cluster.instances()
    assert [kv_events_of(i) for i in insts] == [
        ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"),
        ("tcp://127.0.0.1:7002", "tcp://127.0.0.1:7003"),
        ("tcp://h:9000", "tcp://h:9001"),
        None,
    ]
    for inst in insts[1:3]:
        argv = worker_argv(inst, 8000)
        flag = argv[argv.index("--kv-events-config") + 1]
        cfg = KvEventsConfig.from_json(flag)
        assert cfg.binds() and cfg.replay_endpoint and argv[-2:] == kv_events_args(inst)
    assert "--kv-events-config" not in worker_argv(insts[3], 8000)
    with pytest.raises(ValueError, match="tcp://host:port"):
        ClusterFile.model_validate({"workers": [{"kv_events": "http://x:1"}]})
    with pytest.raises(ValueError, match="run past 65535"):
        ClusterFile.model_validate({"workers": [{"count": 2, "kv_events": "tcp://x:65533"}]})
