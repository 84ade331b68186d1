"""The ``l3`` executor of copy plans: BTB on stock SGLang (SGLANG.md), through the node agents and a warm-up proof.

Each worker's node has a ``btbctl agent`` whose page store is the worker's HiCache L3 tier (``btbctl.sglang_l3``);
the gateway drives the agents' control APIs (``Authorization: Bearer <agent token>``). A copy job (one prefix
``chain`` of SGLang page keys, one source worker, one target worker; :class:`~btbctl.engine.gateway.state.Transfer`
with ``mode="l3"``):

1. **The pages stream behind the source's prefill.** SGLang writes a prefix's pages through to L3 chunk by chunk as
   its prefill commits them (measured on a real SGLang 0.5.23 server: a 4,096-token prompt in 256-token chunks
   landed in its agent 16 pages at a time, 100-200 ms apart, the last with the answer). So the job does not wait
   for the whole prefix: it picks the source's namespaces (every TP rank of the source worker's served model,
   layout, ...; ``GET /v1/info``), authorizes the copy at the target's agent (``POST /v1/expect {"copy_id",
   "keys"}`` returns a one-time token) and has the source's agent push it at once with ``"stream_s"``
   (``POST /v1/push``): each page goes out as soon as the source's write-through lands it, along a ``chain``,
   ``tree`` or ``star`` of target agents. Progress is a long poll (``GET /v1/copies/{id}?since=V``) that the agent
   answers at each milestone (the source holds every page, the copy ends). When the target's node is the
   source's, no bytes move: the job waits for the pages there (``POST /v1/wait``). Jobs of the same prefix to the
   same target node share one copy. The pages are pinned on both agents until the job ends.
2. **Warm-up and proof, as soon as the target's node holds every page.** ``POST {target}/generate {"input_ids":
   prefix token ids + 1 token, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
   "return_cached_tokens_details": true}`` (and the prefix's ``extra_key``/``cache_salt``): SGLang prefetches the
   pages from L3 (``wait_complete``) and says where its cached tokens came from. Outcomes
   (:class:`~btbctl.engine.copies.CopyOutcome`): ``proved`` when ``storage`` covers the prefix (whole pages; the
   copy is ``done`` and the target a holder); ``computed`` when the target already had the prefix on its device or
   host tier (warm, but not by this copy: never reported ``done``); ``short`` when the warm-up reused less (a
   ``storage`` hit clipped to the host tier's size is named as such); ``failed`` for everything else. ``storage``
   tokens count only from pages the target's agent says (``POST /v1/provenance``) came from the copy this job
   ordered or shared, or from the target node's own write-through (:meth:`L3Replicator.trusted`); a page of
   any other provenance fails the job (``proof refused``, one ``l3_proof_untrusted`` line).
3. **Requests wait at the gateway, not at the target.** A copy in flight is visible to the policies as arriving at
   the target (``routable``; :meth:`FleetState.copy_status` estimates its landing from the source's progress, the
   measured agent-to-agent rate of the path and the measured proof time), so a policy may send a burst request
   there; the data plane holds such a request until the copy's ``ready`` future resolves (True: proved, or the
   target computed the prefix; False: the copy failed, and the request is routed again). A target never gets a
   request of the prefix while its pages are incomplete.

**A source whose pages cannot arrive is not waited for.** A job starts streaming from its source when the source's
agent holds a leading page of the prefix, or when the source is computing the prefix (a request of it in flight
there that the gateway did not record it as holding: the copy trails that prefill). A recorded holder whose agent
holds none of the pages writes none (SGLang writes a page through once, when its host tier first backs it up; a
hit on a backed-up page writes nothing): the job waits at most :data:`SOURCE_GRACE_S` for a first page (the
write-through of a prefill that just ended) and fails at once when the source held the prefix before its agent
last restarted. An agent's restart is seen as a new ``instance`` (in its registration and ``GET /v1/info``): the
prefixes its workers were recorded as holding then are *unbacked* there (one ``agent_restarted`` line) until the
agent is seen holding their pages. Such a failure (``l3_copy_failed``, then ``l3_source_excluded``) excludes the
source, not the target, from copies of the prefix for ``exclude_s``; a policy's plan from an unbacked or excluded
source is carried out from another recorded holder whose agent may have the pages, else from it as planned.

Bounds: at most ``max_copies`` jobs in flight in the fleet and ``max_copies_per_agent`` from or to one agent (more
are refused, and the policy may ask again on a later arrival); the source's pages must all land within
``source_wait_s``, the copy end within ``copy_timeout_s`` after that, the warm-up within ``warmup_timeout_s``. Any
failed step ends the job ``failed`` with the reason, and the target gets no copy of that prefix for ``exclude_s``
seconds (an exclusion). No client request is involved in a job: a failure loses none.

Every state change is one structured log line (``event=l3_copy_accepted|l3_copy_started|l3_copy_proved|
l3_copy_failed|l3_proof_short|l3_proof_untrusted|l3_target_excluded|l3_source_excluded``, with copy id, prefix,
source, target, bytes, seconds, outcome; ``l3_source_restored`` when an agent is seen holding pages of a prefix
its workers could not send; ``agent_registered|agent_dropped|agent_restarted`` for the agents).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

import aiohttp

from btbctl.engine.copies import ORIGIN_COPY_PREFIX, CopyOutcome, CopyPlan, CopyState, copy_origin, is_write_origin
from btbctl.engine.gateway.replicator import CopyExecutor, ReplicateError, ReplicateOutcome
from btbctl.engine.gateway.state import FleetState, Transfer
from btbctl.engine.gateway.tokens import PrefixTokens
from btbctl.engine.logfmt import log_event
from btbctl.engine.policies.base import Policy

log = logging.getLogger(__name__)

#: Seconds between polls of an agent where no long poll applies (the source's namespaces when several could hold
#: the prefix). A product choice: a 64-page prefix crosses a LAN in tens of milliseconds.
POLL_S = 0.05
#: How long the agent may hold one progress long poll, seconds: the dashboard's progress refresh while no
#: milestone (source complete, done, failed) comes sooner.
PROGRESS_WAIT_S = 0.25
#: Timeout of one control call to an agent, seconds (a long poll gets its hold on top).
CALL_TIMEOUT_S = 5.0
#: Failed polls in a row that end a job (an agent that stopped answering).
MAX_POLL_ERRORS = 3
#: ``ttl_s`` of a target agent's expectation: the push must arrive within this many seconds.
EXPECT_TTL_S = 120.0
#: Copy ids this gateway ordered that it remembers (oldest forgotten first): their pages count in later proofs on the
#: same node (a same-node job reading pages an earlier copy brought). A product choice: hours of copies.
MAX_ORDERED_COPIES = 1 << 16
#: Longest wait for a first page of the prefix in the source's agent when the source is not computing the prefix,
#: seconds: the write-through of the last chunk of a prefill that just ended (SGLang writes a chunk's pages through
#: within 100-200 ms of committing it, see the module docstring; a product choice with room for a loaded host).
SOURCE_GRACE_S = 2.0


class AgentCallError(Exception):
    """An agent answered badly or not at all (one line)."""


class SourceLost(Exception):
    """The source's agent holds none of the prefix's pages and the source is not writing them (one line)."""


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


def classify_proof(proof: dict[str, int], covered: int) -> CopyOutcome:
    """The outcome of a warm-up whose ``cached_tokens_details`` were ``proof`` (``device``, ``host``, ``storage``
    tokens) for a prefix of ``covered`` tokens: ``proved`` when ``storage`` covers it, ``computed`` when the
    target's own device and host tiers covered (part of) it, ``short`` when the warm-up reused less than the
    prefix."""
    if proof["storage"] >= covered:
        return CopyOutcome.PROVED
    if sum(proof.values()) >= covered:
        return CopyOutcome.COMPUTED
    return CopyOutcome.SHORT


#: Fewest tokens a trailing warm-up adds: SGLang prefetches from L3 only when at least ``prefetch_threshold`` tokens
#: of whole pages remain past the device and host hits (its extra config's default, 256; ``cache_controller.py``).
TRAIL_MIN_TOKENS = 256
#: Most trailing warm-ups per copy (each is one request on the target: a product choice that keeps them a small
#: load while the last one, the proof, loads at most about 1/TRAIL_STEPS of the prefix).
TRAIL_STEPS = 8


def trail_step_pages(pages: int, page_size: int) -> int:
    """Fewest new leading pages at the target that start a trailing warm-up of a ``pages``-page prefix."""
    return max(-(-TRAIL_MIN_TOKENS // max(1, page_size)), -(-pages // TRAIL_STEPS))


@dataclass
class _Loads:
    """What one job's warm-ups found on its target (tokens of the prefix, leading): ``loaded``, those this job's
    warm-ups loaded from L3 (the device and host hits of a later warm-up below it are those same pages);
    ``own_device`` / ``own_host``, the most a warm-up found on the target beyond ``loaded`` (its own, not this
    copy's); ``warmups``, how many answered; ``sent``, how many were sent."""

    loaded: int = 0
    own_device: int = 0
    own_host: int = 0
    warmups: int = 0
    sent: int = 0

    @property
    def own(self) -> int:
        return self.own_device + self.own_host

    def pages(self, page_size: int) -> int:
        return self.loaded // page_size

    def account(self, device: int, host: int, storage: int, asked_tokens: int) -> None:
        """One warm-up's ``cached_tokens_details`` (over ``asked_tokens`` whole-page tokens: ``storage`` beyond them
        is not counted). Pages of its own that any warm-up found keep counting, also when they were evicted before a
        later one."""
        storage = min(storage, max(0, asked_tokens - device - host))
        own = max(0, device + host - self.loaded)
        own_host = min(host, own)
        if own > self.own:
            self.own_host, self.own_device = own_host, own - own_host
        self.loaded = device + host - own + storage

    def outcome(self, covered: int) -> CopyOutcome:
        """:func:`classify_proof` of :meth:`proof`, except that a target on which any warm-up found pages of its own
        is never ``proved``."""
        outcome = classify_proof(self.proof(), covered)
        if outcome is CopyOutcome.PROVED and self.own:
            return CopyOutcome.COMPUTED
        return outcome

    def proof(self) -> dict[str, int]:
        """The copy's proof for :func:`classify_proof`: ``storage`` tokens the warm-ups loaded from L3, ``device``
        and ``host`` tokens the target had of its own."""
        return {"device": self.own_device, "host": self.own_host, "storage": self.loaded}


class L3Replicator(CopyExecutor):
    """Runs ``l3`` copy jobs between the workers of ``state`` (see the module docstring). The same interface as
    :class:`~btbctl.engine.gateway.replicator.Replicator` (``execute``, ``request_copy``, ``replicate``,
    ``refusal``, ``close``).

    Args:
        state: the live fleet state.
        session: returns the shared :class:`aiohttp.ClientSession`.
        agents: ``[{"name", "control_url", "peer_addr"}]``.
        worker_agents: for each worker, its index in ``agents``.
        agent_token: bearer token of the agents' control APIs (one for all).
        agent_tokens: each agent's own bearer token, by agent name (wins over ``agent_token``).
        prefix_tokens: token ids of the prefixes (for warm-ups).
        page_size: returns the gateway's page size (tokens per page).
        fanout: the push's fan-out.
        source_wait_s / copy_timeout_s / warmup_timeout_s / exclude_s: bounds (see :class:`GatewayConfig`).
        max_copies / max_copies_per_agent: jobs in flight, in the fleet and from or to one agent.
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
        agent_tokens: dict[str, str] | None = None,
        page_size: Callable[[], int],
        fanout: str = "chain",
        source_wait_s: float = 30.0,
        copy_timeout_s: float = 300.0,
        warmup_timeout_s: float = 120.0,
        exclude_s: float = 30.0,
        max_copies: int = 16,
        max_copies_per_agent: int = 8,
        on_change: Callable[[Transfer], None] | None = None,
        on_finish: Callable[[Transfer], None] | None = None,
    ) -> None:
        super().__init__(state, session, on_change, on_finish)
        self.agents = [dict(a) for a in agents]
        self.worker_agents = list(worker_agents)
        self.token = agent_token
        self.tokens = dict(agent_tokens or {})
        self.prefix_tokens = prefix_tokens
        self.page_size = page_size
        self.fanout = fanout
        self.source_wait_s = source_wait_s
        self.copy_timeout_s = copy_timeout_s
        self.warmup_timeout_s = warmup_timeout_s
        self.exclude_s = exclude_s
        self.max_copies = max_copies
        self.max_copies_per_agent = max_copies_per_agent
        self.timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        self._excluded: dict[tuple[int, Hashable], float] = {}
        self._pushes: dict[tuple[int, Hashable], asyncio.Future] = {}
        self._pins: dict[tuple[str, Hashable], int] = {}
        self._ordered: OrderedDict[str, None] = OrderedDict()  # copy ids of the pushes this gateway ordered
        self._jobs = 0
        self._agent_jobs: dict[str, int] = {}  # jobs in flight from or to each agent, by name
        self.proofs = {"proved": 0, "short": 0, "failed": 0, "computed": 0}
        n = len(state.workers)
        if not self.worker_agents:
            self.worker_agents = [-1] * n
        if len(self.worker_agents) != n:
            raise ValueError(f"worker_agents names {len(self.worker_agents)} agents for {n} workers")
        #: agent index by name (indices stay stable: a dropped agent that registers again gets its old one back)
        self._index = {a["name"]: i for i, a in enumerate(self.agents)}
        #: registered agents' expiry (the state's clock), by name; the static ones of the config never expire
        self._expires: dict[str, float] = {}
        self._static = set(self._index)
        #: each agent's incarnation as last seen (registration or ``/v1/info``), by name
        self._instances: dict[str, str] = {}
        #: the agent that last served each worker (kept while it has none, to know whose restart it missed)
        self._last_agent: dict[int, str] = {
            r: self.agents[a]["name"] for r, a in enumerate(self.worker_agents) if a >= 0
        }
        #: per worker, the blocks it was recorded as holding when its agent last restarted (their pages are not in
        #: the new agent until seen there)
        self._unbacked: dict[int, set[Hashable]] = {}
        #: (source, prefix key) -> until when (the state's clock) copies of the prefix from that source are refused
        self._source_excluded: dict[tuple[int, Hashable], float] = {}

    # -- eligibility ---------------------------------------------------------------------------------------------

    def agent_of(self, r: int) -> dict:
        """Worker ``r``'s node agent (``{"name", "control_url", "peer_addr"}``); only for a worker that has one."""
        return self.agents[self.worker_agents[r]]

    def has_agent(self, r: int) -> bool:
        """Whether worker ``r`` has a node agent now (static, or registered and not dropped)."""
        return 0 <= r < len(self.worker_agents) and self.worker_agents[r] >= 0

    def agent_names(self) -> list[str | None]:
        """Each worker's node agent by name (None: none now), in worker order."""
        return [self.agents[a]["name"] if a >= 0 else None for a in self.worker_agents]

    def agent_views(self) -> list[dict]:
        """The agents known now: ``{"name", "control_url", "peer_addr", "workers": [worker names], "static": from the
        settings, "expires_in_s": seconds until a registration lapses (None: from the settings)}``."""
        now = self.state.clock()
        out = []
        for i, a in enumerate(self.agents):
            exp = self._expires.get(a["name"])
            if a["name"] not in self._static and exp is None:
                continue  # a registration that lapsed
            out.append(
                {
                    "name": a["name"],
                    "control_url": a["control_url"],
                    "peer_addr": a["peer_addr"],
                    "workers": [self.state.workers[r].name for r, x in enumerate(self.worker_agents) if x == i],
                    "static": a["name"] in self._static,
                    "expires_in_s": None if exp is None else round(max(0.0, exp - now), 3),
                }
            )
        return out

    # -- agents that register --------------------------------------------------------------------------------------

    def pinned(self, r: int, name: str) -> bool:
        """Whether worker ``r`` belongs to an agent of the settings other than ``name``: a registration cannot take it
        (the settings' map, which ``btbctl up`` writes from where it started each worker, is authoritative; a node's
        credentials let it register only as itself, not move another node's workers to it)."""
        a = self.worker_agents[r]
        return a >= 0 and self.agents[a]["name"] in self._static and self.agents[a]["name"] != name

    def register(
        self,
        name: str,
        control_url: str,
        peer_addr: str,
        workers: Sequence[int],
        ttl_s: float,
        instance: str | None = None,
        **fields: object,
    ) -> bool:
        """Record agent ``name``'s announcement: it serves the workers of indices ``workers`` (they leave the agent
        they had, unless :meth:`pinned` to an agent of the settings), at ``control_url`` / ``peer_addr``, until
        ``ttl_s`` seconds from now (the state's clock) unless it announces again. A re-registration replaces the
        previous one: workers it no longer names lose their agent. ``instance``: the agent's incarnation (None: an
        agent that names none); a new one is a restart (:meth:`observe_instance`). Logs one ``agent_registered`` line
        (old and new) when anything changed; returns whether it did. ``fields`` (``node``, ...) go into that line."""
        old_instance = self._instances.get(name)
        self.observe_instance(name, instance)
        now = self.state.clock()
        new = {"name": name, "control_url": control_url, "peer_addr": peer_addr}
        i = self._index.get(name)
        if i is None:
            i = self._index[name] = len(self.agents)
            self.agents.append(new)
            old: dict | None = None
        else:
            old = self.agents[i]
            self.agents[i] = new
        if name not in self._static:
            self._expires[name] = now + ttl_s
        before = [r for r, a in enumerate(self.worker_agents) if a == i]
        moved: dict[int, str] = {}
        serves = {r for r in workers if not self.pinned(r, name)}
        for r, a in enumerate(self.worker_agents):
            if r in serves:
                if a >= 0 and a != i:
                    moved[r] = self.agents[a]["name"]
                self.worker_agents[r] = i
            elif a == i:
                self.worker_agents[r] = -1
        after = [r for r, a in enumerate(self.worker_agents) if a == i]
        for r in after:
            self._last_agent[r] = name
        renewed = instance is None or instance == old_instance
        same = old is not None and old == new and before == after and not moved and renewed
        if same:
            return False
        names = lambda rs: ",".join(self.state.workers[r].name for r in rs) or None
        log_event(
            log,
            "agent_registered",
            logging.INFO,
            agent=name,
            old_control_url=old and old["control_url"],
            control_url=control_url,
            old_peer=old and old["peer_addr"],
            peer=peer_addr,
            old_workers=names(before),
            workers=names(after),
            taken_from=",".join(f"{self.state.workers[r].name}:{a}" for r, a in moved.items()) or None,
            ttl_s=ttl_s,
            old_instance=old_instance,
            instance=instance,
            **fields,
        )
        return True

    def observe_instance(self, name: str, instance: object) -> bool:
        """Agent ``name`` names incarnation ``instance`` (its registration or ``GET /v1/info``; anything but a
        non-empty string is ignored). A new one after another means the agent restarted with an empty page store:
        the prefixes the workers it served were recorded as holding are *unbacked* there from now on (not a copy
        source until its agent is seen holding their pages; :meth:`unbacked`). One ``agent_restarted`` line;
        returns whether it restarted."""
        if not isinstance(instance, str) or not instance:
            return False
        old = self._instances.get(name)
        self._instances[name] = instance
        if old is None or old == instance:
            return False
        served = sorted(r for r, a in self._last_agent.items() if a == name)
        blocks = 0
        for r in served:
            held = set(self.state.workers[r].holdings)
            self._unbacked[r] = held
            blocks += len(held)
        # its pages of a prefix are gone: a source exclusion learned from the old incarnation says nothing now
        for k in [k for k in self._source_excluded if k[0] in served]:
            del self._source_excluded[k]
        log_event(
            log,
            "agent_restarted",
            logging.WARNING,
            agent=name,
            old_instance=old,
            instance=instance,
            workers=",".join(self.state.workers[r].name for r in served) or None,
            unbacked_blocks=blocks,
        )
        return True

    def unbacked(self, r: int, chain: Sequence[Hashable]) -> bool:
        """Whether worker ``r`` was recorded as holding ``chain`` when its node agent last restarted, and its agent
        was not seen holding the prefix's pages since: a request of it there reuses the worker's own tiers and
        writes nothing to the new agent."""
        held = self._unbacked.get(r)
        return bool(held) and bool(chain) and chain[-1] in held

    def source_excluded(self, r: int, key: Hashable) -> bool:
        """Whether copies of prefix ``key`` from worker ``r`` are refused now (a copy from it found its agent
        without the pages and ``r`` not writing them, within ``exclude_s``)."""
        return self._in_force(self._source_excluded, (r, key))

    def _in_force(self, exclusions: dict[tuple[int, Hashable], float], k: tuple[int, Hashable]) -> bool:
        """Whether the exclusion ``k`` of ``exclusions`` (worker, prefix key -> until when, the state's clock) holds
        now; one that ran out is forgotten."""
        until = exclusions.get(k)
        if until is None:
            return False
        if until <= self.state.clock():
            del exclusions[k]
            return False
        return True

    def _backed(self, r: int, chain: Sequence[Hashable]) -> None:
        """Worker ``r``'s agent holds pages of ``chain``: every worker it serves is a copy source of the prefix again
        (the workers of a node share its agent's pages)."""
        a = self.worker_agents[r]
        restored = []
        for x in [r] if a < 0 else [x for x, b in enumerate(self.worker_agents) if b == a]:
            was = self.unbacked(x, chain) or (x, chain[-1]) in self._source_excluded
            held = self._unbacked.get(x)
            if held:
                held.difference_update(chain)
                if not held:
                    del self._unbacked[x]
            self._source_excluded.pop((x, chain[-1]), None)
            if was:
                restored.append(self.state.workers[x].name)
        if restored:
            log_event(
                log,
                "l3_source_restored",
                prefix=chain[-1],
                agent=self.agents[a]["name"] if a >= 0 else None,
                workers=",".join(restored),
            )

    def copy_source(self, chain: Sequence[Hashable], source: int, excluded: Collection[int] = ()) -> int:
        """The worker to copy ``chain`` from when a plan names ``source``: ``source``, unless it is :meth:`unbacked`
        or :meth:`source_excluded` for the prefix and another worker (not in ``excluded``) that accepts copies is
        recorded as holding it and is neither; then the least loaded of those (ties: lower index)."""
        if not chain or not (self.unbacked(source, chain) or self.source_excluded(source, chain[-1])):
            return source
        ws = self.state.workers
        n = len(chain)
        others = [
            r
            for r in range(len(ws))
            if r != source
            and r not in excluded
            and self.accepts_copies(r)
            and ws[r].held_blocks(chain) >= n
            and not self.unbacked(r, chain)
            and not self.source_excluded(r, chain[-1])
        ]
        if not others:
            return source
        return min(others, key=lambda r: (ws[r].inflight, r))

    def execute(self, plan: CopyPlan, policy: Policy, excluded: Collection[int] = ()) -> list[int]:
        """:meth:`CopyExecutor.execute` of ``plan`` from :meth:`copy_source` (a holder whose agent may have the
        pages when the planned source's cannot)."""
        source = self.copy_source(plan.prefix, plan.source, tuple(excluded) + tuple(plan.targets))
        if source != plan.source:
            plan = dataclasses.replace(plan, source=source)
        return super().execute(plan, policy, excluded)

    def expire(self) -> list[str]:
        """Drop the registered agents whose announcement ran out (the state's clock): their workers lose their agent
        (no copies to or from them; a copy in flight through one is not proved). One ``agent_dropped`` line each;
        returns their names."""
        now = self.state.clock()
        gone = [n for n, t in self._expires.items() if t <= now]
        for name in gone:
            del self._expires[name]
            i = self._index[name]
            lost = [r for r, a in enumerate(self.worker_agents) if a == i]
            for r in lost:
                self.worker_agents[r] = -1
            log_event(
                log,
                "agent_dropped",
                logging.WARNING,
                agent=name,
                old_workers=",".join(self.state.workers[r].name for r in lost) or None,
                workers=None,
                reason="no announcement within its ttl",
            )
        return gone

    def next_expiry(self) -> float | None:
        """When the next registered agent runs out (the state's clock), or None."""
        return min(self._expires.values(), default=None)

    def _usable(self, r: int) -> bool:
        ws = self.state.workers
        return 0 <= r < len(ws) and ws[r].healthy

    def after_s(self, target: int, blocks: int) -> float:
        """Seconds a copy of ``blocks`` pages towards ``target`` takes beyond its bytes and the source's prefill:
        the source writes its last prefill chunk through to host memory (a page is copied once its chunk is
        committed and written), then the proof, from the last page at ``target``'s node to ``target`` serving the
        prefix: as the proofs measured (:class:`~btbctl.engine.gateway.state.CopyMeasures`), before the first the
        least it takes by the cost model: SGLang loads the prefix from L3 into the GPU and runs the warm-up's
        one-token step. Host-link figures are ``cost.pcie_bytes_per_s``; the step is ``decode_step_time_s``."""
        st = self.state
        cost = st.cost
        tokens = blocks * st.page_size
        write_through_s = cost.kv_bytes(min(tokens, st.chunk_tokens)) / cost.pcie_bytes_per_s
        proof_s = st.copy_measures.proof_s
        if proof_s is None:
            proof_s = cost.kv_bytes(tokens) / cost.pcie_bytes_per_s + cost.decode_step_time_s(1, tokens)
        return write_through_s + proof_s

    def accepts_copies(self, r: int) -> bool:
        """Whether worker ``r`` can send or receive an l3 copy now (the policies' ``accepts_copies``): healthy, with
        a node agent. A stock SGLang server qualifies: its pages move between agents, not through BTB routes."""
        return self._usable(r) and self.has_agent(r)

    def excluded(self, target: int, key: Hashable) -> bool:
        return self._in_force(self._excluded, (target, key))

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
        for what, r in (("source", source), ("target", target)):
            if not self.has_agent(r):
                return f"the {what} has no node agent (none registered it)"
        if self.source_excluded(source, chain[-1]):
            return (
                "the source's node agent held none of the prefix's pages and the source was not computing it "
                "(excluded as its source for exclude_s)"
            )
        tw = self.state.workers[target]
        if tw.held_blocks(chain) >= len(chain):
            return "target already holds the prefix"
        if self.state.transfers.in_flight(target, chain[-1]):
            return "a copy to the target is already in flight"
        if self.excluded(target, chain[-1]):
            return "target excluded after a failed copy or proof of this prefix"
        if self._jobs >= self.max_copies:
            return f"{self._jobs} l3 copies in flight, the fleet's limit (l3_max_copies)"
        for r in (source, target):
            a = self.agent_of(r)["name"]
            if self._agent_jobs.get(a, 0) >= self.max_copies_per_agent:
                return f"agent {a} has {self.max_copies_per_agent} copies in flight (its limit)"
        if self.prefix_tokens.get(list(chain), self.page_size()) is None:
            return "the prefix's token ids are no longer known (needed for the warm-up)"
        return None

    # -- starting jobs ------------------------------------------------------------------------------------------

    def _transfer(self, chain: tuple, source: int, target: int, manual: bool) -> Transfer:
        t = super()._transfer(chain, source, target, manual)
        t.mode, t.covered_tokens = "l3", len(chain) * self.page_size()
        t.ready = asyncio.get_running_loop().create_future()
        t.path = (self.agent_of(source)["name"], self.agent_of(target)["name"])
        self._jobs += 1
        for a in set(t.path):
            self._agent_jobs[a] = self._agent_jobs.get(a, 0) + 1
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
        cands = [w.index for w in ws if self.accepts_copies(w.index)]
        if not cands:
            raise ReplicateError(409, "no healthy worker with a node agent")
        holders = [r for r in cands if ws[r].held_blocks(chain) >= len(chain)]
        if not holders:
            for r in cands:
                try:
                    if await self._complete_group(self.agent_of(r), list(chain)):
                        holders.append(r)
                except AgentCallError:
                    continue
        if not holders:
            raise ReplicateError(409, f"no healthy worker holds prefix {chain[-1]} ({len(chain)} pages)")
        # holders whose agent may have the pages first (one that restarted since lost them), never an excluded one
        # while another is not
        usable = [r for r in holders if not self.source_excluded(r, chain[-1])] or holders
        holders = [r for r in usable if not self.unbacked(r, chain)] or usable
        return await self._start_manual(
            chain,
            cands,
            holders,
            n,
            wait_s,
            "every worker free to receive it is excluded after a failed proof, or the prefix's token ids are no "
            "longer known",
        )

    # -- bookkeeping --------------------------------------------------------------------------------------------

    def _finish(self, t: Transfer, state: CopyState, event: str, reason: str | None = None, **fields: object) -> None:
        self._jobs -= 1
        for a in set(t.path or ()):
            n = self._agent_jobs.get(a, 0) - 1
            if n > 0:
                self._agent_jobs[a] = n
            else:
                self._agent_jobs.pop(a, None)
        outcome = fields.get("outcome")
        if t.ready is not None and not t.ready.done():
            # computed: the target holds the prefix (its own), so its requests need not wait or move
            t.ready.set_result(state is CopyState.DONE or outcome is CopyOutcome.COMPUTED)
        super()._finish(t, state, event, reason, **fields)

    def _fail(self, t: Transfer, reason: str, kind: CopyOutcome = CopyOutcome.FAILED, exclude: str = "target") -> None:
        """End ``t`` failed (``kind``: ``short``, ``computed`` or ``failed``) and exclude from copies of this prefix
        for ``exclude_s`` its ``exclude`` worker: the ``target`` (unless it computed the prefix itself: then it holds
        it), or the ``source`` whose pages cannot arrive (:class:`SourceLost`); one ``l3_target_excluded`` or
        ``l3_source_excluded`` line."""
        self.proofs[kind.value] += 1
        if kind is CopyOutcome.COMPUTED:
            self.state.workers[t.target].hold(t.chain)
        elif exclude == "source":
            self._source_excluded[(t.source, t.key)] = self.state.clock() + self.exclude_s
        else:
            self._excluded[(t.target, t.key)] = self.state.clock() + self.exclude_s
        self._finish(t, CopyState.FAILED, "copy_failed", reason, outcome=kind, **self._phase_fields(t))
        if kind is not CopyOutcome.COMPUTED:
            self._event(f"{exclude}_excluded", t, for_s=self.exclude_s, reason=reason)

    def _done(self, t: Transfer, warmups: int) -> None:
        self.proofs["proved"] += 1
        self._finish(
            t,
            CopyState.DONE,
            "copy_proved",
            transfer_s=None if t.transfer_s is None else round(t.transfer_s, 6),
            storage_tokens=t.proof_storage_tokens,
            covered_tokens=t.covered_tokens,
            warmups=warmups,
            outcome=CopyOutcome.PROVED,
            **self._phase_fields(t),
        )

    def _phase_fields(self, t: Transfer) -> dict:
        return {f"phase_{k}_s": None if v is None else round(v, 6) for k, v in t.phases().items()}

    # -- agent calls --------------------------------------------------------------------------------------------

    def _headers(self, agent: dict) -> dict:
        token = self.tokens.get(agent["name"], self.token)
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def _call(
        self, agent: dict, method: str, path: str, body: dict | None = None, hold_s: float = 0.0
    ) -> tuple[int, dict]:
        timeout = self.timeout if not hold_s else aiohttp.ClientTimeout(total=CALL_TIMEOUT_S + hold_s)
        try:
            async with self._session().request(
                method, agent["control_url"] + path, json=body, headers=self._headers(agent), timeout=timeout
            ) as resp:
                ans = await resp.json(content_type=None)
                return resp.status, ans if isinstance(ans, dict) else {}
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, OSError) as e:
            raise AgentCallError(f"agent {agent['name']} ({agent['control_url']}): {type(e).__name__}: {e}") from None

    async def _complete_group(self, agent: dict, keys: list) -> list[str] | None:
        """The namespace ids of one complete group holding every page of ``keys`` on ``agent``, or None."""
        st, has = await self._call(agent, "POST", "/v1/has", {"keys": keys})
        if st != 200:
            raise AgentCallError(f"agent {agent['name']}: /v1/has answered {st}: {has.get('error')}")
        complete = set(has.get("complete") or ())
        if not complete:
            return None
        for group in await self._groups(agent):
            if all(ns in complete for ns in group):
                return group
        return None

    async def _groups(self, agent: dict) -> list[list[str]]:
        """The agent's namespace groups (``GET /v1/info``; its ``instance`` goes to :meth:`observe_instance`)."""
        st, info = await self._call(agent, "GET", "/v1/info")
        if st != 200:
            raise AgentCallError(f"agent {agent['name']}: /v1/info answered {st}")
        self.observe_instance(agent["name"], info.get("instance"))
        return _namespace_groups(info)

    def _computing(self, t: Transfer) -> bool:
        """Whether the pages of ``t``'s prefix are on their way to its source's agent: a request of it in flight at
        the source (no first byte yet) while the source is not recorded as holding it and was not holding it when
        its agent last restarted (a request on a holder reuses its own tiers and writes nothing), or a copy of it to
        the source in flight."""
        w = self.state.workers[t.source]
        n = len(t.chain)
        if self.state.transfers.depth_to(t.source, t.chain) >= n:
            return True
        return w.held_blocks(t.chain) < n and w.pending_or_held(t.chain) >= n and not self.unbacked(t.source, t.chain)

    async def _source_group(self, t: Transfer, agent: dict, keys: list) -> list[str] | str:
        """The namespaces the source's pages of ``keys`` are (or will be) written to on ``agent``: the group holding
        the longest leading run when one holds a page; while the source computes the prefix (:meth:`_computing`),
        the one group its workers registered (the stream trails the prefill), else such a run waited for up to
        ``source_wait_s``; or why none. Raises :class:`SourceLost` when the source is not computing the prefix and
        its agent holds none of its pages: at once when the source is :meth:`unbacked`, else after
        :data:`SOURCE_GRACE_S` (the write-through of a prefill that just ended)."""
        clock = self.state.clock
        deadline = clock() + self.source_wait_s
        grace_end: float | None = None
        errors = 0
        while True:
            try:
                groups = await self._groups(agent)
                best, run = None, 0
                if groups:
                    st, has = await self._call(agent, "POST", "/v1/has", {"keys": keys})
                    runs = has.get("namespaces") or {} if st == 200 else {}
                    best = max(groups, key=lambda g: min(int(runs.get(ns, 0)) for ns in g))
                    run = min(int(runs.get(ns, 0)) for ns in best)
                if best is not None and run > 0:
                    self._backed(t.source, t.chain)
                    return best
                if self._computing(t):
                    if len(groups) == 1:
                        return groups[0]
                else:
                    where = f"the source's node agent {agent['name']} holds none of the prefix's {len(keys)} pages"
                    if self.unbacked(t.source, t.chain):
                        raise SourceLost(
                            f"{where}: it restarted after the source computed the prefix, which the source keeps in "
                            "its own tiers without writing it again"
                        )
                    if grace_end is None:
                        grace_end = clock() + min(self.source_wait_s, SOURCE_GRACE_S)
                    elif clock() >= grace_end:
                        raise SourceLost(
                            f"{where} after {min(self.source_wait_s, SOURCE_GRACE_S):g} s and the source is not "
                            "computing it"
                        )
                errors = 0
            except AgentCallError as e:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    return f"source agent unreachable: {e}"
            if not self._usable(t.source):
                return "source became unhealthy"
            if clock() >= deadline:
                return f"no namespace on the source's agent received the prefix within {self.source_wait_s:g} s"
            await asyncio.sleep(POLL_S)

    def pin_ttl_s(self) -> float:
        """How long a job's pins last at most: its longest possible run (source wait, copy, warm-up) plus slack."""
        return min(86400.0, self.source_wait_s + self.copy_timeout_s + self.warmup_timeout_s + 30.0)

    async def _pin(self, t: Transfer, pinned: list, agent: dict, keys: list, group: list[str]) -> None:
        """Pin ``keys`` of namespaces ``group`` on ``agent`` for this job (a pin also holds pages that land later;
        best effort: a failure is logged, the copy goes on and may then find the pages gone)."""
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
        except SourceLost as e:
            self._fail(t, str(e), exclude="source")
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
        group = await self._source_group(t, src_agent, keys)
        if isinstance(group, str):
            return group
        # the pages stay until the target proved it has them (a pin also holds pages that arrive later)
        await self._pin(t, pinned, src_agent, keys, group)
        if dst_agent is not src_agent:
            await self._pin(t, pinned, dst_agent, keys, group)
            moving = self._copy(t, src_agent, dst_agent, keys, group)
            progress = lambda: t.blocks_verified  # pages the source's agent has sent

            def accept(origin: object) -> bool:  # only this copy's pages: stale ones are replaced as it lands
                return t.via_copy_id is not None and origin == copy_origin(t.via_copy_id)

        else:
            moving = self._same_node(t, src_agent, keys, group)
            progress = lambda: max(0, t.blocks_available)  # the shared agent's leading run

            def accept(origin: object) -> bool:  # the source's write-through (or a copy this gateway ordered)
                return self.trusted(t, origin)

        loads = _Loads()
        landed = asyncio.Event()
        trail = asyncio.create_task(self._trail(t, dst_agent, keys, group, loads, landed, progress, accept))
        trail.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            reason = await moving
        except BaseException:
            trail.cancel()
            raise
        landed.set()
        if reason is not None:
            trail.cancel()
            return reason
        t.landed_s = self.state.clock()
        if t.pushed is not None:
            t.pushed.set()
        trailed = await trail  # a trailing warm-up in flight ends first
        if trailed is not None:
            return trailed
        return await self._prove(t, dst_agent, keys, group, loads)

    async def _same_node(self, t: Transfer, agent: dict, keys: list, group: list[str]) -> str | None:
        """The target's L3 tier is the source's: no bytes move; wait until the source's write-through landed every
        page there."""
        clock = self.state.clock
        t.state = CopyState.RUNNING
        t.started_s = clock()
        t.transfer_s = 0.0
        self._event("copy_started", t, bytes=0, note="same node: the target's L3 tier holds the pages")
        self._changed(t)
        deadline = clock() + self.source_wait_s
        errors = 0
        while True:
            if not self._usable(t.source) and not self._usable(t.target):
                return "source and target became unhealthy"
            if not self._usable(t.target):
                return "target became unhealthy"
            hold = max(0.0, min(PROGRESS_WAIT_S, deadline - clock()))
            try:
                st, has = await self._call(
                    agent, "POST", "/v1/wait", {"keys": keys, "namespaces": group, "wait_s": hold}, hold_s=hold
                )
                errors = 0
            except AgentCallError as e:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    return f"source agent unreachable: {e}"
                await asyncio.sleep(POLL_S)
                continue
            if st != 200:
                return f"source agent refused /v1/wait: HTTP {st}: {has.get('error')}"
            runs = has.get("namespaces") or {}
            ready = min((int(runs.get(ns, 0)) for ns in group), default=0)
            if ready != t.blocks_available:
                t.blocks_available = ready
                self._changed(t)
            if ready >= len(keys):
                t.source_complete_s = clock()
                return None
            if clock() >= deadline:
                return f"the source's agent does not hold the prefix's {len(keys)} pages after {self.source_wait_s:g} s"

    async def _copy(self, t: Transfer, src: dict, dst: dict, keys: list, group: list[str]) -> str | None:
        shared = (self.worker_agents[t.target], t.key)
        fut = self._pushes.get(shared)
        if fut is not None:  # another job copies this prefix to the same node: share its outcome
            t.state = CopyState.RUNNING
            t.started_s = self.state.clock()
            self._event("copy_started", t, note="shares a copy to the same node")
            self._changed(t)
            ok, info = await asyncio.shield(fut)
            t.via_copy_id = info.get("copy_id")
            t.bytes_total = t.bytes_sent = info.get("bytes", 0) if ok else 0
            t.transfer_s = info.get("transfer_s")
            t.source_complete_s = info.get("source_complete_s")
            return None if ok else f"shared copy failed: {info.get('error')}"
        fut = asyncio.get_running_loop().create_future()
        self._pushes[shared] = fut
        result: tuple[bool, dict] = (False, {"error": "not started"})
        t.via_copy_id = t.copy_id
        try:
            reason = await self._push(t, src, dst, keys, group)
            info = {
                "copy_id": t.copy_id,
                "bytes": t.bytes_total,
                "transfer_s": t.transfer_s,
                "source_complete_s": t.source_complete_s,
                "error": reason,
            }
            result = (reason is None, info)
            return reason
        finally:
            self._pushes.pop(shared, None)
            fut.set_result(result)

    async def _push(self, t: Transfer, src: dict, dst: dict, keys: list, group: list[str]) -> str | None:
        clock = self.state.clock
        self._ordered[t.copy_id] = None
        while len(self._ordered) > MAX_ORDERED_COPIES:
            self._ordered.popitem(last=False)
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
                "stream_s": self.source_wait_s,
            }
            st, rec = await self._call(src, "POST", "/v1/push", body)
        except AgentCallError as e:
            return str(e)
        if st == 409:
            return f"source agent cannot send the pages: {rec.get('error')}"
        if st != 202:
            return f"source agent refused the push: HTTP {st}: {rec.get('error')}"
        t.bytes_total = int(rec.get("bytes_total") or 0)
        t.state = CopyState.RUNNING
        t.started_s = clock()
        self._event("copy_started", t, bytes=t.bytes_total, pages=rec.get("pages"), namespaces=len(group), stream=True)
        self._changed(t)
        # progress: a long poll the source's agent answers at each milestone (source complete, done, failed)
        deadline = clock() + self.source_wait_s + self.copy_timeout_s
        errors = 0
        since = int(rec.get("version") or 0)
        nss = max(1, len(group))
        while True:
            if not self._usable(t.target):
                await self._cancel(src, t.copy_id)
                return "target became unhealthy during the copy"
            asked = clock()
            try:
                st, ans = await self._call(
                    src,
                    "GET",
                    f"/v1/copies/{t.copy_id}?since={since}&wait_s={PROGRESS_WAIT_S:g}",
                    hold_s=PROGRESS_WAIT_S,
                )
                errors = 0
            except AgentCallError as e:
                errors += 1
                if errors >= MAX_POLL_ERRORS:
                    return f"source agent stopped answering during the copy: {e}"
                await asyncio.sleep(POLL_S)
                continue
            rec = next((r for r in ans.get("records", []) if r.get("role") == "source"), None) if st == 200 else None
            if rec is None:
                return f"source agent does not know the copy (HTTP {st})"
            moved = int(rec.get("version") or since) > since  # a milestone (else the hold ran out)
            since = int(rec.get("version") or since)
            changed = False
            ready = rec.get("pages_ready")
            if isinstance(ready, int) and ready // nss != t.blocks_available:
                t.blocks_available = ready // nss
                changed = True
            if rec.get("source_complete_s") is not None and t.source_complete_s is None:
                t.source_complete_s = clock()
                changed = True
            sent = rec.get("bytes_done")
            if isinstance(sent, int) and sent != t.bytes_sent:
                t.bytes_sent = min(sent, t.bytes_total or sent)
                t.blocks_verified = int(rec.get("pages_done") or 0) // nss
                changed = True
            if rec.get("state") == CopyState.DONE.value:
                now = clock()
                t.transfer_s = now - (t.started_s or now)
                t.blocks_verified = len(t.chain)
                t.send_s = sum(float(x.get("send_s") or 0.0) for x in (rec.get("targets") or {}).values())
                first, complete = rec.get("first_page_s"), rec.get("source_complete_s")
                if isinstance(first, (int, float)) and isinstance(complete, (int, float)):
                    t.overlap_s = max(0.0, complete - first)
                if t.path is not None:
                    self.state.copy_measures.copied(t.path, t.bytes_total, t.send_s, len(t.chain))
                return None
            if rec.get("state") == CopyState.FAILED.value:
                return f"copy failed: {rec.get('error') or 'at the source'}"
            if changed:
                self._changed(t)
            elif not moved and clock() - asked < PROGRESS_WAIT_S / 2:
                await asyncio.sleep(POLL_S)  # an agent that answers at once (an older one, or its waits are full)
            if clock() >= deadline:
                await self._cancel(src, t.copy_id)
                return f"no outcome after {self.source_wait_s + self.copy_timeout_s:g} s"

    async def _cancel(self, agent: dict, copy_id: str) -> None:
        try:
            await self._call(agent, "POST", f"/v1/copies/{copy_id}/cancel")
        except AgentCallError:
            pass

    def trusted(self, t: Transfer, origin: object) -> bool:
        """Whether a warm-up of ``t`` may count a page of provenance ``origin``: the target node's own write-through,
        the copy this job ordered (or shared), or another copy this gateway ordered (the last
        :data:`MAX_ORDERED_COPIES`)."""
        if is_write_origin(origin):
            return True
        if not isinstance(origin, str) or not origin.startswith(ORIGIN_COPY_PREFIX):
            return False
        cid = origin[len(ORIGIN_COPY_PREFIX) :]
        return cid == t.via_copy_id or cid in self._ordered

    async def _untrusted(
        self, t: Transfer, agent: dict, keys: list, group: list[str], ps: int, cached: int, storage: int
    ) -> str | tuple | None:
        """Why a warm-up's ``storage`` tokens cannot count (a page they came from has another provenance than
        :meth:`trusted`, or the target's agent cannot say), or None. Storage hits follow the device and host hits
        (``cached`` tokens), so they are the pages ``[cached / ps, (cached + storage) / ps)``."""
        lo = cached // ps
        hi = min(len(keys), -(-(cached + storage) // ps))
        if hi <= lo:
            return None
        try:
            nss = await self._provenance(agent, keys[lo:hi], group)
        except AgentCallError as e:
            return f"the target's agent cannot say where the pages came from: {e}"
        for ns in group:
            for i, origin in enumerate(nss[ns]):
                if not self.trusted(t, origin):
                    self._event(
                        "proof_untrusted",
                        t,
                        page=lo + i,
                        namespace=ns,
                        origin=origin,
                        storage_tokens=storage,
                    )
                    return (
                        f"proof refused: page {lo + i} of namespace {ns} on the target came from {origin!r}, "
                        f"neither a copy this gateway ordered ({t.via_copy_id or 'none'} here) nor the target "
                        "node's own write-through"
                    )
        return None

    async def _warm_up(
        self, t: Transfer, agent: dict, keys: list, group: list[str], pages: int, loads: _Loads
    ) -> str | tuple | None:
        """One warm-up of the target over the prefix's first ``pages`` pages (``POST /generate``, max 1 new token;
        see the module docstring), accounted in ``loads``; why it cannot count, or None."""
        ps = self.page_size()
        got = self.prefix_tokens.get(list(t.chain), ps)
        if got is None:
            return "the prefix's token ids are no longer known (needed for the warm-up)"
        ids, extra_key, salt = got
        ids = ids[: pages * ps]
        w = self.state.workers[t.target]
        body: dict = {
            "input_ids": ids + [ids[0] if ids else 0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "rid": f"btb-warmup-{t.copy_id}-{loads.sent}",
            # newer SGLang (after 0.5.23, its PR 17648) reports where cached tokens came from only when asked
            "return_cached_tokens_details": True,
        }
        if extra_key is not None:
            body["extra_key"] = extra_key
        if salt is not None:
            body["cache_salt"] = salt
        loads.sent += 1
        try:
            async with self._session().post(
                f"{w.url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=self.warmup_timeout_s)
            ) as resp:
                status = resp.status
                ans = await resp.json(content_type=None) if status == 200 else None
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

        device, host, storage = tok("device"), tok("host"), tok("storage")
        storage = min(storage, max(0, len(ids) - device - host))  # never more than the warm-up asked for
        loads.warmups += 1
        if storage > 0:
            # count storage tokens only from pages of the ordered copy or the target's own write-through
            untrusted = await self._untrusted(t, agent, keys, group, ps, device + host, storage)
            if untrusted is not None:
                return untrusted
        loads.account(device, host, storage, len(ids))
        return None

    async def _trail(
        self,
        t: Transfer,
        agent: dict,
        keys: list,
        group: list[str],
        loads: _Loads,
        landed: asyncio.Event,
        progress: Callable[[], int],
        accept: Callable[[object], bool],
    ) -> str | tuple | None:
        """Warm-ups that trail the copy (the target's prefetch streams behind the pages as they land, so the
        proof after the last page loads only the tail): while the copy runs, each time the target's agent holds
        at least :func:`trail_step_pages` more leading pages than the warm-ups loaded, all of a provenance
        ``accept`` takes (this copy's pages, never what the target held before them), one warm-up over them (one
        at a time). Stops at the first warm-up that finds pages the target had of its own (the proof then
        says ``computed``) or fails; why the copy cannot be counted, or None."""
        step = trail_step_pages(len(keys), self.page_size())
        while not landed.is_set():
            if loads.own == 0 and progress() - loads.pages(self.page_size()) >= step:
                try:
                    run = await self._held_run(agent, keys, group, accept)
                except AgentCallError:
                    run = 0
                if landed.is_set():
                    return None
                if run < len(keys) and run - loads.pages(self.page_size()) >= step:
                    t0 = self.state.clock()
                    before = loads.loaded
                    reason = await self._warm_up(t, agent, keys, group, run, loads)
                    if reason is not None:
                        if isinstance(reason, str) and reason.startswith("warm-up failed"):
                            self._event("prefetch_failed", t, pages=run, error=reason)
                            return None  # the proof after the last page tries again, whole
                        return reason
                    self._event(
                        "prefetched",
                        t,
                        pages=run,
                        loaded_tokens=loads.loaded - before,
                        own_tokens=loads.own,
                        seconds=round(self.state.clock() - t0, 6),
                    )
                    continue
            try:
                await asyncio.wait_for(landed.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass
        return None

    async def _held_run(self, agent: dict, keys: list, group: list[str], accept: Callable[[object], bool]) -> int:
        """Leading pages of ``keys`` that ``agent`` holds in every namespace of ``group`` with a provenance
        ``accept`` takes (``POST /v1/provenance``): a page held there of another origin (planted, or stale from
        before the copy) ends the run."""
        nss = await self._provenance(agent, keys, group)
        run = len(keys)
        for ns in group:
            n = 0
            for origin in nss[ns][:run]:
                if origin is None or not accept(origin):
                    break
                n += 1
            run = min(run, n)
        return run

    async def _provenance(self, agent: dict, keys: list, group: list[str]) -> dict[str, list]:
        """Where each page of ``keys`` held by ``agent`` came from (``POST /v1/provenance``): for each namespace of
        ``group``, one provenance (or None: not held) per key. Raises :class:`AgentCallError` for a bad or missing
        answer."""
        st, ans = await self._call(agent, "POST", "/v1/provenance", {"keys": keys, "namespaces": group})
        nss = ans.get("namespaces") if st == 200 else None
        if not isinstance(nss, dict):
            raise AgentCallError(f"agent {agent['name']}: /v1/provenance answered {st}: {ans.get('error')}")
        for ns in group:
            origins = nss.get(ns)
            if not isinstance(origins, list) or len(origins) != len(keys):
                raise AgentCallError(f"agent {agent['name']}: no provenance for namespace {ns}")
        return nss

    def _agent_changed(self, t: Transfer) -> str | None:
        """Why ``t`` cannot count any more because its source's or target's node agent was dropped or replaced by
        another during the copy (nothing is marked warm then), or None."""
        path = t.path or ("", "")
        for what, r, name in (("source", t.source, path[0]), ("target", t.target, path[1])):
            if not self.has_agent(r) or self.agent_of(r)["name"] != name:
                return f"the {what}'s node agent {name} was dropped or replaced during the copy"
        return None

    async def _prove(self, t: Transfer, agent: dict, keys: list, group: list[str], loads: _Loads) -> str | tuple | None:
        ps = self.page_size()
        t0 = time.monotonic()
        reason = await self._warm_up(t, agent, keys, group, len(keys), loads)
        if reason is not None:
            return reason
        t.proof = loads.proof()
        t.proof_storage_tokens = t.proof["storage"]
        covered = len(t.chain) * ps
        warm_s = round(time.monotonic() - t0, 6)
        outcome = loads.outcome(covered)
        gone = self._agent_changed(t)
        if gone is not None:
            return gone
        if outcome is CopyOutcome.PROVED:
            self.state.copy_measures.proved(self.state.clock() - (t.landed_s or self.state.clock()))
            self._done(t, loads.warmups)
            return None
        total = sum(t.proof.values())
        if outcome is CopyOutcome.COMPUTED:
            why = (
                f"not a copy: the target computed the prefix itself (device {t.proof['device']}, host "
                f"{t.proof['host']}, storage {t.proof['storage']} of {covered} tokens)"
            )
            return why, outcome
        clipped = 0 < t.proof["storage"] < covered and t.proof["device"] + t.proof["host"] == 0
        self._event(
            "proof_short",
            t,
            storage_tokens=t.proof["storage"],
            device_tokens=t.proof["device"],
            host_tokens=t.proof["host"],
            covered_tokens=covered,
            warmup_s=warm_s,
            clipped_to_host_tier=clipped,
        )
        why = (
            f"proof short: the warm-up reused {total} of the prefix's {covered} tokens "
            f"(storage {t.proof['storage']}, device {t.proof['device']}, host {t.proof['host']})"
        )
        if clipped:
            why += (
                "; a partial storage hit may be a whole L3 hit clipped to the host tier's capacity (newer SGLang): "
                "size --hicache-size to hold the whole prefix"
            )
        return why, outcome


__all__ = [
    "AgentCallError",
    "CALL_TIMEOUT_S",
    "L3Replicator",
    "POLL_S",
    "SOURCE_GRACE_S",
    "SourceLost",
    "classify_proof",
]
