"""Agent-to-agent copies over real TCP on loopback: fan-out, and every bad input ends refused with one log line, the
target keeping only the pages that verified before it, never an unverified page. In-process agents (threads) except
where a process must die."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from agent_helpers import SECRET, start_agent, wait_for
from btbctl.engine.agent.events import format_event
from btbctl.engine.agent.pages import ALIGN_BYTES, PageStore
from btbctl.engine.agent.peer import (
    AUTH_LABEL,
    PROTOCOL_VERSION,
    Conn,
    PeerError,
    PeerService,
    SendFaults,
    client_auth,
    fanout_plan,
    server_auth,
)
from btbctl.engine.replication.wire import ClientHandshake
from btbctl.sglang_l3.frames import FRAME_HEAD, KIND_JSON
from btbctl.sglang_l3.keys import page_keys

PAGE = 4 * ALIGN_BYTES


class Node:
    def __init__(self, name: str, arena_bytes: int = 64 * PAGE, secret: bytes = SECRET, **kw) -> None:
        self.events: list[tuple[str, dict]] = []
        self.store = PageStore(arena_bytes, on_event=self.event)
        self.peers = PeerService(self.store, secret, name, self.event, **kw)
        self.addr = f"127.0.0.1:{self.peers.start()}"

    def event(self, name: str, fields: dict) -> None:
        self.events.append((name, fields))

    def lines(self, name: str) -> list[str]:
        return [format_event(e, f) for e, f in self.events if e == name]

    def fill(self, names: list[str]) -> list[bytes]:
        tok, offs = self.store.reserve(names, [PAGE] * len(names), "t", all_or_none=True)
        data = []
        for i, off in enumerate(offs):
            b = bytes([(i * 37 + len(names)) % 256]) * PAGE
            self.store.write(off, b)
            data.append(b)
        self.store.commit(tok)
        return data

    def read(self, names: list[str]) -> list[bytes]:
        offs, lid = self.store.lease(names, PAGE, "test")
        out = [bytes(self.store.read(o, PAGE)) for o in offs]
        self.store.release(lid)
        return out

    def final(self, copy_id: str, role: str, timeout_s: float = 10.0) -> dict:
        def done():
            return [r for r in self.peers.book.find(copy_id) if r.role == role and r.state.final]

        wait_for(lambda: bool(done()), timeout_s, f"{copy_id} {role} final")
        return done()[0].as_dict()

    def close(self) -> None:
        self.peers.close()
        self.store.close()


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(name: str, **kw) -> Node:
        n = Node(name, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def _names(n: int, tag: str = "0123456789abcdef") -> list[str]:
    return [f"{tag}.{k}" for k in page_keys(list(range(n * 4)), 4)]


class _CountingChannel:
    """A page channel that wraps the TCP one and counts what goes through it (another transport would replace it)."""

    def __init__(self, inner: Conn, log: list[str]) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("deadline", "idle_timeout_s"):
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    def send_page(self, index: int, data: memoryview, digest: int) -> None:
        self.log.append(f"page {index}")
        self.inner.send_page(index, data, digest)

    def send_json(self, obj: dict) -> None:
        self.log.append(str(obj.get("op")))
        self.inner.send_json(obj)


def test_outbound_copies_go_through_the_injected_page_channel(nodes):
    from btbctl.engine.replication.wire import connect_channel

    log: list[str] = []
    src = nodes("src", connect=lambda h, p, c, i: _CountingChannel(connect_channel(h, p, c, i), log))
    dst = nodes("dst")
    names = _names(3)
    data = src.fill(names)
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c1")}], "star"))
    assert dst.final("c1", "target")["state"] == "done" and dst.read(names) == data
    assert log == ["hello", "auth", "offer", "page 0", "page 1", "page 2", "end"]


@pytest.mark.parametrize("fanout", ["chain", "tree", "star"])
def test_fan_out_reaches_every_target_verified(nodes, fanout):
    src = nodes("src")
    targets = [nodes(f"t{i}") for i in range(5)]
    names = _names(12)
    data = src.fill(names)
    plan = fanout_plan([{"addr": t.addr, "token": t.peers.expect("c1")} for t in targets], fanout)
    assert len(plan) == {"chain": 1, "tree": 2, "star": 5}[fanout]
    src.peers.push("c1", names, plan)
    assert src.final("c1", "source")["state"] == "done"
    for t in targets:
        rec = t.final("c1", "target")
        assert rec["state"] == "done" and rec["pages_done"] == 12
        assert t.read(names) == data
    assert len(src.lines("copy_finished")) == 1


def test_peer_without_the_secret_is_refused_before_anything_is_reserved(nodes):
    dst = nodes("dst")
    rogue = nodes("rogue", secret=b"another-secret-0123456789abcdef")
    names = _names(3)
    rogue.fill(names)
    token = dst.peers.expect("c1")
    rogue.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))
    rec = rogue.final("c1", "source")
    assert rec["state"] == "failed"
    wait_for(lambda: dst.lines("auth_failed"), 5, "auth_failed line")
    assert len(dst.lines("auth_failed")) == 1 and "bad MAC" in dst.lines("auth_failed")[0]
    assert dst.store.stats()["used_bytes"] == 0 and not dst.peers.book.find("c1")
    # the expectation is intact: the real source can still deliver
    src = nodes("src")
    src.fill(names)
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))
    assert dst.final("c1", "target")["state"] == "done"


def test_garbage_before_authentication_is_cut_off(nodes):
    dst = nodes("dst")
    host, port = dst.addr.split(":")
    s = socket.create_connection((host, int(port)))
    s.settimeout(5)
    s.sendall(FRAME_HEAD.pack(KIND_JSON, 1 << 30))  # a frame far beyond the pre-auth bound
    assert s.recv(4096) == b""  # closed
    wait_for(lambda: dst.lines("auth_failed"), 5, "auth_failed line")
    assert "exceeds 4096" in dst.lines("auth_failed")[0]
    assert dst.store.stats()["used_bytes"] == 0


@pytest.mark.parametrize(
    "fault,reason", [(SendFaults(corrupt_wire=2), "xxh3_64 digest mismatch"), (SendFaults(truncate=1), "bytes where")]
)
def test_forged_or_truncated_page_is_refused_and_only_the_pages_verified_before_it_are_served(nodes, fault, reason):
    src = nodes("src", faults=fault)
    dst = nodes("dst")
    names = _names(6)
    src.fill(names)
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c1")}], "star"))
    rec = dst.final("c1", "target")
    assert rec["state"] == "failed" and reason in rec["error"]
    bad = fault.corrupt_wire if fault.corrupt_wire is not None else fault.truncate
    # the pages ahead of the bad one verified and were committed as they came; the bad one and the rest never
    assert dst.store.leading_ready(names) == bad
    assert dst.store.stats()["used_bytes"] == bad * PAGE and dst.store.stats()["pending_bytes"] == 0
    assert dst.store.provenance(names) == ["copy:c1"] * bad + [None] * (6 - bad)
    assert src.final("c1", "source")["state"] == "failed"
    finished = dst.lines("copy_finished")
    assert len(finished) == 1 and "outcome=failed" in finished[0] and reason.split()[0] in finished[0]


def test_copy_ids_need_their_token_and_are_single_use(nodes):
    src, dst, third = nodes("src"), nodes("dst"), nodes("third")
    names = _names(3)
    src.fill(names)
    third.fill(names)
    token = dst.peers.expect("c1")
    third.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": "f" * 32}], "star"))  # a guess
    assert "bad token" in third.final("c1", "source")["error"]
    third.peers.push("c9", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))  # unknown id
    assert "unknown copy id" in third.final("c9", "source")["error"]
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))
    assert dst.final("c1", "target")["state"] == "done"
    third.peers.push("c1x", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))
    assert third.final("c1x", "source")["state"] == "failed"  # a token bound to another copy id
    dup = nodes("dup")
    dup.fill(names)
    dup.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": token}], "star"))  # replayed token
    assert "already used" in dup.final("c1", "source")["error"]
    deadline = time.monotonic() + 10  # the target logs a refusal after answering it: wait for the fourth line
    while len(dst.lines("copy_refused")) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    refused = dst.lines("copy_refused")
    assert len(refused) == 4 and all("reason=" in line for line in refused)
    with pytest.raises(ValueError, match="already expected or used"):
        dst.peers.expect("c1")


def test_a_full_store_refuses_the_copy_whole(nodes):
    src = nodes("src")
    dst = nodes("dst", arena_bytes=4 * PAGE, max_copy_bytes=1 << 30, max_peer_bytes=1 << 30)
    dst.fill(_names(4, "ffffffffffffffff"))
    dst.store.pin_for(_names(4, "ffffffffffffffff"), 60)  # every page held: nothing may be evicted
    names = _names(3)
    src.fill(names)
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c1")}], "star"))
    assert "store full" in src.final("c1", "source")["error"]
    assert dst.store.stats()["pending_bytes"] == 0 and len(dst.lines("copy_refused")) == 1
    big = nodes("big", arena_bytes=4 * PAGE)  # above the per-copy limit (half the arena)
    src.peers.push("c2", names, fanout_plan([{"addr": big.addr, "token": big.peers.expect("c2")}], "star"))
    assert "exceeds this agent's limit" in src.final("c2", "source")["error"]


def test_an_idle_peer_is_cut_off_and_its_room_freed(nodes):
    dst = nodes("dst", idle_timeout_s=0.5)
    names = _names(4)
    token = dst.peers.expect("c1")
    host, port = dst.addr.split(":")
    conn = Conn(socket.create_connection((host, int(port))), 5.0)
    client_auth(conn, SECRET, "slowpoke")
    conn.send_json({"op": "offer", "copy_id": "c1", "token": token, "names": names, "sizes": [PAGE] * 4})
    assert conn.recv_json()["op"] == "accept"
    assert dst.store.stats()["pending_bytes"] == 4 * PAGE  # room reserved, after authentication and the token
    rec = dst.final("c1", "target", timeout_s=5)
    assert rec["state"] == "failed" and "idle" in rec["error"]
    assert dst.store.stats()["pending_bytes"] == 0 and dst.store.leading_ready(names) == 0
    conn.close()


def test_source_agent_killed_mid_copy_leaves_the_target_only_the_pages_that_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("BTBCTL_AGENT_FAULT", "delay_s=0.1")
    src = start_agent(tmp_path, "src")
    monkeypatch.delenv("BTBCTL_AGENT_FAULT")
    dst = start_agent(tmp_path, "dst")
    try:
        from btbctl.sglang_l3.client import AgentClient
        from btbctl.sglang_l3.keys import Namespace

        ns = Namespace("m", 1, 0, 1, 0, 1, 0, 4, "page_first", "torch.bfloat16", PAGE, "v1", "x")
        c = AgentClient(src.socket, 2.0, ns.describe())
        keys = page_keys(list(range(80)), 4)
        rep, conn = c.call({"op": "put", "ns": ns.ns_id, "keys": keys, "size": PAGE})
        c.call({"op": "commit", "token": rep["token"], "written": [True] * len(keys)})
        token = dst.expect("k1", keys)
        st, _ = src.call(
            "POST", "/v1/push", {"copy_id": "k1", "keys": keys, "targets": [{"addr": dst.peer, "token": token}]}
        )
        assert st == 202
        wait_for(lambda: dst.records("k1").get("target", {}).get("pages_done", 0) >= 3, 10, "3 pages in")
        src.kill()
        rec = dst.wait_final("k1", "target")
        assert rec["state"] == "failed" and rec["pages_done"] < len(keys)
        st, have = dst.call("POST", "/v1/has", {"keys": keys, "namespaces": [ns.ns_id]})
        # only the pages that verified before the source died: the leading run, never the whole prefix
        assert 3 <= have["namespaces"][ns.ns_id] == rec["pages_done"] < len(keys)
        assert ns.ns_id not in have["complete"]
        assert dst.log().count("event=copy_finished copy_id=k1") == 1
        c.close()
    finally:
        src.stop()
        dst.stop()


def test_control_api_auth_and_errors(tmp_path):
    tok = tmp_path / "token"
    tok.write_text("control-token-0123456789abcdef")
    a = start_agent(tmp_path, "a", extra=["--control-token-file", str(tok)])
    try:
        keys = page_keys(list(range(8)), 4)
        assert a.call("GET", "/health")[0] == 200
        assert a.call("POST", "/v1/has", {"keys": keys})[0] == 401
        assert a.call("POST", "/v1/has", {"keys": keys}, token="wrong")[0] == 403
        t = "control-token-0123456789abcdef"
        st, rep = a.call("POST", "/v1/has", {"keys": keys}, token=t)
        assert st == 200 and rep["complete"] == []
        st, rep = a.call(
            "POST",
            "/v1/push",
            {"copy_id": "x", "keys": keys, "targets": [{"addr": "127.0.0.1:9", "token": "t"}]},
            token=t,
        )
        assert st == 409 and "does not hold" in rep["error"]
        st, rep = a.call(
            "POST",
            "/v1/push",
            {"copy_id": "x", "keys": keys, "fanout": "ring", "targets": [{"addr": "127.0.0.1:9", "token": "t"}]},
            token=t,
        )
        assert st == 400 and "fanout" in rep["error"]
        assert a.call("POST", "/v1/expect", {"copy_id": "bad id!"}, token=t)[0] == 400
        assert a.call("POST", "/v1/expect", {"copy_id": "e1"}, token=t)[0] == 200
        assert a.call("POST", "/v1/expect", {"copy_id": "e1"}, token=t)[0] == 409
        assert a.call("GET", "/v1/copies/none", token=t)[0] == 404
        st, rep = a.call("GET", "/metrics")
        assert st == 200 and "btbctl_agent_copies_total" in rep["text"] and "btbctl_agent_arena_bytes" in rep["text"]
    finally:
        a.stop()


@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_cli_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    from btbctl.engine.replication.credentials import node_credentials_text

    sec = tmp_path / "s"
    sec.write_bytes(b"short")
    keys = tmp_path / "agent-a.keys"
    keys.write_text(node_credentials_text(SECRET, "agent-a", ["agent-a", "agent-b"]))
    for args, needle in (
        (["--secret-file", str(keys), "--agent-id", "agent-b"], "holds the credentials of 'agent-a'"),
        (["--secret-file", str(sec)], "--secret-file"),
        (["--secret-file", str(tmp_path / "none")], "cannot read"),
        (["--secret-file", __file__, "--peer", "nope"], "--peer: bad address"),
        (["--secret-file", __file__, "--transport", "carrier-pigeon"], "--transport"),
        (["--secret-file", __file__, "--arena-mib", "0"], "--arena-mib"),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "btbctl", "agent", "--socket", str(tmp_path / "x.sock"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.count("\n") == 1 and needle in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = subprocess.run(
        [sys.executable, "-m", "btbctl", "agent", "--socket", str(tmp_path / "x.sock"), "--secret-file", str(sec)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, "BTBCTL_DEBUG": "1"},
    )
    assert "Traceback" in p.stderr


def test_timestamps_and_copy_states_are_the_shared_vocabulary(nodes):
    src, dst = nodes("src"), nodes("dst")
    names = _names(2)
    src.fill(names)
    src.peers.push("s1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("s1")}], "star"))
    rec = src.final("s1", "source")
    assert rec["state"] in ("done", "failed", "running", "stalled")
    assert rec["finished_s"] >= rec["started_s"] > time.time() - 60


def test_file_mode_copies_exactly_the_named_files(tmp_path, monkeypatch):
    import os

    dir_a, dir_b = tmp_path / "l3-a", tmp_path / "l3-b"
    dir_a.mkdir()
    keys = page_keys(list(range(40)), 8)
    for i, k in enumerate(keys):
        (dir_a / f"{k}_m_0_1.bin").write_bytes(os.urandom(1000 + i))
        (dir_a / f"{k}_m_1_2.bin").write_bytes(b"other rank")  # another namespace: also present, not asked for
    (dir_a / "unrelated.bin").write_bytes(b"x")
    a = start_agent(tmp_path, "fa", extra=["--file-dir", str(dir_a)])
    b = start_agent(tmp_path, "fb", extra=["--file-dir", str(dir_b)])
    monkeypatch.setenv("BTBCTL_AGENT_FAULT", "corrupt_wire=2")
    f = start_agent(tmp_path, "ff", extra=["--file-dir", str(dir_a)])
    try:
        st, have = a.call("POST", "/v1/has", {"keys": keys})
        assert have["complete"] == ["_m_0_1", "_m_1_2"]
        rec_f = f.call(
            "POST",
            "/v1/push",
            {
                "copy_id": "f0",
                "keys": keys,
                "namespaces": ["_m_0_1"],
                "targets": [{"addr": b.peer, "token": b.expect("f0", keys)}],
            },
        )
        assert rec_f[0] == 202 and b.wait_final("f0", "target")["state"] == "failed"
        assert not dir_b.exists() or not any(dir_b.iterdir())  # a forged copy leaves no file, not even a temp one
        st, rec = a.call(
            "POST",
            "/v1/push",
            {
                "copy_id": "f1",
                "keys": keys,
                "namespaces": ["_m_0_1"],
                "targets": [{"addr": b.peer, "token": b.expect("f1", keys)}],
            },
        )
        assert st == 202 and b.wait_final("f1", "target")["state"] == "done"
        assert sorted(p.name for p in dir_b.iterdir()) == sorted(f"{k}_m_0_1.bin" for k in keys)
        assert all((dir_b / p).read_bytes() == (dir_a / p).read_bytes() for p in os.listdir(dir_b))
        body = {"keys": keys, "namespaces": ["_m_0_1"]}
        assert b.call("POST", "/v1/provenance", body)[1]["namespaces"]["_m_0_1"] == ["copy:f1"] * 5
        assert a.call("POST", "/v1/provenance", body)[1]["namespaces"]["_m_0_1"] == ["write"] * 5
        (dir_b / "x.tmp").write_bytes(b"rewritten by SGLang")  # SGLang's own write: temp file, then os.replace
        os.replace(dir_b / "x.tmp", dir_b / f"{keys[0]}_m_0_1.bin")
        assert b.call("POST", "/v1/provenance", body)[1]["namespaces"]["_m_0_1"] == ["write"] + ["copy:f1"] * 4
    finally:
        for x in (a, b, f):
            x.stop()


def test_file_mode_refuses_names_that_are_not_page_files(tmp_path):
    from btbctl.engine.agent.filedir import FileDirStore

    st = FileDirStore(str(tmp_path / "d"), 1 << 20)
    try:
        assert st.valid_name("a" * 64 + "_m_0_1")
        for bad in ("../../etc/passwd", "a" * 64 + "/../x", "a" * 63, "a" * 64 + "_..", "A" * 64):
            assert not st.valid_name(bad), bad
    finally:
        st.close()


def test_cancel_at_the_source_leaves_the_target_only_the_pages_that_verified(nodes):
    src = nodes("src", faults=SendFaults(delay_s=0.05))
    dst = nodes("dst")
    names = _names(20)  # within the per-copy limit (half of the 64-page arena)
    src.fill(names)
    src.peers.push("x1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("x1")}], "star"))
    wait_for(lambda: any(r.pages_done >= 2 for r in dst.peers.book.find("x1")), 10, "2 pages in")
    assert src.peers.cancel("x1")
    assert src.final("x1", "source")["state"] == "failed"
    rec = dst.final("x1", "target")
    assert rec["state"] == "failed" and 2 <= dst.store.leading_ready(names) == rec["pages_done"] < len(names)
    assert dst.store.stats()["pending_bytes"] == 0


# -- streaming copies: the pages trail the source's write-through --------------------------------------------------


def _fill_some(node: Node, names: list[str], lo: int, hi: int) -> None:
    """Write pages ``names[lo:hi]`` into ``node`` as its worker's write-through would (content from the index)."""
    tok, offs = node.store.reserve(names[lo:hi], [PAGE] * (hi - lo), "worker", all_or_none=True)
    for i, off in enumerate(offs, start=lo):
        node.store.write(off, bytes([(i * 37 + 5) % 256]) * PAGE)
    node.store.commit(tok)


