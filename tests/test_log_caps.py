"""Every log btbctl writes is size-capped and private: a launched process's output goes through a rotating writer,
and the gateway's own log file is mode 0600."""

from __future__ import annotations

import logging
import os
import stat
import sys
import time

from btbctl.engine.launcher.local import spawn
from btbctl.engine.launcher.logcap import pump
from btbctl.engine.logfmt import rotating_handler


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_pump_rotates_at_the_cap(tmp_path):
    r, w = os.pipe()
    line = b"x" * 99 + b"\n"
    pid = os.fork()
    if pid == 0:  # the noisy child
        os.close(r)
        for _ in range(3000):
            os.write(w, line)
        os._exit(0)
    os.close(w)
    log = tmp_path / "w.log"
    pump(r, str(log), max_bytes=100_000, backups=2)
    os.waitpid(pid, 0)
    sizes = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert set(sizes) == {"w.log", "w.log.1", "w.log.2"}  # 300 kB written, 3 files of at most 100 kB kept
    assert all(s <= 100_000 for s in sizes.values()) and _mode(log) == 0o600


def test_a_launched_process_cannot_grow_its_log_past_the_cap(tmp_path):
    log = tmp_path / "logs" / "noisy.log"
    noisy = "import sys\nfor i in range(20000): sys.stdout.write('event=refused peer=1.2.3.4 n=%08d\\n' % i)"
    proc = spawn("noisy", [sys.executable, "-c", noisy], log, max_bytes=50_000, backups=1)
    assert proc.popen.wait(30) == 0
    assert proc.writer is not None and proc.writer.wait(30) == 0  # the writer ends with the child's output
    files = sorted(p.name for p in log.parent.iterdir())
    assert files == ["noisy.log", "noisy.log.1"]
    total = sum(p.stat().st_size for p in log.parent.iterdir())
    assert total <= 100_000 and all(_mode(p) == 0o600 for p in log.parent.iterdir())
    assert log.read_text().rstrip().endswith("n=00019999")  # the last lines are kept
    # a new start of the same name begins afresh
    again = spawn("noisy", [sys.executable, "-c", "print('ready http://127.0.0.1:1')"], log)
    again.popen.wait(30)
    deadline = time.monotonic() + 10
    while again.writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in log.parent.iterdir()) == ["noisy.log"]
    assert log.read_text() == "ready http://127.0.0.1:1\n"


def test_the_gateway_log_file_is_private(tmp_path):
    path = tmp_path / "gateway.log"
    h = rotating_handler(str(path), max_bytes=2000, backups=1)
    lg = logging.getLogger("btbctl.test.private")
    lg.addHandler(h)
    lg.propagate = False
    try:
        for i in range(100):
            lg.warning("event=x n=%d", i)
    finally:
        lg.removeHandler(h)
        h.close()
    assert _mode(path) == 0o600 and _mode(str(path) + ".1") == 0o600


def test_a_chunk_larger_than_a_whole_file_is_cut_at_line_ends_and_the_cap_holds(tmp_path):
    src = tmp_path / "output"  # a regular file reads in chunks of CHUNK_BYTES (64 KiB), as a fast writer's pipe does
    lines = [f"event=refused peer=1.2.3.4 n={i:08d}\n" for i in range(20000)]
    src.write_text("".join(lines))
    log = tmp_path / "logs" / "noisy.log"
    log.parent.mkdir()
    fd = os.open(src, os.O_RDONLY)
    try:
        pump(fd, str(log), 20_000, 2)
    finally:
        os.close(fd)
    files = sorted(log.parent.iterdir())
    assert [p.name for p in files] == ["noisy.log", "noisy.log.1", "noisy.log.2"]
    assert all(p.stat().st_size <= 20_000 for p in files)  # no file past the cap, whatever the chunk size
    kept = (log.parent / "noisy.log.2").read_text() + (log.parent / "noisy.log.1").read_text() + log.read_text()
    assert kept.endswith(lines[-1]) and kept.splitlines(keepends=True)[0] in lines  # whole lines, the last kept
