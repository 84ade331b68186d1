"""Run-directory files written as one step: ``tune`` on a full disk changes nothing (the gateway is set back, no
``tuned.json.tmp`` is left), and a failed token write never leaves an empty ``control.token``."""

from __future__ import annotations

import errno
import os

import pytest

from btbctl.commands.app import main
from btbctl.engine.constants import BtbConstants
from btbctl.engine.control.schema import ConstantsAnswer
from btbctl.engine.errors import BtbctlError
from btbctl.engine.launcher import rundir as rundir_mod
from btbctl.engine.launcher.rundir import RunDir


class _FakeApi:
    """The control API of a gateway holding ``threshold=2``: reads and writes as the real one answers."""

    def __init__(self) -> None:
        self.held = {"prefix_blocks": 4, "threshold": 2, "window_s": 30.0, "warm_replicas": 2}
        self.policy = "btb"
        self.puts: list[dict] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def constants(self) -> ConstantsAnswer:
        return ConstantsAnswer(
            policy=self.policy,
            policies=["btb", "round_robin"],
            constants=BtbConstants(**self.held),
            page_size=16,
            prefix_tokens=16 * self.held["prefix_blocks"],
        )

    def set_constants(self, updates: dict) -> ConstantsAnswer:
        self.puts.append(dict(updates))
        for k, v in updates.items():
            if k == "policy":
                self.policy = v
            else:
                self.held[k] = type(self.held[k])(v)
        return self.constants()


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


def test_tune_on_a_full_disk_changes_nothing_and_leaves_no_tmp(tmp_path, monkeypatch, capsys):
    import btbctl.engine.launcher.control as control_mod

    api = _FakeApi()
    monkeypatch.setattr(control_mod, "client_for_run", lambda *a, **k: api)
    rd = RunDir(str(tmp_path))
    rd.prepare()
    rd.save_tuned({"threshold": 2}, "btb", None)
    old = rd.tuned_path.read_bytes()
    _full_disk(monkeypatch, rundir_mod)
    with pytest.raises(SystemExit) as ex:
        main(["tune", "--run-dir", str(tmp_path), "threshold=5"])
    assert ex.value.code != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "No space left" in err and "undone" in err
    assert api.held["threshold"] == 2 and api.policy == "btb"  # the live change was rolled back
    assert rd.tuned_path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("tuned")) == ["tuned.json"]


def test_tune_saves_what_it_applied(tmp_path, monkeypatch):
    import btbctl.engine.launcher.control as control_mod

    api = _FakeApi()
    monkeypatch.setattr(control_mod, "client_for_run", lambda *a, **k: api)
    RunDir(str(tmp_path)).prepare()
    with pytest.raises(SystemExit) as ex:
        main(["tune", "--run-dir", str(tmp_path), "threshold=5", "policy=round_robin"])
    assert ex.value.code == 0
    saved = RunDir(str(tmp_path)).load_tuned()
    assert saved is not None and saved["constants"]["threshold"] == 5 and saved["policy"] == "round_robin"
    assert api.held["threshold"] == 5 and os.stat(RunDir(str(tmp_path)).tuned_path).st_mode & 0o777 == 0o600


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
