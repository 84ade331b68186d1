"""The live fleet through the CLI: ``up -d`` / ``status`` / ``tune`` / ``down`` with real emulated workers and the
real gateway, a foreground ``up``, clean-up after a failed ``up``, SGLang workers through a stand-in interpreter, and
``replicate``."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from btbctl.engine.control.client import ControlClient
from btbctl.engine.control.steering import parse_tune_args
from btbctl.engine.errors import BtbctlError
from btbctl.engine.hashing import chain_hashes, text_to_tokens
from btbctl.engine.launcher.bench import PromptSynth
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.trace.generate import BurstedParams, generate_bursted
from btbctl.engine.trace.writer import write_btb_mixed
from launcher_helpers import FREE_PORTS, ROOT, cli, cli_json, http_json, recorded_pids, wait_gone

STANDIN = Path(__file__).with_name("_standin.py")


def _one_error_line(proc: subprocess.CompletedProcess, *words: str, after_progress: bool = False) -> None:
    """Exit status 2 and the error as one line (the last on stderr; the only one unless ``after_progress``)."""
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("btbctl: error: "), proc.stderr
    assert after_progress or len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "btbctl: error" not in "".join(lines[:-1])
    for w in words:
        assert w in lines[-1], lines[-1]


def test_parse_tune_args():
    assert parse_tune_args(["prefix_blocks=16", "threshold=3", "window_s=0.5", "replicas=2", "policy=cache_aware"]) == {
        "prefix_blocks": 16,
        "threshold": 3,
        "window_s": 0.5,
        "warm_replicas": 2,
        "policy": "cache_aware",
    }
    assert parse_tune_args(["window-s=2"]) == {"window_s": 2.0}
    for bad, key in (
        (["threshold=0"], "threshold"),
        (["threshold=two"], "threshold"),
        (["window_s=-1"], "window_s"),
        (["window_s=nan"], "window_s"),
        (["policy=fastest"], "policy"),
        (["speed=1"], "speed"),
        (["threshold"], "threshold"),
        (["replicas=2", "replicas=3"], "warm_replicas"),
    ):
        with pytest.raises(BtbctlError) as ei:
            parse_tune_args(bad)
        assert key in str(ei.value)


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_commands_without_a_fleet_fail_with_one_line(tmp_path):
    d = str(tmp_path / "none")
    _one_error_line(cli("status", "--run-dir", d, check=False), "no fleet is running")
    nothing = cli("down", "--run-dir", d)  # nothing running is not an error for down (exit 0, one line)
    assert nothing.returncode == 0 and "nothing to stop" in nothing.stdout and not nothing.stderr
    _one_error_line(cli("tune", "--run-dir", d, "threshold=3", check=False), "no fleet is running")
    _one_error_line(cli("tune", "--run-dir", d, "bogus=3", check=False), "bogus", "valid")
    _one_error_line(cli("replicate", "--run-dir", d, "--prefix", "abc", check=False), "no fleet is running")
    _one_error_line(cli("bench", "--run-dir", d, check=False), "no fleet is running")
    _one_error_line(cli("up", "-c", str(tmp_path / "missing.toml"), check=False), "missing.toml", "cannot read")


@pytest.mark.slow
def test_up_detached_status_tune_down(run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS)
    assert st["gateway_url"].startswith("http://127.0.0.1:") and st["control_url"].startswith("http://127.0.0.1:")
    assert [w["name"] for w in st["workers"]] == [f"worker-{i}" for i in range(4)]
    assert all(w["healthy"] and w["url"].startswith("http://127.0.0.1:") for w in st["workers"])
    rd = RunDir(run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for p in (rd.token_path, rd.worker_token_path, rd.state_path, run_dir / "gateway.json"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    pids = recorded_pids(run_dir)
    assert len(pids) == 5

    # a second fleet in the same run directory is refused; the first is untouched
    _one_error_line(
        cli("up", "-d", "--run-dir", str(run_dir), *FREE_PORTS, check=False), "already running", after_progress=True
    )
    assert recorded_pids(run_dir) == pids

    st2 = cli_json("status", "--run-dir", str(run_dir))
    assert {"gateway_url", "control_url", "workers"} <= set(st2)
    assert st2["gateway_url"] == st["gateway_url"]
    for w in st2["workers"]:
        assert {"name", "url", "healthy"} <= set(w) and w["healthy"] is True
        # how long ago the gateway read the worker's numbers, seconds (not a reading of the gateway's own clock)
        assert w["metrics_age_s"] is None or 0 <= w["metrics_age_s"] < 60, w

    # tune: validated locally, applied by the gateway, confirmed back
    _one_error_line(cli("tune", "--run-dir", str(run_dir), "threshold=0", check=False), "threshold")
    res = cli_json("tune", "--run-dir", str(run_dir), "prefix_blocks=8", "window_s=0.5", "policy=least_load")
    assert res["policy"] == "least_load"
    assert res["constants"]["prefix_blocks"] == 8 and res["constants"]["window_s"] == 0.5
    assert cli_json("tune", "--run-dir", str(run_dir))["constants"]["prefix_blocks"] == 8
    # writes need the run's token
    with pytest.raises(BtbctlError, match="401"):
        with ControlClient(st["control_url"], token="wrong") as api:
            api.set_constants({"threshold": 3})

    out = cli_json("down", "--run-dir", str(run_dir))
    assert sorted(out["stopped"] + out["killed"]) == sorted(["gateway"] + [f"worker-{i}" for i in range(4)])
    assert out["gone"] == []
    assert wait_gone(pids) == []
    assert rd.load() is None and not rd.token_path.exists()
    _one_error_line(cli("status", "--run-dir", str(run_dir), check=False), "no fleet is running")


@pytest.mark.slow
def test_foreground_up_stops_everything_on_ctrl_c_and_on_down(run_dir):
    for how in ("sigint", "down"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "btbctl", "up", "--run-dir", str(run_dir), *FREE_PORTS],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            state = None
            while time.monotonic() < deadline:
                state = RunDir(run_dir).load()
                if state is not None and state.complete:
                    break
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.1)
            assert state is not None and state.complete and not state.detached
            assert state.owner_pid == proc.pid
            pids = [p.pid for p in state.processes]
            assert cli_json("status", "--run-dir", str(run_dir))["workers"][0]["healthy"] is True
            if how == "sigint":
                proc.send_signal(signal.SIGINT)
            else:
                res = cli_json("down", "--run-dir", str(run_dir))
                assert sorted(res["stopped"]) == sorted(["gateway"] + [f"worker-{i}" for i in range(4)])
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            assert "stopping the fleet" in err
            assert wait_gone(pids) == []
            assert RunDir(run_dir).load() is None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_failed_up_stops_what_it_started(tmp_path, run_dir):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f"""
