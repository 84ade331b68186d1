"""``btbctl doctor`` against a loopback sshd: a good host, a host with a changed key, one that refuses
connections, one without the configured Python, a busy port; and a cluster file with no hosts."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

import btbctl
from launcher_helpers import cli
from sshd_fixture import host_table
from test_ssh_fleet import write_cluster


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_doctor_table_and_json(sshd, tmp_path):
    with socket.socket() as busy, socket.socket() as closed:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        closed.bind(("127.0.0.2", 0))
        closed_port = closed.getsockname()[1]
        closed.close()
        cfg = write_cluster(
            tmp_path / "c.toml",
            [
                host_table(sshd, "good", "127.0.0.1"),
                host_table(sshd, "rekeyed", "127.0.0.2", known_hosts=str(sshd.other_key_known_hosts)),
                host_table(sshd, "down", "127.0.0.2", port=closed_port),
                host_table(sshd, "nopy", "127.0.0.2", python="/nonexistent/python3"),
            ],
            [
                {"name": "g", "host": "good", "port": busy_port},
                {"name": "r", "host": "rekeyed"},
                {"name": "d", "host": "down"},
                {"name": "n", "host": "nopy"},
            ],
        )
        res = cli("doctor", "-c", str(cfg), "--format", "json", check=False)
        human = cli("doctor", "-c", str(cfg), check=False)
    assert res.returncode == 1 and human.returncode == 1
    rows = {r["host"]: r for r in json.loads(res.stdout)["hosts"]}
    good = rows["good"]
    assert (good["reachable"], good["auth"], good["python"]) == ("yes", "yes", "{}.{}.{}".format(*sys.version_info[:3]))
    assert good["btbctl"] and good["sglang"] is None and isinstance(good["rdma"], list)
    assert good["ports"] == {str(busy_port): "Address already in use"}
    assert good["problems"] == [f"port {busy_port}: Address already in use"]
    assert rows["rekeyed"]["auth"] == "no" and rows["rekeyed"]["problems"][0].startswith("host key mismatch")
    assert rows["down"]["reachable"] == "no" and rows["down"]["problems"][0].startswith("connection refused")
    assert rows["nopy"]["python"] == "not found"
    assert "command not found: /nonexistent/python3" in rows["nopy"]["problems"]
    for name in ("good", "rekeyed", "down", "nopy"):
        assert name in human.stdout
    assert "problems found" in human.stdout


def test_doctor_local_only(tmp_path):
    cfg = write_cluster(tmp_path / "c.toml", [], [{"name": "w", "count": 2}])
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json").stdout)
    assert res["ok"] is True
    assert [r["host"] for r in res["hosts"]] == ["local"]
    assert res["hosts"][0]["btbctl"]
    assert res["hosts"][0]["l3"] is None  # push mode: no agent


def test_doctor_l3_checks_the_agent_place(tmp_path):
    """Replication mode l3: the agent's arena must fit in /dev/shm, its fixed ports must be free, and the workers'
    Python must import btbctl (SGLang loads the L3 backend from it)."""
    import os

    st = os.statvfs("/dev/shm")
    free_mib = st.f_bavail * st.f_frsize // (1 << 20)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = write_cluster(tmp_path / "c.toml", [], [{"name": "w", "count": 2}])
        cfg.write_text(
            cfg.read_text() + f"\n[replication]\nmode = 'l3'\narena_mib = {free_mib + 1024}\npeer_port = {port}\n"
        )
        res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    assert res["ok"] is False
    (row,) = res["hosts"]
    assert row["l3"]["arena_mib"] == free_mib + 1024 and abs(row["l3"]["shm_free_mib"] - free_mib) < 512
    assert any(p.startswith("/dev/shm has ") and "replication.arena_mib" in p for p in row["problems"]), row
    assert any(p.startswith(f"port {port}:") for p in row["problems"]), row
    # a fitting arena, free ports: ready; an SGLang worker's Python without btbctl is a problem in l3 mode
    bare = _python_without_btbctl(tmp_path)
    cfg.write_text(
        "[replication]\nmode = 'l3'\narena_mib = 1\n[[workers]]\nkind = 'sglang'\nmodel = 'Qwen/Qwen3-8B'\n"
        f"tp_size = 1\npython = '{bare}'\n"
    )
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    (row,) = res["hosts"]
    assert row["btbctl"] is None and row["l3"]["arena_mib"] == 1
    assert row["l3"]["sglang_l3"] == {str(bare): "ModuleNotFoundError: No module named 'btbctl'"}
    assert _backend_problem(row, bare) == (
        f"SGLang's Python {bare} cannot import btbctl.sglang_l3 (ModuleNotFoundError: No module named 'btbctl'); "
        f"fix: in a btbctl {btbctl.__version__} checkout run `{bare} -m pip install --no-deps .` "
        "(docs/sglang-install.md)"
    )


def _python_without_btbctl(tmp_path: Path) -> Path:
    """A Python in isolated mode: no working directory or PYTHONPATH on sys.path, no site-packages."""
    bare = tmp_path / "python-without-btbctl"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S "$@"\n')
    bare.chmod(0o755)
    return bare


def _python_with_broken_btbctl(tmp_path: Path) -> Path:
    """A Python whose btbctl package imports a module that is not installed (as a btbctl/__init__.py that imported
    a third-party package would fail in SGLang's environment)."""
    root = tmp_path / "broken-env"
    (root / "btbctl").mkdir(parents=True)
    (root / "btbctl" / "__init__.py").write_text("import typer_not_installed_here\n")
    py = tmp_path / "python-broken-btbctl"
    py.write_text(f'#!/bin/sh\ncd {root} && exec {sys.executable} -S "$@"\n')
    py.chmod(0o755)
    return py


def _backend_problem(row: dict, python: Path) -> str | None:
    return next((p for p in row["problems"] if p.startswith(f"SGLang's Python {python} ")), None)


def test_doctor_l3_probes_each_sglang_python_and_the_agents(tmp_path):
    """Every SGLang worker's own Python must import btbctl.sglang_l3 (not only the first worker's), and the node
    agent's Python (replication.python) must import btbctl; each problem names the interpreter."""
    broken, bare = _python_with_broken_btbctl(tmp_path), _python_without_btbctl(tmp_path)
    worker = "kind = 'sglang'\nmodel = 'Qwen/Qwen3-8B'\ntp_size = 1\n"
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f"[replication]\nmode = 'l3'\narena_mib = 1\npython = '{bare}'\n"
        f"[[workers]]\nname = 'a'\n{worker}python = '{sys.executable}'\n"
        f"[[workers]]\nname = 'b'\n{worker}python = '{broken}'\n"
    )
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    (row,) = res["hosts"]
    assert row["btbctl"] and row["l3"]["sglang_l3"] == {
        sys.executable: "ok",
        str(broken): "ModuleNotFoundError: No module named 'typer_not_installed_here'",
    }
    assert _backend_problem(row, Path(sys.executable)) is None
    assert "-m pip install --no-deps ." in _backend_problem(row, broken)
    assert any(
        p.startswith(f"the node agent cannot run with {bare} (ModuleNotFoundError: No module named 'btbctl')")
        for p in row["problems"]
    ), row
    # a worker Python that does not exist is named as such
    cfg.write_text(cfg.read_text().replace(f"python = '{bare}'\n", "").replace(str(broken), "/nonexistent/python3"))
    (row,) = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)["hosts"]
    assert "command not found: /nonexistent/python3" in row["problems"], row
    assert not any("node agent" in p for p in row["problems"]), row


