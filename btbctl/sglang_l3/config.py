"""The ``--hicache-storage-backend-extra-config`` of btbctl's L3 backend: its keys, SGLang's, and their parsing.

Standard library only: the launcher builds this JSON, the emulated worker reads it the way SGLang and
:class:`~btbctl.sglang_l3.store.BtbL3Store` do, and neither needs torch or SGLang for that.

SGLang 0.5.23 reads and removes some keys before the backend sees the rest (``hybrid_cache_controller.py:378-438``,
``unified_radix_cache.py:484-501``): :data:`SGLANG_CONSUMED` with their defaults. The backend itself reads
:data:`OWN_KEYS` and ignores :data:`SGLANG_KEYS` (SGLang's own switches, or keys of other backends).
"""

from __future__ import annotations

import json
import os
from urllib.parse import urlsplit

#: Default agent socket (``btbctl agent --socket`` uses the same default).
DEFAULT_AGENT_SOCKET = "/run/btbctl/agent.sock"
#: Environment variable overriding the default socket.
AGENT_SOCKET_ENV = "BTBCTL_AGENT_SOCKET"
#: Default bound of one call to the agent, seconds (a product choice: a local round trip takes tens of
#: microseconds; under ``wait_complete`` a stuck call would stall the request, so the bound is short).
DEFAULT_TIMEOUT_S = 2.0
#: Extra-config keys the backend reads. ``worker_url``: the URL the gateway knows this worker by; the backend names
#: it in its ``hello`` so that the node agent can announce which workers it serves (optional).
OWN_KEYS = ("agent_socket", "timeout_s", "worker_url")
#: Keys SGLang itself leaves in ``extra_config`` (``backend_factory.py:140-151``, ``unified_radix_cache.py:497-501``,
#: ``cache_controller.py:664``) or that belong to other backends and are ignored here.
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "file_storage_path",
    "enable_metadata_cache",
    "metadata_ttl",
)
#: Keys SGLang consumes (and removes) before the backend is built, with SGLang 0.5.23's defaults: a prefetch is
#: issued only for at least ``prefetch_threshold`` tokens beyond the device and host hit; under the ``timeout``
#: prefetch policy a request waits at most ``prefetch_timeout_base + prefetch_timeout_per_ki_token x pages x
#: page_size / 1024`` seconds for it (``unified_radix_cache.py:484-492``, ``2259-2271``).
SGLANG_CONSUMED = {
    "prefetch_threshold": 256,
    "prefetch_timeout_base": 1.0,
    "prefetch_timeout_per_ki_token": 0.25,
    "hicache_storage_pass_prefix_keys": False,
    "tp_lcm_size": None,
}


def parse_extra_config(extra: dict | None) -> tuple[str, float, bool]:
    """``(agent_socket, timeout_s, interface_v1)`` from the extra config the backend receives (SGLang's consumed
    keys already removed). Raises ValueError (one line, naming the key and what is valid)."""
    extra = dict(extra or {})
    unknown = sorted(k for k in extra if k not in OWN_KEYS + SGLANG_KEYS)
    if unknown:
        raise ValueError(
            f"BtbL3Store: unknown extra-config key {unknown[0]!r}; valid: {', '.join(OWN_KEYS)} "
            f"(plus SGLang's {', '.join(SGLANG_KEYS[:4])})"
        )
    sock = extra.get("agent_socket", os.environ.get(AGENT_SOCKET_ENV) or DEFAULT_AGENT_SOCKET)
    if not isinstance(sock, str) or not sock:
        raise ValueError("BtbL3Store: agent_socket must be a non-empty path string")
    timeout = extra.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60:
        raise ValueError(f"BtbL3Store: timeout_s must be a number of seconds in (0, 60], got {timeout!r}")
    return sock, float(timeout), bool(extra.get("interface_v1", 0))


def worker_url_ok(url: str) -> bool:
    """Whether ``url`` looks like a worker's base URL (``http(s)://host:port``, at most 2,048 characters)."""
    p = urlsplit(url)
    return len(url) <= 2048 and p.scheme in ("http", "https") and bool(p.hostname)


def worker_url_of(extra: dict) -> str | None:
    """The extra config's ``worker_url`` (None when absent). Raises ValueError with one line when malformed."""
    url = extra.get("worker_url")
    if url is None:
        return None
    if not isinstance(url, str) or not worker_url_ok(url):
        raise ValueError(f"BtbL3Store: worker_url must look like http://host:port, got {url!r}")
    return url.rstrip("/")


def load_extra_config(text: str | None) -> dict:
    """The extra config as SGLang reads ``--hicache-storage-backend-extra-config``: inline JSON, or ``@PATH`` of a
    JSON file (SGLang also takes YAML and TOML files; only JSON here). Raises ValueError with one line."""
    if text is None or text == "":
        return {}
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read the extra config file {text[1:]}: {e.strerror or e}") from None
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the extra config is not a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("the extra config must be a JSON object")
    return obj


def split_consumed(extra: dict) -> tuple[dict, dict]:
    """``(SGLang's consumed keys with defaults filled in, the rest for the backend)``."""
    consumed = {k: extra.get(k, v) for k, v in SGLANG_CONSUMED.items()}
    rest = {k: v for k, v in extra.items() if k not in SGLANG_CONSUMED}
    return consumed, rest


__all__ = [
    "AGENT_SOCKET_ENV",
    "DEFAULT_AGENT_SOCKET",
    "DEFAULT_TIMEOUT_S",
    "OWN_KEYS",
    "SGLANG_CONSUMED",
    "SGLANG_KEYS",
    "load_extra_config",
    "parse_extra_config",
    "split_consumed",
    "worker_url_of",
    "worker_url_ok",
]