@pytest.mark.parametrize("fanout", ["chain", "star"])
def test_a_streaming_copy_sends_each_chunk_as_it_lands_in_order_and_complete(nodes, fanout):
    src = nodes("src")
    targets = [nodes("t1"), nodes("t2")]
    names = _names(12)
    plan = fanout_plan([{"addr": t.addr, "token": t.peers.expect("s1")} for t in targets], fanout)
    rec = src.peers.push("s1", names, plan, stream_s=30.0, sizes=[PAGE] * 12)
    assert rec.pages_ready == 0 and rec.source_complete_s is None
    for lo in (0, 4, 8):  # three prefill chunks of four pages
        _fill_some(src, names, lo, lo + 4)
        # every target holds the chunk's pages verified before the next chunk is even computed
        for t in targets:
            wait_for(
                lambda t=t, lo=lo: any(r.role == "target" and r.pages_done >= lo + 4 for r in t.peers.book.find("s1")),
                10,
                f"chunk at {lo} on {t.peers.agent_id}",
            )
        assert rec.pages_ready == lo + 4
    assert src.final("s1", "source")["state"] == "done"
    assert rec.source_complete_s is not None
    want = [bytes([(i * 37 + 5) % 256]) * PAGE for i in range(12)]
    for t in targets:
        assert t.final("s1", "target")["state"] == "done"
        assert t.read(names) == want


