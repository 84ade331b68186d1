"""Validated settings of the gateway and its control API (pydantic; one docstring per field)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from btbctl.engine.constants import CACHE_TREE_MAX_BLOCKS, CACHE_TREE_MAX_BYTES, MIN_CACHE_TREE_BYTES, BtbConstants
from btbctl.engine.limits import MAX_PROMPT_TOKENS, MAX_REQUEST_BODY_BYTES


class AgentRef(BaseModel):
    """A node agent the gateway drives in replication mode ``l3``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    """Its name (``agent-local``, ``agent-<host>``), for logs and answers."""
    control_url: str
    """Base URL of its control API (``http://host:port``)."""
    peer_addr: str
    """``host:port`` other agents copy to (what a push names as a target)."""

    @field_validator("control_url")
    @classmethod
    def _url(cls, v: str) -> str:
        p = urlsplit(v)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"agent control URL {v!r} must look like http://host:port")
        return v.rstrip("/")


class KvEventsRef(BaseModel):
    """Where one worker publishes its KV events (SGLang's ``--kv-events-config``; :mod:`btbctl.engine.kvevents`)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str
    """Its PUB address (``tcp://host:port``; a wildcard host means loopback)."""
    replay_endpoint: str | None = None
    """Its replay (ROUTER) address; None: a missed batch means a resync of that worker's holdings."""
    topic: str = ""
    """Topic of its messages ("" : all)."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"KV events address {v!r} must look like tcp://host:port")
        return v


class GatewayConfig(BaseModel):
    """Settings of one gateway process (data plane + control API).

    Build with ``GatewayConfig(workers=[...], ...)`` or :func:`btbctl.engine.config.validate` for one-line
    errors that name the key.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    workers: list[str] = Field(min_length=1)
    """Worker base URLs (``http://host:port``), SGLang servers or emulated workers; their order numbers the
    replicas the policies see."""
    worker_names: list[str] | None = None
    """A name for each worker (in ``workers`` order; ``btbctl up`` passes its process names, ``worker-0`` ...):
    the control API, the TUI, the operations log and the copy answers use it (the URL stays a field of its own).
    None: ``w0``, ``w1``, ..."""
    log_file: str | None = None
    """File the gateway writes its log to (logfmt lines, one per event, rotated at 10 MiB with 5 old files kept;
    ``btbctl up`` passes ``<run dir>/logs/gateway.log``); stderr then carries only warnings and errors. None: all
    on stderr."""
    tuned_file: str | None = None
    """File where every confirmed ``PUT /control/constants`` records the constants and policy the gateway then
    holds (:mod:`btbctl.engine.control.tuned`; ``btbctl up`` passes ``<run dir>/tuned.json`` and reapplies it).
    A write that cannot be recorded is undone (HTTP 507). None: nothing is recorded."""
    cluster_file: str | None = None
    """The cluster file the fleet was started from, written into ``tuned_file`` (``up`` reapplies a record only
    to the same cluster file). None: the embedded default fleet."""
    host: str = "127.0.0.1"
    """Data-plane listen address (loopback by default)."""
    port: int = Field(8000, ge=0, le=65535)
    """Data-plane port (0: any free port; the chosen one is in :attr:`Gateway.data_url`)."""
    control_host: str = "127.0.0.1"
    """Control API listen address (loopback by default; on another address reads need the token too)."""
    control_port: int = Field(8001, ge=0, le=65535)
    """Control API port (0: any free port)."""
    register_hosts: list[str] = Field(default_factory=list)
    """l3: addresses of a registration-only listener (``POST /control/agents`` and nothing else; every announcement
    is signed with the agent's node key, :mod:`~btbctl.engine.replication.registration`), for node agents on other
    machines while the control API stays on loopback (``btbctl up`` sets it for the agents of ``[[hosts]]``). Empty:
    agents register on the control API only."""
    register_port: int = Field(0, ge=0, le=65535)
    """Port of the ``register_hosts`` listener, the same on each address (0: a free port; one address only)."""
    policy: str = "btb_plus"
    """Routing policy name (``btbctl.engine.policies.POLICIES``; default ``btb_plus``, ``btb`` is the published
    rule); changeable at run time."""
    constants: BtbConstants = Field(default_factory=BtbConstants)
    """BTB's four constants at start; changeable at run time through the control API."""
    page_size: int | None = Field(None, ge=1)
    """Tokens per block for chain hashing; None: the workers' ``page_size`` from ``/btb/info`` (first one that
    answers), else 256 (SGLang's ``--page-size`` must match for prefix ids to mean the same on both sides)."""
    token: str | None = None
    """Bearer token that guards control-API writes. None: read ``token_file``."""
    token_file: str | None = None
    """File holding the bearer token; created with mode 0600 and a fresh random token when missing. With neither
    ``token`` nor ``token_file`` a random token lives only in memory (``Gateway.token``)."""
    worker_token: str | None = None
    """Bearer token sent to the workers' ``POST /btb/push`` (None: no header)."""
    worker_token_file: str | None = None
    """File holding ``worker_token`` (read at start when ``worker_token`` is None)."""
    health_interval_s: float = Field(1.0, gt=0)
    """Seconds between ``GET /health`` (and ``/v1/loads``) probes of every worker."""
    health_timeout_s: float = Field(2.0, gt=0)
    """Timeout of one health probe, seconds."""
    metrics_interval_s: float = Field(2.0, ge=0)
    """Seconds between reads of each healthy worker's Prometheus ``/metrics`` (SGLang's KV cache, queue and HiCache
    numbers for the fleet view; ``health_timeout_s`` bounds each read); 0: never read them."""
    unhealthy_after: int = Field(2, ge=1)
    """Consecutive failed health probes that mark a worker unhealthy (a connection error or a 5xx on a forwarded
    request marks it at once). A probe that times out on a worker that showed a sign of life within
    ``progress_window_s`` does not count towards it: the worker is degraded (still routed), not down."""
    progress_window_s: float | None = Field(None, gt=0)
    """How long a worker's latest sign of life keeps it from being marked down by ``/health`` timeouts, seconds: an
    answer or a stream chunk of a forwarded request, or a ``/health`` answer that came after its probe timed out.
    Such a worker is busy, not dead: degraded (logged, shown in ``GET /control/fleet``) and still routed; a refused
    or broken connection or an error answer still counts as a failure at once. None: 2 x (``health_interval_s`` +
    ``health_timeout_s``), so a frozen worker is marked down at most about that much later than an idle one."""
    max_retries: int = Field(2, ge=0)
    """Further workers tried when one fails before any byte went back to the client."""
    retry_budget_percent: float = Field(20.0, ge=0, le=100)
    """Retries in flight at once, as a share of the requests in flight (Envoy's retry budget, its default 20%):
    beyond it (and :attr:`retry_budget_min`) a request that failed on its worker is answered 503 instead of being
    sent to another, so a fleet in trouble does not get every queue again (a retry storm)."""
    retry_budget_min: int = Field(10, ge=1)
    """Retries in flight always allowed, whatever the share (Envoy's ``min_retry_concurrency``; its default is 3,
    10 here so that on a small, lightly loaded fleet the queue of one failing worker moves whole; at least 1, or a
    quiet gateway would never retry)."""
    max_body_bytes: int = Field(MAX_REQUEST_BODY_BYTES, ge=1024)
    """Largest accepted request body, bytes (larger: 413 before anything is parsed). The default is the emulated
    worker's own limit (:mod:`btbctl.engine.limits`, 8 MiB): never larger than what the workers accept, or the
    gateway would hash a prompt that the worker then refuses."""
    max_prompt_tokens: int = Field(MAX_PROMPT_TOKENS, ge=1)
    """Longest prompt, tokens (text counts 4 bytes per token): 413 before the prompt is hashed."""
    max_chain_blocks: int = Field(1 << 16, ge=1)
    """Blocks of a prompt the gateway hashes and tracks, at most (its leading ones): routing, the chain index and
    copies see the first ``max_chain_blocks * page_size`` tokens of longer prompts. Bounds the work per request at
    small page sizes (a 2M-token prompt at SGLang's default page size 1 would otherwise mean 2M hashes, and as many
    entries in the policy's tree and the holding record, on the event loop)."""
    cache_tree_max_blocks: int = Field(CACHE_TREE_MAX_BLOCKS, ge=1)
    """Blocks (nodes) the cache-aware prefix tree of ``cache_aware`` and ``btb`` (its fallback) keeps, all workers
    together; beyond, the least recently used ones go first, across workers (2**18 = 262,144: four times the SGLang
    router's per-worker bound, about 135 MiB of distinct prompts; ``btb_cache_tree_blocks``)."""
    cache_tree_max_bytes: int = Field(CACHE_TREE_MAX_BYTES, ge=MIN_CACHE_TREE_BYTES)
    """Estimated bytes the same tree may hold, all workers together (256 MiB; at least 1 MiB): binds first when
    blocks are recorded for several workers each (``btb_cache_tree_bytes``)."""
    offload_bytes: int = Field(256 * 1024, ge=0)
    """Bodies larger than this are parsed and hashed in a worker thread, not on the event loop, so a big prompt
    never stalls other requests or ``/health`` (0: always; smaller bodies take microseconds, a thread hop costs
    more)."""
    fd_reserve: int = Field(128, ge=16)
    """Descriptors kept for everything but proxied requests (listeners, health probes, copies, the control API,
    log files); the rest of ``RLIMIT_NOFILE`` (raised to its hard limit at start) is split between requests in
    flight and client connections (:mod:`btbctl.engine.gateway.guard`)."""
    max_inflight: int | None = Field(None, ge=1)
    """Data-plane requests in flight at most; beyond: 503 with ``Retry-After`` (counted in
    ``btb_rejected_requests_total``). None: a third of the descriptor budget (each proxied request holds two
    sockets)."""
    max_client_connections: int | None = Field(None, ge=1)
    """Open data-plane client connections at most. At the cap a new connection closes the oldest one not serving
    a request; when all are busy its request gets 503. None: the descriptor budget less ``max_inflight``."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A client connection without a complete request head for this long is closed (fresh, half-sent, or idle
    between keep-alive requests), on both listeners."""
    body_timeout_s: float = Field(60.0, gt=0)
    """Longest time reading one request body may take, seconds (408 beyond)."""
    retry_after_s: int = Field(1, ge=1)
    """``Retry-After`` of the gateway's 503 answers when it is at a limit of its own, seconds."""
    control_max_connections: int = Field(64, ge=1)
    """Open unauthenticated control-API connections at most (same rules as the data plane's cap). A connection whose
    request carries the bearer token leaves this budget for one of its own (as many), so connections without the
    token can never lock the operator out."""
    control_max_per_peer: int = Field(16, ge=1)
    """Open unauthenticated control-API connections of one peer address at most (a new one closes that peer's
    oldest idle one)."""
    max_event_subscribers: int = Field(32, ge=1)
    """Concurrent ``GET /control/events`` streams at most; beyond: 503 with ``Retry-After``."""
    declared_requests_max: int = Field(64, ge=0, le=1_000_000)
    """Extra arrivals one client (its address: the data plane takes no token, which a client could mint anew) may
    declare with the ``X-BTB-Expected-Requests`` header within the detector's trailing window (``window_s``); what is
    asked beyond is not counted (one ``declared_burst_capped`` log line per client and window). 0 turns the header
    off. The default lets a batch client make a prefix hot at once (``threshold`` is 2 by default) but not spray heat
    over many."""
    first_byte_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for a worker's first byte (a stream's first data chunk; a non-streamed answer's head, which
    comes when the whole answer is ready), seconds; beyond, the worker counts as failed and the request is retried
    elsewhere (nothing reached the client yet). Must exceed the longest legitimate prefill plus queueing: 300 s
    covers a 1M-token prefill at ~5k tokens/s; lower it for short prompts to detect a frozen worker sooner (the
    health checks usually do it first, see ``reroute_on_unhealthy``)."""
    idle_timeout_s: float = Field(60.0, gt=0)
    """Longest silence of a worker after its first byte (between stream chunks, or while a non-streamed answer's
    body arrives), seconds; beyond, a stream ends with an SSE error event (it cannot be retried once the client has
    bytes of it). Decode steps take milliseconds, so a minute of silence means a frozen worker."""
    reroute_on_unhealthy: bool = True
    """When a worker is marked unhealthy (health checks, or a failed request) and has shown no sign of life within
    ``progress_window_s`` (a frozen process), its requests that got no first byte yet are retried elsewhere at once
    instead of waiting for ``first_byte_timeout_s``; never answered twice. A worker that is still answering keeps
    them (each fails over on its own connection error)."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout of connecting to a worker, seconds."""
    upstream_timeout_s: float | None = Field(None, gt=0)
    """Total time one forwarded request may take, seconds (None: unbounded; generations can be long)."""
    max_connections: int = Field(4096, ge=1)
    """Pooled connections to all workers together (aiohttp ``TCPConnector(limit=...)``)."""
    keepalive_timeout_s: float = Field(4.0, gt=0)
    """Seconds an idle pooled connection is kept; below uvicorn's default 5 s (SGLang's server), so the gateway
    never reuses a connection the worker is closing."""
    seed: int | None = None
    """Seed of the policies' random source (ties between equally good workers, sampling). None (the default): a
    fresh seed for each gateway process, so restarted or parallel gateways do not break ties in lockstep; set it
    only for a reproducible run (the seed in use is ``Gateway.seed``)."""
    poll_interval_s: float = Field(0.1, gt=0)
    """Seconds between a copy's progress polls (``/btb/copies/{id}``)."""
    source_wait_s: float = Field(60.0, gt=0)
    """Longest wait for a copy source still computing the prefix, seconds."""
    copy_timeout_s: float = Field(300.0, gt=0)
    """Longest time a pushed copy may take, seconds."""
    access_log: bool = False
    """Log every data-plane request on stderr (one line each: peer, request line, status; logger ``aiohttp.access``,
    the name it had when the data plane was an aiohttp app)."""
    replication: Literal["push", "l3", "none"] = "push"
    """How copies are made: ``push`` (the workers' ``/btb/push``), ``l3`` (node agents and warm-up proofs,
    :mod:`btbctl.engine.gateway.l3`) or ``none`` (routing only)."""
    agents: list[AgentRef] = Field(default_factory=list)
    """l3: node agents known from the start (``btbctl up`` writes them). Agents also register themselves
    (``POST /control/agents``, signed with their node key; needs ``agent_secret_file``): a registration names the
    workers it serves and replaces a previous one; one that is not renewed within its ``ttl_s`` is dropped. Empty:
    every agent registers (the Kubernetes render)."""
    worker_agents: list[int] = Field(default_factory=list)
    """l3: for each worker (in ``workers`` order), the index in ``agents`` of its node's agent (empty with no
    ``agents``: registrations say)."""
    agent_token: str | None = Field(None, repr=False)
    """l3: bearer token of the agents' control APIs (None: read ``agent_token_file``)."""
    agent_token_file: str | None = None
    """l3: file holding ``agent_token``."""
    agent_secret_file: str | None = None
    """l3: file holding the agents' fleet secret: registrations are checked against it
    (:mod:`~btbctl.engine.replication.registration`), and, unless ``agent_token`` or ``agent_token_file`` gives one
    token for all (the Kubernetes render's agents share one), each agent's control token is derived from it and the
    agent's name (:func:`~btbctl.engine.replication.credentials.control_token`, as ``btbctl up`` hands them out)."""
    l3_fanout: Literal["chain", "tree", "star"] = "chain"
    """l3: how one copy reaches several agents."""
    l3_source_wait_s: float = Field(30.0, gt=0, le=900)
    """l3: longest a copy waits for the source's agent to hold the prefix (its HiCache write-through trails its
    prefill; the copy streams behind it), seconds."""
    l3_max_copies: int = Field(16, ge=1)
    """l3: most copy jobs in flight in the fleet; beyond, a policy's copy is refused (it may ask again later). Each
    job holds agent calls and pinned pages; a product choice: a burst needs M - 1 copies of one prefix."""
    l3_max_copies_per_agent: int = Field(8, ge=1)
    """l3: most copy jobs in flight from or to one node agent."""
    l3_warmup_timeout_s: float = Field(120.0, gt=0)
    """l3: longest a warm-up request may take, seconds."""
    l3_exclude_s: float = Field(30.0, gt=0)
    """l3: after a failed copy or proof, seconds during which no copy of that prefix goes to that worker again."""
    kv_events: list[KvEventsRef | None] = Field(default_factory=list)
    """For each worker (in ``workers`` order), where it publishes its KV events, or None; empty: none does. The
    gateway subscribes and keeps that worker's holdings from its events as well
    (:mod:`btbctl.engine.gateway.kv_events`)."""
    routing_holdings: bool = True
    """Record a worker as holding a prompt's chain when its request produced a first byte there (the gateway's own
    inference). False: for the workers with ``kv_events``, only their events (and confirmed copies) record what
    they hold."""
    tokenize_timeout_s: float = Field(10.0, gt=0)
    """l3: timeout of one call to a worker's tokenizer (``/v1/tokenize``), seconds."""
    redis_url: str | None = None
    """Redis shared by several gateways in front of the same workers (``redis://host:port/db``): they share burst
    detection (each one's arrivals count in the others' windows), copy orders (one copy per prefix and target,
    whichever gateway orders it) and tuning (:mod:`btbctl.engine.gateway.fleetshare`). A gateway that cannot reach it
    works alone until it can. None: this gateway alone."""
    redis_prefix: str = Field("btb", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:-]+$")
    """Prefix of the keys and channels the fleet's gateways share in ``redis_url`` (gateways of another fleet on the
    same Redis need another one)."""

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = urlsplit(v)
        if p.scheme not in ("redis", "rediss", "unix") or (p.scheme != "unix" and not p.hostname):
            raise ValueError(f"redis URL {v!r} must look like redis://host:port (or rediss://, unix://)")
        return v

    @field_validator("register_hosts")
    @classmethod
    def _register_hosts(cls, v: list[str]) -> list[str]:
        from btbctl.engine.netaddr import check_hostname

        if len(set(v)) != len(v):
            raise ValueError("register_hosts must be distinct")
        return [check_hostname(h) for h in v]

    @field_validator("workers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for u in v:
            p = urlsplit(u)
            if p.scheme not in ("http", "https") or not p.hostname:
                raise ValueError(f"worker URL {u!r} must look like http://host:port")
            out.append(u.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError("worker URLs must be distinct")
        return out

    @model_validator(mode="after")
    def _l3(self) -> GatewayConfig:
        if self.worker_names is not None:
            if len(self.worker_names) != len(self.workers):
                raise ValueError("worker_names must name every worker, in the order of workers")
            if len(set(self.worker_names)) != len(self.worker_names) or not all(self.worker_names):
                raise ValueError("worker_names must be distinct and non-empty")
        if self.kv_events and len(self.kv_events) != len(self.workers):
            raise ValueError("kv_events must have one entry (or null) per worker, in the order of workers")
        if self.replication == "l3":
            if not self.agents and not self.agent_secret_file:
                raise ValueError(
                    "replication l3 needs agents (with worker_agents), or agent_secret_file for agents that register"
                )
            if (self.agents or self.worker_agents) and len(self.worker_agents) != len(self.workers):
                raise ValueError("worker_agents must name one agent per worker")
            if any(not 0 <= i < len(self.agents) for i in self.worker_agents):
                raise ValueError(f"worker_agents entries must be in 0..{len(self.agents) - 1}")
        if self.register_hosts:
            if self.replication != "l3" or not self.agent_secret_file:
                raise ValueError("register_hosts needs replication l3 with agent_secret_file (it takes registrations)")
            if self.register_port == 0 and len(self.register_hosts) > 1:
                raise ValueError("register_port must be fixed (not 0) with several register_hosts")
        return self

    def progress_window(self) -> float:
        """``progress_window_s``, or its default: 2 x (``health_interval_s`` + ``health_timeout_s``)."""
        return self.progress_window_s or 2 * (self.health_interval_s + self.health_timeout_s)

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from btbctl.engine.policies import live_policy_error

        why = live_policy_error(v)
        if why is not None:
            raise ValueError(why)
        return v
