"""Import contracts of the gateway and the control-API client: no import cycle among their modules, no imports
hidden in functions or behind ``TYPE_CHECKING`` to dodge one, and no piece that imports the gateway's wiring."""

from __future__ import annotations

import ast
from pathlib import Path

import btbctl

ROOT = Path(btbctl.__file__).parent
PACKAGES = ("engine/gateway", "engine/control")
#: The one module every piece must do without: the wiring that builds them.
WIRING = "btbctl.engine.gateway.server"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> tuple[set[str], list[tuple[str, int]], bool]:
    """``(modules imported at top level, [(module, line) imported inside a function], uses TYPE_CHECKING)``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top: set[str] = set()
    nested: list[tuple[str, int]] = []
    type_checking = False

    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            # "from pkg import mod" imports pkg.mod when it is a module
            return [base] + [f"{base}.{a.name}" for a in node.names]
        return []

    def visit(node: ast.AST, in_function: bool) -> None:
        nonlocal type_checking
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                type_checking = True
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for n in names(child):
                    if in_function:
                        nested.append((n, child.lineno))
                    else:
                        top.add(n)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return top, nested, type_checking


def _graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int]]], list[str]]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))]
    mods = {_module_name(p): p for p in files}
    graph, nested, guarded = {}, {}, []
    for name, path in mods.items():
        top, inner, tc = _imports(path)
        graph[name] = {m for m in top if m in mods and m != name}
        nested[name] = [(m, line) for m, line in inner if m in mods and m != name]
        if tc:
            guarded.append(name)
    return graph, nested, guarded


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = dfs(n)
            if found:
                return found
    return None


def test_no_import_cycle_in_the_gateway_and_the_control_client():
    graph, _, _ = _graph()
    assert "btbctl.engine.gateway.dataplane" in graph and "btbctl.engine.control.client" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_hidden_imports_and_no_piece_imports_the_wiring():
    graph, nested, guarded = _graph()
    assert guarded == [], f"TYPE_CHECKING imports in {guarded}"
    # the package's lazy re-export of the wiring (fast CLI start-up) is the one import inside a function
    allowed = {("btbctl.engine.gateway", "btbctl.engine.gateway.server")}
    hidden = [(mod, m, line) for mod, inner in nested.items() for m, line in inner if (mod, m) not in allowed]
    assert hidden == [], hidden
    users = sorted(m for m, deps in graph.items() if WIRING in deps)
    assert users == [], f"{users} import the gateway's wiring"
