"""The record of a fleet's last confirmed tuning: ``<run dir>/tuned.json``, ``{"constants": {...}, "policy",
"cluster_file", "at"}`` (``at``: Unix seconds).

One writer: the gateway, after every confirmed control-API write (``PUT /control/constants``), whoever sent it
(``btbctl tune``, the dashboard, a raw HTTP client); one reader: ``btbctl up`` (and ``up --gateway-only``), which
reapplies it. The file is written atomically with mode 0600 (:func:`~btbctl.engine.fileio.write_atomic`).
``cluster_file`` is the resolved absolute path of the cluster file the fleet was started with (None: the built-in
default fleet), so ``up`` reapplies a tuning only to the file it was made for, whatever directory it runs from.
"""

from __future__ import annotations

import json
import os
import time

from btbctl.engine.errors import BtbctlError, ConfigError
from btbctl.engine.fileio import RECORD_LIMIT_BYTES, ReadRefused, read_bounded, write_atomic

#: Name of the record inside a run directory.
TUNED_FILE = "tuned.json"


def _unusable(path: str | os.PathLike[str], why: str) -> BtbctlError:
    return BtbctlError(
        f"{path}: {why}; this is the fleet's recorded tuning, not your cluster file: delete {path} to start with "
        f"the cluster file's settings (or fix it)"
    )


def load_tuned(path: str | os.PathLike[str]) -> dict | None:
    """The record at ``path`` checked for reapplying (``{"constants": {...}, "policy", "cluster_file", "at"}``,
    ``constants`` validated as :class:`~btbctl.engine.constants.BtbConstants` keys, ``policy`` a live one), or
    None when there is no such file.

    Raises:
        BtbctlError: one line naming ``path`` (and the key and what is valid) when the file cannot be read, is
            not JSON, not an object, or holds an unknown key or a bad value; it says to delete or fix the file.
    """
    from btbctl.engine.constants import BtbConstants
    from btbctl.engine.policies import live_policy_error

    try:
        raw = read_bounded(path, limit_bytes=RECORD_LIMIT_BYTES)
    except FileNotFoundError:
        return None
    except ReadRefused as e:
        raise _unusable(path, f"cannot be read ({e})") from None
    except OSError as e:
        raise _unusable(path, f"cannot be read ({e.strerror or e})") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise _unusable(path, f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise _unusable(path, f"not a JSON object (a {type(data).__name__})")
    constants = data.get("constants") or {}
    if not isinstance(constants, dict):
        raise _unusable(path, f"constants: not an object; valid keys: {', '.join(BtbConstants.model_fields)}")
    try:
        BtbConstants.parse(constants, prefix="constants")
    except ConfigError as e:
        raise _unusable(path, f"{e.key}: {e.reason}") from None
    policy = data.get("policy")
    if policy is not None and (why := live_policy_error(policy)) is not None:
        raise _unusable(path, f"policy: {why}")
    cluster_file = data.get("cluster_file")
    if cluster_file is not None and not isinstance(cluster_file, str):
        raise _unusable(path, "cluster_file: not a string or null")
    return {**data, "constants": constants}


def save_tuned(path: str | os.PathLike[str], constants: dict, policy: str | None, cluster_file: str | None) -> None:
    """Record ``constants`` (the four, as the gateway holds them) and ``policy`` at ``path``, atomically, mode
    0600. Raises OSError when that fails (a full disk); the old record then stays as it was."""
    body = json.dumps({"constants": constants, "policy": policy, "cluster_file": cluster_file, "at": time.time()})
    write_atomic(path, (body + "\n").encode("utf-8"))


__all__ = ["TUNED_FILE", "load_tuned", "save_tuned"]
