"""Hostile inputs found by trying to break the CLI: each must end in one ``btbctl: error:`` line (exit 2) naming the
key or flag, never a traceback, a hang or an unreadable output file."""

from __future__ import annotations

import json
import math
import os

import pytest

from btbctl.engine.constants import BtbConstants
from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.launcher.rundir import RunDir
from btbctl.engine.trace.generate import MAX_GENERATED_REQUESTS, BurstedParams, generate_bursted
from btbctl.engine.trace.model import Request, Trace
from helpers import run_cli as run

SMALL = ["--bursts", "1", "--burst-size", "5", "--decoys", "0", "--policies", "btb"]


pytestmark = pytest.mark.usefixtures("cli_env")  # fixed terminal width (tests/conftest.py)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("btbctl: error: "), err
    return lines[0]


# -- BTB's constants and the config tree: non-finite floats and wrong types ------------------------------------------


@pytest.mark.parametrize("window_s", [math.inf, -math.inf, math.nan, 0.0, True])
def test_constants_refuse_a_window_that_is_not_a_finite_positive_number(window_s):
    with pytest.raises(ConfigError) as e:
        BtbConstants.parse({"window_s": window_s})
    assert e.value.key == "window_s"


@pytest.mark.parametrize("key", ["prefix_blocks", "threshold", "replicas"])
def test_constants_refuse_booleans_as_integers(key):
    with pytest.raises(ConfigError) as e:
        BtbConstants.parse({key: True})
    assert e.value.key == key


@pytest.mark.parametrize("flag", ["--window-s", "--nic-gbps"])
def test_dry_run_refuses_infinite_flags_with_one_line(capsys, flag):
    # used to print a traceback from the human header (the report held null for the infinite value)
    code, out, err = run(capsys, "dry-run", *SMALL, flag, "inf")
    assert code == 2 and out == ""
    assert one_error_line(err).startswith(f"btbctl: error: {flag}: ")


@pytest.mark.parametrize(
    "toml, key",
    [
        ("[btb]\nwindow_s = inf\n", "btb.window_s"),
        ("[cluster]\nnic_gbps = inf\n", "cluster.nic_gbps"),
        ("[cluster]\nreplicas = true\n", "cluster.replicas"),  # was taken as 1 replica
        ('[cluster]\nreplicas = "4"\n', "cluster.replicas"),
        ("[btb]\nthreshold = 2.0\n", "btb.threshold"),
        ("seed = true\n", "seed"),
    ],
)
def test_config_values_of_the_wrong_type_or_not_finite_are_refused(capsys, tmp_path, toml, key):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    code, out, err = run(capsys, "dry-run", "-c", str(cfg), *SMALL)
    assert code == 2 and out == ""
    line = toml.count("\n")  # the key is on the file's last line
    assert one_error_line(err).startswith(f"btbctl: error: {cfg}:{line}: {key}: ")


def test_dry_run_on_a_directory_says_so(capsys, tmp_path):
    code, _, err = run(capsys, "dry-run", "--trace", str(tmp_path))
    assert code == 2
    assert "is a directory" in one_error_line(err)


# -- the generator: windows too large to generate, and empty ones -------------------------------------------------


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"background_rps": 1e9}, "background_rps"),
        ({"bursts": 100_000, "burst_size": 1000}, "burst_size"),
        ({"prefix_tokens": 10**12, "block_tokens": 1, "bursts": 1, "burst_size": 1, "decoys": 0}, "prefix_tokens"),
    ],
)
def test_generator_refuses_windows_too_large_to_build(changes, key):
    with pytest.raises(ConfigError) as e:
        BurstedParams(**changes)
    assert e.value.key == key


def test_generator_checks_the_size_again_with_the_base_trace_block_size():
    p = BurstedParams(bursts=0, decoys=100, prefix_tokens=300_000, block_tokens=256)  # fine with 256-token blocks
    base = Trace([Request("a", 0.0, 10, 1, (1,))], 1, "mooncake", None)  # ... but the base has 1-token blocks
    with pytest.raises(ConfigError) as e:
        generate_bursted(p, base=base)
    assert e.value.key == "prefix_tokens"


def test_the_published_window_is_far_below_the_bounds():
    p = BurstedParams()
    assert p.bursts * p.burst_size + p.decoys < MAX_GENERATED_REQUESTS / 1000


def test_trace_gen_of_an_empty_window_writes_nothing(capsys, tmp_path):
    out_path = tmp_path / "t.jsonl"
    code, _, err = run(capsys, "trace", "gen", "--out", str(out_path), "--bursts", "0", "--decoys", "0")
    assert code == 2 and "no requests" in one_error_line(err)
    assert not out_path.exists()


