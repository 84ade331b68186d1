"""Utilities that run emulated workers as real processes on loopback (used by the worker and replication tests),
and the tests of the worker's command line."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

READY_TIMEOUT_S = 20.0


class WorkerProc:
    """``python -m btbctl worker ...`` as a child process; ``url`` and ``transfer`` come from its ready line."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        full_env = dict(os.environ)
        full_env.pop("BTBCTL_REPLICATION_FAULT", None)
        full_env.update(env or {})
        argv = [sys.executable, "-m", "btbctl", "worker", "--port", "0", "--transfer-port", "0", *args]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, start_new_session=True
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = ""
        self.transfer = ""

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> WorkerProc:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = None
        if not line or not line.startswith("ready "):
            self.stop()
            raise AssertionError(f"worker not ready: {line!r}; stderr: {self.proc.stderr.read()[-2000:]}")
        parts = line.split()
        assert parts[0] == "ready" and parts[2] == "transfer", line
        self.url, self.transfer = parts[1], parts[3]
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        for f in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                f.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    # -- HTTP -------------------------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        path: str,
        body=None,
        headers: dict | None = None,
        raw: bytes | None = None,
        timeout: float = 20.0,
    ):
        """``(status, parsed JSON or text)``."""
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        if data is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, text, ctype = r.status, r.read().decode(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            status, text, ctype = e.code, e.read().decode(), e.headers.get("Content-Type", "")
        if "json" in ctype:
            return status, json.loads(text)
        return status, text

    def get(self, path: str, **kw):
        return self.call("GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return self.call("POST", path, body, **kw)

    def stream(self, path: str, body: dict) -> list[str]:
        """The ``data:`` payloads of an SSE response, in order (raw strings), checking the framing."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=20) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            text = r.read().decode()
        events = text.split("\n\n")
        assert events[-1] == "", "stream must end with a blank line"
        out = []
        for ev in events[:-1]:
            assert ev.startswith("data: "), ev
            out.append(ev[len("data: ") :])
        return out

    def stream_timed(self, path: str, body: dict) -> list[tuple[float, str]]:
        """``(monotonic arrival time, data payload)`` of each SSE event as it is read."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        out = []
        with urllib.request.urlopen(req, timeout=20) as r:
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode().rstrip("\n")
                if line.startswith("data: "):
                    out.append((time.monotonic(), line[len("data: ") :]))
        return out


def authorized_push(src: WorkerProc, dst: WorkerProc, chain: list[str], copy_id: str | None = None, headers=None):
    """What the gateway does for one copy: mint a token, ``/btb/expect`` it at ``dst`` with the copy id and chain,
    then ``/btb/push`` from ``src`` with the token. Returns the push's ``(status, body)``. (A worker without
    ``/btb/expect`` gets the push alone.)"""
    copy_id = copy_id or secrets.token_hex(8)
    token = secrets.token_hex(32)
    st, r = dst.post("/btb/expect", {"chain": chain, "copy_id": copy_id, "token": token}, headers=headers)
    body = {"chain": chain, "target": dst.transfer, "copy_id": copy_id}
    if st != 404:
        assert st == 201, (st, r)
        body["token"] = token
    return src.post("/btb/push", body, headers=headers)


def start_workers(*specs: tuple) -> list[WorkerProc]:
    """Start several workers at once: each spec is ``(args tuple, env dict or None)``; waits for all."""
    procs = [WorkerProc(*args, env=env) for args, env in specs]
    try:
        for p in procs:
            p.wait_ready()
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return procs


def wait_for(pred, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``pred()`` until it returns a truthy value; returns it, or raises AssertionError on timeout."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


# -- command-line tests ------------------------------------------------------------------------------------------
def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "btbctl", "worker", *args], capture_output=True, text=True, timeout=30)


def test_worker_refuses_a_model_that_does_not_fit_with_one_line():
    r = _run_cli("--model-path", "llama-3.3-70b", "--tp-size", "1", "--port", "0")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "btbctl: error:" in lines[0] and "gpus_per_replica" in lines[0]
    assert r.stdout == ""


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_worker_rejects_bad_flag_values():
    for args, key in (
        (("--gpu", "tpu9"), "gpu"),
        (("--page-size", "0"), "page_size"),
        (("--chunked-prefill-size", "10"), "chunked_prefill_size"),
        (("--btb-token-file", "/nonexistent/token"), "btb_token_file"),
    ):
        r = _run_cli("--model-path", "llama-3.3-70b", "--port", "0", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert key in r.stderr, (args, r.stderr)


def test_worker_help_lists_sglang_and_emulation_flags():
    r = _run_cli("--help")
    assert r.returncode == 0
    for flag in (
        "--model-path",
        "--tp-size",
        "--host",
        "--port",
        "--mem-fraction-static",
        "--page-size",
        "--chunked-prefill-size",
        "--enable-metrics",
        "--served-model-name",
        "--gpu",
        "--time-scale",
        "--zero-delay",
        "--kv-bytes-scale",
        "--transfer-port",
        "--btb-token-file",
    ):
        assert flag in r.stdout, flag


def test_worker_reports_a_taken_port_in_one_line():
    first = WorkerProc("--model-path", "qwen3-8b", "--tp-size", "1").wait_ready()
    try:
        port = first.url.rsplit(":", 1)[1]
        r = _run_cli("--model-path", "qwen3-8b", "--tp-size", "1", "--port", port)
        assert r.returncode == 2 and "cannot listen" in r.stderr and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1
        assert first.get("/health")[0] == 200
    finally:
        first.stop()


def test_worker_beyond_loopback_requires_a_token():
    from btbctl.engine.errors import ConfigError
    from btbctl.engine.worker.config import make_config

    with pytest.raises(ConfigError, match="btb_token_file"):
        make_config(model_path="llama-3.3-70b", host="0.0.0.0")
    assert make_config(model_path="llama-3.3-70b", host="0.0.0.0", btb_token="t").host == "0.0.0.0"
    assert make_config(model_path="llama-3.3-70b", host="127.0.0.2").btb_token is None
