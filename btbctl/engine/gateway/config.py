"""Validated settings of the gateway and its control API (pydantic; one docstring per field)."""

from __future__ import annotations

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from btbctl.engine.constants import BtbConstants


class GatewayConfig(BaseModel):
    """Settings of one gateway process (data plane + control API).

    Build with ``GatewayConfig(workers=[...], ...)`` or :func:`btbctl.engine.config.validate` for one-line
    errors that name the key.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    workers: list[str] = Field(min_length=1)
    """Worker base URLs (``http://host:port``), SGLang servers or emulated workers; their order numbers the
    replicas the policies see."""
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

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from btbctl.engine.policies import live_policy_error

        why = live_policy_error(v)
        if why is not None:
            raise ValueError(why)
        return v