# -- the run directory: a damaged state.json ---------------------------------------------------------------------


def _state(tmp_path, procs) -> RunDir:
    rd = RunDir(tmp_path)
    rd.state_path.write_text(
        json.dumps({"version": 1, "run_dir": str(tmp_path), "created_at": 0.0, "detached": True, "processes": procs})
    )
    return rd


def _proc(**changes) -> dict:
    return {
        "name": "worker-0",
        "role": "worker",
        "kind": "emulated",
        "pid": 12345,
        "pgid": 12345,
        "start_time": "1",
        "argv": [],
        "log": "x.log",
        **changes,
    }


@pytest.mark.parametrize("changes", [{"pid": "abc"}, {"pid": None}, {"pgid": 0}, {"pgid": -1}, {"pid": True}])
def test_state_with_unusable_process_ids_is_refused(tmp_path, changes):
    # a pgid of 0 would make `down` signal its own process group
    rd = _state(tmp_path, [_proc(**changes)])
    with pytest.raises(BtbctlError, match="unreadable run state"):
        rd.load()


def test_state_whose_pgid_is_not_the_pid_is_refused(tmp_path, capsys):
    # an edited pgid used to make `down` signal another process group and leave the gateway orphaned
    rd = _state(tmp_path, [_proc(pgid=os.getpgid(0))])
    with pytest.raises(BtbctlError, match=r"pgid \d+ differs from pid 12345"):
        rd.load()
    code, _, err = run(capsys, "down", "--run-dir", str(tmp_path))
    assert code == 2 and "differs from pid" in one_error_line(err)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "http://[::1", "http://127.0.0.1:99999", "ftp://h/", 7])
def test_state_with_a_control_url_that_is_not_http_is_refused(tmp_path, capsys, url):
    # a file:// control_url made the control client read a local file; a malformed one gave a traceback
    rd = _state(tmp_path, [])
    data = json.loads(rd.state_path.read_text())
    rd.state_path.write_text(json.dumps({**data, "control_url": url}))
    code, _, err = run(capsys, "tune", "--run-dir", str(tmp_path), "threshold=3")
    assert code == 2 and "control_url must be an http:// or https:// URL" in one_error_line(err)


def test_a_process_that_does_not_lead_its_recorded_group_is_not_ours():
    import subprocess
    import sys

    from btbctl.engine.launcher.rundir import ProcessRecord, process_start_time, record_is_ours

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # stays in our group
    try:
        rec = ProcessRecord(**{**_proc(pid=child.pid, pgid=child.pid), "start_time": process_start_time(child.pid)})
        assert not record_is_ours(rec)  # signalling group child.pid would reach nothing (or a stranger)
    finally:
        child.kill()
        child.wait()


def test_state_that_is_not_utf8_is_refused(tmp_path, capsys):
    rd = RunDir(tmp_path)
    rd.state_path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(BtbctlError, match="unreadable run state"):
        rd.load()
    code, _, err = run(capsys, "status", "--run-dir", str(tmp_path))
    assert code == 2 and "unreadable run state" in one_error_line(err)


# -- report: fail before simulating -----------------------------------------------------------------------------

MATRIX = """setups = ["70b_h100x4"]
policies = ["btb"]
[[workloads]]
name = "w"
[workloads.trace]
path = "{path}"
"""


def test_report_refuses_an_unusable_out_before_simulating(capsys, tmp_path, monkeypatch):
    from btbctl.engine import report as rp

    m = tmp_path / "m.toml"
    m.write_text(
        MATRIX.replace('path = "{path}"', "[workloads.trace.generate]\nbursts = 1\nburst_size = 2\ndecoys = 0")
    )
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(rp, "run_matrix", lambda *a, **k: pytest.fail("simulated before checking --out"))
    code, _, err = run(capsys, "report", str(m), "--out", str(blocker), "--no-charts", "-j", "1")
    assert code == 2 and one_error_line(err).startswith("btbctl: error: --out: ")


