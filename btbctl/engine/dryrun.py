"""Dry-run: simulate one fleet and one trace under several routing policies and report TTFT side by side.

The configuration is one validated tree (:class:`DryRunConfig`), read from TOML by :func:`load_dryrun_config` or
built in code; :func:`run_dry_run` runs the simulator once per policy and returns a JSON-ready dict of a fixed
shape (see :func:`run_dry_run`). Everything in that dict except ``timing`` depends only on the configuration, so two
runs with the same inputs give byte-identical JSON (floats rounded in one place, :func:`round_floats`).

A config file looks like::

    seed = 42
    fidelity = "realistic"
    # setup = "70b_h100x4"   # a named setup of the published table fills [cluster]; keys set there still win
    policies = ["round_robin", "least_load", "cache_aware", "cache_aware_spill", "btb", "btb_plus"]

    [trace]                  # either a file ...
    # path = "traces/mooncake_conversation_trace.jsonl"   # relative paths resolve against this file's folder
    # format = "mooncake"
    [trace.generate]         # ... or a generated Bursted window (used when no path is given)
    spread_s = 60.0

    [cluster]
    model = "llama-3.3-70b"
    gpu = "h100"

    [btb]
    prefix_blocks = 256
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Callable
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from btbctl import __version__
from btbctl.engine.config import ClusterConfig, read_toml, validate
from btbctl.engine.constants import BtbConstants
from btbctl.engine.costmodel import ReplicaCost
from btbctl.engine.errors import ConfigError
from btbctl.engine.trace.model import Trace

#: Significant digits kept for every float in a dry-run report (and the per-request JSONL). Six digits resolve a
#: TTFT of 100 s to 0.1 ms, far below the simulator's modelling error, and keep reports stable across platforms.
SIGNIFICANT_DIGITS = 6


def _error(kind: str, message: str) -> PydanticCustomError:
    """A validation error whose message pydantic shows as is (no "Value error, " prefix)."""
    return PydanticCustomError(kind, "{message}", {"message": message})


def _default_policies() -> list[str]:
    from btbctl.engine.policies import DEFAULT_POLICIES

    return list(DEFAULT_POLICIES)


class GenerateSection(BaseModel):
    """A generated Bursted workload: the fields of ``btbctl.engine.trace.generate.BurstedParams``, same defaults.

    The defaults are one synthetic window of the Bursted-ART recipe (bite-the-bullet's dataset generator and
    dataset card): 8 bursts of 500 requests, each burst spread over 60 s and sharing its own 65,536-token prefix
    (256 blocks of 256 tokens), a unique 256-token suffix and 1 output token per request, plus 120 decoys, about
    4,120 requests over about 345 s. ``spread_s = 1`` is the adversarial variant. Cross-field rules (jitter vs first
    burst, decoy window order, background length range) are checked by ``BurstedParams``.
    """

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)

    bursts: int = Field(8, ge=0)
    """Number of burst jobs in the window."""
    burst_size: int = Field(500, ge=1)
    """Requests per burst."""
    first_burst_s: float = Field(20.0, ge=0)
    """Nominal start of burst 0, seconds."""
    burst_period_s: float = Field(40.0, ge=0)
    """Seconds between nominal burst starts (burst k starts at first_burst_s + burst_period_s x k)."""
    jitter_s: float = Field(2.0, ge=0)
    """Each burst start moves by a uniform draw in [-jitter_s, +jitter_s] seconds; at most first_burst_s."""
    spread_s: float = Field(60.0, ge=0)
    """Seconds over which one burst's requests arrive, evenly spaced (60 = published; 1 = adversarial; 0 = all at
    once)."""
    prefix_tokens: int = Field(65536, ge=1)
    """Tokens of the prefix every request of one burst shares, and of each decoy's own prefix (65,536 = 256 blocks
    of 256 tokens)."""
    suffix_tokens: int = Field(256, ge=0)
    """Tokens of the unique suffix each request adds after the prefix."""
    output_tokens: int = Field(1, ge=1)
    """Tokens each burst or decoy request generates (1: the TTFT token is the whole answer)."""
    decoys: int = Field(120, ge=0)
    """Single requests with their own unique prefix of prefix_tokens tokens."""
    decoy_start_s: float = Field(14.0, ge=0)
    """Decoy arrivals are uniform in [decoy_start_s, decoy_end_s], seconds."""
    decoy_end_s: float = Field(340.0, ge=0)
    """End of the decoy arrival interval, seconds (>= decoy_start_s)."""
    block_tokens: int = Field(256, ge=1)
    """Tokens per KV block of the generated trace (the unit of btb.prefix_blocks); with trace.overlay the base
    trace's block size is used instead."""
    background_rps: float = Field(0.0, ge=0)
    """Mean rate of background requests (Poisson arrivals), requests per second; 0 = none (the published recipe)."""
    background_end_s: float | None = Field(None, ge=0)
    """End of the background arrivals, seconds; None = the end of the window."""
    background_input_min_tokens: int = Field(256, ge=1)
    """Background prompt lengths are uniform integers in [background_input_min_tokens,
    background_input_max_tokens]."""
    background_input_max_tokens: int = Field(8192, ge=1)
    """Upper end of the background prompt length, tokens."""
    background_output_tokens: int = Field(128, ge=1)
    """Tokens each background request generates."""
    offset_s: float = Field(0.0, ge=0)
    """Seconds added to every generated arrival (to place the window inside a longer base trace)."""

    def params(self):
        """The generator's ``BurstedParams`` for this section. Raises :class:`ConfigError` (key: the field name)
        when a cross-field rule is broken."""
        from btbctl.engine.trace.generate import BurstedParams

        return BurstedParams(**self.model_dump())


