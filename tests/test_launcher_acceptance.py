"""End to end through the CLI on the default fleet (4 emulated Llama-3.3-70B workers on 4 x H100 + the gateway):

* a compressed Bursted burst under ``btb``: the detector fires, copies arrive verified, at least 3 workers serve
  the burst, and p95 TTFT is lower than on a fresh fleet under ``cache_aware``; ``down`` leaves no process;
* a worker killed mid-burst: every request gets exactly one answer or a clear error, none is served twice, and the
  dead worker shows as unhealthy.

The burst: 80 requests sharing a 2,048-token prefix (8 blocks of 256 tokens; ``prefix_blocks`` tuned to 8) plus a
unique 256-token suffix, arriving evenly over 1 s (the adversarial Bursted spread). At the emulated 70B timings a
cold prefill of the prefix takes about 0.15-0.3 s and a warm request about 15-25 ms, so one worker cannot keep up
with 80 requests per second: cache-aware routing builds a queue there, BTB spreads the burst once copies land.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from btbctl.engine.hashing import chain_hashes, text_to_tokens
from btbctl.engine.launcher.bench import PromptSynth
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.writer import write_btb_mixed
from launcher_helpers import FREE_PORTS, ROOT, cli, cli_json, force_cleanup, http_json, recorded_pids, wait_gone

PREFIX_BLOCKS = 8


def _trace(path: Path, n: int, spread_s: float, seed: int):
    params = BurstedParams(
        bursts=1,
        burst_size=n,
        first_burst_s=0.0,
        jitter_s=0.0,
        spread_s=spread_s,
        prefix_tokens=PREFIX_BLOCKS * 256,
        suffix_tokens=256,
        output_tokens=1,
        decoys=0,
    )
    trace = generate_bursted(params, seed=seed)
    write_btb_mixed(trace, path)
    text = PromptSynth(trace.block_tokens).text(trace.requests[0])
    return trace, chain_hashes(text_to_tokens(text), 256)[:PREFIX_BLOCKS]


@pytest.fixture
def dirs(tmp_path):
    made: list[Path] = []

    def new(name: str) -> Path:
        d = tmp_path / name
        made.append(d)
        return d

    yield new
    for d in made:
        force_cleanup(d)


def _run_policy(run_dir: Path, policy: str, trace_path: Path, requests_out: Path) -> dict:
    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", policy, *FREE_PORTS)
    pids = recorded_pids(run_dir)
    cli("tune", "--run-dir", str(run_dir), f"prefix_blocks={PREFIX_BLOCKS}")
    rep = cli_json("bench", "--run-dir", str(run_dir), "--trace", str(trace_path), "--requests-out", str(requests_out))
    control = st["control_url"]
    out = {
        "report": rep,
        "prefixes": http_json(control + "/control/prefixes?top=10"),
        "transfers": http_json(control + "/control/transfers"),
        "holders": {w["url"]: w for w in http_json(control + "/control/fleet")["workers"]},
    }
    down = cli_json("down", "--run-dir", str(run_dir))
    assert down["gone"] == [] and len(down["stopped"] + down["killed"]) == 5
    assert wait_gone(pids) == [], "down left processes behind"
    assert RunDir(run_dir).load() is None
    return out


@pytest.mark.slow
def test_btb_spreads_a_burst_over_verified_copies_and_beats_cache_aware(tmp_path, dirs):
    trace, chain = _trace(tmp_path / "burst.jsonl", n=80, spread_s=1.0, seed=5)
    key = chain[-1]
    btb = _run_policy(dirs("btb"), "btb", tmp_path / "burst.jsonl", tmp_path / "btb.jsonl")
    ca = _run_policy(dirs("ca"), "cache_aware", tmp_path / "burst.jsonl", tmp_path / "ca.jsonl")
    rb, rc = btb["report"], ca["report"]
    summary = (
        f"p95 TTFT btb {rb['ttft_s']['p95']:.3f} s vs cache_aware {rc['ttft_s']['p95']:.3f} s; "
        f"by worker btb {rb['by_worker']} cache_aware {rc['by_worker']}"
    )
    print(summary)
    assert rb["requests"] == rc["requests"] == 80
    assert rb["errors"] == 0 and rc["errors"] == 0
    assert rb["by_worker_source"] == "header"

    # the detector fired on the burst's prefix
    row = next(p for p in btb["prefixes"]["prefixes"] if p["id"] == key)
    assert row["fires"] >= 1 and row["prefix_blocks"] == PREFIX_BLOCKS
    # copies of exactly that prefix arrived and were verified block by block
    copies = [t for t in btb["transfers"]["transfers"] if t["prefix"] == key]
    done = [t for t in copies if t["state"] == "done"]
    assert len(done) >= 2, copies
    for t in done:
        assert t["blocks_verified"] == PREFIX_BLOCKS and t["bytes_sent"] == t["bytes_total"] > 0
    assert len({t["target"] for t in done}) == len(done)
    # the burst was served by at least 3 workers
    assert len([u for u, n in rb["by_worker"].items() if n > 0]) >= 3, summary
    # cache-aware never copies and keeps the burst where the prefix is
    assert ca["transfers"]["transfers"] == []
    assert max(rc["by_worker"].values()) > 0.5 * 80, summary
    # the point of it all
    assert rb["ttft_s"]["p95"] < rc["ttft_s"]["p95"], summary
    # per-request records: one per request, each ok
    for path in (tmp_path / "btb.jsonl", tmp_path / "ca.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in trace.requests)
        assert all(r["status"] == "ok" and r["ttft_s"] > 0 for r in rows)


@pytest.mark.slow
def test_a_worker_killed_mid_burst_loses_no_request(tmp_path, dirs):
    run_dir = dirs("kill")
    n = 200  # dense enough (about 130 requests/s) that the busiest worker holds several requests at once
    trace, chain = _trace(tmp_path / "burst.jsonl", n=n, spread_s=1.5, seed=9)
    st = cli_json("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS)
    pids = recorded_pids(run_dir)
    by_url = {p.url: p for p in RunDir(run_dir).load().workers()}
    control = st["control_url"]
    cli("tune", "--run-dir", str(run_dir), f"prefix_blocks={PREFIX_BLOCKS}")
    served_before = {w["url"]: w["served"] for w in http_json(control + "/control/fleet")["workers"]}
    env = {k: v for k, v in os.environ.items() if k != "BTBCTL_RUN_DIR"}
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "btbctl",
            "bench",
            "--run-dir",
            str(run_dir),
            "--trace",
            str(tmp_path / "burst.jsonl"),
            "--requests-out",
            str(tmp_path / "out.jsonl"),
            "--format",
            "json",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # wait until the burst is under way, then SIGKILL the busiest worker
        victim = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and victim is None:
            rows = http_json(control + "/control/fleet")["workers"]
            busy = max(rows, key=lambda w: w["load"])
            if busy["load"] >= 2 and sum(w["served"] for w in rows) - sum(served_before.values()) >= 10:
                victim = busy["url"]
            else:
                time.sleep(0.005)
        assert victim is not None, "the burst never got under way"
        os.kill(by_url[victim].pid, signal.SIGKILL)
        out, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, err
    rep = json.loads(out)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    # every request exactly once, each an answer or a clear error
    assert sorted(r["request_id"] for r in rows) == sorted(r.request_id for r in trace.requests)
    assert rep["requests"] == n and rep["ok"] + rep["errors"] == n
    for r in rows:
        if r["status"] == "ok":
            assert r["ttft_s"] is not None and r["worker"].startswith("http://127.0.0.1:")
        else:
            assert r["error"] and (r["http_status"] in (None, 200, 502, 503)), r
    print(
        f"killed {victim}: {rep['ok']} ok, {rep['errors']} errors {rep['errors_by_status']}, "
        f"by worker {rep['by_worker']}"
    )
    assert rep["ok"] >= n - 5, rep  # only answers already streaming from the dead worker may break
    # none served twice: the gateway counted exactly one served answer per successful request
    fleet = http_json(control + "/control/fleet")
    served = sum(w["served"] for w in fleet["workers"]) - sum(served_before.values())
    assert served == rep["ok"], (served, rep)
    # the kill hit requests in flight: the gateway moved them to other workers
    import urllib.request

    with urllib.request.urlopen(st["gateway_url"] + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    retries = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("btb_retries_total ")]
    assert retries and retries[0] >= 1, "no request was in flight on the killed worker"
    # the dead worker is marked unhealthy, by the gateway and by `btbctl status`
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = next(w for w in http_json(control + "/control/fleet")["workers"] if w["url"] == victim)
        if not row["healthy"]:
            break
        time.sleep(0.1)
    assert row["healthy"] is False
    proc = cli("status", "--run-dir", str(run_dir), "--format", "json", check=False)
    assert proc.returncode == 1, proc.stderr  # degraded
    status = json.loads(proc.stdout)
    assert status["verdict"] == "degraded" and any("worker" in p for p in status["problems"])
    dead = next(w for w in status["workers"] if w["url"] == victim)
    assert dead["healthy"] is False and dead["alive"] is False
    assert sum(w["healthy"] for w in status["workers"]) == 3
    down = cli_json("down", "--run-dir", str(run_dir))
    assert down["gone"] == [by_url[victim].name]
    assert wait_gone(pids) == []
