"""Validated configuration shared by ``dry-run``, ``sweep`` and (later) ``up``.

One config tree (pydantic). Every field has a docstring; a bad value raises :class:`ConfigError` naming the key and
what is valid (see :func:`validate`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from btbctl.engine.constants import BtbConstants
from btbctl.engine.costmodel import (
    DEFAULT_HBM_EFFICIENCY,
    DEFAULT_MAX_RUNNING,
    DEFAULT_MEM_FRACTION,
    DEFAULT_MFU,
    ReplicaCost,
    default_chunked_prefill_tokens,
    gpu_preset,
    model_preset,
)
from btbctl.engine.errors import ConfigError

Fidelity = Literal["realistic", "infersim"]
FIDELITIES = ("realistic", "infersim")


class ClusterConfig(BaseModel):
    """A fleet of identical replicas. Defaults: the published BTB setting, 4 replicas of Llama-3.3-70B on
    4xH100 with 400 Gb/s (50 GB/s) of NIC per GPU (REFERENCE.md s1, s2)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str = "llama-3.3-70b"
    """Model preset name (``btbctl presets``)."""
    gpu: str = "h100"
    """GPU preset name (``btbctl presets``)."""
    gpus_per_replica: int = Field(4, ge=1, le=64)
    """TP degree: GPUs per replica."""
    replicas: int = Field(4, ge=1, le=1024)
    """Replicas in the fleet."""
    nic_gbps: float = Field(400.0, gt=0)
    """NIC bandwidth per GPU, gigabits per second (400 = ConnectX-7 400G = 50 GB/s, the Infer-Sim H100 figure)."""
    mem_fraction: float = Field(DEFAULT_MEM_FRACTION, gt=0, le=1)
    """Fraction of HBM for weights + KV (SGLang ``--mem-fraction-static``)."""
    chunked_prefill_tokens: int | None = Field(None, ge=64)
    """Prefill chunk size in tokens (SGLang ``--chunked-prefill-size``); None = SGLang's default for the GPU."""
    max_running: int = Field(DEFAULT_MAX_RUNNING, ge=1)
    """Most requests a replica runs at once (SGLang ``--max-running-requests``)."""
    mfu: float = Field(DEFAULT_MFU, gt=0, le=1)
    """Achieved fraction of peak FLOP/s in prefill."""
    hbm_efficiency: float = Field(DEFAULT_HBM_EFFICIENCY, gt=0, le=1)
    """Achieved fraction of HBM bandwidth in decode."""
    precision: Literal["bf16", "fp8"] = "bf16"
    """Weights/activation precision (``btbctl.engine.costmodel.PRECISIONS``): ``bf16`` (the preset's weight bytes at
    the BF16 tensor-core peak) or ``fp8`` (1-byte weights at the FP8 peak, 2x BF16: prefill compute halves; NVIDIA
    datasheets). Separate from ``kv_dtype``."""
    kv_dtype: Literal["auto", "bf16", "fp8"] = "auto"
    """KV-cache element type (``btbctl.engine.costmodel.KV_DTYPES``, SGLang ``--kv-cache-dtype``): ``auto`` (the
    preset's, BF16 for the BF16 checkpoints), ``bf16`` or ``fp8`` (half the KV bytes to store and to copy)."""

    def replica_cost(
        self, *, attention_term: bool = True, mem_fraction: float | None = None, step_overhead_s: float | None = None
    ) -> ReplicaCost:
        """The cost model of one replica. Raises :class:`ConfigError` for unknown presets or a model that does not
        fit its GPUs."""
        kw = {}
        if step_overhead_s is not None:
            kw["step_overhead_s"] = step_overhead_s
        return ReplicaCost(
            model=model_preset(self.model),
            gpu=gpu_preset(self.gpu),
            gpus_per_replica=self.gpus_per_replica,
            nic_gbps=self.nic_gbps,
            mem_fraction=self.mem_fraction if mem_fraction is None else mem_fraction,
            mfu=self.mfu,
            hbm_efficiency=self.hbm_efficiency,
            attention_term=attention_term,
            precision=self.precision,
            kv_dtype=self.kv_dtype,
            **kw,
        )

    def chunk_tokens(self) -> int:
        """The effective prefill chunk size in tokens."""
        if self.chunked_prefill_tokens is not None:
            return self.chunked_prefill_tokens
        return default_chunked_prefill_tokens(gpu_preset(self.gpu))


