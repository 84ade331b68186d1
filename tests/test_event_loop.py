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


def test_not_allowed_means_asyncio(monkeypatch):
    monkeypatch.delenv(aiotasks.NO_UVLOOP_ENV, raising=False)
    assert aiotasks.loop_factory(allow_uvloop=False) is None
    module, _ = aiotasks.run(_loop_kind(), allow_uvloop=False)
    assert module.startswith("asyncio")


@pytest.mark.parametrize(("nofile", "allowed"), [(256, False), (1024, False), (1 << 14, True), (1 << 20, True)])
def test_gateway_runs_on_uvloop_only_with_descriptors_to_spare(monkeypatch, nofile, allowed):
    from btbctl.engine.gateway import server
    from btbctl.engine.gateway.config import GatewayConfig

    seen = {}

    def fake_run(main, allow_uvloop=True):
        main.close()
        seen["allow"] = allow_uvloop

    monkeypatch.setattr(server, "nofile_target", lambda: nofile)
    monkeypatch.setattr(server.aiotasks, "run", fake_run)
    server.run_gateway(GatewayConfig(workers=["http://127.0.0.1:1"]))
    assert seen["allow"] is allowed


@pytest.mark.parametrize(
    ("limits", "target"),
    [((1024, 4096), 4096), ((4096, 4096), 4096), ((1024, -1), 1 << 20), ((-1, -1), 1 << 20), ((2 << 20, -1), 2 << 20)],
)
def test_nofile_target_is_what_raise_nofile_aims_at(monkeypatch, limits, target):
    import resource

    from btbctl.engine import netguard as guard

    inf = resource.RLIM_INFINITY
    soft, hard = (inf if x == -1 else x for x in limits)
    monkeypatch.setattr(guard.resource, "getrlimit", lambda _: (soft, hard))
    assert guard.nofile_target() == target