def test_doctor_l3_a_no_deps_install_serves_sglang_but_not_the_agent(tmp_path):
    """btbctl without its dependencies (as `pip install --no-deps` leaves it in SGLang's environment) is enough for
    SGLang's L3 backend, not for the node agent: an interpreter like that passes as SGLang's and fails as the agent's,
    naming the missing dependency."""
    env = tmp_path / "no-deps-env"
    env.mkdir()
    (env / "btbctl").symlink_to(Path(btbctl.__file__).parent)
    nodeps = tmp_path / "python-btbctl-no-deps"  # no site-packages: only the standard library and btbctl
    nodeps.write_text(f'#!/bin/sh\ncd {env} && exec {sys.executable} -S "$@"\n')
    nodeps.chmod(0o755)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f"[replication]\nmode = 'l3'\narena_mib = 1\npython = '{nodeps}'\n"
        f"[[workers]]\nkind = 'sglang'\nmodel = 'Qwen/Qwen3-8B'\ntp_size = 1\npython = '{nodeps}'\n"
    )
    (row,) = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)["hosts"]
    assert row["l3"]["sglang_l3"] == {str(nodeps): "ok"} and _backend_problem(row, nodeps) is None
    agent = [p for p in row["problems"] if p.startswith(f"the node agent cannot run with {nodeps} ")]
    assert len(agent) == 1 and "No module named" in agent[0] and "replication.python" in agent[0], row


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_doctor_l3_on_a_host_probes_the_worker_python(sshd, tmp_path):
    """On a [[hosts]] entry the probe runs with the host's Python; an SGLang worker's own Python is probed too,
    over the same connection."""
    bare = _python_without_btbctl(tmp_path)
    cfg = write_cluster(
        tmp_path / "c.toml",
        [host_table(sshd, "gpu1", "127.0.0.1")],
        [{"name": "s", "host": "gpu1", "kind": "sglang", "model": "Qwen/Qwen3-8B", "tp_size": 1, "python": str(bare)}],
    )
    cfg.write_text(cfg.read_text() + "\n[replication]\nmode = 'l3'\narena_mib = 1\n")
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    row = next(r for r in res["hosts"] if r["host"] == "gpu1")
    assert row["btbctl"] and row["l3"]["sglang_l3"] == {str(bare): "ModuleNotFoundError: No module named 'btbctl'"}
    assert "in a btbctl" in _backend_problem(row, bare)
    assert not any("node agent" in p for p in row["problems"]), row  # the agent runs with the host's Python


