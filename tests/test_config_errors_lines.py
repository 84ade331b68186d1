"""A bad key of a TOML file is reported with the line it is on (``FILE:LINE: key: what is valid``)."""

from __future__ import annotations

from btbctl.engine.config import toml_key_line
from launcher_helpers import cli

TEXT = """# a fleet
[gateway]
port = 8000
replicaz = 2

[[workers]]
count = 2

[[workers]]
name = "b"
count = "x"

[replication.env]
"A.B" = "1"

[btb]
threshold = 0
"""


def test_the_line_of_a_key_of_a_table_an_array_of_tables_and_a_missing_key(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(TEXT)
    assert toml_key_line(str(f), "gateway.replicaz") == 4
    assert toml_key_line(str(f), "workers.1.count") == 11
    assert toml_key_line(str(f), "workers.0.count") == 7
    assert toml_key_line(str(f), "workers.1.model") == 9  # not set: the header of its table
    assert toml_key_line(str(f), "btb.threshold") == 17
    assert toml_key_line(str(f), "kubernetes.namespace") is None
    m = tmp_path / "m.toml"  # a table inside an array of tables
    m.write_text('[[workloads]]\nname = "a"\n[[workloads]]\nname = "b"\n[workloads.trace]\npath = "x"\n')
    assert toml_key_line(str(m), "workloads.1.trace.path") == 6
    assert toml_key_line(str(m), "workloads.0.trace.path") == 1
    assert toml_key_line(str(tmp_path / "missing.toml"), "gateway.port") is None


def test_the_cli_names_file_line_key_and_what_is_valid(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(TEXT)
    r = cli("up", "-c", str(f), "--run-dir", str(tmp_path / "run"), check=False)
    assert r.returncode != 0
    [line] = r.stderr.strip().splitlines()
    assert line.startswith(f"btbctl: error: {f}:4: gateway.replicaz: unknown key; valid keys: "), line
