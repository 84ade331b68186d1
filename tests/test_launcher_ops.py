"""Fleet operations on a live local fleet of emulated workers: the gateway's operations log (`btbctl logs`, during
and after a run), `status` exit codes, restarting only the gateway, port checks before anything starts, tuned
constants that survive `down`/`up`."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from btbctl.engine.hashing import chain_hashes, text_to_tokens
from btbctl.engine.launcher.bench import PromptSynth
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.writer import write_btb_mixed
from launcher_helpers import FREE_PORTS, cli, cli_json, recorded_pids, wait_gone


def _trace(path: Path, n: int = 4, prefix_blocks: int = 8):
    params = BurstedParams(
        bursts=1,
        burst_size=n,
        first_burst_s=0.0,
        jitter_s=0.0,
        spread_s=0.5,
        prefix_tokens=prefix_blocks * 256,
        suffix_tokens=256,
        output_tokens=1,
        decoys=0,
    )
    trace = generate_bursted(params, seed=3)
    write_btb_mixed(trace, path)
    text = PromptSynth(trace.block_tokens).text(trace.requests[0])
    return chain_hashes(text_to_tokens(text), 256)[:prefix_blocks]


def _events(run_dir: Path, *extra: str) -> list[dict]:
    out = cli("logs", "gateway", "--run-dir", str(run_dir), "-n", "0", "--json", *extra).stdout
    return [json.loads(line) for line in out.splitlines()]


def _wait_events(run_dir: Path, event: str, timeout_s: float = 15.0, **match: str) -> list[dict]:
    """The gateway's log lines once one ``event`` matching ``match`` is among them (or at ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = _events(run_dir)
        hit = any(e.get("event") == event and all(str(e.get(k)) == v for k, v in match.items()) for e in events)
        if hit or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def _one(events: list[dict], event: str, **match: str) -> dict:
    hits = [e for e in events if e.get("event") == event and all(str(e.get(k)) == v for k, v in match.items())]
    assert hits, (event, match, [e.get("event") for e in events])
    return hits[-1]


