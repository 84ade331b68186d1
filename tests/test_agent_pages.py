"""The agent's page store: allocation, LRU eviction, pins, leases, pending reservations, and the local protocol
over a real Unix socket with the arena mapped by the store-side client."""

from __future__ import annotations

import os
import socket
import time

import pytest

from btbctl.engine.agent.local import LocalServer
from btbctl.engine.agent.pages import ALIGN_BYTES, ExtentAllocator, NoRoom, PageStore, aligned_bytes
from btbctl.sglang_l3.client import AgentClient, AgentUnavailable
from btbctl.sglang_l3.keys import Namespace, page_keys
from btbctl.sglang_l3.wire import encode, recv_frame

PAGE = 2 * ALIGN_BYTES


def _names(n: int, tag: str = "ns") -> list[str]:
    return [f"{tag}.{k}" for k in page_keys(list(range(n)), 1)]


def _fill(store: PageStore, names: list[str], size: int = PAGE) -> None:
    tok, offs = store.reserve(names, [size] * len(names), "t", all_or_none=True)
    for i, off in enumerate(offs):
        store.write(off, bytes([i % 251]) * size)
    assert store.commit(tok) == [True] * len(names)


def test_allocator_reuses_same_size_extents_and_folds_the_top():
    a = ExtentAllocator(10 * ALIGN_BYTES)
    x, y, z = (a.alloc(ALIGN_BYTES) for _ in range(3))
    assert (x, y, z) == (0, ALIGN_BYTES, 2 * ALIGN_BYTES)
    a.free(y, ALIGN_BYTES)
    assert a.alloc(100) == y  # rounded up to the same extent size
    a.free(z, ALIGN_BYTES)
    a.free(y, ALIGN_BYTES)
    assert a.top == ALIGN_BYTES and a.used == ALIGN_BYTES
    assert a.alloc(20 * ALIGN_BYTES) is None


def test_lru_eviction_spares_pinned_leased_and_timed_pins():
    events = []
    store = PageStore(4 * PAGE, on_event=lambda e, f: events.append((e, f)))
    names = _names(8)
    _fill(store, names[:4])
    objs = store.pin_ready([names[0]])
    offs, lease = store.lease([names[1]], PAGE, "reader")
    assert offs and lease
    store.pin_for([names[2]], 30.0)
    _fill(store, names[4:5])  # evicts the only unheld page, names[3]
    assert store.leading_ready(names[:3]) == 3 and store.leading_ready([names[3]]) == 0
    assert events[-1][0] == "evicted" and events[-1][1]["pages"] == 1
    with pytest.raises(NoRoom):
        store.reserve(names[5:7], [PAGE, PAGE], "copy", all_or_none=True)  # only names[4] could go
    assert store.leading_ready([names[4]]) in (0, 1)
    store.unpin_objs(objs)
    store.release(lease)
    store.unpin([names[2]])
    _fill(store, names[5:8])
    assert store.leading_ready(names[5:8]) == 3


def test_pending_pages_are_never_served_and_abort_frees_them():
    store = PageStore(4 * PAGE)
    names = _names(2)
    tok, offs = store.reserve(names, [PAGE, PAGE], "copy:x", all_or_none=True)
    assert store.leading_ready(names) == 0 and store.lease(names, PAGE, "r") == ([], 0)
    assert store.abort(tok) == 2 * PAGE and store.stats()["used_bytes"] == 0
    _fill(store, names)
    assert store.leading_ready(names, PAGE) == 2 and store.leading_ready(names, PAGE + 1) == 0  # size is checked
    tok, offs = store.reserve(names, [PAGE, PAGE], "copy:y", all_or_none=True)
    assert offs == [-1, -1]  # already held: nothing to move


