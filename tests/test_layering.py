"""The engine is headless: importing ``btbctl.engine`` and every module under it pulls in no UI or CLI code."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("textual", "typer", "rich", "btbctl.commands", "btbctl.tui")

_PROBE = r"""
import importlib, json, pkgutil, sys
import btbctl.engine
names = ["btbctl.engine"]
for info in pkgutil.walk_packages(btbctl.engine.__path__, "btbctl.engine."):
    importlib.import_module(info.name)
    names.append(info.name)
forbidden = %r
loaded = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
print(json.dumps({"imported": names, "forbidden_loaded": loaded}))
"""


def test_engine_imports_no_ui_or_cli_modules():
    proc = subprocess.run([sys.executable, "-c", _PROBE % (FORBIDDEN,)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # the walk really covered the engine (not just the empty package)
    for name in (
        "btbctl.engine.costmodel",
        "btbctl.engine.config",
        "btbctl.engine.dryrun",
        "btbctl.engine.trace.model",
        "btbctl.engine.policies.base",
    ):
        assert name in report["imported"]
    assert report["forbidden_loaded"] == []
