"""The gateway's ``l3`` executor without agents or SGLang: a request routed to a copy's target waits at the gateway
until the copy is proved (and is routed again if the copy fails), proofs are classified honestly, and the number of
copy jobs in flight is bounded. The whole path with real agents and SGLang: tests/test_sglang_server.py and the
namespace testbed's tests/test_netns_l3_*.py."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest

from btbctl.engine.copies import CopyOutcome
from btbctl.engine.gateway import tokens as tokens_mod
from btbctl.engine.gateway.l3 import L3Replicator, classify_proof
from btbctl.engine.gateway.prompt import chain_from_packed, prompt_of
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.policies.base import Route
from gateway_fakes import GatewayEnv, until

TEXT = "a shared system prompt " * 8


def _chain(page_size: int) -> tuple:
    data, _ = prompt_of("generate", {"text": TEXT})
    return chain_from_packed(data, page_size)


@pytest.mark.parametrize(
    ("proof", "covered", "outcome"),
    [
        ({"device": 0, "host": 0, "storage": 1024}, 1024, CopyOutcome.PROVED),
        ({"device": 0, "host": 0, "storage": 1040}, 1024, CopyOutcome.PROVED),
        ({"device": 1024, "host": 0, "storage": 0}, 1024, CopyOutcome.COMPUTED),  # the target had it: not a copy
        ({"device": 512, "host": 0, "storage": 512}, 1024, CopyOutcome.COMPUTED),
        ({"device": 0, "host": 0, "storage": 512}, 1024, CopyOutcome.SHORT),  # e.g. clipped to the host tier
        ({"device": 0, "host": 0, "storage": 0}, 1024, CopyOutcome.SHORT),
    ],
)
def test_a_copy_counts_as_proved_only_when_storage_covers_the_prefix(proof, covered, outcome):
    assert classify_proof(proof, covered) is outcome


async def _l3_copy(env: GatewayEnv, blocks: int = 4, source: int = 0, target: int = 1) -> Transfer:
    """An ``l3`` copy of the test prompt's first ``blocks`` blocks in flight from ``source`` to ``target`` (its
    ``ready`` unresolved), once every worker is healthy."""
    gw = env.gw
    await until(lambda: all(w.healthy for w in gw.state.workers))
    chain = _chain(gw.page_size)[:blocks]
    t = Transfer(copy_id=f"c0ffee{blocks}", key=chain[-1], chain=chain, source=source, target=target, mode="l3")
    t.ready = asyncio.get_running_loop().create_future()
    gw.state.transfers.add(t)
    return t


def _route_to(gw, *replicas: int) -> None:
    """The policy picks ``replicas`` in turn (the last one from then on)."""
    picks = iter(replicas)
    last = [replicas[-1]]

    def route(req, view, now):
        last[0] = next(picks, last[0])
        return Route(last[0])

    gw.policy.route = route


async def _gated_request(env: GatewayEnv, target: int, result: bool) -> tuple[int, list[int]]:
    """Send one request while a copy of its prefix to ``target`` is in flight and the policy picks ``target``;
    resolve the copy's ``ready`` with ``result`` once the request waited; returns the answer's status and how
    many requests each worker got."""
    gw = env.gw
    t = await _l3_copy(env, source=1 - target, target=target)
    _route_to(gw, target, 1 - target)
    task = asyncio.ensure_future(env.post("/generate", {"text": TEXT}))
    await asyncio.sleep(0.3)
    assert not task.done() and [len(w.requests) for w in env.fleet] == [0, 0]  # held at the gateway
    assert gw.state.workers[target].inflight == 1  # and counted as queued on the target meanwhile
    t.ready.set_result(result)
    status, _ = await task
    return status, [len(w.requests) for w in env.fleet]


async def test_a_request_for_a_copy_in_flight_waits_for_the_proof_then_goes_to_the_target():
    async with GatewayEnv(2) as env:
        status, got = await _gated_request(env, target=1, result=True)
        assert status == 200 and got == [0, 1]


async def test_a_request_waiting_for_a_failed_copy_goes_to_its_worker_which_computes_the_prefix():
    async with GatewayEnv(2) as env:
        status, got = await _gated_request(env, target=1, result=False)
        assert status == 200 and got == [0, 1]  # answered once, by the worker the policy chose
        assert env.gw.state.workers[1].healthy  # a failed copy is not the worker's failure


async def test_a_failed_copy_whose_source_died_still_gets_its_request_answered():
    async with GatewayEnv(2) as env:
        gw = env.gw
        t = await _l3_copy(env)
        await env.fleet[0].kill()  # the source dies: the only worker left is the copy's target
        await until(lambda: not gw.state.workers[0].healthy, 5)
        task = asyncio.ensure_future(env.post("/generate", {"text": TEXT}))
        await asyncio.sleep(0.3)
        t.ready.set_result(False)
        status, _ = await task
        assert status == 200 and len(env.fleet[1].requests) == 1


async def test_a_request_waiting_for_a_copy_moves_when_the_target_goes_down():
    async with GatewayEnv(2) as env:
        gw = env.gw
        await _l3_copy(env)
        _route_to(gw, 1, 0)
        task = asyncio.ensure_future(env.post("/generate", {"text": TEXT}))
        await asyncio.sleep(0.3)
        assert gw.state.workers[1].gated == 1  # waiting at the gateway, not at the worker
        env.fleet[1].health_status = 500
        await until(lambda: not gw.state.workers[1].healthy, 5)
        status, _ = await asyncio.wait_for(task, 5)  # moved at once, not after the copy's deadlines
        assert status == 200 and [len(w.requests) for w in env.fleet] == [1, 0]
        assert gw.state.workers[1].gated == 0


async def test_a_request_waits_for_the_deepest_copy_of_its_prefix():
    async with GatewayEnv(2) as env:
        gw = env.gw
        short, deep = await _l3_copy(env, 4), await _l3_copy(env, 8)
        _route_to(gw, 1)
        task = asyncio.ensure_future(env.post("/generate", {"text": TEXT}))
        await asyncio.sleep(0.2)
        short.ready.set_result(True)
        await asyncio.sleep(0.3)
        assert not task.done() and len(env.fleet[1].requests) == 0  # the deeper copy is still on its way
        deep.ready.set_result(True)
        status, _ = await task
        assert status == 200 and len(env.fleet[1].requests) == 1


class _Prefixes:
    def get(self, chain, page_size):
        return list(range(len(chain) * page_size)), None, None


async def test_copy_jobs_in_flight_are_capped_per_fleet_and_per_agent():
    state = FleetState([f"http://127.0.0.1:{9 + i}" for i in range(6)])
    for w in state.workers:
        w.healthy = True
    agents = [{"name": f"a{i}", "control_url": "http://127.0.0.1:9", "peer_addr": "127.0.0.1:9"} for i in range(3)]

    async def hang():  # every agent call hangs: the jobs stay in flight
        await asyncio.Event().wait()

    rep = L3Replicator(
        state,
        lambda: None,
        agents=agents,
        worker_agents=[0, 0, 1, 1, 2, 2],
        agent_token=None,
        prefix_tokens=_Prefixes(),
        page_size=lambda: 16,
        max_copies=3,
        max_copies_per_agent=2,
    )
    rep._steps = lambda t, pinned: hang()  # the job's agent work is not under test here
    chains = [tuple(f"{k}{i}" for i in range(4)) for k in "abcdef"]
    assert rep.request_copy(chains[0], 0, 2) is not None  # agents a0, a1
    assert rep.request_copy(chains[1], 1, 3) is not None  # a0, a1: both at their limit of 2
    assert rep.refusal(chains[2], 0, 4) == "agent a0 has 2 copies in flight (its limit)"
    assert rep.request_copy(chains[2], 4, 5) is not None  # a2 only: the fleet's third
    assert rep.refusal(chains[3], 5, 4).startswith("3 l3 copies in flight, the fleet's limit")
    await rep.close()  # the jobs end failed ("gateway stopped") and free their places
    assert rep.refusal(chains[3], 0, 2) is None
    assert {t.outcome for t in state.transfers.recent} == {"failed"}
    assert all(t.ready is not None and t.ready.done() and t.ready.result() is False for t in state.transfers.recent)


async def test_l3_prompts_keep_the_gateways_prompt_limit_and_chain_cap():
    agents = [{"name": "a0", "control_url": "http://127.0.0.1:9", "peer_addr": "127.0.0.1:9"}]
    cfg = {"replication": "l3", "agents": agents, "worker_agents": [0], "max_prompt_tokens": 64}
    async with GatewayEnv(1, page_size=16, max_chain_blocks=2, **cfg) as env:
        await until(lambda: env.gw.state.workers[0].healthy)
        status, body = await env.post("/generate", {"input_ids": list(range(1000))})
        assert status == 413 and "exceeds the limit of 64 tokens" in str(body), body
        assert env.fleet[0].requests == []
        status, _ = await env.post("/generate", {"input_ids": list(range(60))})  # 3 pages, 2 hashed
        assert status == 200
        assert len(env.gw.l3_prompts.prefixes._keys) == 2  # the chain of its first 2 pages only


async def test_l3_text_prompts_are_tokenized_off_the_event_loop_with_the_prompt_limit(monkeypatch):
    """A 6 MiB text prompt at page size 1 on an l3 fleet whose workers use the pseudo-tokenizer (packed by the
    gateway itself). Before: the packing ran on the event loop (the gateway's /health froze for seconds with a
    7 MiB prompt), and the whole prompt's ids were kept for warm-ups (8 such prompts held 224 MiB). Expected: it
    runs in the prompt pool while /health keeps answering, the chain keeps its cap, only the ids up to the chain's
    end are kept, and a prompt over max_prompt_tokens is refused before anything is hashed."""
    import threading
    import time

    from btbctl.engine.gateway import tokens

    seen: list[tuple[int, float, float]] = []
    real = tokens.pack_text

    def timed(text, errors="strict"):
        t = time.perf_counter()
        out = real(text, errors)
        seen.append((threading.get_ident(), t, time.perf_counter()))
        return out

    monkeypatch.setattr(tokens, "pack_text", timed)
    agents = [{"name": "a0", "control_url": "http://127.0.0.1:9", "peer_addr": "127.0.0.1:9"}]
    cfg = {"replication": "l3", "agents": agents, "worker_agents": [0, 0], "max_chain_blocks": 4096}
    kw = {"tokenizer": "btbctl-utf8-4", "hash_prompts": False, "page_size": 1}
    async with GatewayEnv(2, page_size=1, policy="round_robin", worker_kw=kw, **cfg) as env:
        await until(lambda: env.gw.l3_prompts.tokenizer.local)
        loop_thread = threading.get_ident()
        big = json.dumps({"text": "y" * (6 << 20), "sampling_params": {"max_new_tokens": 1}}).encode()
        task = asyncio.create_task(env.post("/generate", big))
        probes = 0
        while not task.done():
            async with env.http.get(env.url + "/health") as r:
                assert r.status == 200
            probes += 1
        status, _ = await task
        assert status == 200, _
        assert seen and all(tid != loop_thread for tid, _, _ in seen), "a big prompt was packed on the event loop"
        assert probes >= 2
        assert len(env.gw.l3_prompts.prefixes._keys) <= 4096  # the chain cap
        assert env.gw.l3_prompts.prefixes._bytes <= 4096 * 4  # ids kept up to the chain's end, not 24 MiB of them
    async with GatewayEnv(1, page_size=1, worker_kw=kw, max_prompt_tokens=1000, **{**cfg, "worker_agents": [0]}) as env:
        await until(lambda: env.gw.l3_prompts.tokenizer.local)
        status, body = await env.post("/generate", {"text": "z" * 8000})
        assert status == 413 and "exceeds the limit of 1000 tokens" in str(body)
        assert env.fleet[0].requests == []


async def test_the_tokenizer_cache_is_bounded_in_prompts_and_tokens():
    tok = tokens_mod.Tokenizer(lambda: None, lambda: [], max_tokens=100, max_entries=8)

    async def ask(tb, run=None):
        return b"\0\0\0\1" * len(tb["prompt"])

    tok._ask = ask
    for i in range(50):  # tiny prompts: the entry bound holds
        await tok._tokens_of({"prompt": f"p{i}"})
    assert len(tok._cache) == 8
    await tok._tokens_of({"prompt": "x" * 90})  # a big one: the token bound holds
    assert tok._tokens <= 100 and len(tok._cache) <= 8
    assert await tok._tokens_of({"prompt": "x" * 90}) and tok.hits == 1


def test_admission_waits_leave_out_requests_held_at_the_gateway():
    state = FleetState(["http://w0"])
    w = state.workers[0]
    w.healthy, w.ttft_ewma_s = True, 1.0
    w.loads = {"running": 0, "waiting": 3, "used_tokens": 0, "max_tokens": 10**6}
    w.loads_prefilling = 0  # the worker's 3 waiting requests are another client's
    assert state.admission_wait_s(0, 10) == 4.0
    w.loads_prefilling = 3  # ... or the gateway's own, which its queue model counts already
    assert state.admission_wait_s(0, 10) == 0.0


# -- provenance: a warm-up counts only pages of the ordered copy or of the target node's own write-through ---------

_NS = "0123456789abcdef"
_FLEET_SECRET = b"fleet-secret-for-tests-0123456789"
_PAGE_BYTES = 8192
_TOKENS_PER_PAGE = 16


class _L3Bed:
    """Two real node agents (in process) with one namespace each, a fake SGLang ``/generate`` that reports the
    prefix loaded from L3 (and first runs ``during_warmup``), and an :class:`L3Replicator` between worker 0 (on
    agent 0) and worker 1 (on agent 1)."""

    def __init__(self, tmp_path, worker_agents: tuple[int, ...] = (0, 1), pages: int = 4) -> None:
        self.tmp = tmp_path
        self.worker_agents = list(worker_agents)
        self.pages = pages
        self.during_warmup = None
        self.answer = None  # input_ids -> cached_tokens_details (default: the whole prefix from storage)

    async def __aenter__(self):
        import aiohttp
        from aiohttp import web

        from btbctl.engine.agent.agent import Agent, AgentConfig
        from btbctl.engine.replication.credentials import control_token
        from btbctl.sglang_l3.keys import page_keys

        self.agents = []
        for i in range(2):
            a = Agent(
                AgentConfig(
                    socket_path=str(self.tmp / f"a{i}.sock"),
                    arena_bytes=8 << 20,
                    secret=_FLEET_SECRET,
                    agent_id=f"agent-{i}",
                    control_token=control_token(_FLEET_SECRET, f"agent-{i}"),
                )
            )
            await a.start()
            a.store.register_namespace(
                _NS, {"model": "m", "tp_rank": 0, "tp_size": 1, "page_bytes": _PAGE_BYTES, "layout": "page_first"}
            )
            self.agents.append(a)
        self.chain = tuple(page_keys(list(range(self.pages * _TOKENS_PER_PAGE)), _TOKENS_PER_PAGE))
        self.names = [f"{_NS}.{k}" for k in self.chain]

        async def generate(request):
            if self.during_warmup is not None:
                await asyncio.to_thread(self.during_warmup)
            if self.answer is not None:
                details = self.answer((await request.json())["input_ids"])
            else:
                details = {"device": 0, "host": 0, "storage": len(self.chain) * _TOKENS_PER_PAGE}
            return web.json_response({"meta_info": {"cached_tokens_details": details}})

        app = web.Application()
        app.router.add_post("/generate", generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.url = url
        self.session = aiohttp.ClientSession()
        self.rep = self.replicator(self.session)
        self.state = self.rep.state
        return self

    def replicator(self, session) -> L3Replicator:
        """An :class:`L3Replicator` over this bed's agents and workers (a fleet state of its own, every worker
        healthy), as one gateway would have; ``session``: its HTTP session."""
        from btbctl.engine.replication.credentials import control_token

        state = FleetState([self.url] * len(self.worker_agents))
        for w in state.workers:
            w.healthy = True
        return L3Replicator(
            state,
            lambda: session,
            agents=[
                {
                    "name": f"agent-{i}",
                    "control_url": f"http://127.0.0.1:{a.control_port}",
                    "peer_addr": f"127.0.0.1:{a.peer_port}",
                }
                for i, a in enumerate(self.agents)
            ],
            worker_agents=self.worker_agents,
            agent_token=None,
            agent_tokens={f"agent-{i}": control_token(_FLEET_SECRET, f"agent-{i}") for i in range(2)},
            prefix_tokens=_Prefixes(),
            page_size=lambda: _TOKENS_PER_PAGE,
            source_wait_s=5.0,
            copy_timeout_s=5.0,
            warmup_timeout_s=5.0,
        )

    async def __aexit__(self, *exc):
        await self.rep.close()
        await self.session.close()
        await self.runner.cleanup()
        for a in self.agents:
            await a.close()

    def write(self, agent: int, byte: int, names=None, origin: str = "write") -> bytes:
        """Pages of ``byte`` under ``names`` (default: the prefix's) in agent ``agent``'s store; returns one."""
        store = self.agents[agent].store
        names = names or self.names
        tok, offs = store.reserve(names, [_PAGE_BYTES] * len(names), "local:1", all_or_none=True, skip_ready=False)
        for off in offs:
            store.write(off, bytes([byte]) * _PAGE_BYTES)
        store.commit(tok, origin=origin, replace=True)
        return bytes([byte]) * _PAGE_BYTES

    def read(self, agent: int) -> list[bytes]:
        store = self.agents[agent].store
        offs, lid = store.lease(self.names, _PAGE_BYTES, "test")
        out = [bytes(store.read(o, _PAGE_BYTES)) for o in offs]
        store.release(lid)
        return out

    async def copy(self) -> Transfer:
        t = self.rep.request_copy(self.chain, 0, 1)
        assert t is not None
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        return t


async def test_an_l3_copy_replaces_garbage_planted_on_the_target_and_is_proved(tmp_path):
    async with _L3Bed(tmp_path) as bed:
        good = bed.write(0, 0x11)
        bed.write(1, 0x66)  # garbage the target's node "already holds" under the prefix's page names
        t = await bed.copy()
        assert t.outcome == "proved" and t.ready.result() is True, t.error
        assert bed.read(1) == [good] * 4  # served pages are the source's, not the planted ones
        assert bed.agents[1].store.provenance(bed.names) == [f"copy:{t.copy_id}"] * 4


async def test_a_warm_up_on_pages_of_another_provenance_is_not_counted(tmp_path, caplog):
    from btbctl.engine.agent.pages import PageStore
    from btbctl.engine.agent.peer import PeerService, fanout_plan

    caplog.set_level(logging.INFO, logger="btbctl")
    async with _L3Bed(tmp_path) as bed:
        bed.write(0, 0x11)
        # another agent of the fleet, run by an attacker with the agents' control token: while the target's worker
        # reads the copied pages, it has the target expect a copy of its own and sends a garbage page over one
        store = PageStore(1 << 20)
        rogue = PeerService(store, _FLEET_SECRET, "agent-rogue", lambda e, f: None)
        rogue.start()
        tok, offs = store.reserve(bed.names[2:3], [_PAGE_BYTES], "local:1", all_or_none=True)
        store.write(offs[0], b"\x66" * _PAGE_BYTES)
        store.commit(tok)

        def plant() -> None:
            token = bed.agents[1].peers.expect("evil")
            rogue.push(
                "evil",
                bed.names[2:3],
                fanout_plan([{"addr": f"127.0.0.1:{bed.agents[1].peer_port}", "token": token}], "star"),
            )
            end = time.monotonic() + 10
            while not any(r.state.final for r in bed.agents[1].peers.book.find("evil")):
                assert time.monotonic() < end
                time.sleep(0.01)

        bed.during_warmup = plant
        try:
            t = await bed.copy()
        finally:
            rogue.close()
            store.close()
        assert bed.agents[1].peers.book.find("evil")[0].state.value == "done"  # the target took the rogue's page
        assert t.outcome == "failed" and t.ready.result() is False
        assert t.error.startswith("proof refused: page 2 ") and "'copy:evil'" in t.error, t.error
        assert bed.state.workers[1].held_blocks(bed.chain) == 0  # the target is not recorded as holding it
        lines = [r.getMessage() for r in caplog.records if "event=l3_proof_untrusted" in r.getMessage()]
        assert len(lines) == 1 and "origin=copy:evil" in lines[0] and "page=2" in lines[0], lines


async def test_pages_an_earlier_ordered_copy_brought_count_for_a_same_node_warm_up(tmp_path):
    async with _L3Bed(tmp_path, (0, 1, 1)) as bed:
        bed.write(0, 0x11)
        first = await bed.copy()
        assert first.outcome == "proved"
        # worker 2 shares worker 1's node: no bytes move, its warm-up reads the pages the first copy brought
        t = bed.rep.request_copy(bed.chain, 1, 2)
        assert t is not None
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        assert t.outcome == "proved", t.error
        assert bed.agents[1].store.provenance(bed.names) == [f"copy:{first.copy_id}"] * 4


async def test_each_agent_has_its_own_control_token_and_the_gateway_derives_them(tmp_path):
    from btbctl.engine.replication.credentials import control_token

    async with _L3Bed(tmp_path) as bed:
        other = {"name": "agent-1", "control_url": bed.rep.agents[0]["control_url"]}  # agent 1's token at agent 0
        st, ans = await bed.rep._call(other, "POST", "/v1/expect", {"copy_id": "c0ffee"})
        assert st == 403 and "invalid control token" in ans["error"]
        st, _ = await bed.rep._call(bed.rep.agents[0], "POST", "/v1/expect", {"copy_id": "c0ffee"})
        assert st == 200
    secret = tmp_path / "agent.secret"
    secret.write_text(_FLEET_SECRET.decode() + "\n")
    agents = [{"name": n, "control_url": "http://127.0.0.1:9", "peer_addr": "127.0.0.1:9"} for n in ("a0", "a1")]
    cfg = {"replication": "l3", "agents": agents, "worker_agents": [0, 1], "agent_secret_file": str(secret)}
    async with GatewayEnv(2, **cfg) as env:
        assert env.gw.replicator.tokens == {n: control_token(_FLEET_SECRET, n) for n in ("a0", "a1")}


# -- warm-ups trail the copy: the target's prefetch streams behind the pages, the proof loads only the tail --------


class _Prefetcher:
    """SGLang's admission as the warm-ups meet it on the target (worker 1, reading its node's agent): the device
    keeps the pages earlier requests loaded or computed; the L3 prefetch reads the leading run the target's agent
    holds past them; the rest of the prompt's whole pages is computed (then on the device too). Records each
    warm-up: pages asked, pages the target's agent held at that moment, and the answer."""

    def __init__(self, bed: _L3Bed, own_pages: int = 0) -> None:
        self.bed = bed
        self.device = own_pages  # leading pages on the target's device
        self.seen: list[tuple[int, int, dict]] = []
        self.loaded_from: list[str | None] = []  # the provenance of every page a warm-up read from L3
        self.first = threading.Event()

    def __call__(self, ids: list[int]) -> dict:
        pages = (len(ids) - 1) // _TOKENS_PER_PAGE
        store = self.bed.agents[self.bed.worker_agents[1]].store
        held = store.leading_ready(self.bed.names[:pages])
        device = min(self.device, pages)
        storage = max(0, held - device)
        self.loaded_from += store.provenance(self.bed.names[device : device + storage])
        self.device = max(self.device, pages)  # loaded, or computed by this request
        ans = {"device": device * _TOKENS_PER_PAGE, "host": 0, "storage": storage * _TOKENS_PER_PAGE}
        self.seen.append((pages, held, ans))
        if pages < len(self.bed.chain):
            self.first.set()
        return ans