class TraceSource(BaseModel):
    """Where the requests come from: a trace file (``path``) or, when no path is given, a generated Bursted window
    (``generate``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)

    path: str | None = None
    """Trace file. In a config file a relative path resolves against the config file's folder; on the command
    line against the current directory. None: generate a trace from ``generate``."""
    format: str | None = None
    """Trace format of ``path`` (``mooncake``, ``btb-mixed-trace-v1``, ``azure2023``); None: detected from the
    file."""
    generate: GenerateSection = Field(default_factory=GenerateSection)
    """Parameters of the generated trace (used when ``path`` is None, or with ``overlay``)."""
    overlay: bool = False
    """With ``path``: lay the generated window (``generate``) over the file's requests, to add bursts to a real
    trace; the generated prefixes use the file's block size."""
    seed: int | None = None
    """Seed of the trace generator; None: the run's ``seed``."""

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from btbctl.engine.trace.readers import FORMATS

        if v not in FORMATS:
            raise _error("unknown_format", f"unknown trace format {v!r}; valid: {', '.join(FORMATS)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TraceSource:
        if self.path is None:
            if self.format is not None:
                raise _error(
                    "format_without_path",
                    f"format {self.format!r} given without a trace path; set path too or drop format",
                )
            if self.overlay:
                raise _error("overlay_without_path", "overlay = true needs a trace path to lay the generated window on")
        elif "generate" in self.model_fields_set and not self.overlay:
            raise _error(
                "generate_with_path",
                f"generate settings apply to a generated trace, but path {self.path!r} is set; drop one of "
                "them, or set overlay = true to add the generated window to the file",
            )
        return self


class DryRunConfig(BaseModel):
    """Everything a dry-run needs. Defaults: the published BTB setting (one generated Bursted window, 4 replicas
    of Llama-3.3-70B on 4xH100, the published constants) under the five default policies."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, strict=True, allow_inf_nan=False)

    trace: TraceSource = Field(default_factory=TraceSource)
    """The requests: a trace file or a generated Bursted window."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """The fleet (model, GPUs, replicas, NIC)."""
    btb: BtbConstants = Field(default_factory=BtbConstants)
    """BTB's four constants."""
    policies: list[str] = Field(default_factory=_default_policies)
    """Routing policies to compare, in report order (``btbctl.engine.policies.SIM_POLICIES``: the live ones and the
    simulator-only reference ``clairvoyant``)."""
    seed: int = 42
    """Seed of the simulator (ties, random choices) and, unless ``trace.seed`` is set, of the trace generator."""
    fidelity: Literal["realistic", "infersim"] = "realistic"
    """Simulator fidelity profile: ``realistic`` or ``infersim`` (the reference simulator's simplifications)."""
    setup: str | None = None
    """Named setup of the published BTB table (``btbctl.engine.setups.SETUPS``: ``70b_h100x4``, ``qwen3_8b_h100x4``,
    ``glm45_h100x4``, ``glm52_h100x8``, ``kimi_k2_h100x8``, ``dense1t_b300x4``). It fills ``cluster.model``,
    ``gpu``, ``gpus_per_replica``, ``replicas`` and ``nic_gbps``; a cluster key given explicitly (in the file or by
    a flag) wins over the setup. None: the cluster keys alone."""

    #: cluster keys the setup filled (so a later override of ``setup`` can replace them)
    _setup_filled: frozenset = PrivateAttr(default=frozenset())

    @model_validator(mode="wrap")
    @classmethod
    def _apply_setup(cls, data: Any, handler):
        filled: frozenset = frozenset()
        if isinstance(data, dict) and isinstance(data.get("setup"), str):
            from btbctl.engine.setups import ALL_SETUPS

            known = ALL_SETUPS.get(data["setup"])
            cluster = data.get("cluster", {})
            if known is not None and isinstance(cluster, dict):
                settings = known.cluster_settings()
                filled = frozenset(k for k in settings if k not in cluster)
                data = {**data, "cluster": {**cluster, **{k: settings[k] for k in filled}}}
        model = handler(data)
        model._setup_filled = filled
        return model

    @field_validator("setup")
    @classmethod
    def _known_setup(cls, v: str | None) -> str | None:
        from btbctl.engine.setups import ALL_SETUPS

        if v is not None and v not in ALL_SETUPS:
            raise _error("unknown_setup", f"unknown setup {v!r}; valid: {', '.join(ALL_SETUPS)}")
        return v

    @field_validator("policies")
    @classmethod
    def _known_policies(cls, v: list[str]) -> list[str]:
        from btbctl.engine.policies import SIM_POLICIES

        if not v:
            raise _error("no_policies", f"at least one policy is needed; valid: {', '.join(SIM_POLICIES)}")
        seen: set[str] = set()
        for name in v:
            if name not in SIM_POLICIES:
                raise _error("unknown_policy", f"unknown policy {name!r}; valid: {', '.join(SIM_POLICIES)}")
            if name in seen:
                raise _error("duplicate_policy", f"policy {name!r} is listed twice")
            seen.add(name)
        return v

    def replica_cost(self) -> ReplicaCost:
        """The cost model of one replica of ``cluster`` (in the ``infersim`` fidelity at Infer-Sim's memory fraction,
        1.0). Raises :class:`ConfigError` (key ``cluster.<field>``) for an unknown preset or a model that does not
        fit its GPUs."""
        try:
            if self.fidelity == "infersim":
                return self.cluster.replica_cost(mem_fraction=1.0)
            return self.cluster.replica_cost()
        except ConfigError as e:
            raise ConfigError(f"cluster.{e.key}", e.reason, e.path) from None

    def check(self) -> ReplicaCost:
        """The checks pydantic cannot do alone: the cluster's presets exist and the model fits its GPUs
        (:meth:`replica_cost`), and the generator's cross-field rules hold (key ``trace.generate.<field>``).
        Returns the replica cost model. Raises :class:`ConfigError`."""
        cost = self.replica_cost()
        if self.trace.path is None or self.trace.overlay:
            try:
                self.trace.generate.params()
            except ConfigError as e:
                raise ConfigError(f"trace.generate.{e.key}", e.reason, e.path) from None
        return cost

    def with_overrides(self, overrides: dict[str, Any], unset: tuple[str, ...] = ()) -> DryRunConfig:
        """A validated copy with dotted keys set (``{"cluster.model": "qwen3-8b", "seed": 7}``; None values are
        skipped) after the dotted keys in ``unset`` went back to their defaults. Raises :class:`ConfigError` naming
        the dotted key."""
        data = self.model_dump(exclude_unset=True)
        if self._setup_filled and isinstance(data.get("cluster"), dict):
            for key in self._setup_filled:  # the (possibly new) setup fills them again
                data["cluster"].pop(key, None)
        for dotted in unset:
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.get(p, {})
            node.pop(leaf, None)
        for dotted, value in overrides.items():
            if value is None:
                continue
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return validate_config(data)


def validate_config(data: dict, path: str | None = None) -> DryRunConfig:
    """Build a :class:`DryRunConfig` from plain data (parsed TOML). Raises :class:`ConfigError` naming ``path``, the
    dotted key of the first problem and what is valid; an unknown key lists the valid keys of its own section."""
    return validate(DryRunConfig, data, path)


def load_dryrun_config(path: str | os.PathLike) -> DryRunConfig:
    """Read a dry-run config from a TOML file.

    A relative ``trace.path`` resolves against the folder holding the config file. :meth:`DryRunConfig.check`
    runs too (presets exist, the model fits its GPUs, the generator's settings agree), so a config that loads can
    be simulated.

    Raises:
        ConfigError: the file cannot be read, is not valid TOML (message names the file and line), or a key is
            unknown or has a bad value (message names the file, the dotted key and what is valid).
    """
    spath = os.fspath(path)
    data = read_toml(spath, "config")
    cfg = validate_config(data, spath)
    if cfg.trace.path is not None and not os.path.isabs(cfg.trace.path):
        resolved = os.path.normpath(os.path.join(os.path.dirname(spath), cfg.trace.path))
        trace = cfg.trace.model_copy(update={"path": resolved})
        cfg = cfg.model_copy(update={"trace": trace})
    try:
        cfg.check()
    except ConfigError as e:
        raise ConfigError(e.key, e.reason, spath) from None
    return cfg


def load_trace(cfg: DryRunConfig) -> Trace:
    """The trace of ``cfg``: read from ``trace.path``, generated from ``trace.generate`` (seed ``trace.seed``,
    else ``cfg.seed``), or both merged (``trace.overlay``).

    Raises:
        ConfigError: ``trace.path`` does not exist or is a directory.
        TraceFormatError: the file cannot be parsed (names the file and line).
    """
    src = cfg.trace
    if src.path is not None:
        from btbctl.engine.trace.readers import read_trace

        if not os.path.isfile(src.path):
            if os.path.isdir(src.path):
                raise ConfigError("trace.path", f"{src.path} is a directory, not a trace file")
            if os.path.exists(src.path):
                raise ConfigError("trace.path", f"{src.path} is not a regular file")
            raise ConfigError("trace.path", f"no such trace file: {src.path}")
        base = read_trace(src.path, src.format)
        if not src.overlay:
            return base
    else:
        base = None
    from btbctl.engine.trace.generate import generate_bursted

    seed = cfg.seed if src.seed is None else src.seed
    return generate_bursted(src.generate.params(), seed=seed, base=base)


def round_floats(obj: Any, digits: int = SIGNIFICANT_DIGITS) -> Any:
    """``obj`` with every float rounded to ``digits`` significant digits (recursively through dicts, lists and
    tuples; tuples become lists). NaN and infinities become None (JSON ``null``). Integers and bools are kept."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        x = float(obj)
        if not math.isfinite(x):
            return None
        return float(f"{x:.{digits}g}")
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_floats(v, digits) for v in obj]
    return obj


#: Keys of one line of the per-request JSONL written by :func:`run_dry_run` (``requests_out``), in order.
REQUEST_KEYS = ("arrival_s", "policy", "replica", "ttft_s", "queue_wait_s", "cached_tokens", "kind", "request_id")


def _trace_format(cfg: DryRunConfig, trace: Trace) -> str:
    """``generated``, the file's format, or ``<file format>+generated`` for an overlay."""
    if cfg.trace.path is None:
        return "generated"
    if cfg.trace.overlay:
        base = trace.meta.get("base", {}).get("format") if isinstance(trace.meta, dict) else None
        return f"{base or cfg.trace.format or 'file'}+generated"
    return trace.format


def run_dry_run(
    cfg: DryRunConfig,
    progress: Callable[[int], None] | None = None,
    requests_out: str | os.PathLike | None = None,
    *,
    trace: Trace | None = None,
) -> dict:
    """Simulate ``cfg``'s trace under each of ``cfg.policies`` and report.

    Args:
        cfg: the validated configuration.
        progress: called with increments of simulated requests; the total is ``len(trace) x len(policies)``.
        requests_out: file to write one JSON line per request per policy (keys :data:`REQUEST_KEYS`; policies in
            report order, requests in the simulator's record order).
        trace: the trace, if the caller loaded it already with :func:`load_trace` (e.g. to size a progress bar).

    Returns:
        ``{"btbctl_version", "fidelity", "seed",
        "trace": {"path", "format", "requests", "span_s", "block_tokens"},
        "cluster": {"model", "gpu", "gpus_per_replica", "replicas", "nic_gbps"},
        "constants": {"prefix_blocks", "threshold", "window_s", "warm_replicas"},
        "results": [SimResult.summary() per policy, in cfg.policies order],
        "timing": {"wall_s", "requests_per_s"}}``; times in seconds, floats rounded to
        :data:`SIGNIFICANT_DIGITS` significant digits, NaN as None. A generated trace has ``path`` None and
        ``format`` ``"generated"``; an overlay has the file's path and format ``<format>+generated``.

    Raises:
        ConfigError: bad cluster (checked before anything is simulated), missing trace file, an unwritable
            ``requests_out``, or a fidelity the simulator does not support.
        TraceFormatError: an unreadable trace file.
    """
    from btbctl.engine.sim import simulate

    cfg.check()  # fail on a bad fleet before reading or simulating anything
    constants = cfg.btb
    if trace is None:
        trace = load_trace(cfg)

    sink: IO[str] | None = None
    if requests_out is not None:
        try:
            sink = open(requests_out, "w", encoding="utf-8")
        except OSError as e:
            raise ConfigError("requests_out", f"cannot write {os.fspath(requests_out)}: {e.strerror or e}") from None

    results = []
    simulated = 0
    t0 = time.perf_counter()
    try:
        for name in cfg.policies:
            try:
                res = simulate(
                    trace, name, cfg.cluster, constants, seed=cfg.seed, fidelity=cfg.fidelity, progress=progress
                )
            except ConfigError as e:
                key = f"cluster.{e.key}" if e.key in ClusterConfig.model_fields else e.key
                raise ConfigError(key, e.reason, e.path) from None
            results.append(res.summary())
            simulated += len(res.records)
            if sink is not None:
                for rec in res.records:
                    row = {
                        "arrival_s": rec.arrival_s,
                        "policy": name,
                        "replica": rec.replica,
                        "ttft_s": rec.ttft_s,
                        "queue_wait_s": rec.queue_wait_s,
                        "cached_tokens": rec.cached_tokens,
                        "kind": rec.kind,
                        "request_id": rec.request_id,
                    }
                    sink.write(json.dumps(round_floats(row), separators=(",", ":")) + "\n")
    finally:
        if sink is not None:
            sink.close()
    wall_s = time.perf_counter() - t0

    cl = cfg.cluster
    report = {
        "btbctl_version": __version__,
        "fidelity": cfg.fidelity,
        "seed": cfg.seed,
        "trace": {
            "path": cfg.trace.path,
            "format": _trace_format(cfg, trace),
            "requests": len(trace),
            "span_s": trace.span_s,
            "block_tokens": trace.block_tokens,
        },
        "cluster": {
            "model": cl.model,
            "gpu": cl.gpu,
            "gpus_per_replica": cl.gpus_per_replica,
            "replicas": cl.replicas,
            "nic_gbps": cl.nic_gbps,
        },
        "constants": constants.as_dict(),
        "results": results,
        "timing": {
            "wall_s": wall_s,
            "requests_per_s": simulated / wall_s if wall_s > 0 else None,
        },
    }
    return round_floats(report)


__all__ = [
    "DryRunConfig",
    "GenerateSection",
    "REQUEST_KEYS",
    "SIGNIFICANT_DIGITS",
    "TraceSource",
    "load_dryrun_config",
    "load_trace",
    "round_floats",
    "run_dry_run",
    "validate_config",
]
