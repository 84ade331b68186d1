"""Real SGLang 0.5.23 servers across two hosts of the namespace testbed (tests/netns.py): each host runs one server
(the tiny model, on the CPU with the harness's stand-in) and its node agent, started by ``btbctl up -d`` over SSH;
the gateway runs on the operator side. A hot prefix's pages cross the paced link agent to agent while the source is
still prefilling it, and the target proves the copy with a warm-up that loads it from L3; a target whose warm-up
times out is never counted warm. Marker ``sglang_server`` (and ``netns``: root, iproute2, sshd)."""

from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from btbctl.sglang_l3.keys import page_keys
from launcher_helpers import ROOT, http_json
from netns import open_testbed, require_sshd, require_testbed, start_sshd
from netns_fleet import _toml, host_entry
from sglang_cpu.harness import venv_dir
from sglang_server import PAGE, SglangFleet, check_standin_log, generate, harness_env, ids, stop

pytestmark = [pytest.mark.sglang_server, pytest.mark.netns, pytest.mark.timeout(1200)]

#: Link rate of each host (slow enough that the link paces a copy of a few MB).
RATE_GBIT = 0.2
#: The burst's prefix: 16 x 256 tokens = 4,096 tokens, 16 prefill chunks of 256 at the fleet's chunk size; BTB's Y
#: is all of it (256 pages of 16), so the copy starts while the source is still prefilling it.
PREFIX_BLOCKS = 16
Y_PAGES = 256
#: Requests in the burst (one every 0.5 s).
BURST = 14


def _cluster(path, servers, env: dict) -> None:
    venv = venv_dir()
    lines = [
        "[gateway]",
        'policy = "btb"',  # the published rule copies when the detector fires
        "port = 0",
        "control_port = 0",
        "page_size = 16",
        "",
        "[gateway.settings]",
        "l3_warmup_timeout_s = 10.0",
        "",
        "[btb]",
        f"prefix_blocks = {Y_PAGES}",
        "threshold = 2",
        "window_s = 2.0",
        "warm_replicas = 2",
        "",
        "[replication]",
        'mode = "l3"',
        "arena_mib = 256",
        "hicache_size_gb = 1",
        "prefetch_threshold = 16",
        "",
    ]
    for s in servers:
        h = host_entry(s)
        h["python"] = sys.executable
        h["start_timeout_s"] = 900.0
        lines.append("[[hosts]]")
        lines += [f"{k} = {_toml(v)}" for k, v in h.items()]
        lines.append("")
    for i, s in enumerate(servers):
        w = {
            "kind": "sglang",
            "name": f"n{i}",
            "host": s.host.name,
            "count": 1,
            "model": str(venv / "tiny-llama"),
            "served_model_name": "tiny-llama",
            "python": str(venv / "bin" / "python"),
            "tp_size": 1,
            "port": 30000,
            "page_size": PAGE,
            "chunked_prefill_size": 256,
            "extra_args": [
                "--device",
                "cpu",
                "--attention-backend",
                "torch_native",
                "--max-total-tokens",
                "8192",
                "--sleep-on-idle",
            ],
            "env": env,
            "ready_timeout_s": 900.0,
        }
        lines.append("[[workers]]")
        lines += [f"{k} = {_toml(v)}" for k, v in w.items()]
        lines.append("")
    path.write_text("\n".join(lines))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    require_testbed()
    require_sshd()
    tmp = tmp_path_factory.mktemp("sglang-netns")
    log = tmp / "standin.jsonl"
    env = harness_env(log)  # skips first where the harness is not built
    tb = open_testbed(2, rate_gbit=RATE_GBIT)
    f = None
    try:
        servers = [start_sshd(h, tmp / "ssh") for h in tb.hosts]
        cfg = tmp / "cluster.toml"
        _cluster(cfg, servers, {**env, "PYTHONPATH": str(ROOT)})
        f = SglangFleet(tmp / "run", env, {}, log)
        f.status = f.json("up", "-d", "-c", str(cfg), timeout=1200)
        f.testbed = tb
        yield f
    finally:
        if f is not None:
            stop(f)
        tb.close()