def _stream_source(bed: _L3Bed, gate: threading.Event) -> threading.Thread:
    """The source's write-through, page by page: half the prefix, then (once ``gate`` is set, or after 10 s) the
    rest."""

    def run() -> None:
        half = len(bed.names) // 2
        for i, name in enumerate(bed.names):
            if i == half:
                gate.wait(10)
            bed.write(0, 0x11, names=[name])
            time.sleep(0.005)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


@pytest.mark.parametrize("nodes", [(0, 0), (0, 1)], ids=["same-node", "across-nodes"])
async def test_warm_ups_trail_the_pages_over_held_ones_and_the_proof_loads_only_the_tail(tmp_path, caplog, nodes):
    caplog.set_level(logging.INFO, logger="btbctl")
    # same node: the target's L3 tier holds each page as the source's write-through lands it; across nodes: as the
    # source's agent streams it and the target's agent verifies and commits it
    async with _L3Bed(tmp_path, nodes, pages=64) as bed:
        fake = bed.answer = _Prefetcher(bed)
        t = bed.rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        writer = _stream_source(bed, fake.first)  # the second half waits for a warm-up over the first
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        writer.join(5)
        assert t.outcome == "proved" and t.ready.result() is True, t.error
        assert t.proof == {"device": 0, "host": 0, "storage": 64 * _TOKENS_PER_PAGE}
        asked = [p for p, _, _ in fake.seen]
        assert len(asked) >= 2 and asked == sorted(set(asked)) and asked[-1] == 64, fake.seen
        # a trailing warm-up never asks for a page the target's agent did not hold: nothing was computed there
        assert all(p <= held for p, held, _ in fake.seen), fake.seen
        steps = zip(fake.seen, [0, *asked[:-1]], strict=True)
        assert all(a["storage"] == (p - prev) * _TOKENS_PER_PAGE for (p, _, a), prev in steps), fake.seen
        # the proof itself loaded only the pages that landed after the last trailing warm-up
        assert fake.seen[-1][2]["device"] == asked[-2] * _TOKENS_PER_PAGE > 0
        lines = [r.getMessage() for r in caplog.records if "event=l3_prefetched" in r.getMessage()]
        assert len(lines) == len(asked) - 1, lines
        done = [r.getMessage() for r in caplog.records if "event=l3_copy_proved" in r.getMessage()]
        assert len(done) == 1 and f"warmups={len(asked)}" in done[0], done


