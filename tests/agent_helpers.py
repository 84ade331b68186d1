"""Real ``btbctl agent`` processes for tests: start, talk to the control API, kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SECRET = b"fleet-secret-for-tests-0123456789"


@dataclass
class AgentProc:
    name: str
    proc: subprocess.Popen
    socket: str
    peer: str
    control_port: int
    log_path: Path

    def call(self, method: str, path: str, body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}{path}", data=data, method=method)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                raw = r.read()
                return r.status, (json.loads(raw) if raw[:1] in (b"{", b"[") else {"text": raw.decode()})
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def expect(self, copy_id: str, keys=None) -> str:
        st, rep = self.call("POST", "/v1/expect", {"copy_id": copy_id, **({"keys": keys} if keys else {})})
        assert st == 200, rep
        return rep["token"]

    def records(self, copy_id: str) -> dict:
        st, rep = self.call("GET", f"/v1/copies/{copy_id}")
        return {r["role"]: r for r in rep.get("records", [])} if st == 200 else {}

    def wait_final(self, copy_id: str, role: str, timeout_s: float = 20.0) -> dict:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            r = self.records(copy_id).get(role)
            if r is not None and r["state"] in ("done", "failed"):
                return r
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: copy {copy_id} ({role}) did not finish: {self.records(copy_id)}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_agent(
    tmp: Path,
    name: str,
    arena_mib: int = 64,
    secret: bytes = SECRET,
    extra: list[str] | None = None,
    python: str | None = None,
) -> AgentProc:
    """Start ``btbctl agent`` with a fresh socket under ``tmp``; returns once it printed its ready line."""
    tmp.mkdir(parents=True, exist_ok=True)
    sec = tmp / f"{name}.secret"
    sec.write_bytes(secret)
    sock = str(tmp / f"{name}.sock")
    log_path = tmp / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [
        python or sys.executable,
        "-m",
        "btbctl",
        "agent",
        "--secret-file",
        str(sec),
        "--arena-mib",
        str(arena_mib),
        "--socket",
        sock,
        "--agent-id",
        name,
        *(extra or []),
    ]
    logf = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, text=True, env=env)
    logf.close()
    line = proc.stdout.readline().split()
    if len(line) < 6 or line[0] != "ready":
        proc.kill()
        raise AssertionError(f"agent {name} did not start: {line} {log_path.read_text()[-2000:]}")
    return AgentProc(name, proc, sock, line[2], int(line[4].rpartition(":")[2]), log_path)


def wait_for(cond, timeout_s: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")