def validate(model_cls: type[BaseModel], data: dict, path: str | None = None, prefix: str = ""):
    """Build ``model_cls`` from ``data``; turn the first pydantic error into a one-line :class:`ConfigError` that
    names the dotted key and what is valid."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
        if prefix:
            key = f"{prefix}.{key}"
        msg = clean_message(err.get("msg", "invalid value"))
        if err.get("type") == "extra_forbidden":
            owner = _model_at(model_cls, tuple(err.get("loc", ()))[:-1])
            fields = ", ".join(owner.model_fields)
            msg = f"unknown key; valid keys: {fields}"
        raise ConfigError(key, msg, path) from None


def clean_message(msg: str) -> str:
    """A pydantic error message without its ``Value error, `` / ``Assertion failed, `` prefix."""
    for lead in ("Value error, ", "Assertion failed, "):
        if msg.startswith(lead):
            return msg[len(lead) :]
    return msg


def _model_at(model_cls: type[BaseModel], loc: tuple) -> type[BaseModel]:
    """The (nested) pydantic model that owns the key at ``loc`` (list indices and Optional unwrapped)."""
    import typing

    cls = model_cls
    for part in loc:
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            continue  # a list index or dict key: stay on the element model found so far
        ann = field.annotation
        candidates = [ann, *typing.get_args(ann)]
        for arg in list(candidates):
            candidates.extend(typing.get_args(arg))
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            break
        cls = nested[0]
    return cls


def read_toml(path, what: str = "config") -> dict:
    """Parse the TOML file at ``path`` into plain data.

    Raises:
        ConfigError: the file cannot be read (``cannot read <what>``), is not UTF-8, or is not valid TOML (the key
            position names the 1-based line and column).
    """
    import os
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib

    from btbctl.engine.fileio import CONFIG_LIMIT_BYTES, ReadRefused, read_bounded

    spath = os.fspath(path)
    try:
        raw = read_bounded(spath, limit_bytes=CONFIG_LIMIT_BYTES)
    except ReadRefused as e:
        raise ConfigError("file", f"cannot read {what}: {e}", spath) from None
    except OSError as e:
        raise ConfigError("file", f"cannot read {what}: {e.strerror or e}", spath) from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError("file", f"not UTF-8 text ({e.reason} at byte {e.start})", spath) from None
    except tomllib.TOMLDecodeError as e:
        raise toml_error(spath, e) from None
    except RecursionError:
        raise ConfigError("file", f"cannot read {what}: arrays or tables nested too deeply", spath) from None


def toml_key_line(path: str, key: str) -> int | None:
    """The 1-based line of ``path`` (a TOML file) where dotted ``key`` (``gateway.port``, ``workers.1.count``: an
    index counts the ``[[workers]]`` tables) is set, or, for a key the file does not set, the header of the deepest
    table of it that the file has; None when neither is found or the file cannot be read. A plain line scan (table
    headers and ``key =`` lines, dotted keys included; a key set inside an inline table is found at the line of that
    table's key): good enough to point a user at a line, never used to read values."""
    from btbctl.engine.fileio import CONFIG_LIMIT_BYTES, ReadRefused, read_bounded

    try:
        text = read_bounded(path, limit_bytes=CONFIG_LIMIT_BYTES).decode("utf-8", "replace")
    except (OSError, ReadRefused):
        return None
    want = key.split(".")
    table: list[str] = []
    arrays: dict[tuple[str, ...], int] = {}
    best: tuple[int, int] | None = None  # (depth, line) of the deepest header on the key's path

    def indexed(name: list[str]) -> list[str]:
        """``name`` with the current index after each array of tables on its way (``workloads.trace`` inside the
        second ``[[workloads]]``: ``workloads.1.trace``)."""
        out: list[str] = []
        for i, part in enumerate(name):
            out.append(part)
            n = arrays.get(tuple(name[: i + 1]))
            if n is not None and i < len(name) - 1:
                out.append(str(n))
        return out

    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("[["):
            name = [p.strip().strip('"') for p in line[2:].split("]]", 1)[0].split(".")]
            n = arrays[tuple(name)] = arrays.get(tuple(name), -1) + 1
            table = [*indexed(name), str(n)]
        elif line.startswith("["):
            table = indexed([p.strip().strip('"') for p in line[1:].split("]", 1)[0].split(".")])
        elif "=" in line and not line.startswith("#"):
            full = table + [p.strip().strip('"') for p in line.split("=", 1)[0].split(".")]
            if full == want[: len(full)]:
                return lineno
            continue
        else:
            continue
        if table == want[: len(table)] and (best is None or len(table) > best[0]):
            best = (len(table), lineno)
    return best[1] if best is not None else None


def toml_error(path: str, err: Exception) -> ConfigError:
    """A :class:`ConfigError` for a TOML syntax error, with the 1-based line (and column) in the key position."""
    import re

    msg = str(err)
    line = getattr(err, "lineno", None)
    col = getattr(err, "colno", None)
    m = re.search(r"\(at line (\d+), column (\d+)\)\s*$", msg)
    if m:
        line, col = line or int(m.group(1)), col or int(m.group(2))
        msg = msg[: m.start()].rstrip()
    elif hasattr(err, "msg"):
        msg = err.msg
    where = f"line {line}" + (f", column {col}" if col else "") if line else "TOML"
    return ConfigError(where, f"invalid TOML: {msg}", path)


__all__ = [
    "BtbConstants",
    "ClusterConfig",
    "FIDELITIES",
    "Fidelity",
    "clean_message",
    "read_toml",
    "toml_error",
    "validate",
]
