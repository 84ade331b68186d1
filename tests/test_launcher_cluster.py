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
    validate_cluster,
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
    assert {w.kind for w in s.workers} == {"sglang"} and s.replication_mode == "none"
    l3 = load_cluster(ROOT / "examples" / "cluster-sglang-l3.toml")
    assert {w.kind for w in l3.workers} == {"sglang"} and l3.replication_mode == "l3"
    assert [h is None for h in l3.agent_hosts()] == [True]  # one agent, on this machine


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


def test_python_and_model_starting_with_dot_resolve_against_the_cluster_file(tmp_path):
    p = _write(
        tmp_path,
        """
[replication]
mode = "none"

[[hosts]]
name = "b"
address = "10.0.0.12"

[[workers]]
kind = "sglang"
model = "./models/tiny"
python = "../venv/bin/python"
gpu = "h100"

[[workers]]
kind = "sglang"
model = "meta-llama/Llama-3.1-8B"
python = "venv/bin/python"
gpu = "h100"

[[workers]]
kind = "sglang"
host = "b"
model = "./remote/model"
python = "./remote/bin/python"
gpu = "h100"
""",
    )
    local, hub, remote = load_cluster(p).workers
    assert local.model == os.path.join(str(tmp_path), "models", "tiny")
    assert local.python == os.path.normpath(os.path.join(str(tmp_path), "..", "venv", "bin", "python"))
    # a hub id and a plain relative name stay as written; a [[hosts]] worker's paths are that host's
    assert (hub.model, hub.python) == ("meta-llama/Llama-3.1-8B", "venv/bin/python")
    assert (remote.model, remote.python) == ("./remote/model", "./remote/bin/python")


# -- replication mode l3: generated HiCache flags, agents, fleet consistency ---------------------------------------

SGLANG_L3_FLEET = {
    "hosts": [{"name": "gpu-b", "address": "10.0.0.12", "python": "/opt/sg/bin/python"}],
    "workers": [
        {
            "kind": "sglang",
            "name": "a",
            "count": 2,
            "model": "meta-llama/Llama-3.3-70B-Instruct",
            "served_model_name": "llama-70b",
            "tp_size": 2,
            "gpu_ids": [0, 1, 2, 3],
            "python": "/opt/sg/bin/python",
            "extra_args": ["--load-format", "dummy"],
        },
        {
            "kind": "sglang",
            "name": "b",
            "host": "gpu-b",
            "model": "meta-llama/Llama-3.3-70B-Instruct",
            "served_model_name": "llama-70b",
            "tp_size": 2,
            "gpu_ids": [0, 1],
            "kv_cache_dtype": "auto",
        },
    ],
    "replication": {"local_peer_host": "10.0.0.11", "arena_mib": 2048},
}


