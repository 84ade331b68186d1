"""The executor seam shared by sweep and report: results in task order whatever ran them, settings checked, a
missing Ray explained in one line, and on a local Ray (marker ``ray``): progress, errors as raised, and a worker
killed mid-task retried with an unchanged result."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from btbctl.engine.dryrun import DryRunConfig, load_trace
from btbctl.engine.errors import ConfigError
from btbctl.engine.executor import Executor, run_batch, valid_ray_address
from btbctl.engine.sweep import SweepGrid, grid_points, point_task
from ray_helpers import local_ray_fixture

local_ray = local_ray_fixture()


@pytest.fixture(scope="module")
def ray_here(local_ray):
    """The local Ray, with this module's run functions shipped by value (Ray's workers cannot import tests/)."""
    module = sys.modules[__name__]
    local_ray.cloudpickle.register_pickle_by_value(module)
    yield local_ray
    local_ray.cloudpickle.unregister_pickle_by_value(module)


SMALL = {
    "trace.generate.bursts": 1,
    "trace.generate.burst_size": 16,
    "trace.generate.decoys": 2,
    "trace.generate.spread_s": 1.0,
    "policies": ["btb"],
}


def _square(shared: int, task: int) -> int:
    return shared + task * task


def _fails_on_three(shared: int, task: int) -> int:
    if task == 3:
        raise ConfigError("threshold", f"task {task} is bad")
    return task


def _kill_once(shared: tuple, task: dict) -> dict:
    """Kill this worker process (SIGKILL, no cleanup) the first time it meets the grid point ``index`` 1; the
    marker file records that it did; every later call simulates."""
    marker, inner = shared
    if task["index"] == 1 and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return point_task(inner, task["point"])


def test_results_come_back_in_task_order_on_every_local_executor():
    tasks = list(range(9))
    order = [8, 0, 7, 1, 6, 2, 5, 3, 4]
    seen = []
    inline, info1 = run_batch(_square, 10, tasks, Executor(jobs=1), progress=seen.append, order=order)
    pool, info2 = run_batch(_square, 10, tasks, Executor(jobs=2), order=order)
    assert inline == pool == [10 + t * t for t in tasks]
    assert seen == [1] * 9
    assert info1 == {"executor": "inline", "jobs": 1} and info2 == {"executor": "processes", "jobs": 2}
    with pytest.raises(ValueError, match="permutation"):
        run_batch(_square, 0, tasks, Executor(jobs=1), order=[0, 1])


def test_bad_settings_name_their_key():
    for executor, key in (
        (Executor(jobs=0), "jobs"),
        (Executor(jobs=True), "jobs"),
        (Executor(ray="not an address"), "ray"),
        (Executor(ray="local", max_retries=-1), "max_retries"),
    ):
        with pytest.raises(ConfigError) as err:
            run_batch(_square, 0, [1], executor)
        assert err.value.key == key
    for good in ("local", "auto", "10.0.0.1:6379", "head.ray.svc:6379", "ray://head:10001", "[::1]:6379"):
        assert valid_ray_address(good), good
    for bad in ("", "ray://", "x.toml:y", "http:/x", "a b:1"):
        assert not valid_ray_address(bad), bad


@pytest.mark.parametrize("command", ["sweep", "report"])
def test_ray_flag_without_ray_says_how_to_install(monkeypatch, capsys, tmp_path, command):
    from btbctl.commands.app import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    args = ["sweep", "--bursts", "1", "--ray"] if command == "sweep" else ["report", str(tmp_path / "m.toml"), "--ray"]
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "btbctl: error: --ray: Ray is not installed; pip install 'btbctl[ray]'\n"
    with pytest.raises(SystemExit) as exit_:
        main([command, "--ray-address", "a b"] if command == "sweep" else [command, "m.toml", "--ray-address", "a b"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("btbctl: error: --ray-address: 'a b' is not a Ray address")


# -- on a local Ray --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # out of the main suite's three minutes (the longest there)
@pytest.mark.ray
def test_ray_progress_order_and_errors_as_raised(ray_here):
    seen = []
    tasks = list(range(7))
    order = list(reversed(tasks))
    out, info = run_batch(_square, 1, tasks, Executor(ray="local"), progress=seen.append, order=order)
    assert out == [1 + t * t for t in tasks] and seen == [1] * 7
    assert info == {"executor": "ray", "jobs": 2}
    with pytest.raises(ConfigError) as err:  # the run's own error, as the local executors raise it
        run_batch(_fails_on_three, 0, tasks, Executor(ray="local"))
    assert str(err.value) == "threshold: task 3 is bad"
    assert ray_here.is_initialized()  # a Ray the caller started is left running


@pytest.mark.ray
@pytest.mark.slow  # end to end (processes, a fleet or an sshd): out of the main suite's time budget
def test_ray_retries_a_task_whose_worker_was_killed_and_the_result_is_unchanged(ray_here, tmp_path):
    base = DryRunConfig().with_overrides(SMALL)
    points = grid_points(SweepGrid(threshold=(2, 8), warm_replicas=(1, 4)).axes(base))
    inner = (base, load_trace(base))
    tasks = [{"index": i, "point": p} for i, p in enumerate(points)]
    marker = tmp_path / "killed"
    expected, _ = run_batch(point_task, inner, points, Executor(jobs=1))
    got, info = run_batch(_kill_once, (str(marker), inner), tasks, Executor(ray="local", max_retries=2))
    assert marker.exists()  # the first try of point 1 did kill its worker
    assert int(marker.read_text()) != os.getpid()
    assert info["executor"] == "ray"
    assert json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