def _host_of(fleet, url: str) -> str:
    addr = url.split("//", 1)[1].rsplit(":", 1)[0]
    return next(h.name for h in fleet.testbed.hosts if h.address == addr)


def test_pages_cross_the_link_while_the_source_prefills_and_the_proof_holds(fleet):
    st = fleet.json("status")
    assert st["replication"] == "l3" and len(st["agents"]) == 2
    assert {_host_of(fleet, w["url"]) for w in st["workers"]} == {h.name for h in fleet.testbed.hosts}
    # one request every 0.5 s: the second fires the detector while the first still prefills the prefix (about 1 s
    # on this CPU), and the copy is usable about 1.5 s later; the published rule then spreads the rest over the
    # holders (least loaded, ties at random), so 10 requests after it leave a burst on one host no real chance
    rep = fleet.json(
        "bench",
        "--prompt",
        "ids",
        "--burst-size",
        str(BURST),
        "--prefix-blocks",
        str(PREFIX_BLOCKS),
        "--spread-s",
        str(BURST * 0.5),
        "--seed",
        "31",
        timeout=900,
    )
    assert (rep["ok"], rep["errors"]) == (BURST, 0), rep
    assert len(rep["by_worker"]) == 2, (rep["by_worker"], rep["copies"])
    fleet.settle()
    copies = [c for c in rep["copies"] if c["mode"] == "l3"]
    done = [c for c in copies if c["state"] == "done"]
    assert done, copies
    for c in done:
        assert _host_of(fleet, c["source"]) != _host_of(fleet, c["target"])
        assert c["bytes"] > 0 and c["outcome"] == "proved", c
        assert c["proof_storage_tokens"] >= c["covered_tokens"], c
        # the first pages crossed the link before the source had written the last one: the copy streamed
        assert c["overlap_s"] is not None and c["overlap_s"] > 0.1, c
        mbps = c["bytes"] * 8 / c["transfer_s"] / 1e6 if c["transfer_s"] else None
        print(
            f"copy {c['bytes'] / 1e6:.2f} MB, usable after {c['usable_s']:.3f} s, phases {c['phases_s']}, "
            f"streamed {c['overlap_s']:.3f} s behind the prefill, {mbps} Mbit/s over a {RATE_GBIT * 1000:g} Mbit/s link"
        )


def test_a_target_whose_warm_up_times_out_is_never_warm(fleet):
    prompt = ids(Y_PAGES * PAGE + 8, seed=41)
    generate(fleet.gateway, prompt)  # one worker computes it (and writes it through to its agent)
    chain = page_keys(prompt, PAGE)[:Y_PAGES]
    holders = [h.rstrip("/") for h in http_json(fleet.control + f"/control/replications/{chain[-1]}")["holders"]]
    b = next(w["url"].rstrip("/") for w in fleet.status["workers"] if w["url"].rstrip("/") not in holders)
    name_b = next(w["name"] for w in fleet.status["workers"] if w["url"].rstrip("/") == b)
    fleet.signal(name_b, signal.SIGSTOP)
    try:
        proc = fleet.cli("replicate", "--prefix", chain[-1], "-n", "1", "--format", "json", check=False)
        deadline = time.monotonic() + 60
        while True:
            rec = http_json(fleet.control + f"/control/replications/{chain[-1]}")
            ended = [c for c in rec["copies"] if c["state"] in ("done", "failed")]
            if ended or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        fleet.signal(name_b, signal.SIGCONT)
    assert ended and ended[-1]["state"] == "failed", (proc.stdout, proc.stderr, rec)
    assert b not in [h.rstrip("/") for h in rec.get("holders", [])], rec
    assert json.loads(proc.stdout or "{}").get("prefix") in (None, chain[-1])


def test_the_stand_in_replaced_only_what_the_facts_name(fleet):
    check_standin_log(fleet.standin_log)
