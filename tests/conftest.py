"""Fixtures shared by the suite.

* ``_isolated_env`` (every test): no ``BTBCTL_DEBUG`` from the caller's shell (errors must be one line), and
  ``BTBCTL_RUN_DIR`` pointing into the test's own temporary folder, so a fleet started without ``--run-dir`` never
  lands in the user's state directory or in another test's (tests run in parallel with ``pytest -n auto``).
* ``cli_env``: a fixed terminal width (``COLUMNS=100``) for tests that compare the CLI's tables.
* ``run_dir``: a fleet's run directory in the test's temporary folder; whatever the test left running there is
  stopped afterwards (:func:`launcher_helpers.force_cleanup`).
* ``sshd`` (per module): a real OpenSSH server on 127.0.0.1 and 127.0.0.2 (:mod:`sshd_fixture`); skips with the
  reason where sshd is not installed.

Async test functions need no marker: ``asyncio_mode = "auto"`` (pyproject.toml) runs each on its own event loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from launcher_helpers import force_cleanup
from sshd_fixture import Sshd, start_sshd


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.delenv("BTBCTL_DEBUG", raising=False)
    monkeypatch.setenv("BTBCTL_RUN_DIR", str(tmp_path_factory.mktemp("run-dir") / "default"))


@pytest.fixture
def cli_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "run"
    yield d
    force_cleanup(d)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    """A loopback sshd for the whole test module."""
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()
