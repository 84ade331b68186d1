"""The operations log's pieces: logfmt lines read back, identical repeats held back and counted, rotation, the
time filter of `btbctl logs --since`."""

from __future__ import annotations

import logging

import pytest

from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher.logs import as_json, line_time, parse_since, read_tail, since_filter
from btbctl.engine.logfmt import LogfmtFormatter, RepeatFilter, format_event, parse_line, rotating_handler


def test_logfmt_lines_read_back():
    line = format_event("control_write", {"peer": "127.0.0.1", "key": "policy", "old": "a b", "new": 'q"z', "x": None})
    assert parse_line(line) == {
        "event": "control_write",
        "peer": "127.0.0.1",
        "key": "policy",
        "old": "a b",
        "new": 'q"z',
    }
    assert parse_line("Traceback (most recent call last):") is None
    assert parse_line("ready http://127.0.0.1:1 control http://127.0.0.1:2") is None
    assert as_json("plain text\n") == {"msg": "plain text"}


def test_logs_json_keeps_numbers_as_numbers_and_ids_as_text():
    line = format_event(
        "copy_done",
        {"prefix": "123456789012", "bytes": 4096, "duration_s": 0.25, "tiny": 1e-05, "source": "worker-0", "n": -3},
    )
    got = as_json("ts=2026-01-02T03:04:05.000Z level=info " + line)
    assert got["bytes"] == 4096 and got["duration_s"] == 0.25 and got["tiny"] == 1e-05 and got["n"] == -3
    assert got["prefix"] == "123456789012" and got["source"] == "worker-0" and got["ts"] == "2026-01-02T03:04:05.000Z"
    assert as_json('event=x msg="3"')["msg"] == "3"


def _record(msg: str, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord("btbctl.x", level, __file__, 1, msg, (), None)


def test_repeat_filter_holds_back_identical_lines_and_counts_them():
    now = [0.0]
    f = RepeatFilter(window_s=10.0, clock=lambda: now[0])
    assert f.filter(_record("accept failed: Too many open files"))
    assert not any(f.filter(_record("accept failed: Too many open files")) for _ in range(500))
    assert f.filter(_record("another line"))  # other lines pass
    now[0] = 11.0
    r = _record("accept failed: Too many open files")
    assert f.filter(r) and r.getMessage().endswith("repeated=500")


def test_rotating_handler_rotates_and_logs_read_whole(tmp_path):
    path = tmp_path / "gateway.log"
    h = rotating_handler(str(path), max_bytes=2000, backups=3)
    lg = logging.getLogger("btbctl.test.rotate")
    lg.propagate = False
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        for i in range(60):
            lg.info("%s", format_event("tick", {"i": i}))
    finally:
        lg.removeHandler(h)
        h.close()
    assert (tmp_path / "gateway.log.1").exists() and not (tmp_path / "gateway.log.4").exists()
    assert path.stat().st_size <= 2000
    whole = read_tail(path, 0, whole=True).splitlines()
    ids = [int(parse_line(ln)["i"]) for ln in whole]
    assert ids == sorted(ids) and ids[-1] == 59  # oldest rotated copy first
    assert all(parse_line(ln)["ts"].endswith("Z") for ln in whole)


def test_formatter_folds_a_traceback_into_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        rec = logging.LogRecord("btbctl.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = LogfmtFormatter().format(rec)
    assert "\n" not in line and parse_line(line)["msg"] == "failed" and "boom" in parse_line(line)["exc"]


def test_since():
    assert parse_since("10m", now=1000.0) == 400.0
    assert parse_since("2h", now=10000.0) == 2800.0
    assert parse_since("1970-01-01T00:01:40Z") == 100.0
    assert parse_since("1970-01-01T00:01:40") == 100.0  # naive: UTC
    with pytest.raises(BtbctlError, match="--since"):
        parse_since("yesterday")
    text = (
        "ts=1970-01-01T00:00:10.000Z level=info event=a\n"
        "ts=1970-01-01T00:01:50.000Z level=info event=b\n"
        "  a continuation line\n"
        "ts=1970-01-01T00:02:00.000Z level=info event=c\n"
    )
    assert line_time("ts=1970-01-01T00:00:10.000Z level=info") == 10.0
    assert [ln.split()[-1] for ln in since_filter(text, 100.0).splitlines()] == ["event=b", "line", "event=c"]
