"""The gateway's Prometheus metrics a Grafana user expects, and the example dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway_fakes import BURST_CONSTANTS, BURST_TEXT, GatewayEnv, burst, metric_value, until

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana-dashboard.json"


def _labels(text: str, label: str) -> set[str]:
    return {s.labels[label] for f in text_string_to_metric_families(text) for s in f.samples if label in s.labels}


async def test_gauges_for_constants_policy_hot_prefixes_and_copies():
    async with GatewayEnv(4, policy="btb", constants=BURST_CONSTANTS) as env:
        m = await env.metrics()
        assert metric_value(m, "btb_constant", constant="prefix_blocks") == 4
        assert metric_value(m, "btb_constant", constant="threshold") == 2
        assert metric_value(m, "btb_constant", constant="window_s") == 5.0
        assert metric_value(m, "btb_constant", constant="warm_replicas") == 3
        assert metric_value(m, "btb_policy_info", policy="btb") == 1
        assert metric_value(m, "btb_hot_prefixes") == 0
        assert "btb_copies_in_flight" in m
        await burst(env, 2)
        await until(lambda: len(env.gw.state.transfers.recent) == 2)
        m = await env.metrics()
        assert metric_value(m, "btb_hot_prefixes") == 1
        assert metric_value(m, "btb_copies_in_flight") == 0
        assert metric_value(m, "btb_copy_duration_seconds_count", mode="push", outcome="done") == 2
        assert metric_value(m, "btb_copy_bytes_total", mode="push", outcome="done") == 2 * 4 * 1000
        env.gw.set_constants({"threshold": 7})
        env.gw.set_policy("round_robin")
        m = await env.metrics()
        assert metric_value(m, "btb_constant", constant="threshold") == 7
        assert metric_value(m, "btb_policy_info", policy="round_robin") == 1
        assert metric_value(m, "btb_policy_info", policy="btb") == 0


async def test_ttft_is_labelled_by_policy_so_a_tune_can_be_compared():
    async with GatewayEnv(2, policy="round_robin") as env:
        assert (await env.post("/generate", {"text": BURST_TEXT}))[0] == 200
        env.gw.set_policy("least_load")
        for _ in range(2):
            assert (await env.post("/generate", {"text": BURST_TEXT}))[0] == 200
        m = await env.metrics()
        assert metric_value(m, "btb_ttft_seconds_count", policy="round_robin") == 1
        assert metric_value(m, "btb_ttft_seconds_count", policy="least_load") == 2


async def test_rejected_requests_are_counted_by_reason():
    async with GatewayEnv(2, max_body_bytes=1024) as env:
        assert (await env.post("/generate", b"{not json"))[0] == 400
        assert (await env.post("/generate", {"text": "x" * 4096}))[0] == 413
        assert (await env.post("/nowhere", {"text": "x"}))[0] == 404
        async with env.http.get(env.url + "/generate") as r:
            assert r.status == 405
        for w in env.fleet:
            await w.kill()
        for w in env.gw.state.workers:
            env.gw.lifecycle.worker_failed(w.index, "test")
        assert (await env.post("/generate", {"text": BURST_TEXT}))[0] == 503
        m = await env.metrics()
        assert metric_value(m, "btb_rejected_requests_total", reason="bad_request", status="400") == 1
        assert metric_value(m, "btb_rejected_requests_total", reason="body_too_large", status="413") == 1
        assert metric_value(m, "btb_rejected_requests_total", reason="not_found", status="404") == 1
        assert metric_value(m, "btb_rejected_requests_total", reason="method_not_allowed", status="405") == 1
        assert metric_value(m, "btb_rejected_requests_total", reason="no_healthy_worker", status="503") == 1


async def test_worker_labels_are_names_not_urls():
    async with GatewayEnv(2) as env:
        for _ in range(4):
            assert (await env.post("/generate", {"text": BURST_TEXT}))[0] == 200
        m = await env.metrics()
        workers = _labels(m, "worker")
        assert workers == {"w0", "w1"}
        assert "http://" not in m


def _dashboard_metric_names() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(board)
    assert exprs, "the dashboard has no queries"
    return {n for e in exprs for n in re.findall(r"\b(btb_[a-z0-9_]+)", e)}


async def test_every_metric_the_example_dashboard_reads_exists():
    async with GatewayEnv(4, policy="btb", constants=BURST_CONSTANTS) as env:
        await burst(env, 2)
        await until(lambda: len(env.gw.state.transfers.recent) == 2)
        assert (await env.post("/generate", b"[]"))[0] == 400
        m = await env.metrics()
    names = set()
    for fam in text_string_to_metric_families(m):
        names.add(fam.name)
        names.update(s.name for s in fam.samples)
    used = _dashboard_metric_names()
    assert len(used) >= 10
    assert used <= names, f"the dashboard reads metrics the gateway does not export: {sorted(used - names)}"


async def test_copies_btb_plus_left_out_for_a_recompute_are_counted():
    async with GatewayEnv(2, policy="btb_plus", constants=BURST_CONSTANTS) as env:
        m = await env.metrics()
        assert metric_value(m, "btb_copies_not_paying_total") == 0
        env.gw.policy._stats["copy_not_paying"] += 3  # the policy's own count, as rule 4 keeps it
        m = await env.metrics()
        assert metric_value(m, "btb_copies_not_paying_total") == 3
