"""``[[hosts]]`` entries of a cluster file: machines reached over SSH that run workers.

A cluster file lists each machine once and refers to it from ``[[workers]]`` by name::

    [[hosts]]
    name = "node-a"
    address = "10.0.0.11"           # what SSH connects to; workers bind to it too (see ``bind``)
    user = "serve"
    identity_file = "~/.ssh/id_ed25519"
    known_hosts = "~/.ssh/known_hosts"
    python = "/opt/btbctl/venv/bin/python"

    [[workers]]
    host = "node-a"                 # a [[hosts]] name: started there over SSH
    count = 2

Only key and agent authentication are used (never a password or keyboard-interactive prompt), and the server's
host key must be listed in ``known_hosts``. Names, addresses, users and environment keys are checked against
narrow patterns here; every other string (paths, the Python, the command prefix, environment values) only ever
reaches the remote shell quoted (:func:`shlex.join`).
"""

from __future__ import annotations

import os
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from btbctl.engine.netaddr import check_hostname, is_address, is_loopback

#: Default SSH port (IANA).
DEFAULT_SSH_PORT = 22
#: Seconds allowed to connect and authenticate to one host; the TCP+SSH handshake takes well under a second on a
#: working network, so ten seconds only ever runs out on a dead or filtered host.
DEFAULT_CONNECT_TIMEOUT_S = 10.0
#: Seconds allowed for everything ``up`` does on one host before its workers report ready (connect, copy the
#: token, launch); waiting for readiness has its own per-worker timeout (``workers.N.ready_timeout_s``).
DEFAULT_START_TIMEOUT_S = 30.0
#: Remote working directory when none is given, relative to the remote user's home (SSH sessions start there).
DEFAULT_WORKDIR = ".btbctl"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
#: POSIX portable user names (letters, digits, '.', '_', '-', not starting with '-').
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class HostSpec(BaseModel):
    """One ``[[hosts]]`` entry: a machine reached over SSH."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)

    name: str
    """Name the ``[[workers]]`` entries use in their ``host`` key (1-63 letters, digits, '_', '.', '-')."""
    address: str
    """Host name or IP address SSH connects to (and, unless ``bind`` is set, the address its workers bind to and
    the gateway reaches them at)."""
    port: int = Field(DEFAULT_SSH_PORT, ge=1, le=65535)
    """SSH port (22)."""
    user: str | None = None
    """Remote user; default: the local user running btbctl."""
    identity_file: str | None = None
    """Private key file (``~`` expands); default: the SSH agent and the usual ``~/.ssh/id_*`` keys."""
    known_hosts: str = "~/.ssh/known_hosts"
    """known_hosts file holding this host's key (``~`` expands). An unknown or changed key is refused."""
    python: str = "python3"
    """Remote Python that runs ``-m btbctl worker`` / ``-m sglang.launch_server`` (a venv's ``bin/python`` picks
    that environment); a worker's own ``python`` key wins."""
    command_prefix: list[str] = Field(default_factory=list)
    """argv elements put before every worker command on this host (for example ``["nice", "-n", "5"]`` or a
    wrapper that loads modules); each element is quoted, never parsed by a shell."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment for every worker on this host (a worker entry's ``env`` wins on conflicts)."""
    workdir: str = DEFAULT_WORKDIR
    """Remote working directory (relative paths are under the remote home). Each run keeps its logs, exit status
    files and worker token in ``<workdir>/runs/<run id>``."""
    bind: str | None = None
    """Address workers bind to and the gateway connects to; default: ``address``."""
    connect_timeout_s: float = Field(DEFAULT_CONNECT_TIMEOUT_S, gt=0)
    """Seconds to connect and authenticate (10)."""
    start_timeout_s: float = Field(DEFAULT_START_TIMEOUT_S, gt=0)
    """Seconds for connecting, preparing and launching every worker of this host (30)."""

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(
                "must be 1-63 characters of letters, digits, '_', '.', '-' (starting with a letter or digit)"
            )
        return v

    @field_validator("address", "bind")
    @classmethod
    def _address_ok(cls, v: str | None) -> str | None:
        return v if v is None else check_hostname(v)

    @field_validator("user")
    @classmethod
    def _user_ok(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError(f"{v!r} is not a user name (letters, digits, '_', '.', '-', not starting with '-')")
        return v

    @field_validator("env")
    @classmethod
    def _env_ok(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_KEY.match(key):
                raise ValueError(f"environment name {key!r} is not a valid variable name")
        return v

    @field_validator("python", "workdir")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v or "\0" in v or "\n" in v:
            raise ValueError("must be a non-empty single-line string")
        return v

    @property
    def bind_address(self) -> str:
        """Where this host's workers listen (``bind`` or ``address``)."""
        return self.bind or self.address

    @property
    def login(self) -> str:
        """The remote user name (``user`` or the local one)."""
        if self.user:
            return self.user
        import getpass

        return getpass.getuser()

    def key_paths(self) -> tuple[str | None, str]:
        """``(identity file, known_hosts file)`` with ``~`` expanded."""
        ident = os.path.expanduser(self.identity_file) if self.identity_file else None
        return ident, os.path.expanduser(self.known_hosts)


__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_SSH_PORT",
    "DEFAULT_START_TIMEOUT_S",
    "DEFAULT_WORKDIR",
    "HostSpec",
    "check_hostname",
    "is_address",
    "is_loopback",
]
