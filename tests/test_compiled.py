"""The routing core's compiled build (README, "Compiled core"): what an installation runs is what it says it runs.

The behaviour of the two builds is checked by the same tests (stored routes and summaries): CI runs the whole suite
on its installed, compiled build and the behaviour tests again on this checkout's plain-Python sources
(``.ci/run``), setting ``BTBCTL_EXPECT_CORE`` to the build each run must have.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from btbctl.engine.compiled import COMPILED_MODULES, compiled_modules, core_build


def test_each_module_is_reported_as_it_is_imported():
    found = compiled_modules()
    assert list(found) == list(COMPILED_MODULES)
    for name in COMPILED_MODULES:
        file = importlib.import_module(name).__file__ or ""
        assert found[name] == (not file.endswith(".py")), (name, file)
    assert core_build() in ("compiled", "plain Python")  # never a mix: setup.py builds all of them or none


def test_the_build_is_the_one_this_run_expects():
    expected = os.environ.get("BTBCTL_EXPECT_CORE")
    if not expected:
        pytest.skip(
            "BTBCTL_EXPECT_CORE is not set (CI sets it: compiled for the installed build, plain for the sources)"
        )
    assert core_build() == {"compiled": "compiled", "plain": "plain Python"}[expected]


def test_version_names_the_build(tmp_path):
    # run outside the checkout: ``-m`` puts the working directory first on the path, and the checkout's sources are
    # plain Python whatever this installation is
    out = subprocess.run(
        [sys.executable, "-m", "btbctl", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert out.strip().endswith(f"(routing core: {core_build()})"), out