def test_a_stream_whose_source_stalls_past_the_idle_timeout_is_kept_alive(nodes):
    src = nodes("src", idle_timeout_s=0.3)
    relay, last = nodes("relay", idle_timeout_s=0.3), nodes("last", idle_timeout_s=0.3)
    names = _names(4)
    plan = fanout_plan([{"addr": t.addr, "token": t.peers.expect("k1")} for t in (relay, last)], "chain")
    src.peers.push("k1", names, plan, stream_s=30.0, sizes=[PAGE] * 4)
    _fill_some(src, names, 0, 2)
    time.sleep(0.8)  # longer than every idle timeout: the senders' keep-alives hold both connections open
    _fill_some(src, names, 2, 4)
    assert src.final("k1", "source")["state"] == "done"
    assert relay.final("k1", "target")["state"] == "done" and last.final("k1", "target")["state"] == "done"


def test_a_stream_whose_pages_never_come_fails_and_the_target_keeps_only_those_that_came(nodes):
    src, dst = nodes("src"), nodes("dst")
    names = _names(4)
    plan = fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("w1")}], "chain")
    src.peers.push("w1", names, plan, stream_s=0.5, sizes=[PAGE] * 4)
    _fill_some(src, names, 0, 2)  # half the prefix; the rest never arrives
    rec = src.final("w1", "source")
    assert rec["state"] == "failed" and "stream window" in rec["error"]
    assert dst.final("w1", "target")["state"] == "failed"
    assert dst.store.leading_ready(names) == 2 and dst.store.stats()["pending_bytes"] == 0


