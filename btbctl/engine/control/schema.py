"""The control API's schema: one pydantic model per request body, answer and event payload.

The gateway builds its answers as these models and dumps them (``model_dump(mode="json")``); the client
(:mod:`btbctl.engine.control.client`) validates what it receives into the same models. ``docs/control-api.md``
describes every route with these fields; a test checks that the page names each of them.

Conventions: times ending in ``_s`` are seconds (``now_s`` and the other instants are gateway seconds since it
started); sizes are bytes or tokens as the names say; a prefix id is the hex hash of the prefix's last block;
workers are named by their base URL (``http://host:port``). ``null`` means unknown or not applicable.

Answers ignore fields they do not know (a newer gateway may add some); request bodies refuse unknown keys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import CopyOutcome, CopyState


class Answer(BaseModel):
    """Base of every answer and event payload: unknown fields are ignored, every field has a docstring."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)


class Body(BaseModel):
    """Base of the request bodies: unknown keys are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, populate_by_name=True)


# -- errors -------------------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong (the ``error`` object of every 4xx answer). Only ``message`` is always present."""

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    message: str
    """One line for a person."""
    key: str | None = None
    """The request field or query parameter at fault (``threshold``, ``prefix``, ``top``)."""
    valid: str | list[str] | None = None
    """What would be accepted: the valid keys or policy names, or a sentence such as ``an integer in [1, 1048576]``."""
    candidates: list[str] | None = None
    """Prefix ids an ambiguous short id matches."""

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ErrorAnswer(Answer):
    """Body of every error answer: ``{"error": {"message", ...}}`` (absent fields are left out, not ``null``)."""

    error: ErrorDetail
    """The error."""


# -- constants ----------------------------------------------------------------------------------------------------


class ConstantsAnswer(Answer):
    """``GET /control/constants``, ``PUT /control/constants`` and the ``constants`` event: what the gateway holds
    now."""

    policy: str
    """Routing policy in force."""
    policies: list[str]
    """Every policy name ``PUT`` accepts."""
    constants: BtbConstants
    """BTB's four constants: ``prefix_blocks``, ``threshold``, ``window_s``, ``warm_replicas``."""
    page_size: int
    """Tokens per KV block (page) of the gateway's chains."""
    prefix_tokens: int
    """``prefix_blocks x page_size``: tokens in the matched and copied prefix."""


class ConstantsUpdate(Body):
    """Body of ``PUT /control/constants``: any of the four constants and/or ``policy``. The gateway validates every
    key before it applies any; ``replicas`` is accepted as the old spelling of ``warm_replicas``."""

    prefix_blocks: int | None = None
    """Y: prefix length, blocks."""
    threshold: int | None = None
    """X: arrivals inside the window that fire replication."""
    window_s: float | None = None
    """Z: trailing detection window, seconds."""
    warm_replicas: int | None = Field(None, alias="replicas")
    """M: workers that should hold a hot prefix, the holder included (``replicas`` on input is the same key)."""
    policy: str | None = None
    """Routing policy to switch to (one of ``policies``)."""

    def dump(self) -> dict[str, Any]:
        """The JSON body (only the keys given)."""
        return self.model_dump(mode="json", exclude_none=True)


# -- fleet --------------------------------------------------------------------------------------------------------

#: Worker-row fields a worker reports only when it knows them; left out of the JSON (not ``null``) when unknown.
_REPORTED_ONLY = (
    "hbm_used_bytes",
    "hbm_total_bytes",
    "hbm_modelled",
    "gpu_util_pct",
    "kv_bytes_per_token",
    "kv_bytes_scale",
)


#: The worker-row fields that are the worker's own numbers (from its ``/v1/loads`` and ``/metrics``), in the order
#: ``btbctl status --format json`` and ``btbctl prefixes --format json`` show them per worker.
WORKER_NUMBERS = (
    "metrics_source",
    "running",
    "waiting",
    "kv_used_tokens",
    "kv_cached_tokens",
    "kv_capacity_tokens",
    "kv_use",
    "host_tier_tokens",
    "host_tier_capacity_tokens",
    "storage_hit_tokens_total",
    "storage_prefetched_tokens_total",
    "storage_backup_tokens_total",
    "load_back_tokens_total",
    "metrics_note",
    "last_metrics_s",
)


