"""The gateway's wiring: :class:`Gateway` builds the pieces, swaps the policy and the constants, and runs the
lifecycle; :func:`serve_gateway` / :func:`run_gateway` start one.

The pieces, each in its own module and none of them aware of the gateway (they take callbacks and protocols):

* :mod:`~btbctl.engine.gateway.state`: the fleet state (workers, holdings, copies, chains, TTFT), the policies' view;
* :mod:`~btbctl.engine.gateway.dataplane`: the data plane (routes, forwarding, retries, TTFT), asking a
  :class:`~btbctl.engine.gateway.dataplane.Router` (the gateway) where each request goes;
* :mod:`~btbctl.engine.gateway.replicator`: the executor of copy plans over the workers' ``/btb/push``;
* :mod:`~btbctl.engine.gateway.health`: the health prober, reporting through callbacks;
* :mod:`~btbctl.engine.gateway.sglang_metrics`: the workers' own numbers from their Prometheus ``/metrics``;
* :mod:`~btbctl.engine.gateway.reports`: the control API's answers (schema models) built from the state;
* :mod:`~btbctl.engine.gateway.control_api`: the control API's handlers, writing through
  :class:`~btbctl.engine.gateway.control_api.Steering` (the gateway);
* :mod:`~btbctl.engine.gateway.events`: the event bus behind ``GET /control/events``.

Start it in-process with ``gw = await serve_gateway(config)`` (returns once both listeners accept connections;
``gw.data_url`` and ``gw.control_url`` say where) and stop it with ``await gw.stop()``; or block with
``run_gateway(config)`` until SIGINT/SIGTERM.

Startup: every worker is probed once (``/health``, ``/btb/info``, ``/v1/loads``) before listening, so the first
request already sees which workers are up; the page size is taken from the workers' ``/btb/info`` unless
configured; then the health prober checks every worker every ``health_interval_s``, and every
``metrics_interval_s`` the scraper reads each healthy worker's ``/metrics`` (never a reason to mark it down).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import random
import secrets
import signal
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from btbctl.engine import aiotasks
from btbctl.engine.compiled import core_build
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.schema import TTFT_RECENT_WINDOW_S
from btbctl.engine.control.tuned import save_tuned
from btbctl.engine.copies import CopyState
from btbctl.engine.detector import BurstDetector, DeclaredBursts, tracked_key
from btbctl.engine.errors import ConfigError
from btbctl.engine.fileio import read_text_bounded
from btbctl.engine.gateway.config import GatewayConfig
from btbctl.engine.gateway.control_api import build_control_app, build_register_app
from btbctl.engine.gateway.dataplane import DATA_ROUTES, WORKER_HEADER, DataLimits, DataPlane, build_data_app
from btbctl.engine.gateway.events import EventBus
from btbctl.engine.gateway.fleetshare import FleetShare
from btbctl.engine.gateway.guard import (
    ConnectionGuard,
    RateLimiter,
    fd_budget,
    host_guard,
    install_accept_error_limiter,
    listen_http,
    nofile_target,
    raise_nofile,
)
from btbctl.engine.gateway.health import HealthProber
from btbctl.engine.gateway.httpserver import HttpRequest, HttpServer
from btbctl.engine.gateway.kv_events import HoldingsFeed, KvEventsSubscriber, chain_keyer, l3_keyer
from btbctl.engine.gateway.l3 import L3Replicator
from btbctl.engine.gateway.lifecycle import PromptLimits, RequestLifecycle
from btbctl.engine.gateway.metrics import GatewayMetrics, worker_label
from btbctl.engine.gateway.prompt import PromptError, PromptTooLong
from btbctl.engine.gateway.replicator import (
    CopyExecutor,
    PrewarmOutcome,
    ReplicateError,
    ReplicateOutcome,
    Replicator,
)
from btbctl.engine.gateway.reports import EVENT_TOP_PREFIXES, EVENT_TRANSFERS, Reports
from btbctl.engine.gateway.sglang_metrics import MetricsScraper
from btbctl.engine.gateway.state import Clock, FleetState, Transfer, WorkerState
from btbctl.engine.gateway.tokens import L3Prompts
from btbctl.engine.gateway.upstream import UpstreamPool
from btbctl.engine.httpclient import client_session
from btbctl.engine.logfmt import log_event
from btbctl.engine.netaddr import is_loopback, local_url
from btbctl.engine.policies import live_policy_error, make_policy
from btbctl.engine.policies.base import Policy
from btbctl.engine.replication.auth import bearer_ok

log = logging.getLogger(__name__)

#: Page size when neither the config nor any worker's ``/btb/info`` gives one: BTB's 256-token block
#: (REFERENCE.md s1).
DEFAULT_PAGE_SIZE = 256
#: Least descriptor limit (``RLIMIT_NOFILE`` as the gateway raises it) with which it runs on uvloop; below it, on
#: asyncio's own loop (see :func:`run_gateway`). A product choice: running out of 16,384 descriptors takes about
#: 10,000 simultaneous client connections; the limits where that happens in the field are the low ones (1,024).
UVLOOP_MIN_NOFILE = 1 << 14
#: Seconds between checks for registered node agents whose announcement ran out (a drop comes at most this late).
AGENT_EXPIRY_CHECK_S = 1.0


def load_token(config: GatewayConfig) -> str:
    """The control API's bearer token: ``config.token``; else the content of ``config.token_file`` (created with
    mode 0600 and a fresh 32-byte random token when missing); else a fresh random token kept in memory.

    Raises:
        ConfigError: the token file exists but is empty or unreadable.
    """
    if config.token:
        return config.token
    if config.token_file:
        return _read_or_create_token(config.token_file, "token_file")
    return secrets.token_urlsafe(32)


def _read_or_create_token(path: str, key: str) -> str:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            tok = read_text_bounded(path).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(key, f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
        if not tok:
            raise ConfigError(key, f"{path} is empty") from None
        return tok
    except OSError as e:
        raise ConfigError(key, f"cannot create {path}: {e.strerror}") from None
    tok = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(tok + "\n")
    return tok


class Gateway:
    """A running gateway (build with :func:`serve_gateway`).

    Attributes:
        config: the settings.
        clock: seconds since start (``now_s`` of every component); default a monotonic :class:`Clock` (a
            benchmark or a test moves its own).
        state: live :class:`~btbctl.engine.gateway.state.FleetState` (also the policies' view).
        policy: the routing policy in use (swap with :meth:`set_policy`).
        constants: BTB's four constants in force (change with :meth:`set_constants`).
        detector: the burst detector, shared with BTB-style policies and kept across policy swaps.
        replicator: runs the copies (the policies' plans and the control API's manual ones).
        prober: the workers' health checks.
        reports: the control API's answers.
        metrics: Prometheus metrics.
        bus: the control API's event bus.
        token: the control API's bearer token.
        page_size: tokens per block of the chains.
        data_url / control_url: ``http://host:port`` of the listeners (after start).
    """

    def __init__(self, config: GatewayConfig, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.clock = clock or Clock()
        self.state = FleetState(config.workers, self.clock, config.worker_names)
        constants = config.constants
        self.detector = BurstDetector(constants)
        self.detector.on_fire = self._detector_fired
        #: the per-client bound on declared bursts (``X-BTB-Expected-Requests``)
        self.declared = DeclaredBursts(config.declared_requests_max)
        #: seed of the policies' random source: the configured one, else fresh for this process
        self.seed: int = config.seed if config.seed is not None else secrets.randbits(63)
        self.rng = random.Random(self.seed)
        first_policy = make_policy(config.policy, len(config.workers), self.rng, constants)
        self.page_size = config.page_size or DEFAULT_PAGE_SIZE
        self._page_size_fixed = config.page_size is not None
        self.token = load_token(config)
        wt = config.worker_token
        if wt is None and config.worker_token_file:
            wt = _read_or_create_token(config.worker_token_file, "worker_token_file")
        self.worker_token = wt
        self.metrics = GatewayMetrics(lambda: self.detector.stats()["fires"], live=self)
        self.bus = EventBus(max_subscribers=config.max_event_subscribers, clock=self.clock)
        self.dataplane: DataPlane | None = None
        self.guards: list[ConnectionGuard] = []
        self.limiter = RateLimiter()
        self._restore_loop_handler: Callable[[], None] | None = None
        self.reports = Reports(self)
        self._session: aiohttp.ClientSession | None = None
        self._upstream: UpstreamPool | None = None
        self.replication_mode = config.replication
        #: l3: the prompts' token ids and SGLang page keys (None in the other modes)
        self.l3_prompts: L3Prompts | None = None
        #: l3: the agents' fleet secret (``agent_secret_file``), which registrations are checked against
        self._agent_secret: bytes | None = None
        self._expiry_task: asyncio.Task | None = None
        #: Unix time, for the freshness of agent registrations (injectable in tests)
        self.wall_clock: Callable[[], float] = time.time
        #: the executor of copy plans, by replication mode (:data:`EXECUTORS`)
        self.replicator: CopyExecutor = EXECUTORS[config.replication](self, config)
        self.state.copy_capable = self.replicator.accepts_copies
        self.state.copy_after = self.replicator.after_s
        self.replicator.prefix_blocks = lambda: self.constants.prefix_blocks
        self.replicator.block_tokens = lambda: self.page_size
        self.state.progress_window_s = config.progress_window()
        self._fallback = False  # routing to workers that are not healthy but answering (none is healthy)
        #: the request path: admission, routing, copy orders, accounting (:mod:`~btbctl.engine.gateway.lifecycle`)
        self.lifecycle = RequestLifecycle(
            state=self.state,
            detector=self.detector,
            executor=self.replicator,
            metrics=self.metrics,
            constants=constants,
            rng=self.rng,
            declared=self.declared,
            limits=PromptLimits(config.max_prompt_tokens, config.max_chain_blocks, config.offload_bytes),
            clock=self.clock,
            mark=self.bus.mark,
            page_size=lambda: self.page_size,
            on_fallback=self._falling_back,
            reroute_on_unhealthy=config.reroute_on_unhealthy,
            l3_prompts=self.l3_prompts,
            policy=first_policy,
        )
        self.prober = HealthProber(
            self.state.workers,
            lambda: self.session,
            self.clock,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            unhealthy_after=config.unhealthy_after,
            # a worker removed from and added back to the routing: the request lifecycle's
            on_down=self.lifecycle.worker_down,
            on_info=self._worker_info,
            on_up=self.lifecycle.worker_up,
            on_loads=self._worker_loads,
            on_degraded=self.lifecycle.worker_degraded,
            progress_window_s=config.progress_window(),
        )
        self.scraper = MetricsScraper(
            self.state.workers,
            lambda: self.session,
            self.clock,
            interval_s=config.metrics_interval_s,
            timeout_s=config.health_timeout_s,
            on_change=lambda _w: self.bus.mark("fleet"),
        )
        #: the KV event subscribers, one per worker with ``kv_events`` (:mod:`btbctl.engine.gateway.kv_events`)
        self.kv_subscribers: list[KvEventsSubscriber] = []
        self._runners: list[web.AppRunner | HttpServer] = []
        self.data_url = ""
        self.control_url = ""
        #: the registration-only listener's URLs (``register_hosts``; empty without)
        self.register_urls: list[str] = []
        self._stopped = False
        self._fleet_tasks: set[asyncio.Task] = set()

    def _push_executor(self, config: GatewayConfig) -> CopyExecutor:
        """Replication modes ``push`` (the workers' ``/btb`` routes) and ``none`` (the same executor, refusing every
        copy)."""
        rep = Replicator(
            self.state,
            lambda: self.session,
            worker_token=self.worker_token,
            poll_interval_s=config.poll_interval_s,
            source_wait_s=config.source_wait_s,
            copy_timeout_s=config.copy_timeout_s,
            on_change=self._transfer_changed,
            on_finish=self._transfer_finished,
        )
        rep.enabled = config.replication != "none"
        return rep

    def _l3_executor(self, config: GatewayConfig) -> CopyExecutor:
        """Replication mode ``l3``: prompts become SGLang's page keys (:mod:`~btbctl.engine.gateway.tokens`) and
        copies go through the node agents with a warm-up proof (:mod:`~btbctl.engine.gateway.l3`)."""
        token = config.agent_token
        tokens = None
        if token is None and config.agent_token_file:
            token = _read_or_create_token(config.agent_token_file, "agent_token_file")
        if config.agent_secret_file:
            from btbctl.engine.replication.credentials import control_token

            try:
                secret = read_text_bounded(config.agent_secret_file).strip().encode()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(
                    "agent_secret_file", f"cannot read {config.agent_secret_file}: {getattr(e, 'strerror', None) or e}"
                ) from None
            self._agent_secret = secret
            if token is None:
                tokens = {a.name: control_token(secret, a.name) for a in config.agents}
        self.l3_prompts = L3Prompts(lambda: self.session, self.state, config.tokenize_timeout_s)
        return L3Replicator(
            self.state,
            lambda: self.session,
            agents=[a.model_dump() for a in config.agents],
            worker_agents=config.worker_agents,
            agent_token=token,
            agent_tokens=tokens,
            prefix_tokens=self.l3_prompts.prefixes,
            page_size=lambda: self.page_size,
            fanout=config.l3_fanout,
            source_wait_s=config.l3_source_wait_s,
            copy_timeout_s=config.copy_timeout_s,
            warmup_timeout_s=config.l3_warmup_timeout_s,
            exclude_s=config.l3_exclude_s,
            max_copies=config.l3_max_copies,
            max_copies_per_agent=config.l3_max_copies_per_agent,
            on_change=self._transfer_changed,
            on_finish=self._transfer_finished,
        )

    # -- what the pieces read -----------------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        """The shared upstream HTTP session (open between :meth:`start` and :meth:`stop`)."""
        assert self._session is not None, "gateway not started"
        return self._session

    @property
    def upstream(self) -> UpstreamPool:
        """The data plane's connections to the workers (open between :meth:`start` and :meth:`stop`)."""
        assert self._upstream is not None, "gateway not started"
        return self._upstream

    @property
    def policy_name(self) -> str:
        return self.policy.name

    @property
    def worker_agent_names(self) -> list[str | None] | None:
        """l3: the node agent of each worker (by name; None: it has none now); None in other modes."""
        rep = self.replicator
        return rep.agent_names() if isinstance(rep, L3Replicator) else None

    def registered_agents(self) -> dict:
        """``GET /control/agents``: ``{"agents": [...]}`` (:meth:`L3Replicator.agent_views`; empty unless l3)."""
        rep = self.replicator
        return {"agents": rep.agent_views() if isinstance(rep, L3Replicator) else []}

    def register_agent(self, body: bytes, signature: str | None) -> dict:
        """Take a node agent's announcement (``POST /control/agents``,
        :mod:`~btbctl.engine.replication.registration`): verified against the fleet secret, its worker URLs matched
        to this gateway's workers, recorded by the l3 executor. Returns ``{"agent", "workers": [names],
        "unknown_workers": [urls], "pinned_workers": [urls], "ttl_s", "changed"}``.

        Raises:
            AnnouncementError: 404 when this gateway takes no registrations (not l3, or no ``agent_secret_file``),
                else as :func:`~btbctl.engine.replication.registration.verify`.
        """
        from btbctl.engine.replication.credentials import control_token
        from btbctl.engine.replication.registration import AnnouncementError, verify

        rep = self.replicator
        if not isinstance(rep, L3Replicator) or self._agent_secret is None:
            raise AnnouncementError(
                "this gateway takes no agent registrations (replication l3 with agent_secret_file)", 404
            )
        ann = verify(body, signature, self._agent_secret, self.wall_clock())
        by_url = self.state.index_of_url
        mine = [by_url[u] for u in ann.workers if u in by_url and not rep.pinned(by_url[u], ann.agent)]
        pinned = [u for u in ann.workers if u in by_url and rep.pinned(by_url[u], ann.agent)]
        unknown = [u for u in ann.workers if u not in by_url]
        if rep.token is None:
            rep.tokens[ann.agent] = control_token(self._agent_secret, ann.agent)
        changed = rep.register(
            ann.agent,
            ann.control_url,
            ann.peer_addr,
            mine,
            ann.ttl_s,
            instance=ann.instance,
            node=ann.node,
            unknown_workers=",".join(unknown) or None,
            pinned_workers=",".join(pinned) or None,
        )
        if changed:
            self.bus.mark("fleet")
        return {
            "agent": ann.agent,
            "workers": [self.state.workers[r].name for r in mine],
            "unknown_workers": unknown,
            "pinned_workers": pinned,
            "ttl_s": ann.ttl_s,
            "changed": changed,
        }

    async def _expire_agents(self) -> None:
        """Drop registered agents whose announcement ran out: at the next one's expiry, and at least every
        :data:`AGENT_EXPIRY_CHECK_S`."""
        rep = self.replicator
        assert isinstance(rep, L3Replicator)
        while True:
            due = rep.next_expiry()
            wait = AGENT_EXPIRY_CHECK_S if due is None else due - self.clock()
            await asyncio.sleep(min(AGENT_EXPIRY_CHECK_S, max(0.01, wait)))
            if rep.expire():
                self.bus.mark("fleet")

    def token_ok(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the bearer token (constant-time comparison; nothing counted:
        the control listener's connection budget asks this of every request)."""
        return bearer_ok(header, self.token)

    def check_token(self, header: str | None) -> bool:
        """:meth:`token_ok`, counting a refusal in ``btb_rejected_requests{reason="auth"}``."""
        ok = self.token_ok(header)
        if not ok:
            self.metrics.reject(401, "auth")  # a control request without the right token
        return ok

    # -- policy and constants -----------------------------------------------------------------------------------

    def save_tuned(self) -> str | None:
        """Record the constants and policy held now in ``config.tuned_file`` (atomically); return its path, or
        None when the gateway records nothing. Raises OSError when the file cannot be written (a full disk). The
        control API calls it once a write is confirmed, so the change also goes to the fleet's other gateways
        (``redis_url``)."""
        self._share_tune()
        path = self.config.tuned_file
        if path is None:
            return None
        save_tuned(path, self.constants.as_dict(), self.policy.name, self.config.cluster_file)
        return path

    @property
    def policy(self) -> Policy:
        """The routing policy in use (the request lifecycle's; swap it with :meth:`set_policy`)."""
        return self.lifecycle.policy

    @property
    def constants(self) -> BtbConstants:
        """BTB's four constants in force (the request lifecycle's; change them with :meth:`set_constants`)."""
        return self.lifecycle.constants

    @property
    def fleet(self) -> FleetShare | None:
        """The fleet's shared detection, copy orders and tuning (``redis_url``; None: this gateway alone); the
        request lifecycle's, which notes arrivals in it."""
        return self.lifecycle.fleet

    def _install_policy(self, new: Policy, old: Policy | None) -> None:
        """Route with ``new`` from the next request (:meth:`RequestLifecycle.install_policy`, under this gateway's
        bounds of a cache-aware tree)."""
        cfg = self.config
        self.lifecycle.install_policy(new, old, cfg.cache_tree_max_blocks, cfg.cache_tree_max_bytes)

    def set_policy(self, name: str) -> None:
        """Swap the routing policy now (next request). The detector, the holding record, loads and transfers are
        gateway state and stay; a cache-aware prefix tree moves to the new policy when both have one.

        Raises:
            ConfigError: unknown name (key ``policy``; the message lists the valid ones).
        """
        if name == self.policy.name:
            return
        new = make_policy(name, self.state.n_replicas, self.rng, self.constants)
        self._install_policy(new, self.policy)
        self.bus.mark("constants")

    def set_constants(self, updates: dict) -> BtbConstants:
        """Apply a partial update of the four constants live (next request).

        Raises:
            ConfigError: unknown key or invalid value (the key is named).
        """
        new = self.constants.with_updates(**updates)
        self.lifecycle.constants = new
        self.policy.set_constants(new)
        self.detector.set_constants(new)  # no-op when the policy already retuned it
        self.bus.mark("constants")
        self.bus.mark("prefixes")
        return new

    # -- routing ------------------------------------------------------------------------------------------------

    def _falling_back(self, on: bool) -> None:
        """Routing falls back to workers that are not healthy but answering (``on``), or no longer: one line per
        change."""
        if on != self._fallback:
            self._fallback = on
            if on:
                alive = [w.name for w in self.state.workers if self.state.alive(w)]
                log_event(log, "routing_fallback", logging.WARNING, healthy=0, answering=",".join(alive) or "none")
            else:
                log_event(log, "routing_fallback_end", healthy=sum(w.healthy for w in self.state.workers))

    async def replicate(self, chain: tuple, n: int) -> ReplicateOutcome:
        """Copy ``chain`` to ``n`` more workers now (the control API's manual replicate; see
        :meth:`~btbctl.engine.gateway.replicator.Replicator.replicate`)."""
        return await self.replicator.replicate(chain, n)

    async def prewarm(self, route: str, obj: dict, n: int) -> PrewarmOutcome:
        """Keep a prompt warm before its burst: one worker computes it (``obj``, a data-plane request body for
        ``route`` asking for one new token, sent through this gateway's own data plane, so the policy routes it and
        the gateway records who holds it), then its whole blocks are copied to ``n`` more workers as
        :meth:`replicate` does.

        Raises:
            ReplicateError: 400/413 a malformed or too long prompt, or one shorter than a block; 502 the computing
                request failed; as :meth:`replicate` for the copies (409).
        """
        dp = self.dataplane
        if dp is None:
            raise ReplicateError(503, "the gateway is not serving yet")
        body = json.dumps(obj).encode()
        try:
            _, chain, n_tokens = await self.lifecycle.prompt_chain(route, body)
        except PromptTooLong as e:
            raise ReplicateError(413, f"prompt: {e}") from None
        except PromptError as e:
            raise ReplicateError(400, f"prompt: {e}") from None
        if not chain:
            raise ReplicateError(
                400, f"prompt: {n_tokens} tokens, shorter than one block of {self.page_size}: nothing to keep warm"
            )
        path = DATA_ROUTES[route]
        log_event(log, "prewarm_compute", prefix=chain[-1], blocks=len(chain), tokens=n_tokens, route=path, n=n)
        try:
            async with self.session.post(
                local_url(self.data_url) + path, data=body, headers={"Content-Type": "application/json"}
            ) as resp:
                status, text = resp.status, (await resp.text())[:300]
                worker = resp.headers.get(WORKER_HEADER)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise ReplicateError(502, f"computing the prompt failed: {type(e).__name__}: {e}") from None
        if status != 200:  # a worker's 4xx is the prompt's fault (e.g. token ids out of its vocabulary): the caller's
            code = 400 if 400 <= status < 500 and status not in (408, 429) else 502
            raise ReplicateError(code, f"computing the prompt failed: HTTP {status}: {' '.join(text.split())}")
        computed_by = self.state.index_of_url.get(worker or "", -1)
        outcome = await self.replicate(tuple(chain), n)
        key = tracked_key(chain, self.constants.prefix_blocks)
        hot = None if key is None else str(key)
        return PrewarmOutcome(outcome, computed_by, n_tokens, len(chain), hot)

    async def flush(self) -> dict[str, str]:
        """Empty every worker's cache (``POST /flush_cache``, SGLang's route) and forget what the gateway recorded
        about the flushed ones; start a fresh policy (its prefix tree) and detector, so the next bench starts cold.
        Returns ``{worker name: "flushed" or why not}``."""
        headers = {"Authorization": f"Bearer {self.worker_token}"} if self.worker_token else {}
        out: dict[str, str] = {}
        for w in self.state.workers:
            try:
                async with self.session.post(
                    f"{w.url}/flush_cache", headers=headers, timeout=aiohttp.ClientTimeout(total=30)
                ) as resp:
                    text = (await resp.text())[:200].strip()
                    out[w.name] = "flushed" if resp.status == 200 else f"HTTP {resp.status}: {text}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                out[w.name] = f"{type(e).__name__}: {e}".splitlines()[0]
            if out[w.name] == "flushed":
                w.forget()
            log_event(log, "worker_flush", worker=w.name, url=w.url, result=out[w.name])
        self.detector.reset()
        self._install_policy(make_policy(self.policy.name, self.state.n_replicas, self.rng, self.constants), None)
        self.bus.mark("prefixes")
        self.bus.mark("fleet")
        return out

    # -- worker health (the prober's callbacks) -----------------------------------------------------------------

    def _worker_info(self, w: WorkerState, info: dict | None) -> None:
        if info is None:  # no /btb routes: a plain SGLang server
            w.btb = False
            w.info = None
            if self.l3_prompts is not None:
                self.l3_prompts.worker_info()
            return
        w.info = info
        w.btb = True
        self.state.reset_cost()  # the replica cost model may now come from this worker's presets
        if self.l3_prompts is not None:
            self.l3_prompts.worker_info()
        self._check_page_size(w)

    def _check_page_size(self, w: WorkerState) -> None:
        """Size ``w``'s holding record from its capacity; once the page size is settled, refuse replication with
        a worker whose page size differs (its block hashes would not match the gateway's)."""
        info = w.info or {}
        ps = info.get("page_size")
        if self._page_size_fixed and w.btb and isinstance(ps, int) and ps != self.page_size:
            w.btb = False
            w.info = dict(
                info, note=f"page_size {ps} differs from the gateway's {self.page_size}; no replication to or from it"
            )
        cap = info.get("capacity_tokens")
        if isinstance(cap, int) and cap > 0:
            w.capacity_blocks = max(1, cap // self.page_size)

    def _heat_in_window(self, now_s: float) -> bool:
        """Whether a tracked prefix has arrivals in the detector's window at ``now_s`` (its heat decays with time
        alone: the event stream sends ``prefixes`` while this holds, and once after)."""
        last = self.detector.last_arrival_s()
        return last is not None and last > now_s - self.detector.constants.window_s

    def _ttft_in_window(self, now_s: float) -> bool:
        """Whether a first byte was measured in the trailing :data:`TTFT_RECENT_WINDOW_S` (the ``ttft`` event's
        window summary changes with time alone while it holds)."""
        samples = self.state.ttft.samples  # the newest is the last: the window holds one when it holds that one
        return bool(samples) and samples[-1][0] > now_s - TTFT_RECENT_WINDOW_S

    def _detector_fired(self, det) -> None:
        """The burst detector made a prefix hot: one line with its id, the arrivals in the window and the window."""
        from btbctl.engine.chains import prefix_id, short_id

        c = self.constants
        log_event(
            log,
            "detector_fired",
            prefix=short_id(prefix_id(det.key)),
            count=det.arrivals_in_window,
            threshold=c.threshold,
            window_s=c.window_s,
            prefix_blocks=c.prefix_blocks,
            policy=self.policy.name,
        )

    def _log_response(self, request: HttpRequest, status: int) -> None:
        """Data plane: one line per answer with a 4xx or 5xx status (successes are counted by the metrics only);
        identical lines are held back and counted by the log's repeat filter."""
        if status >= 400:
            log_event(
                log,
                "request_error",
                logging.WARNING if status >= 500 else logging.INFO,
                status=status,
                method=request.method,
                path=request.path,
                peer=request.remote,
            )

    def _worker_loads(self, w: WorkerState, loads: dict | None) -> None:
        w.new_loads(loads)
        self.bus.mark("fleet")

    # -- transfers (the replicator's callbacks) -----------------------------------------------------------------

    def _transfer_changed(self, t: Transfer) -> None:
        self.bus.mark("transfers")

    def _transfer_finished(self, t: Transfer) -> None:
        self.metrics.replications.labels(t.state.value).inc()
        if t.state is CopyState.DONE:
            self.metrics.replicated_bytes.inc(t.bytes_sent)
        end = t.finished_s if t.finished_s is not None else self.clock()
        self.metrics.observe_copy(t.mode, t.state.value, end - t.created_s, t.bytes_sent)
        if t.usable_s is not None:
            self.metrics.usable.labels(t.mode).observe(t.usable_s)
        if t.mode == "l3":
            self.metrics.proofs.labels(t.outcome or "failed").inc()
            for phase, secs in t.phases().items():
                if secs is not None:
                    self.metrics.copy_phase.labels(phase).observe(secs)
            if t.state is CopyState.DONE and t.proof_storage_tokens:
                self.metrics.proof_storage_tokens.inc(t.proof_storage_tokens)
        self.bus.mark("prefixes")
        self.bus.mark("fleet")

    # -- the fleet's other gateways (redis_url) ------------------------------------------------------------------

    def _join_fleet(self, url: str) -> None:
        """Share detection, copy orders and tuning with the other gateways on ``url`` (connects in the background)."""
        cfg = self.config
        fleet = self.lifecycle.fleet = FleetShare(
            url,
            cfg.redis_prefix,
            on_arrivals=lambda key, n: self.detector.fold(key, self.clock(), n),
            on_copy_done=self._fleet_copy_done,
            on_tune=self._fleet_tuned,
            on_copy_started=self._fleet_copy_started,
            claim_ttl_s=cfg.source_wait_s + cfg.copy_timeout_s + 60.0,
        )
        self.replicator.orders = fleet
        self.replicator.order_wait_s = cfg.source_wait_s + cfg.copy_timeout_s
        fleet.start()

    def _fleet_copy_done(self, chain: tuple, target_url: str, gateway_id: str) -> None:
        """Another gateway's copy of ``chain`` to ``target_url`` ended done: the target holds it from now on."""
        idx = self.state.index_of_url.get(target_url)
        if idx is None or not chain:
            return
        w = self.state.workers[idx]
        w.hold(chain)
        log_event(log, "fleet_copy_learned", prefix=chain[-1], target=w.name, target_url=w.url, gateway=gateway_id)
        self.bus.mark("prefixes")
        self.bus.mark("fleet")

    def _fleet_copy_started(self, chain: tuple, source_url: str, target_url: str, gateway_id: str) -> None:
        """Another gateway runs a copy of ``chain`` to ``target_url``: record it here as in flight (its outcome is
        awaited, never run twice), so this gateway's policy counts it as arriving and orders no other."""
        by_url = self.state.index_of_url
        source, target = by_url.get(source_url), by_url.get(target_url)
        if source is None or target is None or not chain:
            return
        self.replicator.request_copy(chain, source, target, source_confirmed=True, ordered_by=gateway_id)

    def _fleet_tuned(self, constants: dict, policy: str, gateway_id: str) -> None:
        """Another gateway was tuned: take its constants and policy (recorded in ``tuned_file`` too, not shared
        again); one line with the old and new values."""
        old, old_policy = self.constants.as_dict(), self.policy.name
        try:
            new = self.constants.with_updates(**constants).as_dict()
            why = live_policy_error(policy) if policy != old_policy else None
            if why is not None:
                raise ValueError(f"policy: {why}")
        except (ConfigError, ValueError, TypeError) as e:
            log_event(log, "fleet_tune_refused", logging.WARNING, gateway=gateway_id, reason=str(e))
            return
        changed = {k: (old[k], new[k]) for k in new if new[k] != old.get(k)}
        if policy != old_policy:
            changed["policy"] = (old_policy, policy)
        if not changed:
            return
        self.set_constants(constants)
        self.set_policy(policy)
        if self.config.tuned_file:
            try:
                save_tuned(self.config.tuned_file, self.constants.as_dict(), self.policy.name, self.config.cluster_file)
            except OSError as e:
                log_event(log, "fleet_tune_unsaved", logging.WARNING, reason=e.strerror or str(e))
        log_event(
            log,
            "fleet_tuned",
            gateway=gateway_id,
            keys=",".join(changed),
            old=",".join(f"{k}={v[0]}" for k, v in changed.items()),
            new=",".join(f"{k}={v[1]}" for k, v in changed.items()),
        )

    def _share_tune(self) -> None:
        """Send the constants and policy held now to the fleet's other gateways (in the background)."""
        if self.fleet is None:
            return
        task = asyncio.get_running_loop().create_task(
            self.fleet.publish_tune(self.constants.as_dict(), self.policy.name)
        )
        self._fleet_tasks.add(task)
        task.add_done_callback(self._fleet_tasks.discard)

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def _settle_page_size(self) -> None:
        """Take the page size from the first worker's ``/btb/info`` that gives one (unless configured); from then
        on it is fixed and workers that differ get no copies."""
        if not self._page_size_fixed:
            sizes = [w.info.get("page_size") for w in self.state.workers if w.info]
            sizes = [s for s in sizes if isinstance(s, int) and s >= 1]
            self._page_size_fixed = True
            if sizes:
                self.page_size = sizes[0]
                for w in self.state.workers:
                    self._check_page_size(w)
        self.state.page_size = self.page_size

    async def start(self) -> None:
        """Probe the workers, settle the page size and the policy, start the health checker and both listeners.

        Raises:
            ConfigError: a listen address/port that cannot be bound (key ``port`` or ``control_port``).
        """
        cfg = self.config
        old_nofile, nofile = raise_nofile()
        auto_inflight, auto_conns = fd_budget(nofile, cfg.fd_reserve)
        max_inflight = cfg.max_inflight or auto_inflight
        max_conns = cfg.max_client_connections or auto_conns
        log_event(
            log,
            "gateway_limits",
            nofile_before=old_nofile,
            nofile=nofile,
            fd_reserve=cfg.fd_reserve,
            max_inflight=max_inflight,
            max_client_connections=max_conns,
            control_max_connections=cfg.control_max_connections,
        )
        self._restore_loop_handler = install_accept_error_limiter(asyncio.get_running_loop(), self.limiter)
        # upstream sockets: the data plane's pool holds one per request in flight; the session (health probes,
        # tokenization, copies) as before, one per request in flight plus room in the reserve. A request holds
        # one of them at a time; idle ones close after keepalive_timeout_s.
        self._upstream = UpstreamPool(
            limit=min(cfg.max_connections, max_inflight),
            keepalive_timeout_s=cfg.keepalive_timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            total_timeout_s=cfg.upstream_timeout_s,
        )
        connector = aiohttp.TCPConnector(
            limit=min(cfg.max_connections, max_inflight + cfg.fd_reserve // 2),
            limit_per_host=0,
            keepalive_timeout=cfg.keepalive_timeout_s,
            ttl_dns_cache=300,
        )
        self._session = client_session(
            connector=connector,
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=cfg.upstream_timeout_s, sock_connect=cfg.connect_timeout_s),
        )
        await self.prober.probe_all()
        self._settle_page_size()
        self._install_policy(self.policy, None)
        for w in self.state.workers:
            self.metrics.worker_mode.labels(worker_label(w), self.replication_mode).set(1)
        reports = self.reports
        self.bus.register("fleet", reports.fleet)
        self.bus.register("prefixes", lambda: reports.prefixes(EVENT_TOP_PREFIXES))
        self.bus.register("transfers", lambda: reports.transfers(EVENT_TRANSFERS))
        self.bus.register("ttft", reports.ttft_event)
        self.bus.register("constants", reports.constants)
        self.bus.age("prefixes", self._heat_in_window)
        self.bus.age("ttft", self._ttft_in_window)
        self.bus.start()
        self._start_kv_events()
        self.prober.start()
        if isinstance(self.replicator, L3Replicator) and self._agent_secret is not None:
            self._expiry_task = asyncio.create_task(self._expire_agents())
        if cfg.metrics_interval_s > 0:
            self.scraper.start()
        if cfg.redis_url:
            self._join_fleet(cfg.redis_url)
        log_event(
            log,
            "gateway_start",
            policy=self.policy.name,
            seed=self.seed,
            routing_core=core_build(),
            workers=",".join(w.name for w in self.state.workers),
            **self.constants.as_dict(),
        )
        self.dataplane = DataPlane(self, self.lifecycle, DataLimits.from_config(cfg, max_inflight=max_inflight))
        self.lifecycle.on_worker_down = self.dataplane.worker_down
        data_guard = self._guard("data", max_conns)
        control_guard = self._guard(
            "control",
            cfg.control_max_connections,
            authorized=lambda request: self.token_ok(request.headers.get("Authorization")),
            max_per_peer=cfg.control_max_per_peer,
        )
        data = build_data_app(
            self.dataplane, middlewares=[self._host_guard("data", cfg.host)], on_answer=self._log_response
        )
        control = build_control_app(
            reports,
            self,
            self.bus,
            open_reads=is_loopback(cfg.control_host),
            retry_after_s=cfg.retry_after_s,
            middlewares=[self._host_guard("control", cfg.control_host)],
        )
        try:
            self.data_url = await self._listen(data, cfg.host, cfg.port, "port", cfg.access_log, data_guard)
            self.control_url = await self._listen(
                control, cfg.control_host, cfg.control_port, "control_port", False, control_guard
            )
            await self._listen_register(reports)
        except BaseException:
            await self.stop()
            raise

    async def _listen_register(self, reports: Reports) -> None:
        """The registration-only listener on each of ``register_hosts`` (one port for all: ``register_port``, or the
        one the first address got); its URLs are :attr:`register_urls`. Nothing without ``register_hosts``."""
        cfg = self.config
        port = cfg.register_port
        for host in cfg.register_hosts:
            app = build_register_app(reports, self, self.bus, middlewares=[self._host_guard("register", host)])
            guard = self._guard("register", cfg.control_max_connections, max_per_peer=cfg.control_max_per_peer)
            url = await self._listen(app, host, port, "register_port", False, guard)
            port = int(url.rsplit(":", 1)[1])
            self.register_urls.append(url)
        if self.register_urls:
            log_event(log, "register_listen", urls=",".join(self.register_urls))

    def _start_kv_events(self) -> None:
        """Subscribe to the KV events of every worker that has an endpoint (pyzmq and msgspec are imported then)."""
        refs = self.config.kv_events
        if not any(refs):
            return
        keyer = l3_keyer if self.replication_mode == "l3" else chain_keyer
        for w, ref in zip(self.state.workers, refs, strict=True):
            if ref is None:
                continue
            w.routing_holdings = self.config.routing_holdings
            feed = HoldingsFeed(w, keyer, lambda: self.page_size, on_change=lambda: self.bus.mark("fleet"))
            sub = KvEventsSubscriber(feed, ref.endpoint, ref.replay_endpoint, ref.topic)
            sub.start()
            self.kv_subscribers.append(sub)

    def _host_guard(self, name: str, bind_host: str) -> Callable:
        """The listener's :func:`host_guard`; refusals count in ``btb_rejected_requests{reason="host"|"origin"}``."""
        metrics = self.metrics
        return host_guard(name, bind_host, self.limiter, lambda why: metrics.reject(403, why))

    def _guard(
        self,
        name: str,
        cap: int,
        authorized: Callable[[web.Request], bool] | None = None,
        max_per_peer: int | None = None,
    ) -> ConnectionGuard:
        """The guard of listener ``name``: ``cap`` unauthenticated connections; with ``authorized``, connections with
        valid credentials have their own budget of as many (see :mod:`btbctl.engine.netguard`)."""
        closed = self.metrics.connections_closed
        metrics = self.metrics

        def on_reject(reason: str) -> None:
            if reason == "over_cap":
                metrics.reject(503, "over_cap")
            else:
                closed.labels(name, reason).inc()

        guard = ConnectionGuard(
            name,
            max_connections=cap,
            header_timeout_s=self.config.header_timeout_s,
            idle_timeout_s=self.config.header_timeout_s,  # idle keep-alive connections close like half-sent ones
            retry_after_s=self.config.retry_after_s,
            limiter=self.limiter,
            on_reject=on_reject,
            authorized=authorized,
            max_per_peer=max_per_peer,
        )
        self.guards.append(guard)
        return guard

    async def _listen(
        self,
        app: web.Application | HttpServer,
        host: str,
        port: int,
        key: str,
        access_log: bool,
        guard: ConnectionGuard,
    ) -> str:
        try:
            runner, bound = await listen_http(
                app,
                host,
                port,
                guard,
                access_log=logging.getLogger("aiohttp.access") if access_log else None,
            )
        except OSError as e:
            raise ConfigError(key, f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._runners.append(runner)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{bound}"

    async def stop(self) -> None:
        """Stop listening, cancel copy jobs and health checks, close connections. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        log_event(log, "gateway_stop", policy=self.policy.name)
        self.bus.close()
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry_task
        for sub in self.kv_subscribers:
            await sub.stop()
        await self.prober.stop()
        await self.scraper.stop()
        await self.replicator.close()
        if self.fleet is not None:
            await self.fleet.stop()
        await self.bus.stop()
        if self._session is not None:
            await self._session.close()
        if self._upstream is not None:
            await self._upstream.close()
        self.lifecycle.close()
        for guard in self.guards:
            guard.close()
        if self._restore_loop_handler is not None:
            self._restore_loop_handler()
            self._restore_loop_handler = None


# -- entry points -----------------------------------------------------------------------------------------------


#: The executor of each replication mode (``GatewayConfig.replication``): a new mode (NIXL, say) registers its
#: builder here.
EXECUTORS: dict[str, Callable[[Gateway, GatewayConfig], CopyExecutor]] = {
    "none": Gateway._push_executor,
    "push": Gateway._push_executor,
    "l3": Gateway._l3_executor,
}


async def serve_gateway(config: GatewayConfig) -> Gateway:
    """Start a gateway in the running event loop and return it once both listeners accept connections.

    Raises:
        ConfigError: bad token file or a port that cannot be bound.
    """
    gw = Gateway(config)
    await gw.start()
    return gw


#: The gateway process's garbage-collector thresholds (CPython's default: 700, 10, 10). A request allocates a few
#: hundred objects and frees nearly all of them by reference counting, so the default collects every few
#: requests, scanning the requests in flight each time.
GC_THRESHOLDS = (20_000, 20, 20)


def run_gateway(config: GatewayConfig, on_ready: Callable[[Gateway], None] | None = None) -> None:
    """Run a gateway until SIGINT or SIGTERM (blocking). ``on_ready`` is called once it listens."""

    async def main() -> None:
        gw = await serve_gateway(config)
        # What start-up built lives as long as the process: out of the collector's way (gc.freeze), and the
        # young generation collected less often; together they take the collector from about 5 % of the
        # gateway's CPU per request to well under 1 % (benchmarks/bench_router.py's overhead part).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread / platform
                pass
        try:
            if on_ready is not None:
                on_ready(gw)
            await stop.wait()
        finally:
            await gw.stop()

    # uvloop unless descriptors are scarce: out of descriptors, libuv accepts and at once closes the connections
    # waiting in the backlog (clients see resets) where asyncio's loop pauses accepting and leaves them queued
    # until descriptors free up, which the gateway's descriptor guards rely on (see guard.py)
    aiotasks.run(main(), allow_uvloop=nofile_target() >= UVLOOP_MIN_NOFILE)
