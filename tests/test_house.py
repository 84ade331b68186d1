"""The house tools run as part of the suite: ``ruff check`` (lint), ``ruff format --check``, ``mypy`` (the engine's
pure core, strictly) and ``lint-imports`` (the import contracts), all configured in ``pyproject.toml``. Each test
fails with the tool's own output. The tools come with the ``test`` extra (``pip install -e '.[test]'``).

One more contract lives here because import-linter cannot state it: no module-level import cycle anywhere in
``btbctl``, counting imports inside functions (``acyclic_siblings`` compares sibling packages, so a cycle between a
package's ``__init__`` and one of its own modules slips past it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: What ruff checks (the same paths as the README's command).
LINTED = ("btbctl", "tests", "benchmarks", "scripts")


def _tool(name: str) -> list[str]:
    """The command line that starts ``name`` from this interpreter's environment."""
    if name in ("ruff", "mypy"):
        argv = [sys.executable, "-m", name]
        probe = name
    else:  # import-linter has no ``python -m`` entry point; its script sits next to the interpreter
        script = Path(sys.executable).with_name(name)
        found = str(script) if script.exists() else shutil.which(name)
        argv = [found] if found else []
        probe = "importlinter"
    try:
        __import__(probe)
    except ImportError:
        argv = []
    if not argv:
        pytest.fail(f"{name} is not installed; install the test extra: pip install -e '.[test]'")
    return argv


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_ruff_check():
    proc = _run([*_tool("ruff"), "check", "--no-cache", "--output-format", "concise", *LINTED], 120)
    assert proc.returncode == 0, _report(proc)


def test_ruff_format():
    proc = _run([*_tool("ruff"), "format", "--check", "--no-cache", *LINTED], 120)
    assert proc.returncode == 0, _report(proc)


@pytest.mark.timeout(300)
def test_mypy_on_the_engine_core():
    # the files and flags come from [tool.mypy]; a cold run takes about 10 s on one core
    proc = _run([*_tool("mypy")], 280)
    assert proc.returncode == 0, _report(proc)


def test_import_contracts():
    proc = _run([*_tool("lint-imports"), "--no-cache", "--no-logo"], 120)
    assert proc.returncode == 0, _report(proc)
    assert "0 broken" in proc.stdout, _report(proc)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_through_a_package_init():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "q": {"p"}}
    assert _cycles(graph) == [["p", "p.a", "p.b"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_level_import_cycle_anywhere():
    grimp = pytest.importorskip("grimp")  # import-linter's graph builder; comes with the test extra
    g = grimp.build_graph("btbctl", cache_dir=None)
    graph = {m: set(g.find_modules_directly_imported_by(m)) & g.modules for m in g.modules}
    # the walk really covered the tree, imports inside functions included
    assert "btbctl.engine.sim.replica" in graph and "btbctl.engine.gateway.server" in graph["btbctl.engine.gateway"]
    assert _cycles(graph) == []