class FleetWorker(Answer):
    """One worker of ``GET /control/fleet``."""

    name: str
    """``w<index>``: the replica number the policies use."""
    url: str
    """Base URL."""
    healthy: bool
    """Passes health checks and had no connection error or 5xx since the last passing check."""
    error: str | None
    """Why it is unhealthy (null when healthy)."""
    degraded: str | None = None
    """Why its health checks fail while it shows signs of life (answers, stream chunks, late ``/health`` answers):
    busy, not dead, and still routed (null when not degraded)."""
    load: int
    """Requests the gateway has in flight to it."""
    prefilling: int
    """Of those, requests without a first byte yet."""
    served: int
    """Requests it answered (gateway count)."""
    failed: int
    """Requests that failed on it (connection error or 5xx)."""
    running: int | None
    """Requests running there, from its ``/v1/loads`` (else its ``/metrics``; null when unknown)."""
    waiting: int | None
    """Requests queued there, from its ``/v1/loads`` (else its ``/metrics``)."""
    kv_used_tokens: int | None
    """KV-cache tokens held by its running requests (SGLang's ``num_used_tokens``), from its ``/v1/loads`` (else
    its ``/metrics``)."""
    kv_capacity_tokens: int | None
    """KV-cache size, tokens, from its ``/v1/loads`` (else its ``/metrics``)."""
    kv_use: float | None
    """Share of the KV cache holding tokens, 0..1: ``(kv_used_tokens + kv_cached_tokens) / kv_capacity_tokens``;
    without ``kv_cached_tokens`` only the running requests' share (SGLang's ``token_usage``)."""
    kv_cached_tokens: int | None = None
    """KV-cache tokens of cached prefixes no running request holds (evictable; SGLang's
    ``sglang:kv_evictable_tokens``), from its ``/metrics`` (null when it does not report them)."""
    host_tier_tokens: int | None = None
    """HiCache host tier (L2): tokens held (``sglang:hicache_host_used_tokens``), from its ``/metrics`` (null
    without HiCache or metrics)."""
    host_tier_capacity_tokens: int | None = None
    """HiCache host tier size, tokens (``sglang:hicache_host_total_tokens``)."""
    storage_hit_tokens_total: int | None = None
    """Tokens its L3 (storage) prefetch queries found, since it started
    (``sglang:storage_prefetch_hit_tokens_total``)."""
    storage_prefetched_tokens_total: int | None = None
    """Tokens it read from L3 into the host tier, since it started (``sglang:prefetched_tokens_total``)."""
    storage_backup_tokens_total: int | None = None
    """Tokens it wrote from the host tier to L3, since it started (``sglang:backuped_tokens_total``)."""
    load_back_tokens_total: int | None = None
    """Tokens it loaded back from the host tier to the GPU, since it started (``sglang:load_back_tokens_total``,
    pool ``kv``)."""
    metrics_source: str | None = None
    """Where its numbers come from: ``sglang_metrics`` (a real SGLang server's ``/metrics`` and ``/v1/loads``),
    ``sglang_loads`` (only its ``/v1/loads``: no cache or HiCache numbers), ``modelled`` (btbctl's emulated
    worker: the cost model's numbers under SGLang's names), null (nothing read yet)."""
    metrics_note: str | None = None
    """Why its ``/metrics`` numbers are missing (null when they are there)."""
    last_metrics_s: float | None = None
    """When its ``/metrics`` was last read successfully, on the gateway's clock (compare with the answer's
    ``now_s``; null before)."""
    replication: bool
    """Copies to and from it are possible (``push``: it has the ``/btb`` routes and the gateway's page size; ``l3``:
    it is healthy and has a node agent)."""
    replication_note: str
    """Why (not), in words."""
    replication_mode: str = "push"
    """How copies reach it: ``l3`` (node agents and a warm-up proof), ``push`` (its ``/btb/push``) or ``none``."""
    agent: str | None = None
    """l3: the node agent its HiCache L3 tier lives in (null in other modes)."""
    held_blocks: int
    """Blocks the gateway records as resident there (its approximate record)."""
    model: str | None
    """Model name from its ``/btb/info``."""
    gpu: str | None
    """GPU name from its ``/btb/info``."""
    tp_size: int | None
    """Tensor-parallel size from its ``/btb/info``."""
    page_size: int | None
    """Its page size from ``/btb/info``."""
    transfer_addr: str | None
    """``host:port`` its copies arrive on, from ``/btb/info``."""
    last_health_s: float | None
    """When its latest health answer came (null before the first)."""
    last_progress_s: float | None = None
    """When it last showed a sign of life outside a passing health check: an answer or a stream chunk of a
    forwarded request, or a late ``/health`` answer (gateway seconds; null before the first)."""
    ttft_ewma_s: float | None
    """Smoothed TTFT of its recent requests, seconds."""
    hbm_used_bytes: float | None = None
    """HBM in use, bytes, where the worker reports it (left out otherwise)."""
    hbm_total_bytes: float | None = None
    """HBM size, bytes, where the worker reports it (left out otherwise)."""
    hbm_modelled: bool | None = None
    """True when ``hbm_used_bytes``/``hbm_total_bytes`` are an emulated worker's model (weights plus the KV cache it
    holds: running requests' and cached prefixes', of its model and GPU presets), not a measurement (left out
    otherwise)."""
    kv_bytes_per_token: float | None = None
    """KV-cache bytes per token of its model, from ``/btb/info`` (left out when unknown)."""
    kv_bytes_scale: int | None = None
    """Emulated workers: the factor their copies scale KV bytes down by (``--kv-bytes-scale``; left out
    otherwise)."""
    gpu_util_pct: float | None = None
    """GPU utilisation 0..100, where the worker reports it (left out otherwise)."""

    @model_serializer(mode="wrap")
    def _leave_out_unreported(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for k in _REPORTED_ONLY:
            if out.get(k, 0) is None:
                del out[k]
        return out


class FleetAnswer(Answer):
    """``GET /control/fleet`` and the ``fleet`` event."""

    now_s: float
    """Gateway time of the answer."""
    policy: str
    """Routing policy in force."""
    page_size: int
    """Tokens per block."""
    constants: BtbConstants
    """BTB's four constants in force."""
    healthy: int
    """Healthy workers."""
    total: int
    """Workers."""
    replication: str
    """On how many workers copies are possible, in words."""
    replication_mode: str = "push"
    """The fleet's replication mode: ``l3``, ``push`` or ``none``."""
    workers: list[FleetWorker]
    """One row per worker, in replica order."""


# -- prefixes -----------------------------------------------------------------------------------------------------


class PrefixEntry(Answer):
    """One prefix of ``GET /control/prefixes``."""

    id: str
    """Prefix id (what ``POST /control/replicate`` takes)."""
    prefix_blocks: int
    """Length, blocks."""
    prefix_tokens: int
    """Length, tokens."""
    arrivals_in_window: int
    """Arrivals inside the trailing window."""
    total_arrivals: int
    """Arrivals since it was first tracked."""
    threshold: int
    """Arrivals that make it hot."""
    hot: bool
    """The detector has it active."""
    fires: int
    """Times it turned hot."""
    first_seen_s: float
    """Its first tracked arrival."""
    last_seen_s: float
    """Its latest arrival."""
    holders: list[str]
    """Workers recorded as holding all of it."""
    copies_in_flight: int
    """Copies of it under way."""


class PrefixesAnswer(Answer):
    """``GET /control/prefixes?top=N`` and the ``prefixes`` event (top 10): the prefixes with the most arrivals in
    the window."""

    now_s: float
    """Gateway time of the answer."""
    window_s: float
    """Detection window, seconds."""
    threshold: int
    """Arrivals that fire replication."""
    prefix_blocks: int
    """Prefix length, blocks."""
    prefix_tokens: int
    """Prefix length, tokens."""
    page_size: int
    """Tokens per block."""
    prefixes: list[PrefixEntry]
    """Most arrivals in the window first."""


# -- transfers ----------------------------------------------------------------------------------------------------


class TransferEntry(Answer):
    """One copy of ``GET /control/transfers`` and ``GET /control/replications/{prefix}``."""

    copy_id: str
    """Id of the copy (hex)."""
    prefix: str
    """Id of the chain copied (hash of its last block)."""
    prefix_blocks: int
    """Blocks copied."""
    source: str
    """Worker sending."""
    target: str
    """Worker receiving."""
    state: CopyState
    """``stalled`` (accepted, waiting for the source), ``running``, ``done`` (verified at the target) or
    ``failed``."""
    bytes_sent: int
    """Bytes delivered so far."""
    bytes_total: int
    """Bytes the copy moves (0 until known)."""
    blocks_verified: int
    """Blocks the target verified so far."""
    bytes_per_s: float
    """Average rate since sending started."""
    eta_s: float | None
    """Seconds left at that rate (null when unknown, 0 when finished)."""
    error: str | None
    """Why it failed."""
    created_s: float
    """When it was planned."""
    started_s: float | None
    """When bytes started moving."""
    finished_s: float | None
    """When it ended."""
    manual: bool
    """Started through ``POST /control/replicate`` (else by the policy)."""
    mode: str = "push"
    """``push`` (the workers' ``/btb/push``) or ``l3`` (node agents, then a warm-up proof)."""
    duration_s: float | None = None
    """When finished: seconds from planned to done or failed (an ``l3`` copy: source wait, copy and proof)."""
    transfer_s: float | None = None
    """l3: seconds the pages took between the agents (null before, 0 when the target's node already had them)."""
    covered_tokens: int | None = None
    """l3: prompt tokens the proof must cover (the prefix's whole pages)."""
    proof: dict[str, int] | None = None
    """l3: the target's warm-up answer, ``{"device", "host", "storage"}`` tokens of ``cached_tokens_details``
    (null before the warm-up)."""
    proof_storage_tokens: int | None = None
    """l3: ``proof["storage"]``, the prompt tokens the target loaded from L3 (its HiCache storage tier)."""
    outcome: CopyOutcome | None = None
    """How it ended (null while in flight): ``done`` (push), ``proved`` (l3: loaded from L3), ``computed`` (l3: the
    target computed the prefix itself, not a copy), ``short``, ``failed``."""
    hot_prefix: str = ""
    """Id of the hot prefix the copy is for, as ``GET /control/prefixes`` lists it (the chain through block
    ``prefix_blocks`` of the constants; equal to ``prefix`` unless the policy copies a deeper chain, as btb_plus
    does)."""
    prefix_tokens: int | None = None
    """Tokens copied (``prefix_blocks`` x page size; null when the page size is unknown)."""
    usable_s: float | None = None
    """Seconds from planned (the detector's fire, for a policy's copy) until the target could serve the prefix
    (push: verified; l3: proved); null unless done."""
    phase_source_s: float | None = None
    """l3: seconds from planned until the source's node held every page (the copy streams behind it)."""
    phase_transfer_s: float | None = None
    """l3: seconds after that until the target's node held every page."""
    phase_proof_s: float | None = None
    """l3: seconds of the warm-up proof."""
    blocks_available: int | None = None
    """Leading blocks the source holds so far (a copy trails a source still prefilling; null when not said)."""
    send_s: float | None = None
    """l3: seconds the source's agent spent handing this copy's bytes to the network (``bytes_total / send_s`` is
    the rate of the path while it sent); null until done."""
    overlap_s: float | None = None
    """l3: seconds during which pages already moved while the source was still writing the prefix through (> 0:
    the copy streamed behind the source's prefill); null until known."""


class TransferTotals(Answer):
    """Counts over the finished copies the gateway keeps (the latest 200)."""

    done: int
    """Copies that arrived and verified."""
    failed: int
    """Copies that failed."""
    bytes: int
    """Bytes of the copies that arrived."""


class TransfersAnswer(Answer):
    """``GET /control/transfers?limit=N`` and the ``transfers`` event (50 rows)."""

    now_s: float
    """Gateway time of the answer."""
    in_flight: int
    """Copies under way."""
    transfers: list[TransferEntry]
    """In flight (oldest first), then the most recent finished ones."""
    totals: TransferTotals
    """Counts over the finished copies."""


# -- TTFT ---------------------------------------------------------------------------------------------------------


class TtftBucket(Answer):
    """TTFT over one bucket of gateway time."""

    t_s: float
    """End of the bucket."""
    n: int
    """First bytes in the bucket."""
    p50_s: float | None
    """Median TTFT, seconds (null for an empty bucket)."""
    p95_s: float | None
    """95th percentile, seconds."""
    rps: float
    """First bytes per second in the bucket."""


class TtftSummary(Answer):
    """TTFT over a trailing window (every value null when it saw no request)."""

    n: int
    """First bytes in the window."""
    mean_s: float | None
    """Mean TTFT, seconds."""
    p50_s: float | None
    """Median."""
    p95_s: float | None
    """95th percentile."""
    p99_s: float | None
    """99th percentile."""
    max_s: float | None
    """Largest."""


class TtftAnswer(Answer):
    """``GET /control/ttft?window_s=60&step_s=1``: TTFT measured at the gateway (arrival to first byte)."""

    now_s: float
    """Gateway time of the answer."""
    window_s: float
    """Trailing window asked for, seconds."""
    step_s: float
    """Bucket width, seconds."""
    series: list[TtftBucket]
    """Oldest bucket first; the last one ends at ``now_s``."""
    summary: TtftSummary
    """Over the whole window."""


#: Seconds of the ``ttft`` event's ``last_60s`` summary, and the window the dashboard's TTFT panel shows.
TTFT_RECENT_WINDOW_S = 60.0


class TtftEvent(Answer):
    """The ``ttft`` event: sent when first bytes were measured since the last one."""

    now_s: float
    """Gateway time of the event."""
    last_10s: TtftSummary
    """Over the trailing 10 seconds."""
    point: TtftBucket
    """The trailing second (a bucket ending at ``now_s``)."""
    last_60s: TtftSummary | None = None
    """Over the trailing :data:`TTFT_RECENT_WINDOW_S` (60) seconds: the window the dashboard states."""


# -- replication --------------------------------------------------------------------------------------------------


class ReplicateRequest(Body):
    """Body of ``POST /control/replicate``."""

    prefix: str
    """Prefix id, or an unambiguous leading part of one (at least 8 hex digits)."""
    n: int = 1
    """How many more workers should get a copy (>= 1)."""


class ReplicateCopy(Answer):
    """One copy started by ``POST /control/replicate``."""

    copy_id: str
    """Id of the copy."""
    target: str
    """Worker receiving it."""
    state: CopyState
    """Where it is when the answer was sent."""
    error: str | None
    """Why it failed already, if it did."""


class FlushAnswer(Answer):
    """``POST /control/flush``: every worker's cache emptied (SGLang's ``/flush_cache``) and the gateway's record of
    what they hold, its prefix tree and its burst detector reset, so the next bench starts cold."""

    workers: dict[str, str]
    """Per worker name: ``flushed``, or why not (a worker answers 400 while it has requests or copies in flight)."""
    flushed: int
    """Workers whose cache was emptied."""


class AgentView(Answer):
    """A node agent the gateway knows (``GET /control/agents``)."""

    name: str
    """The agent's name (``agent-local``, ``agent-<host>``)."""
    control_url: str
    """Its control API."""
    peer_addr: str
    """``host:port`` other agents copy to."""
    workers: list[str]
    """Names of the workers that use it."""
    static: bool
    """Named in the gateway's settings (else registered)."""
    expires_in_s: float | None
    """Seconds until its registration lapses (None: from the settings)."""


class AgentsAnswer(Answer):
    """``GET /control/agents``: the node agents the gateway knows now (replication ``l3``; empty otherwise)."""

    agents: list[AgentView]
    """Registered or from the settings."""


class AgentRegistrationAnswer(Answer):
    """``POST /control/agents``: a node agent's announcement as the gateway took it."""

    agent: str
    """The agent's name (its id; the node key it signed with is derived from it)."""
    workers: list[str]
    """Names of this gateway's workers it now serves (the announced URLs this gateway knows)."""
    unknown_workers: list[str]
    """Announced worker URLs this gateway does not have (ignored)."""
    pinned_workers: list[str]
    """Announced worker URLs the gateway's settings give another agent (kept there: the settings win)."""
    ttl_s: float
    """Seconds the registration holds without a new announcement."""
    changed: bool
    """Whether anything changed (false: a heartbeat that only renewed it)."""


class ReplicateAnswer(Answer):
    """``POST /control/replicate`` (202): the copies started; follow them with
    ``GET /control/replications/{prefix}``. 200 with no ``targets``: every eligible worker already holds the prefix
    (or is receiving it), so there was nothing to copy; ``holders`` names them."""

    prefix: str
    """The full prefix id."""
    source: str
    """Worker copied from (the least-loaded one that confirmed it holds the prefix)."""
    targets: list[str]
    """Workers copied to."""
    copy_ids: list[str]
    """Ids of the copies, in ``targets`` order."""
    copies: list[ReplicateCopy]
    """The copies."""
    skipped: int
    """How many fewer than ``n`` started (no other eligible worker)."""
    holders: list[str] = []
    """Workers that held the whole prefix when the copies started (the source among them)."""


#: The fields of a prewarm body that carry its prompt (exactly one is given).
PROMPT_KEYS = ("text", "messages", "input_ids")


class PrewarmRequest(Body):
    """Body of ``POST /control/prewarm``: one prompt, as exactly one of ``text``, ``messages`` and ``input_ids``."""

    text: str | None = None
    """A plain prompt (computed as SGLang's ``POST /generate`` with ``text``)."""
    messages: list[dict[str, Any]] | None = None
    """A chat (computed as ``POST /v1/chat/completions``, so its template matches the batch's chat requests)."""
    input_ids: list[Annotated[int, Field(ge=0, lt=2**32)]] | None = None
    """Token ids, each in [0, 2^32) (computed as ``POST /generate`` with ``input_ids``; a worker refusing them, e.g.
    out of its vocabulary, answers the prewarm 400)."""
    n: int = Field(1, ge=1)
    """How many more workers should get a copy once one worker computed it (>= 1)."""

    @model_validator(mode="after")
    def _one_prompt(self) -> PrewarmRequest:
        given = [k for k in PROMPT_KEYS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, messages, input_ids (got {', '.join(given) or 'none'})")
        return self


class PrewarmAnswer(ReplicateAnswer):
    """``POST /control/prewarm`` (202 with copies started, 200 when every eligible worker holds the prompt already):
    what :class:`ReplicateAnswer` says, and who computed the prompt."""

    computed_by: str
    """Worker that computed the prompt (the one the policy routed it to); the copies' usual source."""
    prompt_tokens: int
    """The prompt's length, tokens."""
    prefix_blocks: int
    """Blocks of the prompt kept warm (its whole blocks; ``prefix`` is the last one's id)."""
    hot_prefix: str | None = None
    """The id ``GET /control/prefixes`` and the detector track this prompt under (its first ``prefix_blocks``
    blocks of the gateway's constants), or None when the prompt is shorter than that."""


class ReplicationAnswer(Answer):
    """``GET /control/replications/{prefix}``: who holds a prefix and its copies."""

    prefix: str
    """The full prefix id."""
    prefix_blocks: int
    """Its length, blocks."""
    holders: list[str]
    """Workers recorded as holding all of it."""
    copies: list[TransferEntry]
    """Its copies (and those made for it as the hot prefix): in flight first, then the recent finished ones (newest
    first)."""


# -- the event stream ---------------------------------------------------------------------------------------------

#: Event types of ``GET /control/events``.
EventKind = Literal["fleet", "prefixes", "transfers", "ttft", "constants"]

#: The payload model of each event type.
EVENT_MODELS: dict[str, type[Answer]] = {
    "fleet": FleetAnswer,
    "prefixes": PrefixesAnswer,
    "transfers": TransfersAnswer,
    "ttft": TtftEvent,
    "constants": ConstantsAnswer,
}


def dump(model: BaseModel) -> Any:
    """The JSON value of an answer, as the gateway sends it."""
    return model.model_dump(mode="json")


__all__ = [
    "AgentRegistrationAnswer",
    "AgentView",
    "AgentsAnswer",
    "Answer",
    "Body",
    "ConstantsAnswer",
    "ConstantsUpdate",
    "FlushAnswer",
    "EVENT_MODELS",
    "ErrorAnswer",
    "ErrorDetail",
    "EventKind",
    "FleetAnswer",
    "FleetWorker",
    "PrefixEntry",
    "PrefixesAnswer",
    "PrewarmAnswer",
    "PrewarmRequest",
    "ReplicateAnswer",
    "ReplicateCopy",
    "ReplicateRequest",
    "ReplicationAnswer",
    "TransferEntry",
    "TransferTotals",
    "TransfersAnswer",
    "TtftAnswer",
    "TtftBucket",
    "TtftEvent",
    "TtftSummary",
    "WORKER_NUMBERS",
    "dump",
]