@pytest.mark.slow
def test_operations_log_shows_bench_tune_replicate_and_outlives_down(tmp_path, run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", "cache_aware", *FREE_PORTS)
    names = {w["url"]: w["name"] for w in st["workers"]}
    chain = _trace(tmp_path / "t.jsonl")
    rep = cli_json("bench", "--run-dir", str(run_dir), "--trace", str(tmp_path / "t.jsonl"))
    assert rep["ok"] == 4
    cli("tune", "--run-dir", str(run_dir), "threshold=3", "policy=btb")
    res = cli_json("replicate", "--run-dir", str(run_dir), "--prefix", chain[-1][:8], "-n", "1")
    assert res["status"] == "done"
    # a client error is logged once (a 200 is not)
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(urllib.request.Request(st["gateway_url"] + "/generate", data=b"{", method="POST"))

    # the gateway's log during the run: who, what, old, new; the copy's source, target, bytes, duration, outcome
    ev = _events(run_dir)
    assert all("ts" in e and "level" in e for e in ev if "event" in e)
    w = _one(ev, "control_write", key="threshold")
    assert w["old"] == 2 and w["new"] == 3 and w["token"] == "yes" and w["peer"] == "127.0.0.1"
    p = _one(ev, "control_write", key="policy")
    assert p["old"] == "cache_aware" and p["new"] == "btb"
    _one(ev, "control_replicate", prefix=chain[-1][:8])
    done = _one(ev, "copy_done", prefix=chain[-1])
    assert done["source"] in names.values() and done["target"] in names.values()
    assert done["source"] != done["target"] and done["source_url"] in names
    assert done["bytes"] > 0 and done["duration_s"] > 0 and done["outcome"] == "done"
    err = _one(ev, "request_error", status="400")
    assert err["path"] == "/generate"
    assert not [e for e in ev if e.get("event") == "request_error" and e.get("status") == 200]
    # the build the gateway's process runs (this installation's, or the checkout's sources when started from it)
    assert _one(ev, "gateway_start")["routing_core"] in ("compiled", "plain Python")
    human = cli("logs", "gateway", "--run-dir", str(run_dir), "-n", "0").stdout
    assert "event=control_write" in human and "key=threshold old=2 new=3" in human and "event=copy_done" in human

    # --since: a duration and a timestamp
    assert _events(run_dir, "--since", "10m")
    assert _events(run_dir, "--since", "2999-01-01T00:00:00") == []
    # a name that does not exist lists the valid ones
    bad = cli("logs", "nope", "--run-dir", str(run_dir), check=False)
    assert bad.returncode == 2 and "gateway" in bad.stderr and "worker-0" in bad.stderr

    pids = recorded_pids(run_dir)
    cli("down", "--run-dir", str(run_dir))
    assert wait_gone(pids) == []
    # after down: the logs are still there, listed and readable
    listed = cli("logs", "--run-dir", str(run_dir)).stdout.split()
    assert {"gateway", "gateway.out", "worker-0", "worker-3"} <= set(listed)
    after = _events(run_dir)
    assert _one(after, "copy_done", prefix=chain[-1])["bytes"] == done["bytes"]
    _one(after, "control_write", key="threshold")
    assert "ready " in cli("logs", "gateway.out", "--run-dir", str(run_dir)).stdout

    # the constants tuned survive down/up (same cluster file: the embedded default)
    again = cli("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS, "--format", "json")
    try:
        st = json.loads(again.stdout)
        assert st["policy"] == "btb"
        assert cli_json("tune", "--run-dir", str(run_dir))["constants"]["threshold"] == 3
        assert "applying the tuning last confirmed on the default fleet (policy btb, " in again.stderr
        assert "threshold 3" in again.stderr
    finally:
        cli("down", "--run-dir", str(run_dir))


@pytest.mark.slow
def test_status_codes_and_gateway_only_restart(run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS)
    assert st["verdict"] == "up"
    assert cli("status", "--run-dir", str(run_dir)).returncode == 0
    cli("tune", "--run-dir", str(run_dir), "window_s=7")
    state = RunDir(run_dir).load()
    workers = [p.pid for p in state.workers()]
    os.kill(state.gateway().pid, signal.SIGKILL)
    wait_gone([state.gateway().pid])

    proc = cli("status", "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 1 and "gateway is not running" in proc.stdout and "--gateway-only" in proc.stdout
    # a plain up points at --gateway-only instead of refusing with "already running"
    up = cli("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS, check=False)
    assert up.returncode == 2 and "--gateway-only" in up.stderr
    assert [p.pid for p in RunDir(run_dir).load().workers()] == workers

    cli("up", "--gateway-only", "--run-dir", str(run_dir))
    st2 = cli_json("status", "--run-dir", str(run_dir))
    assert st2["verdict"] == "up" and st2["gateway_url"] == st["gateway_url"]  # same ports
    assert [p.pid for p in RunDir(run_dir).load().workers()] == workers  # the workers (and caches) stayed
    assert cli_json("tune", "--run-dir", str(run_dir))["constants"]["window_s"] == 7  # the last tune reapplied
    assert [w["name"] for w in st2["workers"]] == [f"worker-{i}" for i in range(4)]
    again = cli("up", "--gateway-only", "--run-dir", str(run_dir), check=False)
    assert again.returncode == 2 and "still running" in again.stderr
    ev = _events(run_dir)
    assert len([e for e in ev if e.get("event") == "gateway_start"]) == 2  # appended, not truncated

    # a dead worker: degraded, exit 1, one line per problem and no traceback
    victim = RunDir(run_dir).load().workers()[1]
    os.kill(victim.pid, signal.SIGKILL)
    wait_gone([victim.pid])
    deadline = time.monotonic() + 15
    while True:
        proc = cli("status", "--run-dir", str(run_dir), "--format", "json", check=False)
        row = next(w for w in json.loads(proc.stdout)["workers"] if w["name"] == victim.name)
        if not row["healthy"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert proc.returncode == 1 and row["health_error"] == "process exited"
    human = cli("status", "--run-dir", str(run_dir), check=False).stdout
    assert "Traceback" not in human and "aiohttp" not in human and row["url"] in human  # URLs are not cut
    # status sees the dead pid at once; the gateway's prober notices on its next probe, so wait for its line
    _one(_wait_events(run_dir, "worker_down", worker=victim.name), "worker_down", worker=victim.name)
    cli("down", "--run-dir", str(run_dir))
    proc = cli("status", "--run-dir", str(run_dir), check=False)
    assert proc.returncode == 2 and "no fleet" in proc.stderr


@pytest.mark.slow
def test_busy_gateway_port_is_refused_before_any_worker_starts(run_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        proc = cli("up", "-d", "--run-dir", str(run_dir), "--port", str(busy), "--control-port", "0", check=False)
    assert proc.returncode == 2 and f"127.0.0.1:{busy} is in use" in proc.stderr
    assert "started worker-" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1  # none started
    assert RunDir(run_dir).load() is None
    assert not (run_dir / "logs" / "worker-0.log").exists()


@pytest.mark.slow
def test_prefixes_flush_and_the_warnings(tmp_path, run_dir):
    from launcher_helpers import http_json

    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", "cache_aware", *FREE_PORTS)
    urls = [w["url"] for w in st["workers"]]
    chain = _trace(tmp_path / "t.jsonl")
    # --seed shapes only the default trace: with --trace it is refused, not ignored
    bad = cli("bench", "--run-dir", str(run_dir), "--trace", str(tmp_path / "t.jsonl"), "--seed", "7", check=False)
    assert bad.returncode == 2 and "--seed" in bad.stderr and "--trace" in bad.stderr
    cli("tune", "--run-dir", str(run_dir), "prefix_blocks=8")  # the trace's prefix, so the detector tracks it
    cli_json("bench", "--run-dir", str(run_dir), "--trace", str(tmp_path / "t.jsonl"))
    assert sum(http_json(u + "/btb/match", {"chain": chain})["cached_blocks"] for u in urls) == 8

    # prefixes: ids in the form replicate --prefix takes, holders by name
    res = cli_json("prefixes", "--run-dir", str(run_dir))
    assert [p["id"] for p in res["prefixes"]] == [chain[-1]]
    human = cli("prefixes", "--run-dir", str(run_dir)).stdout
    from btbctl.engine.chains import short_id

    assert short_id(chain[-1]) in human and "worker-" in human and "http://" not in human
    cli_json("replicate", "--run-dir", str(run_dir), "--prefix", short_id(chain[-1]), "-n", "1")

    # tune above the fleet size: accepted, with a warning line
    proc = cli("tune", "--run-dir", str(run_dir), "replicas=99")
    assert "warning" in proc.stderr and "4 worker" in proc.stderr

    # flush: every worker's cache and the gateway's records are emptied
    out = cli_json("flush", "--run-dir", str(run_dir))
    assert out["flushed"] == 4 and set(out["workers"]) == {f"worker-{i}" for i in range(4)}
    assert [http_json(u + "/btb/match", {"chain": chain})["cached_blocks"] for u in urls] == [0, 0, 0, 0]
    assert cli_json("prefixes", "--run-dir", str(run_dir))["prefixes"] == []
    assert _one(_events(run_dir), "control_flush")["flushed"] == 4
    cli("down", "--run-dir", str(run_dir))
