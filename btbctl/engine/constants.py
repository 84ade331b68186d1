"""BTB's four tuning constants: the one definition every config section, flag, control-API key and dashboard field
derives from.

Defaults are the published ones (Birmiwal & Bhat, "Biting the Bullet", 2026-07-22; REFERENCE.md s1). Upper bounds
are sanity limits far beyond any real setting (a 2**20-block prefix is 268M tokens at 256 tokens per block; a
day-long window; thousands of replicas), so a typo cannot make the detector track absurd state.

Names: ``warm_replicas`` is BTB's M (how many replicas should hold a hot prefix); the fleet size is ``replicas``
everywhere else. ``replicas`` is still accepted for M as an input alias (config files, ``btbctl tune``, the
control API) where it cannot be confused with the fleet size, so files written before the rename keep working.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from btbctl.engine.errors import ConfigError

#: Largest ``prefix_blocks`` and ``threshold`` accepted.
MAX_COUNT = 1 << 20
#: Largest ``warm_replicas`` accepted.
MAX_WARM_REPLICAS = 4096
#: Largest ``window_s`` accepted, seconds (one day).
MAX_WINDOW_S = 86400.0
#: The old spelling of ``warm_replicas`` (accepted on input, documented in the README).
WARM_REPLICAS_ALIAS = "replicas"

#: Bound on the cache-aware prefix tree (``cache_aware``, ``btb``'s fallback), all workers together, in blocks
#: (tree nodes): the gateway's ``cache_tree_max_blocks`` default and the simulators' tree. Four times the SGLang
#: router's per-worker bound (65,536 blocks of 256 tokens; REFERENCE.md s4), so the published fleet of 4 replicas
#: fits whole and larger fleets share it instead of multiplying it: 2**18 blocks are 67M tokens of distinct
#: prompts at 256 tokens per block, about 135 MiB (see ``cache_aware.NODE_BYTES``). A product choice.
CACHE_TREE_MAX_BLOCKS = 1 << 18
#: Bound on the same tree's estimated bytes (``cache_aware.BlockPrefixTree.estimated_bytes``), all workers
#: together: the gateway's ``cache_tree_max_bytes`` default. It binds before the block bound once blocks are held by
#: several workers each (every extra worker on a block costs an entry). A product choice.
CACHE_TREE_MAX_BYTES = 256 << 20
#: Smallest ``cache_tree_max_bytes`` accepted (below it the bound would hold next to nothing).
MIN_CACHE_TREE_BYTES = 1 << 20


class BtbConstants(BaseModel):
    """The four constants of Biting the Bullet (immutable; :meth:`with_updates` makes a validated copy).

    Build user-given values with :meth:`parse` (one-line :class:`ConfigError` naming the key); as a section of a
    config model it validates like any pydantic field (the config loader names the file and the dotted key)."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=True,
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        populate_by_name=True,
    )

    prefix_blocks: int = Field(256, ge=1, le=MAX_COUNT)
    """Y: length of the matched and copied prefix, in KV blocks (pages) of the trace's or the gateway's block size
    (256 blocks x 256 tokens = 65,536 tokens). Prompts with fewer blocks never trigger."""
    threshold: int = Field(2, ge=1, le=MAX_COUNT)
    """X: arrivals of the same Y-block prefix inside the window that fire replication."""
    window_s: float = Field(1.0, gt=0, le=MAX_WINDOW_S)
    """Z: trailing detection window, seconds."""
    warm_replicas: int = Field(
        4, ge=1, le=MAX_WARM_REPLICAS, validation_alias=AliasChoices("warm_replicas", WARM_REPLICAS_ALIAS)
    )
    """M: how many replicas should hold a hot prefix, the holder included (not the fleet size)."""

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and WARM_REPLICAS_ALIAS in data and "warm_replicas" in data:
            raise ValueError(f"{WARM_REPLICAS_ALIAS} is an alias of warm_replicas; give only one of them")
        return data

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The four keys, in table order."""
        return tuple(cls.model_fields)

    @classmethod
    def parse(
        cls, data: Mapping[str, Any], *, where: str | None = None, prefix: str = "", from_text: bool = False
    ) -> BtbConstants:
        """Build from a mapping (a config section, a control-API body, parsed ``KEY=VALUE`` arguments).

        Args:
            data: any of the four keys (``replicas`` is read as ``warm_replicas``).
            where: what the data came from (a file, ``btbctl tune``, ...), named first in errors.
            prefix: dotted path of the section (``btb``), named before the key in errors.
            from_text: values are strings typed by a person (``"3"``, ``"0.5"``): numbers are parsed from text;
                otherwise types are strict (no bools as numbers, no strings).

        Raises:
            ConfigError: an unknown key, a duplicate (``replicas`` with ``warm_replicas``), or a bad value; the
                message names ``where``, the dotted key and what is valid.
        """
        data = dict(data)
        if from_text:
            data = {k: _number_from_text(v, k, where, prefix) for k, v in data.items()}
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise constants_error(e, where, prefix) from None

    @classmethod
    def describe(cls, key: str) -> str:
        """What a valid value of ``key`` is (``an integer in [1, 1048576]``), from the field's bounds; for an
        unknown key, the valid keys."""
        name = "warm_replicas" if key == WARM_REPLICAS_ALIAS else key
        field = cls.model_fields.get(name)
        if field is None:
            return f"one of {', '.join(cls.keys())}"
        lo = hi = None
        closed_lo = True
        for m in field.metadata:
            if getattr(m, "ge", None) is not None:
                lo = m.ge
            if getattr(m, "gt", None) is not None:
                lo, closed_lo = m.gt, False
            if getattr(m, "le", None) is not None:
                hi = m.le
        kind = "an integer" if field.annotation is int else "a number"
        if lo is None or hi is None:  # every constant has both bounds today
            return kind
        return f"{kind} in {'[' if closed_lo else '('}{_num(lo)}, {_num(hi)}]"

    def with_updates(self, **changes: Any) -> BtbConstants:
        """A validated copy with ``changes`` applied (``replicas`` is read as ``warm_replicas``).

        Raises:
            ConfigError: an unknown key or a bad value (the key is named as given).
        """
        unknown = set(changes) - set(self.keys()) - {WARM_REPLICAS_ALIAS}
        if unknown:
            key = sorted(unknown)[0]
            raise ConfigError(key, f"unknown constant; valid: {', '.join(self.keys())}")
        base = self.model_dump()
        if WARM_REPLICAS_ALIAS in changes:
            del base["warm_replicas"]
        return self.parse({**base, **changes})

    def as_dict(self) -> dict[str, Any]:
        """``{"prefix_blocks", "threshold", "window_s", "warm_replicas"}``."""
        return self.model_dump()


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _number_from_text(value: Any, key: str, where: str | None, prefix: str) -> Any:
    """``"3"`` -> 3 for the integer keys, ``"0.5"`` -> 0.5 for ``window_s``; other values are left to validation."""
    if not isinstance(value, str):
        return value
    name = "warm_replicas" if key == WARM_REPLICAS_ALIAS else key
    field = BtbConstants.model_fields.get(name)
    if field is None:
        return value
    text = value.strip()
    try:
        if field.annotation is int:
            return int(text)
        number = float(text)
    except ValueError:
        kind = "an integer" if field.annotation is int else "a number"
        raise ConfigError(_dotted(prefix, key), f"must be {kind}, got {value!r}", where) from None
    if not math.isfinite(number):
        raise ConfigError(_dotted(prefix, key), f"must be a finite number, got {value!r}", where)
    return number


def constants_error(e: ValidationError, where: str | None = None, prefix: str = "") -> ConfigError:
    """The first error of a :class:`BtbConstants` validation as a one-line :class:`ConfigError`: the key (as given)
    and what a valid value is."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    if err.get("type") == "extra_forbidden":
        return ConfigError(_dotted(prefix, loc[0]), f"unknown key; valid keys: {', '.join(BtbConstants.keys())}", where)
    if not loc:  # the model-level check (both spellings of M given)
        msg = err.get("msg", "invalid value")
        return ConfigError(_dotted(prefix, WARM_REPLICAS_ALIAS), msg.removeprefix("Value error, "), where)
    key = loc[0]
    return ConfigError(_dotted(prefix, key), f"must be {BtbConstants.describe(key)}, got {err.get('input')!r}", where)


__all__ = [
    "BtbConstants",
    "CACHE_TREE_MAX_BLOCKS",
    "CACHE_TREE_MAX_BYTES",
    "MIN_CACHE_TREE_BYTES",
    "MAX_COUNT",
    "MAX_WARM_REPLICAS",
    "MAX_WINDOW_S",
    "WARM_REPLICAS_ALIAS",
    "constants_error",
]
