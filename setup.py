"""Build hook: the routing core compiled with mypyc (README, "Compiled core"); everything else is in pyproject.toml.

A wheel (``pip install .``) compiles :data:`COMPILED` to C extension modules when mypyc and a C compiler are there,
and falls back to plain Python, with one line saying why, when they are not. An editable install
(``pip install -e .``), or ``BTBCTL_PURE_PYTHON=1``, keeps the core plain Python (an edited source takes effect at
once). The compiled modules behave exactly as their sources: the suite's stored routes and summaries are the check.
"""

from __future__ import annotations

import os
import runpy
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

#: Source files of ``btbctl.engine.compiled.COMPILED_MODULES`` (read from that file: the package is not importable
#: while it is being built).
COMPILED = [
    m.replace(".", "/") + ".py"
    for m in runpy.run_path(os.path.join("btbctl", "engine", "compiled.py"))["COMPILED_MODULES"]
]
#: setup.py commands that build the package's files (``egg_info``, ``dist_info``, ``sdist`` and ``editable_wheel``
#: do not compile).
BUILDS = {"bdist_wheel", "build", "build_ext", "install"}


def stays_plain(why: str) -> None:
    """The one line saying the core installs as plain Python, and why (``pip install -v`` shows it)."""
    print(f"btbctl: the routing core stays plain Python ({why})", file=sys.stderr)


def ext_modules() -> list:
    if os.environ.get("BTBCTL_PURE_PYTHON") or "editable_wheel" in sys.argv or not BUILDS.intersection(sys.argv):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as e:
        stays_plain(f"no mypyc: {e}")
        return []
    try:
        # the running Python's version (pyproject's [tool.mypy] checks the oldest supported one); notes about the
        # config's sections for other modules are not errors here
        version = f"--python-version={sys.version_info[0]}.{sys.version_info[1]}"
        exts = mypycify([version, "--no-warn-unused-configs", *COMPILED], opt_level="3", group_name="btbctl_core")
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure to compile falls back to plain Python
        stays_plain(f"mypyc failed: {e}")
        return []
    return exts


class AllOrNone(build_ext):
    """Builds every compiled module or none: the modules share one C library, so a module built without it would
    fail to import; on any failure (no C compiler) the built ones are removed and the core stays plain Python."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.force = True  # never modules left in build/ by an earlier build (they would hide a failure here)

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any failure to compile falls back to plain Python
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.remove(path)
            why = " ".join(str(e).split())
            why = why if len(why) <= 200 else "..." + why[-200:]  # a compiler's command line: its end says why
            stays_plain(f"compiling it failed: {why}")


setup(ext_modules=ext_modules(), cmdclass={"build_ext": AllOrNone})