[[workers]]
count = 2

[[workers]]
name = "broken"
command = ["{sys.executable}", "{STANDIN}", "--port", "{{port}}"]
env = {{ STANDIN_EXIT = "7" }}
""")
    proc = cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS, check=False)
    _one_error_line(proc, "broken-0 exited with status 7", "asked to fail", after_progress=True)
    assert RunDir(run_dir).load() is None
    # the two emulated workers that had started are gone too
    started = [int(line.split("pid ")[1].rstrip(")")) for line in proc.stderr.splitlines() if "pid " in line]
    assert wait_gone(started) == []


@pytest.mark.slow
def test_up_fails_at_once_when_a_worker_cannot_bind_its_port_but_stays_up(tmp_path, run_dir):
    """A server whose port is taken may log the bind error and stay up (SGLang: its scheduler children keep it);
    `up` fails on that log line, not after the ready timeout (10 min here), and stops the worker and its child.

    `up` refuses a taken port it knows of before starting anything, so the port is one the worker's own command
    line names (what `up` cannot check), held by a socket of this test."""
    pid_file = tmp_path / "child.pid"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        cfg = tmp_path / "busy.toml"
        cfg.write_text(f"""
[[workers]]
name = "busy"
command = ["{sys.executable}", "{STANDIN}", "--port", "{taken}"]
env = {{ STANDIN_STAY_UP_ON_BIND_ERROR = "1", STANDIN_CHILD = "1", STANDIN_CHILD_PID_FILE = "{pid_file}" }}
ready_timeout_s = 600.0
""")
        proc = cli("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS, check=False, timeout=120)
    _one_error_line(
        proc,
        f"busy-0: port busy: 127.0.0.1:{taken} is taken by another process",
        f"bind on address ('127.0.0.1', {taken}): address already in use",
        after_progress=True,
    )
    assert RunDir(run_dir).load() is None
    started = [int(line.split("pid ")[1].rstrip(")")) for line in proc.stderr.splitlines() if "pid " in line]
    assert len(started) == 1
    assert wait_gone([*started, int(pid_file.read_text())]) == []


@pytest.mark.slow
def test_sglang_workers_start_with_their_command_line_behind_the_gateway(tmp_path, run_dir):
    """kind = "sglang" through `up` (replication mode l3, their default): a stand-in interpreter records the argv
    of the node agent and of each worker and answers /health like them; the workers' HiCache flags name the agent's
    socket, and `down` stops the agent after the workers."""
    exe = tmp_path / "python-standin"
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STANDIN)!r}\n"
        f"runpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    exe.chmod(0o755)
    cfg = tmp_path / "sglang.toml"
    cfg.write_text(f"""