def test_report_names_the_workload_of_a_missing_trace(capsys, tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(MATRIX.format(path="missing.jsonl"))
    code, _, err = run(capsys, "report", str(m), "--out", str(tmp_path / "r"))
    assert code == 2
    line = next(i for i, x in enumerate(m.read_text().splitlines(), 1) if "missing.jsonl" in x)
    assert one_error_line(err).startswith(f"btbctl: error: {m}:{line}: workloads.0.trace.path: ")


def test_report_errors_carry_no_pydantic_prefix(capsys, tmp_path):
    m = tmp_path / "m.toml"
    m.write_text('setups = ["70b_h100x4"]\npolicies = ["btb"]\nworkloads = []\n')
    code, _, err = run(capsys, "report", str(m))
    assert code == 2
    assert one_error_line(err) == f"btbctl: error: {m}:3: workloads: at least one workload is needed"


# -- devices are not traces ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_reading_a_device_is_refused_instead_of_filling_memory(capsys):
    from btbctl.engine.errors import TraceFormatError
    from btbctl.engine.trace.readers import read_trace

    with pytest.raises(TraceFormatError, match="device"):
        read_trace("/dev/zero")  # used to read until memory ran out
    code, _, err = run(capsys, "trace", "audit", "/dev/zero")
    assert code == 2 and "device" in one_error_line(err)
    code, _, err = run(capsys, "dry-run", "--trace", "/dev/zero")
    assert code == 2 and "not a regular file" in one_error_line(err)


def test_a_pipe_is_still_read(tmp_path):
    from btbctl.engine.trace.readers import read_trace

    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    line = json.dumps({"arrival_s": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"], "request_id": "1"})
    import threading

    def feed():
        with open(fifo, "w") as f:
            f.write(line + "\n")

    t = threading.Thread(target=feed)
    t.start()
    try:
        assert len(read_trace(str(fifo))) == 1
    finally:
        t.join(5)


def test_bench_refuses_an_unwritable_requests_out_before_replaying(capsys, tmp_path, monkeypatch):
    from btbctl.engine.launcher import bench as lb

    monkeypatch.setattr(lb, "replay", lambda *a, **k: pytest.fail("replayed before checking --requests-out"))
    code, _, err = run(
        capsys,
        "bench",
        "--target",
        "http://127.0.0.1:9",
        "--run-dir",
        str(tmp_path / "run"),
        "--burst-size",
        "2",
        "--prefix-blocks",
        "1",
        "--requests-out",
        str(tmp_path / "missing" / "r.jsonl"),
    )
    assert code == 2
    assert one_error_line(err).startswith("btbctl: error: --requests-out: cannot write ")


def test_constants_have_sane_upper_bounds():
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.errors import ConfigError

    for key, bad in (("prefix_blocks", 10**26), ("threshold", 2**21), ("replicas", 5000), ("window_s", 1e9)):
        with pytest.raises(ConfigError, match=key):
            BtbConstants().with_updates(**{key: bad})
    assert BtbConstants(prefix_blocks=1 << 20, threshold=1 << 20, replicas=4096, window_s=86400.0)


# -- every reader is bounded: devices, FIFOs without a writer, deep nesting, decompression bombs ---------------------


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize("command", [["dry-run", "-c"], ["doctor", "-c"], ["report"]])
def test_a_device_as_a_config_file_is_one_line_not_a_read_forever(capsys, command):
    # used to read /dev/zero until memory ran out (8 GB in 15 s)
    code, _, err = run(capsys, *command, "/dev/zero")
    assert code == 2
    line = one_error_line(err)
    assert "/dev/zero" in line and "device" in line


def test_a_fifo_without_a_writer_is_refused_instead_of_a_hang(capsys, tmp_path, monkeypatch):
    from btbctl.engine import fileio

    monkeypatch.setattr(fileio, "FIFO_WAIT_S", 0.05)
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "trace", "audit", str(fifo))  # used to block forever in open()
    assert code == 2 and "FIFO with no writer for 0.05 s" in one_error_line(err)
    code, _, err = run(capsys, "doctor", "-c", str(fifo))
    assert code == 2 and "FIFO with no writer" in one_error_line(err)


def test_a_fifo_whose_writer_comes_later_is_read(tmp_path):
    import threading

    from btbctl.engine.fileio import read_bounded

    fifo = tmp_path / "late.fifo"
    os.mkfifo(fifo)
    opened = threading.Event()

    def feed():
        opened.wait(5)
        with open(fifo, "wb") as f:  # connects only after the reader is waiting
            f.write(b"late data")

    t = threading.Thread(target=feed)
    t.start()
    try:
        threading.Timer(0.05, opened.set).start()
        assert read_bounded(fifo, limit_bytes=100) == b"late data"
    finally:
        t.join(5)


def test_deeply_nested_toml_is_one_line(capsys, tmp_path):
    p = tmp_path / "deep.toml"
    p.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    code, _, err = run(capsys, "dry-run", "-c", str(p))
    assert code == 2 and "nested too deeply" in one_error_line(err) and str(p) in err


def test_a_gzip_bomb_trace_stops_at_the_limit(tmp_path, monkeypatch):
    import gzip

    from btbctl.engine import fileio
    from btbctl.engine.errors import TraceFormatError
    from btbctl.engine.trace.readers import read_trace

    p = tmp_path / "bomb.jsonl.gz"
    p.write_bytes(gzip.compress(b"\n" * (8 << 20), 9))  # 8 MiB of output from about 8 KiB
    assert p.stat().st_size < 64 << 10
    monkeypatch.setattr(fileio, "TRACE_LIMIT_BYTES", 1 << 20)
    with pytest.raises(TraceFormatError, match="decompresses to over the 1 MiB limit"):
        read_trace(str(p))


def test_bounded_reads_of_regular_files_pipes_and_gzip_members(tmp_path):
    import gzip

    from btbctl.engine.fileio import ReadRefused, read_bounded

    p = tmp_path / "f"
    p.write_bytes(b"x" * 100)
    assert read_bounded(p, limit_bytes=100) == b"x" * 100
    with pytest.raises(ReadRefused, match="over the 99 bytes limit"):
        read_bounded(p, limit_bytes=99)
    g = tmp_path / "f.gz"
    g.write_bytes(gzip.compress(b"ab") + gzip.compress(b"cd"))  # two members, as `cat a.gz b.gz` makes
    assert read_bounded(g, limit_bytes=4, gzip=True) == b"abcd"
    g.write_bytes(gzip.compress(b"abcdef")[:-6])
    with pytest.raises(ReadRefused, match="truncated"):
        read_bounded(g, limit_bytes=100, gzip=True)
    g.write_bytes(b"not gzip")
    with pytest.raises(ReadRefused, match="not a valid gzip file"):
        read_bounded(g, limit_bytes=100, gzip=True)


# -- cluster values that used to end in a traceback or a hang -------------------------------------------------------


@pytest.mark.parametrize(
    "toml, key",
    [
        ('[[workers]]\nenv = { A = "x\\u0000y" }\n', "workers.0.env"),
        ('[[workers]]\nextra_args = ["--a\\u0000"]\n', "workers.0.extra_args"),
        ("[gateway]\nhealth_interval_s = inf\n", "gateway.health_interval_s"),
    ],
)
def test_cluster_values_that_cannot_run_are_refused_up_front(capsys, tmp_path, toml, key):
    p = tmp_path / "cluster.toml"
    p.write_text(toml)
    code, _, err = run(capsys, "doctor", "-c", str(p))  # the same loader as up's, refused before any check
    assert code == 2
    line = one_error_line(err)
    assert str(p) in line and key in line, line


def test_a_full_disk_is_one_line_naming_the_file(capsys, monkeypatch):
    import errno

    from btbctl.commands import app as app_mod

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", "/run/btbctl/state.json")

    monkeypatch.setattr(app_mod, "app", full)
    code, out, err = run(capsys, "status")
    assert code == 1 and out == ""
    assert err == "btbctl: error: /run/btbctl/state.json: No space left on device\n"


def test_an_unexpected_os_error_still_shows_its_traceback(monkeypatch):
    import errno

    from btbctl.commands import app as app_mod

    def bug(*_a, **_k):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(app_mod, "app", bug)
    with pytest.raises(OSError, match="Bad file descriptor"):
        app_mod.main(["status"])


# -- names and addresses: a trailing newline is not a valid last character ------------------------------------------


def test_names_and_addresses_with_a_trailing_newline_are_refused():
    """The validating patterns end at the end of the string (``\\Z``): ``$`` would also match before a final newline,
    and ``re.match`` would let ``"w0\\n"`` through as a worker name, an SSH host or user, or a page file name."""
    from pydantic import ValidationError

    from btbctl.engine.agent.filedir import FileDirStore as FileDir
    from btbctl.engine.launcher.cluster import validate_cluster
    from btbctl.engine.launcher.hosts import HostSpec, check_hostname
    from btbctl.engine.replication.transport import TransferError, parse_address

    assert validate_cluster({"workers": [{"name": "w0"}]}).workers[0].name == "w0"
    with pytest.raises(ConfigError) as e:
        validate_cluster({"workers": [{"name": "w0\n"}]})
    assert e.value.key == "workers.0.name"
    assert HostSpec(name="h", address="gpu1.example", user="me", env={"A": "1"}).name == "h"
    for bad in ({"name": "h\n"}, {"address": "gpu1.example\n"}, {"user": "me\n"}, {"env": {"A\n": "1"}}):
        with pytest.raises(ValidationError):
            HostSpec(**{"name": "h", "address": "gpu1.example", **bad})
    with pytest.raises(ValueError, match="not a host name"):
        check_hostname("gpu1\n")
    assert parse_address("node-1:7000") == ("node-1", 7000)
    with pytest.raises(TransferError):
        parse_address("node-1\n:7000")
    assert FileDir.valid_name("a" * 64) and not FileDir.valid_name("a" * 64 + "\n")