def test_milestones_wake_a_long_poll(nodes):
    src, dst = nodes("src"), nodes("dst")
    names = _names(2)
    plan = fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("m1")}], "chain")
    rec = src.peers.push("m1", names, plan, stream_s=30.0, sizes=[PAGE] * 2)
    v0 = rec.version
    t0 = time.monotonic()
    assert [r.version for r in src.peers.wait_change("m1", v0, 0.3)] == [v0]  # nothing happened: the wait ran out
    assert time.monotonic() - t0 >= 0.25
    _fill_some(src, names, 0, 2)
    recs = src.peers.wait_change("m1", v0, 10.0)
    assert recs[0].version > v0 and recs[0].source_complete_s is not None
    assert src.peers.wait_change("unknown-copy", 0, 0.1) == []


def test_a_stream_to_a_target_holding_part_of_the_prefix_still_reports_the_source_complete(nodes):
    src, dst = nodes("src"), nodes("dst")
    names = _names(4)
    _fill_some(dst, names, 0, 2)  # the target has the first two pages: it still asks for all four
    plan = fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("q1")}], "chain")
    rec = src.peers.push("q1", names, plan, stream_s=30.0, sizes=[PAGE] * 4)
    _fill_some(src, names, 0, 4)
    assert src.final("q1", "source")["state"] == "done"
    assert rec.pages_ready == 4 and rec.source_complete_s is not None
    assert dst.final("q1", "target")["pages_done"] == 4 and dst.store.provenance(names) == ["copy:q1"] * 4


