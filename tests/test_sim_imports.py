"""Import contracts of the fleet model: no import cycle reaches the simulator or the emulated worker, and the two
simulators do not import each other (not even inside a function)."""

from __future__ import annotations

import ast
from pathlib import Path

import btbctl

ROOT = Path(btbctl.__file__).resolve().parent
PACKAGES = ("btbctl.engine.sim", "btbctl.engine.worker")


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = ("btbctl",) + p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, dict[str, bool]]:
    """module -> {imported btbctl module: imported at module level}."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out: dict[str, dict[str, bool]] = {}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        top = {id(n) for n in tree.body}
        deps: dict[str, bool] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for n in names:
                t = resolve(n) if n.startswith("btbctl") else None
                if t and t != m:
                    deps[t] = deps.get(t, False) or id(node) in top
        out[m] = deps
    return out


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in graph.get(m, ()):
            if t == goal:
                return True
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return False


def test_no_import_cycle_through_the_simulator_or_the_worker():
    mods = _modules()
    deps = _imports(mods)
    graph = {m: set(d) for m, d in deps.items()}  # function-level imports count too
    ours = [m for m in mods if any(m == p or m.startswith(p + ".") for p in PACKAGES)]
    assert "btbctl.engine.sim.replica" in ours and "btbctl.engine.worker.model" in ours
    cyclic = [m for m in ours if _reaches(graph, m, m)]
    assert cyclic == []


def test_the_simulators_do_not_import_each_other():
    deps = _imports(_modules())
    assert "btbctl.engine.sim.infersim" not in deps["btbctl.engine.sim.simulator"]
    assert "btbctl.engine.sim.simulator" not in deps["btbctl.engine.sim.infersim"]
    assert set(deps["btbctl.engine.sim.replica"]) & {"btbctl.engine.sim.simulator", "btbctl.engine.sim.infersim",
                                                      "btbctl.engine.sim.dispatch"} == set()