async def test_trailing_warm_ups_never_read_pages_the_target_held_before_the_copy(tmp_path):
    async with _L3Bed(tmp_path, pages=64) as bed:
        bed.write(1, 0x66, names=bed.names[:48])  # stale pages on the target's node under the prefix's names
        fake = bed.answer = _Prefetcher(bed)
        t = bed.rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        writer = _stream_source(bed, fake.first)
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        writer.join(5)
        assert t.outcome == "proved", t.error
        assert len(fake.seen) >= 2, fake.seen  # a trailing warm-up ran while the stale pages were still there
        assert fake.loaded_from == [f"copy:{t.copy_id}"] * 64  # every page read was this copy's, each once


async def test_a_target_that_had_pages_of_its_own_is_computed_not_proved_and_trailing_stops(tmp_path):
    async with _L3Bed(tmp_path, (0, 0), pages=64) as bed:
        fake = bed.answer = _Prefetcher(bed, own_pages=40)
        t = bed.rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        writer = _stream_source(bed, fake.first)
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        writer.join(5)
        assert t.outcome == "computed" and t.state.value == "failed", t.error
        assert t.ready.result() is True  # it holds the prefix (its own): requests need not move
        assert t.proof["storage"] < 64 * _TOKENS_PER_PAGE and sum(t.proof.values()) == 64 * _TOKENS_PER_PAGE
        assert len(fake.seen) <= 2, fake.seen  # one trailing warm-up found the own pages; then only the proof