def _push_to_hostile_target(src, names: list[str], target) -> dict:
    """``src`` pushes ``names`` (copy ``h1``) to a target that runs ``target(conn)`` on its one connection (a
    :class:`Conn` it closes afterwards); the source's final record of the copy."""
    import threading

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve() -> None:
        sock, _ = srv.accept()
        conn = Conn(sock, 5.0)
        try:
            target(conn)
        finally:
            conn.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    src.peers.push("h1", names, [{"addr": f"127.0.0.1:{port}", "token": "t" * 32, "children": []}])
    rec = src.final("h1", "source")
    th.join(5)
    srv.close()
    return rec


def test_a_target_asking_for_a_page_twice_is_refused(nodes):
    src = nodes("src")
    names = _names(2)
    src.fill(names)

    def hostile_target(conn: Conn) -> None:
        server_auth(conn, SECRET, "hostile")
        conn.recv_json()  # the offer
        conn.send_json({"op": "accept", "need": [0] * 1000})  # the same page a thousand times
        time.sleep(1.0)

    rec = _push_to_hostile_target(src, names, hostile_target)
    assert rec["state"] == "failed" and "malformed accept" in rec["error"] and rec["pages_done"] == 0


def test_deeply_nested_json_before_authentication_is_one_refusal(nodes):
    import threading

    errors = []
    old = threading.excepthook
    threading.excepthook = lambda a: errors.append(a.exc_type.__name__)
    try:
        dst = nodes("dst")
        h, p = dst.addr.split(":")
        s = socket.create_connection((h, int(p)))
        body = b"[" * 2000 + b"]" * 2000
        s.sendall(FRAME_HEAD.pack(KIND_JSON, len(body)) + body)
        wait_for(lambda: bool(dst.lines("auth_failed")), 5, "auth_failed")
        s.close()
    finally:
        threading.excepthook = old
    assert errors == []


