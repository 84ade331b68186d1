"""Run-directory files written as one step: a control write the gateway cannot record in ``tuned.json`` (a full
disk) changes nothing (the gateway is set back, no ``tuned.json.tmp`` is left), and a failed token write never
leaves an empty ``control.token``."""

from __future__ import annotations

import errno
import os

import pytest

from btbctl.engine import fileio as fileio_mod
from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher import rundir as rundir_mod
from btbctl.engine.launcher.rundir import RunDir
from gateway_fakes import GatewayEnv


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_disk(monkeypatch, module) -> None:
    """Files ``module`` creates exist (empty) but every write to them fails with ENOSPC, as on a full disk: the
    descriptor handed back is ``/dev/full``'s."""
    real_open = os.open

    def fake_open(path, flags, mode=0o777, *a, **k):
        fd = real_open(path, flags, mode, *a, **k)
        if flags & os.O_CREAT:
            os.close(fd)
            return real_open("/dev/full", os.O_WRONLY)
        return fd

    monkeypatch.setattr(module.os, "open", fake_open)


async def test_a_write_the_gateway_cannot_record_is_undone_and_leaves_no_tmp(tmp_path, monkeypatch):
    rd = RunDir(str(tmp_path))
    rd.prepare()
    rd.save_tuned({"threshold": 2}, "btb", None)
    old = rd.tuned_path.read_bytes()
    async with GatewayEnv(2, policy="btb", tuned_file=str(rd.tuned_path)) as env:
        _full_disk(monkeypatch, fileio_mod)
        status, err = await env.put_control("/control/constants", {"threshold": 5, "policy": "round_robin"})
        monkeypatch.undo()
        assert status == 507 and "No space left" in err["error"]["message"] and "undone" in err["error"]["message"]
        assert env.gw.constants.threshold == 2 and env.gw.policy.name == "btb"  # the live change was set back
    assert rd.tuned_path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tuned")) == ["tuned.json"]


async def test_every_confirmed_control_write_is_recorded_whoever_sent_it(tmp_path):
    """A raw PUT, as the dashboard sends it (no CLI involved), lands in tuned.json with the cluster file."""
    rd = RunDir(str(tmp_path))
    rd.prepare()
    async with GatewayEnv(2, policy="btb", tuned_file=str(rd.tuned_path), cluster_file="fleet.toml") as env:
        status, _ = await env.put_control("/control/constants", {"threshold": 5, "policy": "round_robin"})
        assert status == 200
        saved = RunDir(str(tmp_path)).load_tuned()
        assert saved is not None and saved["constants"]["threshold"] == 5 and saved["policy"] == "round_robin"
        assert saved["cluster_file"] == "fleet.toml" and saved["constants"]["window_s"] == env.gw.constants.window_s
    assert os.stat(rd.tuned_path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("fail", ["disk", "fsync"])
def test_a_failed_token_write_never_leaves_an_empty_token(tmp_path, monkeypatch, fail):
    rd = RunDir(str(tmp_path))
    rd.prepare()
    tok, _ = rd.new_tokens()
    _fail(monkeypatch, fail)
    with pytest.raises(BtbctlError, match="No space left"):
        rd.new_tokens()
    monkeypatch.undo()
    assert rd.read_token() == tok  # the old token stays whole
    assert not list(tmp_path.glob("*.tmp"))
    rd.token_path.unlink()
    _fail(monkeypatch, fail)
    with pytest.raises(BtbctlError):
        rd.new_tokens()
    monkeypatch.undo()
    assert not rd.token_path.exists()  # none rather than an empty one


def _fail(monkeypatch, how: str) -> None:
    if how == "disk":
        _full_disk(monkeypatch, rundir_mod)
    else:
        monkeypatch.setattr(rundir_mod.os, "fsync", _enospc)