@pytest.mark.parametrize(
    ("answers", "proof", "outcome"),
    [
        # warm-ups over 4, 8 and 16 pages of 16 tokens (two: 8 and 16), each loading what is new
        ([(0, 0, 64), (64, 0, 64), (128, 0, 128)], {"device": 0, "host": 0, "storage": 256}, "proved"),
        # pages an earlier warm-up loaded moved to the host tier in between: still this copy's
        ([(0, 0, 128), (64, 64, 128)], {"device": 0, "host": 0, "storage": 256}, "proved"),
        # evicted in between and read again from L3
        ([(0, 0, 128), (0, 0, 256)], {"device": 0, "host": 0, "storage": 256}, "proved"),
        # the target held 64 tokens more than the warm-ups loaded: its own
        ([(0, 0, 64), (128, 0, 128)], {"device": 64, "host": 0, "storage": 192}, "computed"),
        # the last read was short of the prefix
        ([(0, 0, 128), (128, 0, 64)], {"device": 0, "host": 0, "storage": 192}, "short"),
        # pages of its own an earlier warm-up found, evicted before the last one read the whole prefix from L3
        ([(128, 0, 0), (0, 0, 256)], {"device": 128, "host": 0, "storage": 256}, "computed"),
        # a warm-up claiming more storage than it asked for counts only what it asked for
        ([(0, 0, 10_000), (128, 0, 128)], {"device": 0, "host": 0, "storage": 256}, "proved"),
    ],
)
def test_the_proof_adds_up_the_warm_ups_loads(answers, proof, outcome):
    from btbctl.engine.gateway.l3 import _Loads

    loads = _Loads()
    asked = [64, 128, 256][3 - len(answers) :]  # the warm-ups' whole-page tokens: the last one is the prefix
    for (device, host, storage), tokens in zip(answers, asked, strict=True):
        loads.account(device, host, storage, tokens)
    assert loads.proof() == proof
    assert loads.outcome(256).value == outcome


