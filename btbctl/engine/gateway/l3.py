"""The ``l3`` executor of copy plans: BTB on stock SGLang (SGLANG.md), through the node agents and a warm-up proof.

Each worker's node has a ``btbctl agent`` whose page store is the worker's HiCache L3 tier (``btbctl.sglang_l3``);
the gateway drives the agents' control APIs (``Authorization: Bearer <agent token>``). A copy job (one prefix
``chain`` of SGLang page keys, one source worker, one target worker; :class:`~btbctl.engine.gateway.state.Transfer`
with ``mode="l3"``, ``routable=False``):

1. **Source holds it.** ``POST {source agent}/v1/has {"keys": chain}`` until a complete set of namespaces holds
   every page: every TP rank of one namespace (the source's HiCache writes the pages through after its prefill;
   the job waits at most ``source_wait_s``, state ``stalled``). Namespace descriptions come from ``GET /v1/info``.
   Then ``POST {source agent}/v1/pin`` holds those pages against eviction (a burst's own write-throughs would
   otherwise push a hot prefix out of a small arena mid-copy), and so does the target's agent for the pages it is
   about to receive, until the job ends: the pins are counted per agent and prefix across jobs, and the last job
   of a prefix on an agent unpins it (each pin also expires on its own after the job's longest possible run).
2. **Copy.** When the target's node is the source's node, its L3 tier holds the pages already: no copy. Otherwise
   ``POST {target agent}/v1/expect {"copy_id", "keys"}`` returns a one-time token, and ``POST {source agent}/v1/push
   {"copy_id", "keys", "namespaces", "targets": [{"addr": target agent's peer address, "token"}], "fanout"}``
   starts it (202; state ``running``); ``GET {source agent}/v1/copies/{id}`` is polled for progress until the source
   record is ``done`` (the target verified and committed every page) or ``failed``. Jobs of the same prefix to the
   same target node share one copy.
3. **Warm-up and proof.** ``POST {target}/generate {"input_ids": prefix token ids + 1 token, "sampling_params":
   {"max_new_tokens": 1, "temperature": 0}}`` (and the prefix's ``extra_key``/``cache_salt``). The target counts as a
   holder only when the answer's ``meta_info.cached_tokens_details`` covers the prefix (whole pages): ``device +
   host + storage >= len(chain) x page_size``; ``storage`` (tokens loaded from L3) is recorded as the proof. Only then
   is the copy ``done`` and the target recorded as holding the prefix.

Until its proof, requests for the prefix are not routed to the target (:meth:`L3Replicator.hold_back`), and the
copy does not count as arriving there for the policies (``routable`` false). Any failed step (the source never
holds the pages, an agent refuses or dies, the copy fails or times out, the warm-up fails, or its proof falls
short) ends the job ``failed`` with the reason, and the target gets no copy of that prefix for ``exclude_s``
seconds (an exclusion). No client request is involved in a job: a failure loses none.

Every state change is one structured log line (``event=l3_copy_accepted|l3_copy_started|l3_copy_proved|
l3_copy_failed|l3_proof_short|l3_target_excluded``, with copy id, prefix, source, target, bytes, seconds, outcome).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Hashable, Sequence

import aiohttp

from btbctl.engine.copies import CopyState
from btbctl.engine.gateway.replicator import CopyExecutor, ReplicateError, ReplicateOutcome
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.gateway.tokens import PrefixTokens

log = logging.getLogger(__name__)

#: Seconds between polls of an agent (source holding, copy progress). A product choice: a copy of a 64-page
#: prefix over a LAN takes tens of milliseconds to seconds; 50 ms keeps the dashboard current.
POLL_S = 0.05
#: Timeout of one control call to an agent, seconds.
CALL_TIMEOUT_S = 5.0
#: Failed polls in a row that end a job (an agent that stopped answering).
MAX_POLL_ERRORS = 3
#: ``ttl_s`` of a target agent's expectation: the push must arrive within this many seconds.
EXPECT_TTL_S = 120.0


class AgentCallError(Exception):
    """An agent answered badly or not at all (one line)."""


def _namespace_groups(info: dict) -> list[list[str]]:
    """The agent's namespaces grouped into byte-compatible sets (all TP ranks of one served model, layout, ...):
    each group is the list of its namespace ids, one per rank, in rank order; groups missing a rank are left
    out."""
    groups: dict[str, dict] = {}
    for ns, desc in (info.get("namespaces") or {}).items():
        if not isinstance(desc, dict):
            continue
        key = json.dumps({k: v for k, v in desc.items() if k != "tp_rank"}, sort_keys=True)
        g = groups.setdefault(key, {"tp_size": desc.get("tp_size"), "ranks": {}})
        g["ranks"][desc.get("tp_rank")] = ns
    out = []
    for g in groups.values():
        ranks = g["ranks"]
        if None in ranks:  # rank-replicated KV (MLA): one namespace serves every rank
            out.append([ranks[None]])
            continue
        tp = g["tp_size"]
        if isinstance(tp, int) and tp >= 1 and all(r in ranks for r in range(tp)):
            out.append([ranks[r] for r in range(tp)])
    return out


class L3Replicator(CopyExecutor):
    """Runs ``l3`` copy jobs between the workers of ``state`` (see the module docstring). The same interface as
    :class:`~btbctl.engine.gateway.replicator.Replicator` (``execute``, ``request_copy``, ``replicate``,
    ``refusal``, ``close``) plus :meth:`hold_back`.

    Args:
        state: the live fleet state.
        session: returns the shared :class:`aiohttp.ClientSession`.
        agents: ``[{"name", "control_url", "peer_addr"}]``.
        worker_agents: for each worker, its index in ``agents``.
        agent_token: bearer token of the agents' control APIs.
        prefix_tokens: token ids of the prefixes (for warm-ups).
        page_size: returns the gateway's page size (tokens per page).
        fanout: the push's fan-out.
        source_wait_s / copy_timeout_s / warmup_timeout_s / exclude_s: bounds (see :class:`GatewayConfig`).
        on_change / on_finish: as the push replicator's.
    """

    mode = "l3"
    event_prefix = "l3_"
    logged_bytes = "bytes_total"
    unit = "pages"

    def __init__(
        self,
        state: FleetState,
        session: Callable[[], aiohttp.ClientSession],
        *,
        agents: Sequence[dict],
        worker_agents: Sequence[int],
        agent_token: str | None,
        prefix_tokens: PrefixTokens,
        page_size: Callable[[], int],
        fanout: str = "chain",
        source_wait_s: float = 30.0,
        copy_timeout_s: float = 300.0,
        warmup_timeout_s: float = 120.0,
        exclude_s: float = 30.0,
        on_change: Callable[[Transfer], None] | None = None,
        on_finish: Callable[[Transfer], None] | None = None,
    ) -> None:
        super().__init__(state, session, on_change, on_finish)
        self.agents = [dict(a) for a in agents]
        self.worker_agents = list(worker_agents)
        self.token = agent_token
        self.prefix_tokens = prefix_tokens
        self.page_size = page_size
        self.fanout = fanout
        self.source_wait_s = source_wait_s
        self.copy_timeout_s = copy_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self.exclude_s = exclude_s
        self.timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        self._excluded: dict[tuple[int, Hashable], float] = {}
        self._pushes: dict[tuple[int, Hashable], asyncio.Future] = {}
        self._pins: dict[tuple[str, Hashable], int] = {}
        self.proofs = {"proved": 0, "short": 0, "failed": 0}

    # -- eligibility ---------------------------------------------------------------------------------------------

    def agent_of(self, r: int) -> dict:
        return self.agents[self.worker_agents[r]]

    def _usable(self, r: int) -> bool:
        ws = self.state.workers
        return 0 <= r < len(ws) and ws[r].healthy

    def accepts_copies(self, r: int) -> bool:
        """Whether worker ``r`` can send or receive an l3 copy now (the policies' ``accepts_copies``): healthy, with
        a node agent. A stock SGLang server qualifies: its pages move between agents, not through BTB routes."""
        return self._usable(r) and 0 <= self.worker_agents[r] < len(self.agents)

    def excluded(self, target: int, key: Hashable) -> bool:
        until = self._excluded.get((target, key))
        if until is None:
            return False
        if until <= self.state.clock():
            del self._excluded[(target, key)]
            return False
        return True

    def refusal(self, chain: Sequence[Hashable], source: int, target: int) -> str | None:
        """Why a copy of ``chain`` from ``source`` to ``target`` would be refused, or None when it would start."""
        if not chain:
            return "empty chain"
        if source == target:
            return "source and target are the same worker"
        if not self._usable(source):
            return "source unhealthy"
        if not self._usable(target):
            return "target unhealthy"
        tw = self.state.workers[target]
        if tw.held_blocks(chain) >= len(chain):
            return "target already holds the prefix"
        if self.state.transfers.in_flight(target, chain[-1]):
            return "a copy to the target is already in flight"
        if self.excluded(target, chain[-1]):
            return "target excluded after a failed copy or proof of this prefix"
        if self.prefix_tokens.get(list(chain), self.page_size()) is None:
            return "the prefix's token ids are no longer known (needed for the warm-up)"
        return None

    def hold_back(self, chain: Sequence[Hashable]) -> list[int]:
        """Workers that must not get a request for ``chain`` now: targets of copies of a leading part of it that
        are not proved yet."""
        if not chain or not self.state.transfers.active:
            return []
        return self.state.transfers.unproven(chain)

    # -- starting jobs ------------------------------------------------------------------------------------------

    def _transfer(self, chain: tuple, source: int, target: int, manual: bool) -> Transfer:
        t = super()._transfer(chain, source, target, manual)
        t.mode, t.routable, t.covered_tokens = "l3", False, len(chain) * self.page_size()
        return t

    async def replicate(self, chain: Sequence[Hashable], n: int, *, wait_s: float = 10.0) -> ReplicateOutcome:
        """Copy ``chain`` to ``n`` more workers now (the control API's manual replicate): the source is the
        least-loaded healthy worker recorded as holding it, or whose node agent holds its pages; the targets the
        least-loaded healthy workers that neither hold it nor receive it (ties: lower index).

        Raises:
            ReplicateError: 409 when no worker holds the prefix or none can receive it.
        """
        chain = tuple(chain)
        ws = self.state.workers
        cands = [w.index for w in ws if self._usable(w.index)]
        if not cands:
            raise ReplicateError(409, "no healthy worker")
        holders = [r for r in cands if ws[r].held_blocks(chain) >= len(chain)]
        if not holders:
            for r in cands:
                try:
                    if await self._source_namespaces(self.agent_of(r), list(chain)):
                        holders.append(r)
                except AgentCallError:
                    continue
        if not holders:
            raise ReplicateError(409, f"no healthy worker holds prefix {chain[-1]} ({len(chain)} pages)")
        return await self._start_manual(
            chain,
            cands,
            holders,
            n,
            wait_s,
            "every other healthy worker holds it, receives it, is excluded after a failed proof, or the prefix's "
            "token ids are no longer known",
        )

    # -- bookkeeping --------------------------------------------------------------------------------------------

    def _fail(self, t: Transfer, reason: str, kind: str = "failed") -> None:
        """End ``t`` failed (``kind``: ``short`` when its proof fell short) and exclude its target from this prefix
        for ``exclude_s``."""
        self.proofs["short" if kind == "short" else "failed"] += 1
        self._excluded[(t.target, t.key)] = self.state.clock() + self.exclude_s
        self._finish(t, CopyState.FAILED, "copy_failed", reason, outcome=kind)
        self._event("target_excluded", t, for_s=self.exclude_s, reason=reason)

    def _done(self, t: Transfer) -> None:
        self.proofs["proved"] += 1
        self._finish(
            t,
            CopyState.DONE,
            "copy_proved",
            transfer_s=None if t.transfer_s is None else round(t.transfer_s, 6),
            storage_tokens=t.proof_storage_tokens,
            covered_tokens=t.covered_tokens,
            outcome="proved",
        )

    # -- agent calls --------------------------------------------------------------------------------------------

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _call(self, agent: dict, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            async with self._session().request(
                method, agent["control_url"] + path, json=body, headers=self._headers(), timeout=self.timeout
            ) as resp:
                ans = await resp.json(content_type=None)
                return resp.status, ans if isinstance(ans, dict) else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            raise AgentCallError(f"agent {agent['name']} ({agent['control_url']}): {type(e).__name__}: {e}") from None

    async def _source_namespaces(self, agent: dict, keys: list) -> list[str] | None:
        """The namespace ids of one complete group holding every page of ``keys`` on ``agent``, or None."""
        st, has = await self._call(agent, "POST", "/v1/has", {"keys": keys})
        if st != 200:
            raise AgentCallError(f"agent {agent['name']}: /v1/has answered {st}: {has.get('error')}")
        complete = set(has.get("complete") or ())
        if not complete:
            return None
        st, info = await self._call(agent, "GET", "/v1/info")
        if st != 200:
            raise AgentCallError(f"agent {agent['name']}: /v1/info answered {st}")
        for group in _namespace_groups(info):
            if all(ns in complete for ns in group):
                return group
        return None

    def pin_ttl_s(self) -> float:
        """How long a job's pins last at most: its longest possible run (source wait, copy, warm-up) plus slack."""
        return min(86400.0, self.source_wait_s + self.copy_timeout_s + self.warmup_timeout_s + 30.0)

    async def _pin(self, t: Transfer, pinned: list, agent: dict, keys: list, group: list[str]) -> None:
        """Pin ``keys`` of namespaces ``group`` on ``agent`` for this job (best effort: a failure is logged, the
        copy goes on and may then find the pages gone)."""
        ref = (agent["name"], t.key)
        self._pins[ref] = self._pins.get(ref, 0) + 1
        pinned.append((agent, ref, keys, group))
        try:
            st, ans = await self._call(
                agent, "POST", "/v1/pin", {"keys": keys, "namespaces": group, "ttl_s": self.pin_ttl_s()}
            )
            if st != 200:
                self._event("pin_failed", t, agent=agent["name"], error=ans.get("error", st))
        except AgentCallError as e:
            self._event("pin_failed", t, agent=agent["name"], error=str(e))

    async def _unpin(self, pinned: list) -> None:
        """Release this job's pins; an agent's pages of a prefix are unpinned when no other job holds them."""
        for agent, ref, keys, group in pinned:
            n = self._pins.get(ref, 0) - 1
            if n > 0:
                self._pins[ref] = n
                continue
            self._pins.pop(ref, None)
            try:
                await self._call(agent, "POST", "/v1/unpin", {"keys": keys, "namespaces": group})
            except Exception:  # noqa: BLE001 - best effort (also while the gateway stops): the pin expires
                pass

    # -- the job ------------------------------------------------------------------------------------------------

    async def _job(self, t: Transfer, source_confirmed: bool) -> None:
        pushed = t.pushed
        assert pushed is not None
        pinned: list = []
        try:
            reason = await self._steps(t, pinned)
            if isinstance(reason, tuple):
                self._fail(t, *reason)
            elif reason is not None:
                self._fail(t, reason)
        except asyncio.CancelledError:
            if t.active:
                self._fail(t, "gateway stopped")
            raise
        except Exception as e:  # a bug or an unexpected answer: the job fails, the gateway keeps running
            log.exception("l3 copy %s crashed", t.copy_id)
            if t.active:
                self._fail(t, f"internal error: {e!r}")
        finally:
            pushed.set()
            if pinned:
                await asyncio.shield(self._unpin(pinned))

    async def _steps(self, t: Transfer, pinned: list) -> str | tuple | None:
        src_agent, dst_agent = self.agent_of(t.source), self.agent_of(t.target)
        keys = list(t.chain)
        clock = self.state.clock
        # 1. the source's agent holds every page (its HiCache writes them through after the prefill)
        deadline = clock() + self.source_wait_s
        errors = 0
        while True:
            if not self._usable(t.source):
                return "source became unhealthy"
            try:
                group = await self._source_namespaces(src_agent, keys)
                errors = 0
            except AgentCallError as e:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    return f"source agent unreachable: {e}"
                group = None
            if group:
                break
            if not t.waited:
                t.waited = True
                self._changed(t)
            if clock() >= deadline:
                return f"the source's agent does not hold the prefix's {len(keys)} pages after {self.source_wait_s:g} s"
            await asyncio.sleep(POLL_S)
        # the pages stay until the target proved it has them (a pin also holds pages that arrive later)
        await self._pin(t, pinned, src_agent, keys, group)
        if dst_agent is not src_agent:
            await self._pin(t, pinned, dst_agent, keys, group)
        # 2. the pages reach the target's agent
        if dst_agent is src_agent:
            t.state = CopyState.RUNNING
            t.started_s = clock()
            t.transfer_s = 0.0
            self._event("copy_started", t, bytes=0, note="same node: the target's L3 tier holds the pages")
            self._changed(t)
        else:
            reason = await self._copy(t, src_agent, dst_agent, keys, group)
            if reason is not None:
                return reason
        if t.pushed is not None:
            t.pushed.set()
        # 3. warm-up and proof
        return await self._prove(t)

    async def _copy(self, t: Transfer, src: dict, dst: dict, keys: list, group: list[str]) -> str | None:
        shared = (self.worker_agents[t.target], t.key)
        fut = self._pushes.get(shared)
        if fut is not None:  # another job copies this prefix to the same node: share its outcome
            t.state = CopyState.RUNNING
            t.started_s = self.state.clock()
            self._event("copy_started", t, note="shares a copy to the same node")
            self._changed(t)
            ok, info = await asyncio.shield(fut)
            t.bytes_total = t.bytes_sent = info.get("bytes", 0) if ok else 0
            t.transfer_s = info.get("transfer_s")
            return None if ok else f"shared copy failed: {info.get('error')}"
        fut = asyncio.get_running_loop().create_future()
        self._pushes[shared] = fut
        result: tuple[bool, dict] = (False, {"error": "not started"})
        try:
            reason = await self._push(t, src, dst, keys, group)
            result = (reason is None, {"bytes": t.bytes_total, "transfer_s": t.transfer_s, "error": reason})
            return reason
        finally:
            self._pushes.pop(shared, None)
            fut.set_result(result)

    async def _push(self, t: Transfer, src: dict, dst: dict, keys: list, group: list[str]) -> str | None:
        clock = self.state.clock
        try:
            st, ans = await self._call(
                dst, "POST", "/v1/expect", {"copy_id": t.copy_id, "keys": keys, "ttl_s": EXPECT_TTL_S}
            )
            if st != 200:
                return f"target agent refused to expect the copy: {ans.get('error', st)}"
            body = {
                "copy_id": t.copy_id,
                "keys": keys,
                "namespaces": group,
                "targets": [{"addr": dst["peer_addr"], "token": ans["token"]}],
                "fanout": self.fanout,
            }
            st, rec = await self._call(src, "POST", "/v1/push", body)
        except AgentCallError as e:
            return str(e)
        if st == 409:
            return f"source agent no longer holds the pages: {rec.get('error')}"
        if st != 202:
            return f"source agent refused the push: HTTP {st}: {rec.get('error')}"
        t.bytes_total = int(rec.get("bytes_total") or 0)
        t.state = CopyState.RUNNING
        t.started_s = clock()
        self._event("copy_started", t, bytes=t.bytes_total, pages=rec.get("pages"), namespaces=len(group))
        self._changed(t)
        # progress until the source reports the outcome (done: every page verified and committed at the target)
        deadline = clock() + self.copy_timeout_s
        errors = 0
        while True:
            await asyncio.sleep(POLL_S)
            if not self._usable(t.target):
                await self._cancel(src, t.copy_id)
                return "target became unhealthy during the copy"
            try:
                st, ans = await self._call(src, "GET", f"/v1/copies/{t.copy_id}")
                errors = 0
            except AgentCallError as e:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    return f"source agent stopped answering during the copy: {e}"
                continue
            rec = next((r for r in ans.get("records", []) if r.get("role") == "source"), None) if st == 200 else None
            if rec is None:
                return f"source agent does not know the copy (HTTP {st})"
            sent = rec.get("bytes_done")
            if isinstance(sent, int) and sent != t.bytes_sent:
                t.bytes_sent = min(sent, t.bytes_total or sent)
                t.blocks_verified = int(rec.get("pages_done") or 0)
                self._changed(t)
            if rec.get("state") == CopyState.DONE.value:
                t.transfer_s = clock() - (t.started_s or clock())
                t.blocks_verified = len(t.chain)
                return None
            if rec.get("state") == CopyState.FAILED.value:
                return f"copy failed: {rec.get('error') or 'at the source'}"
            if clock() >= deadline:
                await self._cancel(src, t.copy_id)
                return f"no outcome after {self.copy_timeout_s:g} s"

    async def _cancel(self, agent: dict, copy_id: str) -> None:
        try:
            await self._call(agent, "POST", f"/v1/copies/{copy_id}/cancel")
        except AgentCallError:
            pass

    async def _prove(self, t: Transfer) -> str | tuple | None:
        ps = self.page_size()
        got = self.prefix_tokens.get(list(t.chain), ps)
        if got is None:
            return "the prefix's token ids are no longer known (needed for the warm-up)"
        ids, extra_key, salt = got
        w = self.state.workers[t.target]
        body: dict = {
            "input_ids": ids + [ids[0] if ids else 0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "rid": f"btb-warmup-{t.copy_id}",
        }
        if extra_key is not None:
            body["extra_key"] = extra_key
        if salt is not None:
            body["cache_salt"] = salt
        t0 = time.monotonic()
        try:
            async with self._session().post(
                f"{w.url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=self.warmup_timeout_s)
            ) as resp:
                ans = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            return f"warm-up failed: {type(e).__name__}: {e}"
        if status != 200 or not isinstance(ans, dict):
            return f"warm-up failed: HTTP {status}"
        meta = ans.get("meta_info") if isinstance(ans.get("meta_info"), dict) else {}
        det = meta.get("cached_tokens_details")
        det = det if isinstance(det, dict) else {}

        def tok(k: str) -> int:
            v = det.get(k, 0)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        t.proof = {"device": tok("device"), "host": tok("host"), "storage": tok("storage")}
        t.proof_storage_tokens = t.proof["storage"]
        covered = len(t.chain) * ps
        total = sum(t.proof.values())
        warm_s = round(time.monotonic() - t0, 6)
        if total < covered:
            self._event(
                "l3_proof_short",
                t,
                storage_tokens=t.proof["storage"],
                device_tokens=t.proof["device"],
                host_tokens=t.proof["host"],
                covered_tokens=covered,
                warmup_s=warm_s,
            )
            why = (
                f"proof short: the warm-up reused {total} of the prefix's {covered} tokens "
                f"(storage {t.proof['storage']}, device {t.proof['device']}, host {t.proof['host']})"
            )
            return why, "short"
        self._done(t)
        return None


__all__ = ["AgentCallError", "CALL_TIMEOUT_S", "L3Replicator", "POLL_S"]