def test_an_agent_stops_at_once_while_clients_long_poll_it(tmp_path):
    import threading

    a = start_agent(tmp_path, "lp")
    keys = page_keys(list(range(64)), 16)
    answers = []

    def wait_pages():
        answers.append(a.call("POST", "/v1/wait", {"keys": keys, "namespaces": ["0" * 16], "wait_s": 30}))

    threads = [threading.Thread(target=wait_pages, daemon=True) for _ in range(4)]
    for th in threads:
        th.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    a.stop()  # SIGTERM
    assert time.monotonic() - t0 < 8, "the agent waited for its long-polls to run out"
    for th in threads:
        th.join(5)


def test_a_port_probe_is_not_a_failed_authentication(nodes):
    """`btbctl status` connects to the copy port and closes before a byte: no auth_failed line for that; a connection
    that sends half a frame and closes still gets one."""
    dst = nodes("dst")
    h, p = dst.addr.split(":")
    socket.create_connection((h, int(p))).close()
    s = socket.create_connection((h, int(p)))
    s.sendall(b"J\x00")
    s.shutdown(socket.SHUT_WR)  # end of file after half a frame
    s.settimeout(5)
    while s.recv(4096):  # until the agent closes
        pass
    s.close()
    wait_for(lambda: bool(dst.lines("auth_failed")), 5, "auth_failed")
    time.sleep(0.2)
    lines = dst.lines("auth_failed")
    assert len(lines) == 1 and "connection closed (2 of 5" in lines[0]


# -- provenance, integrity and per-node credentials ----------------------------------------------------------------


def _plant(node: Node, names: list[str], byte: int = 0x66) -> None:
    """Pages of garbage under ``names`` on ``node``, as any process that can write its arena could put there."""
    tok, offs = node.store.reserve(names, [PAGE] * len(names), "local:9", all_or_none=True)
    for off in offs:
        node.store.write(off, bytes([byte]) * PAGE)
    node.store.commit(tok)


@pytest.mark.parametrize("fanout", ["chain", "star"])
def test_garbage_planted_on_the_target_is_replaced_by_the_verified_copy(nodes, fanout):
    src, dst, relay_dst = nodes("src"), nodes("dst"), nodes("dst2")
    names = _names(4)
    data = src.fill(names)
    _plant(dst, names[1:3])  # the target "already holds" two of the pages: garbage
    _plant(relay_dst, names[:1], 0x77)
    targets = [{"addr": t.addr, "token": t.peers.expect("c1")} for t in (dst, relay_dst)]
    src.peers.push("c1", names, fanout_plan(targets, fanout))
    for t in (dst, relay_dst):
        rec = t.final("c1", "target")
        assert rec["state"] == "done" and rec["pages_done"] == 4  # every page came, none was skipped
        assert t.read(names) == data  # the garbage is gone
        assert t.store.provenance(names) == ["copy:c1"] * 4
    # the replaced extents were freed: exactly the four copied pages are held
    assert dst.store.stats()["used_bytes"] == 4 * PAGE
    assert len(dst.lines("copy_accepted")) == 1 and "need=4" in dst.lines("copy_accepted")[0]
    finished = dst.lines("copy_finished")  # the log says what the copy replaced
    assert len(finished) == 1 and "replaced=2" in finished[0] and "replaced_from=write" in finished[0]