def test_a_trailing_warm_up_adds_at_least_the_prefetch_threshold_and_there_are_few():
    from btbctl.engine.gateway.l3 import TRAIL_STEPS, trail_step_pages

    assert trail_step_pages(64, 256) == 8  # 16k tokens: eight steps of 2,048 tokens
    assert trail_step_pages(4, 16) == 16  # 64 tokens: below SGLang's prefetch threshold, no trailing warm-up
    assert trail_step_pages(1024, 64) == 1024 // TRAIL_STEPS


# -- a source whose agent lost the pages (restarted, or evicted them) is not waited for --------------------------


class _Policy:
    """A policy that only hears how its copy plans went."""

    def __init__(self) -> None:
        self.results: list[tuple[int, bool]] = []

    def on_copy_result(self, plan, target, ok, now_s) -> None:
        self.results.append((target, ok))


def _lines(caplog, event: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"event={event} " in r.getMessage() + " "]


async def test_a_copy_from_a_holder_whose_agent_restarted_fails_at_once_and_another_holder_is_the_source(
    tmp_path, caplog
):
    from btbctl.engine.copies import CopyPlan

    caplog.set_level(logging.INFO, logger="btbctl")
    # worker 0 on agent 0; workers 1 and 2 on agent 1, whose store holds the prefix (worker 2 wrote it through)
    async with _L3Bed(tmp_path, (0, 1, 1)) as bed:
        rep = bed.rep
        rep.source_wait_s = 600.0  # a source wait would outlast the test's bound
        rep.observe_instance("agent-0", "incarnation-before")  # the agent the source computed the prefix under
        bed.state.workers[0].hold(bed.chain)  # the gateway recorded worker 0 as holding it ...
        bed.state.workers[0].add_pending(bed.chain)  # ... and sent it a request of it (a hit there: nothing written)
        bed.write(1, 0x11)
        bed.state.workers[2].hold(bed.chain)
        # agent 0 restarted (its store is empty): the job sees its new instance and does not wait for the pages
        t = rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        assert t.outcome == "failed" and t.ready.result() is False
        assert "holds none of the prefix's 4 pages: it restarted" in t.error, t.error
        restarted = _lines(caplog, "agent_restarted")
        assert len(restarted) == 1 and "old_instance=incarnation-before" in restarted[0], restarted
        assert f"instance={bed.agents[0].instance}" in restarted[0] and "workers=w0" in restarted[0]
        # the source is excluded for the prefix, not the target; nothing is marked warm
        assert rep.unbacked(0, bed.chain) and rep.source_excluded(0, bed.chain[-1])
        assert not rep.excluded(1, bed.chain[-1]) and bed.state.workers[1].held_blocks(bed.chain) == 0
        assert len(_lines(caplog, "l3_source_excluded")) == 1 and not _lines(caplog, "l3_target_excluded")
        assert "not computing it" in rep.refusal(bed.chain, 0, 1)
        # a policy's plan from worker 0 is carried out from worker 2, whose agent holds the pages
        policy = _Policy()
        assert rep.execute(CopyPlan(bed.chain, 0, (1,), 1), policy) == [1]
        assert policy.results == [(1, True)]
        t2 = next(x for x in bed.state.transfers.active.values() if x.target == 1)
        assert t2.source == 2
        await asyncio.wait_for(asyncio.shield(t2.ready), 20)
        assert t2.outcome == "proved" and t2.ready.result() is True, t2.error


