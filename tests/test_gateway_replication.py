"""BTB in the live gateway: the detector fires, the policy asks for copies, the planner pushes over /btb routes,
and a target counts as a holder only after the source reports the copy done."""

from __future__ import annotations

import asyncio

from gateway_fakes import BURST_CONSTANTS, BURST_TEXT, GatewayEnv, burst, metric_value, until


async def test_detector_fires_and_btb_copies_to_the_least_loaded_targets():
    async with GatewayEnv(4, policy="btb", constants=BURST_CONSTANTS, worker_token="wtok") as env:
        gw = env.gw
        await burst(env, 2)
        source = next(w for w in env.fleet if w.requests)
        assert len(source.requests) == 2  # cache-aware fallback kept the burst on its first worker
        await until(lambda: len(gw.state.transfers.recent) == 2)
        pushes = source.pushes
        assert len(pushes) == 2 and all(p["auth"] == "Bearer wtok" for p in pushes)
        prefix_id = pushes[0]["body"]["chain"][-1]
        assert all(len(p["body"]["chain"]) == 4 for p in pushes)
        assert len({p["body"]["target"] for p in pushes}) == 2
        assert source.matches  # the source was confirmed with /btb/match before pushing
        holders = gw.state.holders(prefix_id)
        assert len(holders) == 3
        # the copies went to workers that really received them (the fake commits on "done")
        targets = {p["body"]["target"] for p in pushes}
        assert all(prefix_id in w.held for w in env.fleet if w.transfer_addr in targets)
        # each copy was authorized at its target first, with a fresh token the push carried too
        for p in pushes:
            tw = next(w for w in env.fleet if w.transfer_addr == p["body"]["target"])
            exp = tw.expects[p["body"]["copy_id"]]
            assert exp["token"] == p["body"]["token"] and len(exp["token"]) == 64 and exp["auth"] == "Bearer wtok"
            assert exp["chain"] == p["body"]["chain"]
        assert pushes[0]["body"]["token"] != pushes[1]["body"]["token"]
        m = await env.metrics()
        assert metric_value(m, "btb_detector_fires_total") == 1
        assert metric_value(m, "btb_replications_total", result="done") == 2
        assert metric_value(m, "btb_replicated_bytes_total") == 2 * 4 * 1000
        # the burst now spreads over the holders
        await burst(env, 6)
        used = [len(w.requests) for w in env.fleet]
        assert sum(1 for u in used if u) >= 2
        status, heat = await env.get_control("/control/prefixes?top=5")
        row = next(p for p in heat["prefixes"] if p["id"] == prefix_id)
        assert row["hot"] and row["arrivals_in_window"] == 8 and row["threshold"] == 2
        assert len(row["holders"]) == 3 and row["copies_in_flight"] == 0 and row["prefix_tokens"] == 16


async def test_failed_copy_never_makes_the_target_a_holder():
    async with GatewayEnv(2, policy="btb", constants=BURST_CONSTANTS, worker_kw={"copy_outcome": "failed"}) as env:
        gw = env.gw
        await burst(env, 2)
        await until(lambda: len(gw.state.transfers.recent) == 1)
        t = gw.state.transfers.recent[0]
        assert t.state == "failed" and "checksum" in t.error
        assert gw.state.holders(t.key) == [t.source]
        status, tr = await env.get_control("/control/transfers")
        row = tr["transfers"][0]
        assert row["state"] == "failed" and "checksum" in row["error"] and row["bytes_total"] == 4000
        assert tr["totals"]["failed"] == 1
        m = await env.metrics()
        assert metric_value(m, "btb_replications_total", result="failed") == 1
        assert metric_value(m, "btb_replicated_bytes_total") == 0


async def test_copy_in_flight_is_visible_with_progress_then_done():
    async with GatewayEnv(
        2, policy="btb", constants=BURST_CONSTANTS, poll_interval_s=0.05, worker_kw={"copy_polls": 6}
    ) as env:
        gw = env.gw
        await burst(env, 2)
        await until(lambda: any(t.bytes_sent for t in gw.state.transfers.active.values()))
        status, tr = await env.get_control("/control/transfers")
        row = tr["transfers"][0]
        assert tr["in_flight"] == 1 and row["state"] == "running"
        assert 0 < row["bytes_sent"] < row["bytes_total"] == 4000 and row["bytes_per_s"] > 0
        assert row["eta_s"] is not None and row["eta_s"] > 0
        key = row["prefix"]
        target = 1 - gw.state.holders(key)[0]
        assert gw.state.copy_in_flight(target, gw.state.chains.chain_of(key))
        assert target not in gw.state.holders(key)  # not warm while sending
        status, heat = await env.get_control("/control/prefixes")
        assert heat["prefixes"][0]["copies_in_flight"] == 1
        await until(lambda: not gw.state.transfers.active)
        assert sorted(gw.state.holders(key)) == [0, 1]


