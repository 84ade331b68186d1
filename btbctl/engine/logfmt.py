"""One structured log line per state change: ``event=<name> key=value ...`` (values with spaces, quotes, ``=`` or
newlines are double-quoted, ``None`` values left out), the format the node agent (:mod:`btbctl.engine.agent.events`)
and the gateway's copy executors use, so one ``grep event=`` follows a copy across processes."""

from __future__ import annotations

import logging


def _fmt(v: object) -> str:
    s = str(v)
    if not s or any(c in s for c in ' \t"=\n'):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ") + '"'
    return s


def format_event(event: str, fields: dict) -> str:
    """``event=<event> k=v ...`` (one line)."""
    return " ".join([f"event={event}"] + [f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None])


def log_event(logger: logging.Logger, event: str, **fields: object) -> None:
    """Log ``event`` with ``fields`` as one INFO line on ``logger``."""
    logger.info("%s", format_event(event, fields))


__all__ = ["format_event", "log_event"]
