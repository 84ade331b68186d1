"""Cluster files: parsing, defaults, errors naming file and key, and the exact SGLang command line."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from btbctl.engine.errors import ConfigError
from btbctl.engine.launcher.cluster import (
    ClusterFile,
    WorkerSpec,
    default_cluster,
    emulated_argv,
    load_cluster,
    sglang_argv,
    worker_argv,
)
from btbctl.engine.launcher.local import spawn, stop_group, wait_ready

ROOT = Path(__file__).resolve().parents[1]
STANDIN = Path(__file__).with_name("_standin.py")


def _write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_default_cluster_is_four_emulated_llama_70b_on_4xh100():
    c = default_cluster()
    insts = c.instances()
    assert [i.name for i in insts] == ["worker-0", "worker-1", "worker-2", "worker-3"]
    assert {(i.spec.kind, i.spec.model, i.spec.gpu, i.spec.tp_size) for i in insts} == {
        ("emulated", "llama-3.3-70b", "h100", 4)
    }
    assert all(i.spec.host == "127.0.0.1" for i in insts)
    assert c.gateway.host == "127.0.0.1" and c.gateway.control_host == "127.0.0.1"
    assert c.gateway.policy == "btb_plus"
    assert c.btb.as_dict() == {"prefix_blocks": 256, "threshold": 2, "window_s": 1.0, "warm_replicas": 4}
    # an empty file means the default
    assert ClusterFile.model_validate({}).model_dump() == c.model_dump()


def test_examples_load_and_agree_with_the_default():
    c = load_cluster(ROOT / "examples" / "cluster-default.toml")
    assert c.model_dump() == default_cluster().model_dump()
    s = load_cluster(ROOT / "examples" / "cluster-sglang.toml")
    assert {w.kind for w in s.workers} == {"sglang"}


def test_ports_are_consecutive_and_names_unique(tmp_path):
    p = _write(
        tmp_path,
        """
[[workers]]
count = 3
port = 31000
transfer_port = 32000

[[workers]]
kind = "sglang"
name = "big"
count = 2
model = "meta-llama/Llama-3.3-70B-Instruct"
tp_size = 2
gpu_ids = [0, 1, 2, 3]
port = 31010
""",
    )
    c = load_cluster(p)
    insts = c.instances()
    assert [(i.name, i.port, i.transfer_port) for i in insts] == [
        ("worker-0", 31000, 32000),
        ("worker-1", 31001, 32001),
        ("worker-2", 31002, 32002),
        ("big-0", 31010, 0),
        ("big-1", 31011, 0),
    ]
    assert insts[3].env() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert insts[4].env() == {"CUDA_VISIBLE_DEVICES": "2,3"}


@pytest.mark.parametrize(
    "text, key, words",
    [
        ("[gateway]\npolicy = 'nope'\n", "gateway.policy", "valid: "),
        ("[gateway]\nbogus = 1\n", "gateway.bogus", "valid keys"),
        ("[[workers]]\nkind = 'docker'\n", "workers.0.kind", "'emulated' or 'sglang'"),
        ("[[workers]]\ncount = 0\n", "workers.0.count", "greater than or equal to 1"),
        ("[[workers]]\nport = 65535\ncount = 2\n", "workers.0", "past 65535"),
        ("[[workers]]\nmodel = 'gpt-9'\n", "workers.0.model", "unknown preset"),
        ("[[workers]]\ngpu = 'tpu'\n", "workers.0.gpu", "unknown preset"),
        ("[[workers]]\nextra_args = '--foo bar'\n", "workers.0.extra_args", "list"),
        ("[[workers]]\ncommand = ['x', '{nope}']\n", "workers.0.command", "unknown placeholder"),
        ("[[workers]]\nkind = 'sglang'\ncount = 2\ntp_size = 2\ngpu_ids = [0, 1]\n", "workers.0", "gpu_ids"),
        ("[[workers]]\npage_size = 64\n", "workers.0.page_size", "gateway.page_size"),
        ("[gateway]\nport = 31000\n[[workers]]\nport = 31000\n", "workers.0.port", "already gateway.port"),
        ("[[workers]]\nport = 31000\ncount = 2\n[[workers]]\nport = 31001\n", "workers.1.port", "already"),
        ("[btb]\nthreshold = 0\n", "btb.threshold", "greater than or equal to 1"),
        ("[[workers]]\nname = 'a b'\n", "workers.0.name", "letters"),
    ],
)
def test_errors_name_file_and_key(tmp_path, text, key, words):
    p = _write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_cluster(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}: {key}"), msg
    assert words in msg


def test_toml_syntax_and_missing_file(tmp_path):
    p = _write(tmp_path, "[gateway\nport = 1\n")
    with pytest.raises(ConfigError, match=r"line 1.*invalid TOML"):
        load_cluster(p)
    with pytest.raises(ConfigError, match="cannot read cluster file"):
        load_cluster(tmp_path / "missing.toml")


def test_sglang_argv_is_a_list_in_launch_server_order():
    spec = WorkerSpec(
        kind="sglang",
        model="meta-llama/Llama-3.3-70B-Instruct",
        tp_size=8,
        host="127.0.0.1",
        mem_fraction=0.85,
        page_size=256,
        gpu="h200",
        python="/opt/sglang/bin/python",
        extra_args=["--load-format", "dummy", "--attention-backend", "fa3"],
    )
    assert sglang_argv(spec, 30001) == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "meta-llama/Llama-3.3-70B-Instruct",
        "--tp-size",
        "8",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--mem-fraction-static",
        "0.85",
        "--page-size",
        "256",
        "--chunked-prefill-size",
        "16384",
        "--enable-metrics",
        "--load-format",
        "dummy",
        "--attention-backend",
        "fa3",
    ]
    # user text with spaces or shell characters stays one argument
    spec2 = WorkerSpec(
        kind="sglang",
        model="/models/my model; rm -rf ~",
        chunked_prefill_size=4096,
        enable_metrics=False,
        served_model_name="m",
    )
    argv = sglang_argv(spec2, 30000)
    assert argv[0] == sys.executable
    assert argv[argv.index("--model-path") + 1] == "/models/my model; rm -rf ~"
    assert argv[argv.index("--chunked-prefill-size") + 1] == "4096"
    assert "--enable-metrics" not in argv
    assert argv[-2:] == ["--served-model-name", "m"]


def test_emulated_argv_carries_the_emulation_flags():
    spec = WorkerSpec(time_scale=0.25, zero_delay=True, kv_bytes_scale=4096)
    argv = emulated_argv(spec, 31000, 32000, token_file="/run/x/worker.token")
    assert argv[:4] == [sys.executable, "-m", "btbctl", "worker"]
    pairs = {argv[i]: argv[i + 1] for i in range(4, len(argv) - 1) if argv[i].startswith("--")}
    assert pairs["--model-path"] == "llama-3.3-70b"
    assert pairs["--served-model-name"] == "llama-3.3-70b"
    assert pairs["--tp-size"] == "4" and pairs["--gpu"] == "h100"
    assert pairs["--port"] == "31000" and pairs["--transfer-port"] == "32000"
    assert pairs["--time-scale"] == "0.25" and pairs["--kv-bytes-scale"] == "4096"
    assert pairs["--btb-token-file"] == "/run/x/worker.token"
    assert "--zero-delay" in argv and "--enable-metrics" in argv


def _standin_executable(tmp_path: Path) -> Path:
    exe = tmp_path / "bin" / "python-standin"
    exe.parent.mkdir()
    exe.write_text(
        f"#!{sys.executable}\nimport runpy, sys\nsys.argv[0] = {str(STANDIN)!r}\n"
        f"runpy.run_path({str(STANDIN)!r}, run_name='__main__')\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_sglang_worker_is_launched_with_exactly_that_argv(tmp_path):
    """The launcher executes the argv as built (no shell): a stand-in interpreter records what it received."""
    exe = _standin_executable(tmp_path)
    p = _write(
        tmp_path,
        f"""