async def test_plain_sglang_workers_route_without_replication():
    async with GatewayEnv(3, policy="btb", constants=BURST_CONSTANTS, page_size=4, worker_kw={"btb": False}) as env:
        await burst(env, 4)
        await asyncio.sleep(0.1)
        m = await env.metrics()
        assert metric_value(m, "btb_detector_fires_total") == 1  # hot, but nothing can be copied
        assert all(not w.pushes and not w.matches for w in env.fleet)
        assert not env.gw.state.transfers.all()
        status, fleet = await env.get_control("/control/fleet")
        assert "unsupported" in fleet["replication"]
        assert all(not w["replication"] and "plain SGLang" in w["replication_note"] for w in fleet["workers"])


async def test_page_size_defaults_to_256_without_btb_info():
    async with GatewayEnv(1, worker_kw={"btb": False}) as env:
        assert env.gw.page_size == 256


async def test_push_goes_out_while_the_source_still_prefills():
    first_byte = asyncio.Event()  # no worker sends a first byte before the test sets this
    async with GatewayEnv(3, policy="btb", constants=BURST_CONSTANTS, worker_kw={"first_byte_gate": first_byte}) as env:
        gw = env.gw
        first = asyncio.ensure_future(env.post("/generate", {"text": BURST_TEXT + "a"}))
        await until(lambda: any(w.requests for w in env.fleet))
        second = asyncio.ensure_future(env.post("/generate", {"text": BURST_TEXT + "b"}))
        await until(lambda: any(w.pushes for w in env.fleet))
        # the push went out before the source's first byte (it is still held back)
        assert not first.done()
        source = next(w for w in env.fleet if w.pushes)
        assert source.matches and all(p["body"]["chain"][-1] in source.computing for p in source.pushes)
        ts = list(gw.state.transfers.active.values())
        # running once the gateway read the source's 202 (the push reached the source above; its answer may not
        # have been read yet), and never held back waiting for the source
        await until(lambda: all(t.state == "running" for t in ts))
        assert ts and not any(t.waited for t in ts)  # pushed, never stalled
        # the targets count the prefix as arriving: the published rule does not copy to them again
        chain = tuple(source.pushes[0]["body"]["chain"])
        assert all(gw.state.pending_blocks(t.target, chain) == len(chain) for t in ts)
        first_byte.set()
        assert (await first)[0] == 200 and (await second)[0] == 200


async def test_a_declared_burst_fires_the_detector_on_its_first_request_within_the_clients_bound(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="btbctl.engine.gateway")
    constants = {**BURST_CONSTANTS, "threshold": 8}
    async with GatewayEnv(4, policy="btb", constants=constants, declared_requests_max=10) as env:
        gw = env.gw
        declare = {"X-BTB-Expected-Requests": "8"}
        status, _ = await env.post("/generate", {"text": BURST_TEXT + "a"}, headers=declare)
        assert status == 200
        source = next(w for w in env.fleet if w.requests)
        assert "X-BTB-Expected-Requests" not in str(source.requests)  # not forwarded
        prefix_id = env.fleet[0].chain_of("/generate", {"text": BURST_TEXT})[3]
        assert gw.detector.is_active(prefix_id, gw.clock())  # hot on its first request (threshold 8)
        assert gw.detector.arrivals_in_window(prefix_id, gw.clock()) == 8
        # the batch's second request (no header) finds a holder: the copies go out (3 warm replicas: 2 copies)
        assert (await env.post("/generate", {"text": BURST_TEXT + "b"}))[0] == 200
        await until(lambda: len(gw.state.transfers.recent) == 2)
        assert source.pushes[0]["body"]["chain"][-1] == prefix_id
        # the same client again within the window: 3 of its 10 extra arrivals are left, the rest is not counted
        other = "another prefix " * 10
        status, _ = await env.post("/generate", {"text": other}, headers={"X-BTB-Expected-Requests": "50"})
        assert status == 200
        other_id = env.fleet[0].chain_of("/generate", {"text": other})[3]
        assert gw.detector.arrivals_in_window(other_id, gw.clock()) == 4 and not gw.detector.is_active(
            other_id, gw.clock()
        )
        await env.post("/generate", {"text": other + "x"}, headers={"X-BTB-Expected-Requests": "50"})
        capped = [r.getMessage() for r in caplog.records if "declared_burst_capped" in r.getMessage()]
        assert len(capped) == 1 and "asked=49" in capped[0] and "granted=3" in capped[0] and "cap=10" in capped[0]
        for bad in ("0", "-3", "many", "1e3", "99999999999", "\u00b2", "\uff13", "\u0663"):  # not ASCII digits
            status, body = await env.post("/generate", {"text": other}, headers={"X-BTB-Expected-Requests": bad})
            assert status == 400 and "X-BTB-Expected-Requests" in body["error"]["message"], bad
