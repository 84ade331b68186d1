"""Structured log lines: ``event=<name> key=value ...`` (logfmt), one line per state change.

Values with spaces, tabs, quotes, ``=`` or newlines are double-quoted (newlines become spaces); fields whose value is
None are left out. The node agent (:mod:`btbctl.engine.agent.events`), the workers' transfer receivers
(:mod:`btbctl.engine.replication.tcp`) and the gateway's copy executors write their events this way, so one
``grep event=`` follows a copy across processes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping


def _fmt(v: object) -> str:
    s = str(v)
    if not s or any(c in s for c in ' \t"=\n'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
    return s


def format_event(event: str, fields: Mapping[str, object]) -> str:
    """``event=<event> k=v ...`` (one line)."""
    return " ".join([f"event={event}"] + [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None])


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: object) -> None:
    """Write one structured line ``event=<event> k=v ...`` on ``logger``."""
    if logger.isEnabledFor(level):
        logger.log(level, "%s", format_event(event, fields))


__all__ = ["format_event", "log_event"]