[btb]
prefix_blocks = 64

[replication]
python = "{exe}"
arena_mib = 512

[[workers]]
kind = "sglang"
name = "sg"
count = 2
model = "meta-llama/Llama-3.3-70B-Instruct"
tp_size = 2
gpu_ids = [0, 1, 2, 3]
python = "{exe}"
extra_args = ["--load-format", "dummy"]
""")
    st = cli_json("up", "-d", "-c", str(cfg), "--run-dir", str(run_dir), *FREE_PORTS)
    assert st["replication"] == "l3"
    assert [w["name"] for w in st["workers"]] == ["sg-0", "sg-1"]
    assert all(w["healthy"] and w["replication"] == "l3" for w in st["workers"])
    assert [(a["name"], a["host"], a["alive"]) for a in st["agents"]] == [("agent-local", "local", True)]
    agent = http_json(st["agents"][0]["control_url"] + "/argv")
    sock = agent[agent.index("--socket") + 1]
    assert agent[1:] == [
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        str(run_dir / "agent-local.keys"),
        "--control-token-file",
        str(run_dir / "agent-local.token"),
        "--socket",
        sock,
        "--peer",
        "127.0.0.1:0",
        "--control",
        "127.0.0.1:0",
        "--arena-mib",
        "512",
        "--agent-id",
        "agent-local",
        "--gateway",
        st["control_url"],
        "--register-interval-s",
        "2",
    ]
    assert sock.endswith("agent.sock")
    extra_config = (
        '{"backend_name":"btb","module_path":"btbctl.sglang_l3","class_name":"BtbL3Store","interface_v1":1,'
        f'"agent_socket":"{sock}","timeout_s":2.0,"prefetch_threshold":256,"worker_url":"{{url}}"}}'
    )
    for w in st["workers"]:
        argv = http_json(w["url"] + "/argv")
        port = w["url"].rsplit(":", 1)[1]
        assert argv[1:] == [
            "-m",
            "sglang.launch_server",
            "--model-path",
            "meta-llama/Llama-3.3-70B-Instruct",
            "--tp-size",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--mem-fraction-static",
            "0.9",
            "--page-size",
            "256",
            "--chunked-prefill-size",
            "8192",
            "--enable-metrics",
            "--served-model-name",
            "meta-llama/Llama-3.3-70B-Instruct",
            "--enable-hierarchical-cache",
            "--hicache-mem-layout",
            "page_first",
            "--hicache-write-policy",
            "write_through",
            # twice the 16,384-token prefix (64 blocks x 256 tokens) at 327,680 B/token over 2 ranks: 5.4 GB -> 6
            "--hicache-size",
            "6",
            "--hicache-storage-prefetch-policy",
            "wait_complete",
            "--hicache-storage-backend",
            "dynamic",
            "--hicache-storage-backend-extra-config",
            extra_config.replace("{url}", w["url"]),
            "--kv-cache-dtype",
            "auto",
            "--enable-cache-report",
            "--load-format",
            "dummy",
        ]
    state = RunDir(run_dir).load()
    assert [p.kind for p in state.workers()] == ["sglang", "sglang"]
    assert [p.role for p in state.processes] == ["agent", "worker", "worker", "gateway"]
    down = cli_json("down", "--run-dir", str(run_dir))
    assert sorted(down["stopped"] + down["killed"]) == ["agent-local", "gateway", "sg-0", "sg-1"]
    assert wait_gone([p.pid for p in state.processes]) == []


def _burst_trace(path: Path, n: int, prefix_blocks: int, spread_s: float, seed: int = 3):
    params = BurstedParams(
        bursts=1,
        burst_size=n,
        first_burst_s=0.0,
        jitter_s=0.0,
        spread_s=spread_s,
        prefix_tokens=prefix_blocks * 256,
        suffix_tokens=256,
        output_tokens=1,
        decoys=0,
    )
    trace = generate_bursted(params, seed=seed)
    write_btb_mixed(trace, path)
    return trace


def _prefix_chain(trace, prefix_blocks: int) -> list[str]:
    text = PromptSynth(trace.block_tokens).text(trace.requests[0])
    return chain_hashes(text_to_tokens(text), 256)[:prefix_blocks]


@pytest.mark.slow
def test_replicate_makes_three_more_workers_hold_the_prefix(tmp_path, run_dir):
    st = cli_json("up", "-d", "--run-dir", str(run_dir), "--policy", "cache_aware", *FREE_PORTS)
    urls = [w["url"] for w in st["workers"]]
    trace = _burst_trace(tmp_path / "t.jsonl", n=4, prefix_blocks=8, spread_s=0.5)
    rep = cli_json("bench", "--run-dir", str(run_dir), "--trace", str(tmp_path / "t.jsonl"))
    assert rep["ok"] == 4 and len(rep["by_worker"]) == 1  # cache-aware keeps the prefix on one worker
    holder = next(iter(rep["by_worker"]))
    chain = _prefix_chain(trace, 8)
    before = {u: http_json(u + "/btb/match", {"chain": chain})["cached_blocks"] for u in urls}
    assert before == {u: (8 if u == holder else 0) for u in urls}

    _one_error_line(cli("replicate", "--run-dir", str(run_dir), "--prefix", "not-hex", check=False), "hexadecimal")
    _one_error_line(
        cli("replicate", "--run-dir", str(run_dir), "--prefix", "deadbeefdeadbeef", "-n", "3", check=False),
        "unknown prefix",
    )

    proc = cli("replicate", "--run-dir", str(run_dir), "--prefix", chain[-1][:10], "-n", "3", "--format", "json")
    res = json.loads(proc.stdout)
    assert res["prefix"] == chain[-1] and res["source"] == holder
    assert res["status"] == "done" and sorted(res["targets"]) == sorted(u for u in urls if u != holder)
    assert res["bytes"] > 0
    # the real KV size of 3 copies of 8 blocks of 256 tokens of Llama-3.3-70B, and the emulated byte scale
    assert res["modelled_bytes"] == 3 * 8 * 256 * 327680 and res["kv_bytes_scale"] == 65536
    assert "copy " in proc.stderr and "done" in proc.stderr  # progress went to stderr
    after = {u: http_json(u + "/btb/match", {"chain": chain})["cached_blocks"] for u in urls}
    assert after == dict.fromkeys(urls, 8)
    # nobody left to copy to: not an error, and it says who holds it
    again = cli("replicate", "--run-dir", str(run_dir), "--prefix", chain[-1], "-n", "1")
    assert again.returncode == 0 and again.stdout.startswith(f"prefix {chain[-1][:12]} already held by 4 workers: ")
    cli("down", "--run-dir", str(run_dir))
