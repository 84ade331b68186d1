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
from typing import Any

from btbctl.engine.errors import BtbctlError

#: Seconds one control-API call may take (they answer from memory; replication runs in the background).
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


__all__ = ["ControlClient", "DEFAULT_TIMEOUT_S"]
