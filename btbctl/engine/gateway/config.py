"""Validated settings of the gateway and its control API (pydantic; one docstring per field)."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from btbctl.engine.constants import BtbConstants


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
    host: str = "127.0.0.1"
    """Data-plane listen address (loopback by default)."""
    port: int = Field(8000, ge=0, le=65535)
    """Data-plane port (0: any free port; the chosen one is in :attr:`Gateway.data_url`)."""
    control_host: str = "127.0.0.1"
    """Control API listen address (loopback by default; on another address reads need the token too)."""
    control_port: int = Field(8001, ge=0, le=65535)
    """Control API port (0: any free port)."""
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
    unhealthy_after: int = Field(2, ge=1)
    """Consecutive failed health probes that mark a worker unhealthy (a connection error or a 5xx on a forwarded
    request marks it at once)."""
    max_retries: int = Field(2, ge=0)
    """Further workers tried when one fails before any byte went back to the client."""
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    """Largest accepted request body, bytes (larger: 413). 32 MiB holds a 1M-token prompt as ``input_ids``."""
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
    """Log every data-plane request (aiohttp's access log) on stderr."""
    replication: Literal["push", "l3", "none"] = "push"
    """How copies are made: ``push`` (the workers' ``/btb/push``), ``l3`` (node agents and warm-up proofs,
    :mod:`btbctl.engine.gateway.l3`) or ``none`` (routing only)."""
    agents: list[AgentRef] = Field(default_factory=list)
    """l3: the node agents."""
    worker_agents: list[int] = Field(default_factory=list)
    """l3: for each worker (in ``workers`` order), the index in ``agents`` of its node's agent."""
    agent_token: str | None = Field(None, repr=False)
    """l3: bearer token of the agents' control APIs (None: read ``agent_token_file``)."""
    agent_token_file: str | None = None
    """l3: file holding ``agent_token``."""
    l3_fanout: Literal["chain", "tree", "star"] = "chain"
    """l3: how one copy reaches several agents."""
    l3_source_wait_s: float = Field(30.0, gt=0)
    """l3: longest wait for the source's agent to hold the prefix (its HiCache write-through), seconds."""
    l3_warmup_timeout_s: float = Field(120.0, gt=0)
    """l3: longest a warm-up request may take, seconds."""
    l3_exclude_s: float = Field(30.0, gt=0)
    """l3: after a failed copy or proof, seconds during which no copy of that prefix goes to that worker again."""
    tokenize_timeout_s: float = Field(10.0, gt=0)
    """l3: timeout of one call to a worker's tokenizer (``/v1/tokenize``), seconds."""

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
        if self.replication == "l3":
            if not self.agents:
                raise ValueError("replication l3 needs agents")
            if len(self.worker_agents) != len(self.workers):
                raise ValueError("worker_agents must name one agent per worker")
            if any(not 0 <= i < len(self.agents) for i in self.worker_agents):
                raise ValueError(f"worker_agents entries must be in 0..{len(self.agents) - 1}")
        return self

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from btbctl.engine.policies import live_policy_error

        why = live_policy_error(v)
        if why is not None:
            raise ValueError(why)
        return v
