"""A small synchronous client of the gateway's control API (``/control/...``), for the CLI.

Reads need no token; writes (``PUT /control/constants``, ``POST /control/replicate``) send
``Authorization: Bearer <token>`` with the token ``up`` wrote to the run directory. Every failure becomes a
one-line :class:`BtbctlError`: unreachable API, HTTP errors (with the server's ``error`` message when it sends one),
answers that are not JSON.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Callable

from btbctl.engine.constants import WARM_REPLICAS_ALIAS, BtbConstants
from btbctl.engine.copies import FINAL_STATES
from btbctl.engine.errors import BtbctlError, ConfigError

#: Seconds one control-API call may take (a product choice: the API answers from memory in milliseconds;
#: replication runs in the background and is polled).
DEFAULT_TIMEOUT_S = 10.0


class ControlClient:
    """Calls ``<base_url>/control/...``.

    Args:
        base_url: the control API's base URL (``http://127.0.0.1:30081``).
        token: bearer token for writes (None: reads only).
        timeout_s: per-call limit, seconds.
    """

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def get(self, path: str) -> Any:
        """``GET`` ``path`` (e.g. ``/control/fleet``) and return the decoded JSON."""
        return self._call("GET", path, None)

    def put(self, path: str, data: Any) -> Any:
        """``PUT`` JSON ``data`` to ``path`` with the bearer token; return the decoded JSON answer."""
        return self._call("PUT", path, data)

    def post(self, path: str, data: Any) -> Any:
        """``POST`` JSON ``data`` to ``path`` with the bearer token; return the decoded JSON answer."""
        return self._call("POST", path, data)

    def _call(self, method: str, path: str, data: Any) -> Any:
        url = self.base_url + path
        body = None
        headers = {"Accept": "application/json"}
        if data is not None:
            body = json.dumps(data).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token and method != "GET":
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise BtbctlError(f"control API {method} {path}: HTTP {e.code}: {_error_text(e)}") from None
        except urllib.error.URLError as e:
            reason = getattr(e.reason, "strerror", None) or e.reason
            raise BtbctlError(f"cannot reach the control API at {self.base_url}: {reason}") from None
        except (TimeoutError, OSError) as e:
            raise BtbctlError(f"cannot reach the control API at {self.base_url}: {e}") from None
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            raise BtbctlError(f"control API {method} {path}: the answer is not JSON") from None


def _error_text(e: urllib.error.HTTPError) -> str:
    try:
        raw = e.read()
    except OSError:
        raw = b""
    try:
        data = json.loads(raw)
    except ValueError:
        text = raw.decode("utf-8", "replace").strip()
        return (text[:300] or e.reason or "error").replace("\n", " ")
    if isinstance(data, dict):
        err = data.get("error", data.get("message", data.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)
    return str(data)[:300]




# ----------------------------------------------------------------------------------------------------------------
# operations built on the API: tune and replicate

#: Copy states after which a copy changes no more.
FINAL_COPY_STATES = tuple(str(s) for s in FINAL_STATES)
#: What ``btbctl tune`` sets besides the four constants.
POLICY_KEY = "policy"


def tune_keys() -> tuple[str, ...]:
    """Keys ``btbctl tune`` accepts: the four constants (:class:`~btbctl.engine.constants.BtbConstants`) and the
    routing policy."""
    return (*BtbConstants.keys(), POLICY_KEY)


def parse_tune_args(args: list[str]) -> dict:
    """Turn ``["prefix_blocks=16", "policy=btb", ...]`` into a validated partial update.

    Each constant is checked by :class:`~btbctl.engine.constants.BtbConstants` (the same bounds as a config file
    and the control API; ``replicas`` is read as ``warm_replicas``) and the policy against the registry, so a typo
    never reaches the fleet.

    Raises:
        ConfigError: a malformed argument, an unknown key (the valid ones are listed), a repeated key or a bad
            value (``btbctl tune`` and the key are named).
    """
    from btbctl.engine.policies import POLICIES

    where = "btbctl tune"
    out: dict = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        key = key.strip().replace("-", "_")
        raw = raw.strip()
        if not sep or not key or not raw:
            raise ConfigError(arg, "expected KEY=VALUE, e.g. threshold=3", where)
        if key == WARM_REPLICAS_ALIAS:
            key = "warm_replicas"
        if key not in tune_keys():
            raise ConfigError(key, f"unknown key; valid: {', '.join(tune_keys())}", where)
        if key in out:
            raise ConfigError(key, "given twice", where)
        if key == POLICY_KEY and raw not in POLICIES:
            raise ConfigError(key, f"unknown policy {raw!r}; valid: {', '.join(POLICIES)}", where)
        out[key] = raw
    consts = {k: v for k, v in out.items() if k != POLICY_KEY}
    if consts:
        parsed = BtbConstants.parse(consts, where=where, from_text=True)
        out.update({k: getattr(parsed, k) for k in consts})
    return out


def replicate(client: ControlClient, prefix: str, n: int, *, timeout_s: float = 120.0, poll_s: float = 0.2,
              on_progress: Callable[[list[dict]], None] | None = None) -> dict:
    """Copy one prefix to ``n`` more workers and wait for the copies to finish.

    ``POST /control/replicate {"prefix", "n"}`` starts the copies; ``GET /control/replications/{prefix}`` is polled
    every ``poll_s`` until every copy is ``done`` or ``failed`` or ``timeout_s`` passes. ``on_progress`` gets the
    copies' rows (``copy_id``, ``target``, ``state``, ``bytes_sent``, ``bytes_total``, ``error``) whenever they
    change.

    Returns:
        ``{"prefix", "source", "targets": [URL], "status", "bytes", "copies": [row], "holders": [URL],
        "skipped"}``: ``status`` is ``done`` (every copy arrived and was verified), ``partial`` (some failed),
        ``failed`` (all failed) or ``timeout``; ``bytes`` is the sum of bytes sent by the copies that finished.

    Raises:
        BtbctlError: bad prefix or ``n`` (checked here first), unknown or ambiguous prefix, no holder or no target
            (the gateway's message), or an unreachable control API.
    """
    import time

    from btbctl.engine.chains import check_prefix_id

    try:
        p = check_prefix_id(prefix)
    except ValueError as e:
        raise BtbctlError(f"--prefix: {e}") from None
    if not isinstance(n, int) or n < 1:
        raise BtbctlError(f"-n must be an integer >= 1, got {n!r}")
    started = client.post("/control/replicate", {"prefix": p, "n": n})
    if not isinstance(started, dict) or "copy_ids" not in started:
        raise BtbctlError("control API POST /control/replicate: unexpected answer")
    key = str(started.get("prefix", p))
    ids = [str(c) for c in started.get("copy_ids", [])]
    deadline = time.monotonic() + timeout_s
    last = None
    rows: list[dict] = []
    holders: list[str] = []
    status = "timeout"
    while True:
        rep = client.get(f"/control/replications/{key}")
        copies = rep.get("copies", []) if isinstance(rep, dict) else []
        holders = list(rep.get("holders", [])) if isinstance(rep, dict) else []
        by_id = {str(c.get("copy_id")): c for c in copies if isinstance(c, dict)}
        rows = [by_id.get(i, {"copy_id": i, "state": "planned"}) for i in ids]
        snapshot = [(r.get("state"), r.get("bytes_sent")) for r in rows]
        if snapshot != last:
            last = snapshot
            if on_progress is not None:
                on_progress(rows)
        if all(r.get("state") in FINAL_COPY_STATES for r in rows):
            done = sum(1 for r in rows if r.get("state") == "done")
            status = "done" if done == len(rows) else ("failed" if done == 0 else "partial")
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return {
        "prefix": key,
        "source": started.get("source"),
        "targets": list(started.get("targets", [])),
        "status": status,
        "bytes": sum(int(r.get("bytes_sent") or 0) for r in rows if r.get("state") == "done"),
        "copies": rows,
        "holders": holders,
        "skipped": started.get("skipped", 0),
    }


def client_for_run(run_dir: str | None = None, url: str | None = None, token: bool = True) -> ControlClient:
    """A client of the control API recorded in the run directory (or at ``url``), with the run's token when
    ``token`` is true. Raises :class:`BtbctlError` when no running fleet is recorded."""
    from btbctl.engine.launcher.rundir import RunDir

    rd = RunDir(run_dir)
    tok = None
    if url is None:
        state = rd.live_state()
        if not state.control_url:
            raise BtbctlError(f"the fleet recorded in {rd.path} has no control API yet (still starting?)")
        url = state.control_url
    if token:
        tok = rd.read_token()
    return ControlClient(url, tok)


__all__ = ["ControlClient", "DEFAULT_TIMEOUT_S", "client_for_run", "parse_tune_args", "replicate", "tune_keys"]
