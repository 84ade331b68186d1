"""The event loop a long-running server runs on (:func:`btbctl.engine.aiotasks.loop_factory`): uvloop when it is
installed, asyncio's own loop with ``BTBCTL_NO_UVLOOP`` set or without uvloop; :func:`~btbctl.engine.aiotasks.run`
runs a coroutine to its result on either. (The in-process gateway tests run on pytest-asyncio's stdlib loop; the
gateway child processes of ``test_gateway_hardening`` run on the loop picked here.)"""

from __future__ import annotations

import asyncio
import sys

import pytest

from btbctl.engine import aiotasks

needs_uvloop = pytest.mark.skipif(sys.version_info < (3, 11), reason="the loop factory needs Python 3.11")


async def _loop_kind() -> tuple[str, int]:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__, 42


@needs_uvloop
def test_uvloop_by_default(monkeypatch):
    uvloop = pytest.importorskip("uvloop")
    monkeypatch.delenv(aiotasks.NO_UVLOOP_ENV, raising=False)
    assert aiotasks.loop_factory() is uvloop.new_event_loop
    module, value = aiotasks.run(_loop_kind())
    assert module.startswith("uvloop") and value == 42


@pytest.mark.parametrize("flag", ["1", "yes"])
def test_env_turns_uvloop_off(monkeypatch, flag):
    monkeypatch.setenv(aiotasks.NO_UVLOOP_ENV, flag)
    assert aiotasks.loop_factory() is None
    module, value = aiotasks.run(_loop_kind())
    assert module.startswith("asyncio") and value == 42


def test_zero_or_empty_env_keeps_the_default(monkeypatch):
    monkeypatch.setenv(aiotasks.NO_UVLOOP_ENV, "0")
    zero = aiotasks.loop_factory()
    monkeypatch.setenv(aiotasks.NO_UVLOOP_ENV, "")
    assert aiotasks.loop_factory() is zero
    monkeypatch.delenv(aiotasks.NO_UVLOOP_ENV)
    assert aiotasks.loop_factory() is zero


def test_falls_back_without_uvloop(monkeypatch):
    monkeypatch.delenv(aiotasks.NO_UVLOOP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # "import uvloop" raises ImportError
    assert aiotasks.loop_factory() is None
    module, value = aiotasks.run(_loop_kind())
    assert module.startswith("asyncio") and value == 42


def test_run_propagates_exceptions(monkeypatch):
    async def boom() -> None:
        raise ValueError("x")

    for flag in ("1", ""):
        monkeypatch.setenv(aiotasks.NO_UVLOOP_ENV, flag)
        with pytest.raises(ValueError, match="x"):
            aiotasks.run(boom())