def _sglang_l3_line(port: int, socket_path: str, python: str, extra: list[str], host: str) -> list[str]:
    """The whole launch line of one worker of SGLANG_L3_FLEET, written out by hand (SGLANG.md "Worker flags")."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "meta-llama/Llama-3.3-70B-Instruct",
        "--tp-size",
        "2",
        "--host",
        host,
        "--port",
        str(port),
        "--mem-fraction-static",
        "0.9",
        "--page-size",
        "256",
        "--chunked-prefill-size",
        "8192",
        "--enable-metrics",
        "--served-model-name",
        "llama-70b",
        "--enable-hierarchical-cache",
        "--hicache-mem-layout",
        "page_first",
        "--hicache-write-policy",
        "write_through",
        # twice the 65,536-token prefix (256 blocks x 256 tokens) at 327,680 B/token over 2 ranks: 21.5 GB -> 22
        "--hicache-size",
        "22",
        "--hicache-storage-prefetch-policy",
        "wait_complete",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        (
            '{"backend_name":"btb","module_path":"btbctl.sglang_l3","class_name":"BtbL3Store","interface_v1":1,'
            f'"agent_socket":"{socket_path}","timeout_s":2.0,"prefetch_threshold":256}}'
        ),
        "--kv-cache-dtype",
        "auto",
        "--enable-cache-report",
        *extra,
    ]


def test_every_l3_agent_registers_the_local_one_on_the_control_api_a_hosts_one_on_the_registration_listener(
    tmp_path, monkeypatch
):
    from btbctl.engine import netaddr
    from btbctl.engine.errors import BtbctlError
    from btbctl.engine.launcher import fleet
    from btbctl.engine.launcher.agents import plan_agents
    from btbctl.engine.launcher.rundir import RunDir

    c = validate_cluster({**SGLANG_L3_FLEET, "gateway": {"replicas": 2, "register_port": 9100}})
    asked = []
    monkeypatch.setattr(netaddr, "source_address", lambda host, port: asked.append((host, port)) or "10.0.0.11")
    reg = fleet._registration(c)
    assert asked == [("10.0.0.12", 22)]  # the address this machine sends from towards gpu-b's SSH port
    assert reg == fleet.Registration(
        ["10.0.0.11"], [9100, 9102], {"gpu-b": ["http://10.0.0.11:9100", "http://10.0.0.11:9102"]}
    )
    controls = ["http://127.0.0.1:8001", "http://127.0.0.1:8003"]
    local, remote = plan_agents(c, RunDir(tmp_path / "run"), gateways=controls, host_gateways=reg.host_gateways)
    reg_args = ["--register-interval-s", "2"]
    assert local.argv[-6:] == ["--gateway", controls[0], "--gateway", controls[1], *reg_args]
    far = reg.host_gateways["gpu-b"]
    assert remote.argv[-6:] == ["--gateway", far[0], "--gateway", far[1], *reg_args]
    # a fixed register_host wins (a NAT between); no route to a host and none set: one line naming both
    c2 = validate_cluster({**SGLANG_L3_FLEET, "gateway": {"register_host": "192.0.2.7", "register_port": 9200}})
    assert fleet._registration(c2).host_gateways == {"gpu-b": ["http://192.0.2.7:9200"]}

    def no_route(host, port):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(netaddr, "source_address", no_route)
    with pytest.raises(BtbctlError, match=r"host gpu-b: no route .* set \[gateway\] register_host"):
        fleet._registration(c)
    with pytest.raises(ConfigError, match="register_host"):
        validate_cluster({**SGLANG_L3_FLEET, "gateway": {"register_host": "a b"}})


def test_sglang_fleet_in_l3_mode_gets_exactly_the_hicache_flags(tmp_path):
    from btbctl.engine.launcher.agents import REMOTE_SOCKET, plan_agents
    from btbctl.engine.launcher.cluster import hicache_args
    from btbctl.engine.launcher.rundir import RunDir
    from btbctl.engine.launcher.ssh import remote_argv

    c = validate_cluster(SGLANG_L3_FLEET)
    assert c.replication_mode == "l3"  # SGLang workers, no mode given
    rd = RunDir(tmp_path / "run")
    plans = plan_agents(c, rd)
    assert [(p.name, p.host.name if p.host else None) for p in plans] == [
        ("agent-local", None),
        ("agent-gpu-b", "gpu-b"),
    ]
    local, remote = plans
    assert local.argv == [
        sys.executable,
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        str(rd.agent_credentials_path("agent-local")),
        "--control-token-file",
        str(rd.agent_control_token_path("agent-local")),
        "--socket",
        local.socket,
        "--peer",
        "10.0.0.11:0",
        "--control",
        "127.0.0.1:0",
        "--arena-mib",
        "2048",
        "--agent-id",
        "agent-local",
    ]
    assert remote.socket == REMOTE_SOCKET
    assert remote.argv == [
        "/opt/sg/bin/python",
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        "agent.keys",
        "--control-token-file",
        "agent.token",
        "--socket",
        "agent.sock",
        "--peer",
        "10.0.0.12:0",
        "--control",
        "10.0.0.12:0",
        "--arena-mib",
        "2048",
        "--agent-id",
        "agent-gpu-b",
    ]
    insts = c.instances()
    assert [i.name for i in insts] == ["a-0", "a-1", "b-0"]
    for inst, port in zip(insts, (30000, 30001, 30000), strict=True):
        host = c.host_of(inst.spec)
        sock = local.socket if host is None else remote.socket
        l3 = hicache_args(c, inst.spec, inst.entry, sock)
        if host is None:
            argv = worker_argv(inst, port, 0, l3=l3)
            assert argv == _sglang_l3_line(port, sock, "/opt/sg/bin/python", ["--load-format", "dummy"], "127.0.0.1")
        else:  # on its host: bound to the host's address, run by the host's python
            argv = remote_argv(inst, host, port, 0, "worker.token", l3=l3)
            assert argv == _sglang_l3_line(port, sock, "/opt/sg/bin/python", [], "10.0.0.12")
        cfg = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
        assert cfg == {
            "backend_name": "btb",
            "module_path": "btbctl.sglang_l3",
            "class_name": "BtbL3Store",
            "interface_v1": 1,
            "agent_socket": sock,
            "timeout_s": 2.0,
            "prefetch_threshold": 256,
        }
    # the L3 store parses that JSON as SGLang hands it over (torch-free parser)
    from btbctl.sglang_l3.config import load_extra_config, parse_extra_config, split_consumed

    consumed, own = split_consumed(load_extra_config(argv[argv.index("--hicache-storage-backend-extra-config") + 1]))
    assert parse_extra_config(own) == (remote.socket, 2.0, True)
    assert consumed["prefetch_threshold"] == 256


def test_l3_settings_reach_the_generated_flags():
    data = json.loads(json.dumps(SGLANG_L3_FLEET))
    data["replication"].update(
        prefetch_policy="best_effort",
        write_policy="write_through_selective",
        mem_layout="page_first_direct",
        prefetch_threshold=512,
        store_timeout_s=0.5,
        hicache_size_gb=40,
    )
    for w in data["workers"]:
        w["kv_cache_dtype"] = "fp8_e4m3"
    c = validate_cluster(data)
    from btbctl.engine.launcher.cluster import hicache_args

    args = hicache_args(c, c.workers[0], 0, "/s")
    assert args == [
        "--enable-hierarchical-cache",
        "--hicache-mem-layout",
        "page_first_direct",
        "--hicache-write-policy",
        "write_through_selective",
        "--hicache-size",
        "40",
        "--hicache-storage-prefetch-policy",
        "best_effort",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        (
            '{"backend_name":"btb","module_path":"btbctl.sglang_l3","class_name":"BtbL3Store","interface_v1":1,'
            '"agent_socket":"/s","timeout_s":0.5,"prefetch_threshold":512}'
        ),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--enable-cache-report",
    ]


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"tp_size": 4, "gpu_ids": [0, 1, 2, 3]}, "workers.1.tp_size"),
        ({"page_size": 64}, "workers.1.page_size"),
        ({"served_model_name": "other"}, "workers.1.served_model_name"),
        ({"kv_cache_dtype": "fp8_e4m3"}, "workers.1.kv_cache_dtype"),
        ({"extra_args": ["--hicache-size=8"]}, "workers.1.extra_args"),
        ({"command": ["x", "{port}"]}, "workers.1.command"),
    ],
)
def test_l3_refuses_a_mixed_fleet_naming_the_key(change, key):
    data = json.loads(json.dumps(SGLANG_L3_FLEET))
    data["workers"][1].update(change)
    if "page_size" in change:
        data["gateway"] = {"page_size": 256}
    with pytest.raises(ConfigError) as ei:
        validate_cluster(data)
    assert str(ei.value).startswith(key), str(ei.value)


def test_l3_with_workers_here_and_on_hosts_needs_a_reachable_local_peer_address():
    data = json.loads(json.dumps(SGLANG_L3_FLEET))
    del data["replication"]["local_peer_host"]
    with pytest.raises(ConfigError, match=r"^replication.local_peer_host"):
        validate_cluster(data)
    # push and none start no agents and generate no flags
    for mode in ("push", "none"):
        data["replication"]["mode"] = mode
        c = validate_cluster(data)
        assert c.replication_mode == mode and c.agent_hosts() == []