def test_a_digest_mismatch_is_refused_with_one_line_and_a_counted_metric(nodes):
    from btbctl.engine.agent.events import AgentMetrics

    src = nodes("src", faults=SendFaults(corrupt_wire=1))
    dst = nodes("dst")
    metrics = AgentMetrics()
    dst.peers.event = lambda name, fields: (dst.event(name, fields), metrics.event(name, fields))
    names = _names(3)
    src.fill(names)
    _plant(dst, names)  # what the target held: replaced only by the pages that verified before the bad one
    src.peers.push("c1", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c1")}], "star"))
    assert dst.final("c1", "target")["state"] == "failed"
    refused = dst.lines("page_refused")
    assert len(refused) == 1 and "reason=digest_mismatch" in refused[0] and "copy_id=c1" in refused[0]
    assert f"page={names[1]}" in refused[0]
    assert 'btbctl_agent_pages_refused_total{reason="digest_mismatch"} 1.0' in metrics.exposition().decode()
    assert dst.store.provenance(names) == ["copy:c1", "write", "write"] and dst.store.stats()["pending_bytes"] == 0


def test_a_node_can_speak_to_its_peers_only_as_itself():
    from btbctl.engine.replication.credentials import Credentials, node_credentials_text, parse_credentials

    fleet = ["agent-a", "agent-b", "agent-c"]
    files = {a: node_credentials_text(SECRET, a, fleet) for a in fleet}
    assert not any(SECRET.decode() in text for text in files.values())  # the fleet secret stays with the launcher
    creds = {a: parse_credentials(files[a].encode(), a, f"{a}.keys") for a in fleet}
    store = PageStore(8 * PAGE)
    events: list[tuple[str, dict]] = []
    target = PeerService(store, creds["agent-b"], "agent-b", lambda e, f: events.append((e, f)))
    port = target.start()
    try:

        def connect(as_id: str, with_creds: Credentials) -> str:
            conn = Conn(socket.create_connection(("127.0.0.1", port)), 5.0)
            try:
                return client_auth(conn, with_creds, as_id)
            finally:
                conn.close()

        assert connect("agent-a", creds["agent-a"]) == "agent-b"  # a speaks as itself
        assert connect("agent-c", creds["agent-c"]) == "agent-b"
        # c, with every file it holds, claims to be a: its keys are not a's
        forged = Credentials("agent-a", creds["agent-c"].node_key, creds["agent-c"].links)
        with pytest.raises(PeerError, match="connection closed"):  # the target hangs up at the bad MAC
            connect("agent-a", forged)
        wait_for(lambda: any(e == "auth_failed" for e, _ in events), 5, "auth_failed")
        failed = [f for e, f in events if e == "auth_failed"]
        assert len(failed) == 1 and "bad MAC for agent 'agent-a'" in failed[0]["reason"]
        # an agent with the fleet secret (the Kubernetes render) and one with node credentials interoperate
        assert connect("agent-a", Credentials.from_fleet_secret(SECRET, "agent-a")) == "agent-b"
    finally:
        target.close()
        store.close()


def test_a_relay_chain_runs_on_node_credentials(nodes):
    from btbctl.engine.replication.credentials import node_credentials_text, parse_credentials

    fleet = ["s", "r", "t"]
    creds = {a: parse_credentials(node_credentials_text(SECRET, a, fleet).encode(), a, a) for a in fleet}
    src, relay, dst = (nodes(a, secret=creds[a]) for a in fleet)
    names = _names(3)
    data = src.fill(names)
    plan = fanout_plan([{"addr": n.addr, "token": n.peers.expect("c1")} for n in (relay, dst)], "chain")
    src.peers.push("c1", names, plan)
    assert dst.final("c1", "target")["state"] == "done" and dst.read(names) == data
    outsider = nodes("x", secret=parse_credentials(node_credentials_text(SECRET, "x", ["x", "s"]).encode(), "x", "x"))
    outsider.fill(names)
    outsider.peers.push("c2", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c2")}], "star"))
    assert "no key for agent 't'" in outsider.final("c2", "source")["error"]  # not in its fleet: no key to speak


# -- hostile input on the copy port ---------------------------------------------------------------------------------


@pytest.fixture
def thread_errors():
    """Exceptions that escaped a thread (each would print a traceback through the thread excepthook)."""
    import threading

    errors: list[str] = []
    old = threading.excepthook
    threading.excepthook = lambda a: errors.append(f"{a.exc_type.__name__}: {a.exc_value}")
    yield errors
    threading.excepthook = old


def _metered(node: Node):
    """Route ``node``'s copy-port events through the agent's metrics sink too (rate-limited log, counters)."""
    from btbctl.engine.agent.events import AgentMetrics

    m = AgentMetrics()
    node.peers.event = lambda e, f: (node.event(e, f), m.event(e, f))
    return m


def _auth_with_mac(node: Node, mac_value: object) -> bytes:
    h, p = node.addr.split(":")
    conn = Conn(socket.create_connection((h, int(p))), 5.0)
    conn.send_json(ClientHandshake(AUTH_LABEL, PROTOCOL_VERSION).hello(agent="intruder"))
    assert conn.recv_json()["op"] == "challenge"
    conn.send_json({"op": "auth", "mac": mac_value})
    conn.sock.settimeout(5)
    rest = conn.sock.recv(4096)
    conn.close()
    return rest


def test_a_non_ascii_mac_is_a_failed_authentication_logged_once_and_counted(nodes, thread_errors, caplog):
    dst = nodes("dst")
    m = _metered(dst)
    with caplog.at_level("WARNING", logger="btbctl.agent"):
        for mac_value in ("é" * 64, "\udcff" * 64, 7):
            assert _auth_with_mac(dst, mac_value) == b""  # closed, no auth_ok
        wait_for(lambda: len(dst.lines("auth_failed")) == 3, 5, "three auth_failed events")
    assert all("bad MAC for agent 'intruder'" in line for line in dst.lines("auth_failed"))
    assert m.registry.get_sample_value("btbctl_agent_auth_failures_total") == 3
    assert len([r for r in caplog.records if "auth_failed" in r.getMessage()]) == 1  # once per kind and window
    assert thread_errors == [] and not dst.lines("peer_error")


def test_a_target_answering_with_a_non_ascii_mac_fails_the_copy_as_an_authentication_failure(nodes, thread_errors):
    src = nodes("src")
    names = _names(2)
    src.fill(names)

    def hostile_target(conn: Conn) -> None:
        conn.recv_json()  # the source's hello
        conn.send_json({"op": "challenge", "nonce": "b" * 32, "agent": "hostile"})
        conn.recv_json()  # the source's auth
        conn.send_json({"op": "auth_ok", "mac": "é" * 64})
        with contextlib.suppress(PeerError, OSError):
            conn.recv_json()  # nothing more comes: the source hangs up

    rec = _push_to_hostile_target(src, names, hostile_target)
    assert rec["state"] == "failed" and "target failed authentication" in rec["error"]
    assert thread_errors == []
    assert len(src.lines("auth_failed")) == 1 and "outbound" in src.lines("auth_failed")[0]


def test_a_non_ascii_copy_token_is_refused_as_a_bad_token(nodes, thread_errors):
    dst = nodes("dst")
    dst.peers.expect("c1")
    h, p = dst.addr.split(":")
    conn = Conn(socket.create_connection((h, int(p))), 5.0)
    client_auth(conn, SECRET, "src")
    conn.send_json({"op": "offer", "copy_id": "c1", "token": "é" * 64, "names": _names(1), "sizes": [PAGE]})
    assert conn.recv_json() == {"op": "refuse", "error": "bad token for copy c1"}
    conn.close()
    assert thread_errors == []


def test_an_unexpected_error_on_a_connection_is_one_line_and_the_port_serves_on(nodes, thread_errors, caplog):
    dst = nodes("dst")
    m = _metered(dst)
    real = dst.peers._check_offer
    dst.peers._check_offer = lambda offer, peer_id: {}[offer["op"]]  # a bug: KeyError escapes every handler
    names = _names(2)
    h, p = dst.addr.split(":")
    with caplog.at_level("DEBUG", logger="btbctl.agent"):
        for _ in range(2):
            conn = Conn(socket.create_connection((h, int(p))), 5.0)
            client_auth(conn, SECRET, "src")
            conn.send_json({"op": "offer", "copy_id": "c1", "token": "x", "names": names, "sizes": [PAGE] * 2})
            conn.sock.settimeout(5)
            assert conn.sock.recv(4096) == b""  # the connection is closed
            conn.close()
        wait_for(lambda: len(dst.lines("peer_error")) == 2, 5, "two peer_error events")
    assert "KeyError: 'offer'" in dst.lines("peer_error")[0] and "listener=copy_port" in dst.lines("peer_error")[0]
    assert m.registry.get_sample_value("btbctl_agent_peer_errors_total") == 2
    assert len([r for r in caplog.records if r.levelname == "WARNING" and "peer_error" in r.getMessage()]) == 1
    assert all(r.exc_info for r in caplog.records if r.levelname == "DEBUG")  # the traceback: debug level only
    assert thread_errors == []
    dst.peers._check_offer = real
    src = nodes("src")
    src.fill(names)
    src.peers.push("c2", names, fanout_plan([{"addr": dst.addr, "token": dst.peers.expect("c2")}], "star"))
    assert dst.final("c2", "target")["state"] == "done"


def test_an_offer_of_many_tiny_pages_counts_their_aligned_size_against_the_limits(nodes):
    dst = nodes("dst", arena_bytes=64 * PAGE)  # per-copy and per-peer limit: half the arena, 128 pages of 4 KiB
    names = _names(200)
    h, p = dst.addr.split(":")
    conn = Conn(socket.create_connection((h, int(p))), 5.0)
    client_auth(conn, SECRET, "src")
    conn.send_json(
        {"op": "offer", "copy_id": "c1", "token": dst.peers.expect("c1"), "names": names, "sizes": [1] * 200}
    )
    rep = conn.recv_json()
    conn.close()
    assert rep["op"] == "refuse" and f"{200 * ALIGN_BYTES} bytes of arena" in rep["error"]
    assert "exceeds this agent's limit" in rep["error"] and dst.store.stats()["pending_bytes"] == 0


def test_an_offer_that_cannot_fit_leaves_the_targets_cache_alone(nodes):
    dst = nodes("dst", arena_bytes=8 * ALIGN_BYTES, max_copy_bytes=1 << 30, max_peer_bytes=1 << 30)
    held = _names(3, "ffffffffffffffff")
    tok, offs = dst.store.reserve(held, [ALIGN_BYTES] * 3, "t", all_or_none=True)
    dst.store.commit(tok)
    names = _names(16)
    h, p = dst.addr.split(":")
    conn = Conn(socket.create_connection((h, int(p))), 5.0)
    client_auth(conn, SECRET, "src")
    conn.send_json({"op": "offer", "copy_id": "c1", "token": dst.peers.expect("c1"), "names": names, "sizes": [1] * 16})
    rep = conn.recv_json()
    conn.close()
    assert rep["op"] == "refuse" and "store full" in rep["error"]
    assert dst.store.leading_ready(held) == 3 and not dst.lines("evicted")