[[workers]]
kind = "sglang"
model = "Qwen/Qwen3-8B"
tp_size = 1
python = "{exe}"
port = 0
extra_args = ["--load-format", "dummy", "--context-length", "8192"]
env = {{ STANDIN_ARGV_FILE = "{tmp_path / "argv.json"}" }}
""",
    )
    inst = load_cluster(p).instances()[0]
    from btbctl.engine.launcher.fleet import free_port

    port = free_port()
    argv = worker_argv(inst, port)
    proc = spawn(inst.name, argv, tmp_path / "w.log", env=inst.env())
    try:
        wait_ready(proc, 20.0, health_url=f"http://127.0.0.1:{port}")
        recorded = json.loads((tmp_path / "argv.json").read_text())
    finally:
        stop_group(proc.pid, 5.0, popen=proc.popen)
    # sys.argv[0] is the script; the rest is exactly what the launcher built after the interpreter
    assert recorded[1:] == [
        "-m",
        "sglang.launch_server",
        "--model-path",
        "Qwen/Qwen3-8B",
        "--tp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--mem-fraction-static",
        "0.9",
        "--page-size",
        "256",
        "--chunked-prefill-size",
        "8192",
        "--enable-metrics",
        "--load-format",
        "dummy",
        "--context-length",
        "8192",
    ]
    assert argv[0] == str(exe)


def test_command_override_placeholders_and_relative_path(tmp_path):
    (tmp_path / "scripts").mkdir()
    p = _write(
        tmp_path,
        """
[[workers]]
name = "custom"
count = 2
port = 31100
command = ["scripts/serve", "--listen", "{host}:{port}", "--id={name}/{index}", "{model}"]
""",
    )
    c = load_cluster(p)
    a0, a1 = (worker_argv(i, i.port) for i in c.instances())
    assert a0 == [
        os.path.join(str(tmp_path), "scripts", "serve"),
        "--listen",
        "127.0.0.1:31100",
        "--id=custom-0/0",
        "llama-3.3-70b",
    ]
    assert a1[2:4] == ["127.0.0.1:31101", "--id=custom-1/1"]
