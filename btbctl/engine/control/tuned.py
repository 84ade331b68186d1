"""The record of a fleet's last confirmed tuning: ``<run dir>/tuned.json``, ``{"constants": {...}, "policy",
"cluster_file", "at"}`` (``at``: Unix seconds).

One writer: the gateway, after every confirmed control-API write (``PUT /control/constants``), whoever sent it
(``btbctl tune``, the dashboard, a raw HTTP client); one reader: ``btbctl up`` (and ``up --gateway-only``), which
reapplies it. The file is written atomically with mode 0600 (:func:`~btbctl.engine.fileio.write_atomic`).
"""

from __future__ import annotations

import json
import os
import time

from btbctl.engine.fileio import RECORD_LIMIT_BYTES, ReadRefused, read_bounded, write_atomic

#: Name of the record inside a run directory.
TUNED_FILE = "tuned.json"


def load_tuned(path: str | os.PathLike[str]) -> dict | None:
    """The record at ``path`` (``{"constants": {...}, "policy", "cluster_file", "at"}``), or None when nothing was
    tuned or the file is unreadable or not that shape."""
    try:
        data = json.loads(read_bounded(path, limit_bytes=RECORD_LIMIT_BYTES).decode("utf-8"))
    except (OSError, ReadRefused, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("constants", {}), dict):
        return None
    return data


def save_tuned(path: str | os.PathLike[str], constants: dict, policy: str | None, cluster_file: str | None) -> None:
    """Record ``constants`` (the four, as the gateway holds them) and ``policy`` at ``path``, atomically, mode
    0600. Raises OSError when that fails (a full disk); the old record then stays as it was."""
    body = json.dumps({"constants": constants, "policy": policy, "cluster_file": cluster_file, "at": time.time()})
    write_atomic(path, (body + "\n").encode("utf-8"))


__all__ = ["TUNED_FILE", "load_tuned", "save_tuned"]
