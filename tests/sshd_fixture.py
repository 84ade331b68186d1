"""A real OpenSSH server on loopback for the SSH launcher tests.

:func:`start_sshd` makes a host key, a client key, ``authorized_keys`` and a ``known_hosts`` file in a temporary
folder, writes an ``sshd_config`` that listens on 127.0.0.1 and 127.0.0.2 (two "hosts" on one machine) at a free
port, and runs ``sshd -D -e`` as a child process. Tests that need it call :func:`require_sshd`, which skips them
with the reason when ``sshd`` or ``ssh-keygen`` is not installed (``apt-get install openssh-server``).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
HOSTS = ("127.0.0.1", "127.0.0.2")


def sshd_path() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    for p in SSHD_CANDIDATES:
        if os.access(p, os.X_OK):
            return p
    return None


def require_sshd() -> str:
    """The sshd binary, or skip the test with the reason."""
    path = sshd_path()
    if path is None:
        pytest.skip(
            "sshd is not installed (apt-get install openssh-server); the SSH launcher tests need a real "
            "sshd on loopback"
        )
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (openssh-client)")
    if not sys.platform.startswith("linux"):
        pytest.skip("the loopback SSH tests use 127.0.0.2, which only Linux routes to lo without setup")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the same port must be free on 127.0.0.2 too
    with socket.socket() as s:
        s.bind(("127.0.0.2", port))
    return port


@dataclass
class Sshd:
    """A running sshd and the files a client needs.

    Attributes:
        port: the port it listens on, on both addresses.
        client_key: private key accepted for the current user.
        known_hosts: a known_hosts file listing the server key for both addresses at ``port``.
        other_key_known_hosts: a known_hosts file listing a different key for both (a "changed host key").
        user: the login.
        proc: the sshd process.
        dir: the folder holding all of it.
    """

    port: int
    client_key: Path
    known_hosts: Path
    other_key_known_hosts: Path
    user: str
    proc: subprocess.Popen
    dir: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _keygen(path: Path) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "btbctl-test", "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return (path.with_suffix(".pub")).read_text().split(None, 2)[0:2]


def start_sshd(folder: Path) -> Sshd:
    """Start sshd on 127.0.0.1 and 127.0.0.2 with fresh keys under ``folder`` (see the module docstring)."""
    sshd = require_sshd()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    host_key = folder / "host_ed25519"
    client_key = folder / "client_ed25519"
    other_key = folder / "other_ed25519"
    htype, hkey = _keygen(host_key)
    ctype, ckey = _keygen(client_key)
    otype, okey = _keygen(other_key)
    (folder / "authorized_keys").write_text(f"{ctype} {ckey}\n")
    os.chmod(folder / "authorized_keys", 0o600)
    port = _free_port()
    known = folder / "known_hosts"
    known.write_text("".join(f"[{h}]:{port} {htype} {hkey}\n" for h in HOSTS))
    other = folder / "known_hosts_other"
    other.write_text("".join(f"[{h}]:{port} {otype} {okey}\n" for h in HOSTS))
    cfg = folder / "sshd_config"
    cfg.write_text(
        "\n".join(
            [
                f"Port {port}",
                *(f"ListenAddress {h}" for h in HOSTS),
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {folder / 'authorized_keys'}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PermitRootLogin prohibit-password",
                "MaxSessions 64",
                "MaxStartups 64",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    log = open(folder / "sshd.log", "wb")
    proc = subprocess.Popen(
        [sshd, "-D", "-e", "-f", str(cfg), "-o", "PidFile=none"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited with {proc.returncode}: {(folder / 'sshd.log').read_text()[-2000:]}")
        try:
            for h in HOSTS:
                with socket.create_connection((h, port), timeout=0.5):
                    pass
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("sshd did not listen within 10 s") from None
            time.sleep(0.05)
    return Sshd(
        port=port,
        client_key=client_key,
        known_hosts=known,
        other_key_known_hosts=other,
        user=getpass.getuser(),
        proc=proc,
        dir=folder,
    )


def host_table(server: Sshd, name: str, address: str, **over) -> dict:
    """A ``[[hosts]]`` entry (as a dict) reaching ``address`` through ``server``, running this Python."""
    entry = {
        "name": name,
        "address": address,
        "port": server.port,
        "user": server.user,
        "identity_file": str(server.client_key),
        "known_hosts": str(server.known_hosts),
        "python": sys.executable,
        "workdir": str(server.dir / "remote" / name),
        "env": {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        "connect_timeout_s": 5.0,
        "start_timeout_s": 20.0,
    }
    entry.update(over)
    return entry
