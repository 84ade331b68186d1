"""Shell metacharacters in a cluster file cannot run anything on a host: addresses, users and environment names
are refused at load time; arguments, environment values and paths arrive at the worker as the literal strings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.launcher import ssh
from btbctl.engine.launcher.cluster import validate_cluster
from btbctl.engine.launcher.hosts import HostSpec
from sshd_fixture import host_table


def _marker_args(folder: Path) -> list[str]:
    """Arguments that would each create a file in ``folder`` if any shell ever parsed them."""
    f = folder
    return [
        f"; touch {f}/pwn1",
        f"$(touch {f}/pwn2)",
        f"`touch {f}/pwn3`",
        f"' ; touch {f}/pwn4 ; '",
        f'" ; touch {f}/pwn5 ; "',
        f"a\ntouch {f}/pwn6",
        f"| touch {f}/pwn7",
        f"&& touch {f}/pwn8 &",
        "$HOME",
        "*",
        "-n",
        "\\",
        "{a,b}",
    ]


@pytest.mark.parametrize(
    "key, value",
    [
        ("address", "127.0.0.2; touch /tmp/x"),
        ("address", "-oProxyCommand=touch /tmp/x"),
        ("address", "$(touch /tmp/x)"),
        ("user", "root; touch /tmp/x"),
        ("user", "-oProxyCommand=x"),
        ("name", "a b"),
    ],
)
def test_hostile_host_fields_are_refused_naming_the_key(key, value):
    data = {
        "hosts": [{"name": "h", "address": "127.0.0.2", key: value}],
        "workers": [{"host": "h" if key != "name" else value}],
    }
    with pytest.raises(ConfigError) as err:
        validate_cluster(data, "c.toml")
    assert f"hosts.0.{key}" in str(err.value)


def test_hostile_env_name_is_refused():
    with pytest.raises(ConfigError) as err:
        validate_cluster(
            {"hosts": [{"name": "h", "address": "127.0.0.2", "env": {"A;touch x": "1"}}], "workers": [{"host": "h"}]},
            "c.toml",
        )
    assert "hosts.0.env" in str(err.value)


def test_unknown_worker_host_names_the_key():
    with pytest.raises(ConfigError) as err:
        validate_cluster({"hosts": [{"name": "h", "address": "127.0.0.2"}], "workers": [{"host": "nope"}]}, "c.toml")
    assert "workers.0.host" in str(err.value) and "'nope'" in str(err.value) and "valid: h" in str(err.value)


def test_arguments_env_and_paths_arrive_literally(sshd, tmp_path):
    traps = tmp_path / "traps"
    traps.mkdir()
    out = tmp_path / "argv.json"
    evil = _marker_args(traps)
    code = (
        "import json, os, sys; json.dump({'argv': sys.argv[2:], 'env': os.environ.get('EVIL'), "
        "'cwd': os.getcwd()}, open(sys.argv[1], 'w'))"
    )
    workdir = str(tmp_path / "remote" / f"w $(touch {traps}/pwn9) ;x")
    host = HostSpec(
        **host_table(
            sshd, "h", "127.0.0.2", workdir=workdir, env={"EVIL": f"$(touch {traps}/pwn10); `touch {traps}/pwn11`"}
        )
    )
    cluster = validate_cluster(
        {
            "hosts": [host.model_dump()],
            "workers": [
                {"name": "x", "host": "h", "port": 1, "command": [sys.executable, "-c", code, str(out), *evil]}
            ],
        }
    )
    started = []
    with ssh.SshPool() as pool:
        with pytest.raises(BtbctlError) as err:
            ssh.start_all(
                pool,
                [(host, cluster.instances())],
                run_id="quoting",
                logs_dir=tmp_path / "logs",
                token="t",
                on_started=started.append,
            )
    # the command exits once it wrote its arguments: up reports that, naming host and worker
    assert "host h (127.0.0.2" in str(err.value) and "x-0: exited at once: status 0" in str(err.value)
    got = json.loads(out.read_text())
    assert got["argv"] == evil
    assert got["env"] == f"$(touch {traps}/pwn10); `touch {traps}/pwn11`"
    assert got["cwd"] == workdir + "/runs/quoting"
    assert sorted(p.name for p in traps.iterdir()) == []