def test_local_protocol_put_get_with_the_mapped_arena(tmp_path):
    store = PageStore(16 * PAGE)
    srv = LocalServer(store, str(tmp_path / "agent.sock"))
    srv.start()
    ns = Namespace("m", 1, 0, 1, 0, 1, 0, 16, "page_first", "torch.bfloat16", PAGE, "v1", "0.5.23")
    c = AgentClient(str(tmp_path / "agent.sock"), 2.0, ns.describe())
    keys = page_keys(list(range(48)), 16)
    try:
        rep, conn = c.call({"op": "put", "ns": ns.ns_id, "keys": keys, "size": PAGE})
        for i, off in enumerate(rep["offsets"]):
            conn.arena.view[off : off + PAGE] = bytes([i + 1]) * PAGE
        assert c.call({"op": "commit", "token": rep["token"], "written": [True, False, True]})[0]["committed"] == [
            True,
            False,
            True,
        ]
        assert c.call({"op": "exists", "ns": ns.ns_id, "keys": keys})[0]["n"] == 1  # page 1 was not written
        # each page records the process whose write-through it is (this one: the store runs in this test)
        names = [f"{ns.ns_id}.{k}" for k in keys]
        assert store.provenance(names) == [f"write:pid={os.getpid()}", None, f"write:pid={os.getpid()}"]
        rep, conn = c.call({"op": "get", "ns": ns.ns_id, "keys": keys, "size": PAGE})
        assert len(rep["offsets"]) == 1 and bytes(conn.arena.view[rep["offsets"][0] :][:PAGE]) == b"\x01" * PAGE
        c.send({"op": "release", "lease": rep["lease"]})
        assert store.namespaces[ns.ns_id]["model"] == "m"
        with pytest.raises(AgentUnavailable, match="keys must be"):
            c.call({"op": "exists", "ns": ns.ns_id, "keys": ["not-a-key"]})
        # a store that disconnects mid-write leaves nothing pending
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(tmp_path / "agent.sock"))
        s.sendall(encode({"op": "put", "ns": ns.ns_id, "keys": page_keys(list(range(99, 131)), 16), "size": PAGE}))
        assert recv_frame(s)["ok"]
        assert store.stats()["pending_bytes"] == 2 * PAGE
        s.close()
        deadline = time.monotonic() + 5
        while store.stats()["pending_bytes"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.stats()["pending_bytes"] == 0
    finally:
        c.close()
        srv.close()
        store.close()


@pytest.mark.timeout(20)
def test_client_without_agent_fails_fast_with_a_kind(tmp_path):
    # a one-hour call timeout: failing fast means not waiting on it (the per-test timeout catches a wait; no
    # wall-clock bound is asserted)
    c = AgentClient(str(tmp_path / "none.sock"), 3600.0, None)
    for _ in range(3):
        with pytest.raises(AgentUnavailable) as ei:
            c.call({"op": "exists", "ns": "0" * 16, "keys": []})
        assert ei.value.kind in ("connect", "agent_down")


def test_a_copy_replaces_a_held_page_and_frees_the_old_one_only_when_its_last_reader_lets_go():
    store = PageStore(8 * PAGE)
    names = _names(2)
    _fill(store, names)  # this node's write-through
    assert store.provenance(names) == ["write", "write"]
    offs, lid = store.lease(names[:1], PAGE, "local:1")  # a local store is reading page 0
    old = bytes(store.read(offs[0], PAGE))
    tok, new_offs = store.reserve(names, [PAGE] * 2, "copy:c7", all_or_none=True, skip_ready=False)
    assert -1 not in new_offs  # nothing skipped: room for both pages
    for off in new_offs:
        store.write(off, b"\x5a" * PAGE)
    assert store.commit(tok, origin="copy:c7", replace=True) == [True, True]
    assert store.provenance(names) == ["copy:c7", "copy:c7"] and store.provenance(_names(3)[2:]) == [None]
    # the reader's extent is neither freed nor reused while it reads: 2 new pages + the leased old one
    assert store.stats()["used_bytes"] == 3 * PAGE and bytes(store.read(offs[0], PAGE)) == old
    store.release(lid)
    assert store.stats()["used_bytes"] == 2 * PAGE
    got, lid2 = store.lease(names, PAGE, "local:1")
    assert [bytes(store.read(o, PAGE)) for o in got] == [b"\x5a" * PAGE] * 2
    store.release(lid2)
    # a local write never replaces a held page (the write-through of a page this node has)
    tok, offs = store.reserve(names, [PAGE] * 2, "local:2", all_or_none=False)
    assert offs == [-1, -1] and store.commit(tok) == [True, True] and store.provenance(names) == ["copy:c7"] * 2
    store.close()


def _evicted(events: list) -> int:
    return sum(f["pages"] for e, f in events if e == "evicted")


@pytest.mark.parametrize(
    ("count", "size"),
    [(9, ALIGN_BYTES), (40, 4096), (16, 1)],  # more pages than the arena holds; 16 one-byte pages take 16 slots
)
def test_a_reservation_that_cannot_fit_evicts_nothing(count, size):
    events: list = []
    store = PageStore(8 * ALIGN_BYTES, on_event=lambda e, f: events.append((e, f)))
    held = _names(3, "held")
    _fill(store, held, ALIGN_BYTES)
    used = store.stats()["used_bytes"]
    with pytest.raises(NoRoom):
        store.reserve(_names(count), [size] * count, "copy:big", all_or_none=True)
    assert store.leading_ready(held) == 3 and _evicted(events) == 0 and store.evictions == 0
    assert store.stats()["used_bytes"] == used and store.stats()["pending_bytes"] == 0
    _fill(store, _names(5, "more"), ALIGN_BYTES)  # the free room is intact: 5 more pages fit without eviction
    assert _evicted(events) == 0 and store.leading_ready(held) == 3


def test_a_fitting_reservation_still_evicts_least_recently_used_first():
    events: list = []
    store = PageStore(8 * ALIGN_BYTES, on_event=lambda e, f: events.append((e, f)))
    old = _names(8, "old")
    _fill(store, old, ALIGN_BYTES)
    store.lease(old[:1], ALIGN_BYTES, "reader")  # oldest, but leased: spared (and now the most recently used)
    tok, offs = store.reserve(_names(3), [ALIGN_BYTES] * 3, "copy:x", all_or_none=True)
    assert None not in offs and events[-1] == (
        "evicted",
        {"pages": 3, "bytes": 3 * ALIGN_BYTES, "reason": "reservation by copy:x"},
    )
    assert [store.leading_ready([n]) for n in old] == [1, 0, 0, 0, 1, 1, 1, 1]
    assert store.abort(tok) == 3 * ALIGN_BYTES


def test_a_reservation_never_evicts_a_page_it_reports_as_held():
    store = PageStore(4 * ALIGN_BYTES)
    names = _names(5)
    _fill(store, names[:4], ALIGN_BYTES)  # names[0] is the least recently used
    tok, offs = store.reserve(names[:1] + names[4:], [ALIGN_BYTES] * 2, "local", all_or_none=True)
    assert offs[0] == -1 and offs[1] is not None
    assert store.leading_ready(names[:1]) == 1 and store.leading_ready(names[1:2]) == 0


def test_a_partial_reservation_without_all_or_none_takes_what_fits():
    store = PageStore(4 * ALIGN_BYTES)
    _fill(store, _names(2, "old"), ALIGN_BYTES)
    tok, offs = store.reserve(_names(6), [ALIGN_BYTES] * 6, "local", all_or_none=False)
    assert sum(o is not None for o in offs) == 4 and offs[4:] == [None, None]
    assert store.leading_ready(_names(2, "old")) == 0


def test_arena_bytes_of_pages_count_whole_aligned_slots():
    assert aligned_bytes([1] * 65_536) == 256 << 20  # 65,536 one-byte pages take 256 MiB of arena, not 64 KiB
    assert aligned_bytes([ALIGN_BYTES, ALIGN_BYTES + 1, 0]) == 3 * ALIGN_BYTES
