"""Errors the engine raises for bad user input.

Every user-facing failure is a :class:`BtbctlError`. The CLI prints ``str(err)`` as one line on stderr and exits
with status 2 (no traceback unless ``BTBCTL_DEBUG=1``). Anything else that escapes is a bug.
"""

from __future__ import annotations


class BtbctlError(Exception):
    """A user error: bad input, bad config, an impossible request. ``str()`` is one self-contained line."""

    exit_code = 2


class TraceFormatError(BtbctlError):
    """A trace file that cannot be read. The message names the file and, where known, the 1-based line."""

    def __init__(self, path: str | None, message: str, line: int | None = None) -> None:
        self.path = path
        self.line = line
        self.reason = message
        where = path or "<trace>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple[type[TraceFormatError], tuple[str | None, str, int | None]]:
        # pickled by a process pool or Ray: rebuilt from its fields, not from ``args``
        return (type(self), (self.path, self.reason, self.line))


class ConfigError(BtbctlError):
    """A bad setting. The message names the key (and file, if any) and what would be valid."""

    def __init__(self, key: str, message: str, path: str | None = None) -> None:
        self.key = key
        self.path = path
        self.reason = message
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{key}: {message}")

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str | None]]:
        # pickled by a process pool or Ray: rebuilt from its fields, not from ``args``
        return (type(self), (self.key, self.reason, self.path))


#: ``type`` of an HTTP API error answer by status when the caller names none (OpenAI's vocabulary).
API_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found",
    405: "invalid_request_error",
    409: "conflict",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "unavailable",
}


def api_error_body(status: int, message: str, kind: str | None = None, **extra: object) -> dict[str, object]:
    """The one shape of an HTTP error answer of the gateway and the emulated worker (OpenAI's):
    ``{"error": {"message", "type", "param": null, "code": status, ...extra}}``."""
    return {
        "error": {
            "message": message,
            "type": kind or API_ERROR_TYPES.get(status, "error"),
            "param": None,
            "code": status,
            **extra,
        }
    }