async def test_a_copy_from_a_holder_whose_agent_holds_none_of_the_pages_fails_after_the_grace(
    tmp_path, caplog, monkeypatch
):
    from btbctl.engine.gateway import l3 as l3_mod

    monkeypatch.setattr(l3_mod, "SOURCE_GRACE_S", 0.2)
    caplog.set_level(logging.INFO, logger="btbctl")
    async with _L3Bed(tmp_path, (0, 1, 0)) as bed:
        bed.rep.source_wait_s = 600.0
        bed.state.workers[0].hold(bed.chain)  # recorded holder; its agent evicted the pages (no restart seen)
        t = bed.rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        assert t.outcome == "failed" and "after 0.2 s and the source is not computing it" in t.error, t.error
        assert not _lines(caplog, "agent_restarted") and bed.rep.source_excluded(0, bed.chain[-1])
        assert bed.rep.request_copy(bed.chain, 0, 1) is None  # refused while excluded: no job waits again
        # worker 2, on the same node, computes the prefix: its agent holds the pages, and worker 0 may send them too
        bed.write(0, 0x11)
        bed.state.workers[2].hold(bed.chain)
        t = bed.rep.request_copy(bed.chain, 2, 1)
        assert t is not None
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        assert t.outcome == "proved", t.error
        assert not bed.rep.source_excluded(0, bed.chain[-1])
        restored = _lines(caplog, "l3_source_restored")
        assert len(restored) == 1 and "workers=w0" in restored[0] and "agent=agent-0" in restored[0], restored