@pytest.mark.slow  # end to end (an sshd): out of the main suite's time budget
def test_doctor_checks_that_a_hosts_agent_reaches_the_registration_address(sshd, tmp_path):
    """l3 with a node agent on a host: doctor listens where that agent would register and has the host connect;
    an address that is not this machine's is reported as not checked, not as a problem."""
    cfg = write_cluster(tmp_path / "c.toml", [host_table(sshd, "good", "127.0.0.1")], [{"name": "g", "host": "good"}])
    l3 = "\n[replication]\nmode = 'l3'\narena_mib = 1\n"
    cfg.write_text(cfg.read_text() + l3)
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    [row] = [r for r in res["hosts"] if r["host"] == "good"]
    assert row["register"] == "ok", row
    assert not [p for p in row["problems"] if "registration" in p], row
    nat = cfg.read_text().replace("[gateway]\n", "[gateway]\nregister_host = '192.0.2.7'\n", 1)
    if "[gateway]" not in nat:
        nat = "[gateway]\nregister_host = '192.0.2.7'\n" + cfg.read_text()
    cfg.write_text(nat)
    res = json.loads(cli("doctor", "-c", str(cfg), "--format", "json", check=False).stdout)
    [row] = [r for r in res["hosts"] if r["host"] == "good"]
    assert row["register"].startswith("not checked: cannot listen on 192.0.2.7 here"), row
    assert not [p for p in row["problems"] if "registration" in p], row
    # a registration address the host cannot reach (nothing listens there): a problem naming it and the fix
    import asyncio

    from btbctl.engine.launcher import doctor as doc
    from btbctl.engine.launcher.cluster import load_cluster

    host = load_cluster(str(cfg)).hosts[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    row = asyncio.run(doc._check_host(host, [], doc._Needs(host.python, register=("127.0.0.1", closed))))
    assert row["register"].startswith("ConnectionRefusedError"), row
    [p] = [p for p in row["problems"] if "registration address" in p]
    assert f"127.0.0.1:{closed}" in p and "register_host" in p