async def test_a_copy_trailing_the_sources_prefill_still_waits_for_its_write_through(tmp_path):
    async with _L3Bed(tmp_path) as bed:
        bed.state.workers[0].add_pending(bed.chain)  # a request computing the prefix there, nothing written yet
        t = bed.rep.request_copy(bed.chain, 0, 1)
        assert t is not None
        await until(lambda: t.state.value == "running")  # the push waits at the source's agent for the pages
        assert not t.ready.done()
        bed.write(0, 0x11)
        await asyncio.wait_for(asyncio.shield(t.ready), 20)
        assert t.outcome == "proved", t.error


def test_a_new_agent_instance_marks_the_prefixes_its_workers_held_unbacked(caplog):
    caplog.set_level(logging.INFO, logger="btbctl")
    state = FleetState(["http://w0", "http://w1"])
    for w in state.workers:
        w.healthy = True
    rep = L3Replicator(
        state,
        lambda: None,
        agents=[],
        worker_agents=[],
        agent_token="t",
        prefix_tokens=_Prefixes(),
        page_size=lambda: 16,
    )
    chain = ("a", "b", "c")
    assert rep.register("node-a", "http://a:1", "a:2", [0, 1], 15.0, instance="one")
    state.workers[0].hold(chain)
    assert not rep.unbacked(0, chain)
    # restarted: it announces again, with none of its workers connected yet (they lose their agent meanwhile)
    assert rep.register("node-a", "http://a:1", "a:2", [], 15.0, instance="two")
    assert rep.agent_names() == [None, None]
    assert rep.unbacked(0, chain) and not rep.unbacked(1, chain)
    assert rep.register("node-a", "http://a:1", "a:2", [0, 1], 15.0, instance="two")
    assert rep.copy_source(chain, 0) == 0  # no other holder: as planned (the job finds out)
    state.workers[1].hold(chain)
    assert rep.copy_source(chain, 0) == 1
    lines = _lines(caplog, "agent_restarted")
    assert len(lines) == 1 and "old_instance=one" in lines[0] and "unbacked_blocks=3" in lines[0], lines
    assert not rep.register("node-a", "http://a:1", "a:2", [0, 1], 15.0, instance="two")  # a renewal
