"""Import discipline of the gateway and the control-API client beyond the contracts in ``pyproject.toml`` (no cycle,
no piece importing the gateway's wiring): no import hidden inside a function or behind ``TYPE_CHECKING`` to dodge a
cycle. The one exception is the package's lazy re-export of the wiring, which keeps ``btbctl --help`` fast."""

from __future__ import annotations

import ast
from pathlib import Path

import btbctl

ROOT = Path(btbctl.__file__).parent
PACKAGES = ("engine/gateway", "engine/control")
#: (importing module, imported module) pairs allowed inside a function.
ALLOWED = {("btbctl.engine.gateway", "btbctl.engine.gateway.server")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _nested_imports(path: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """``([(module, line) imported inside a function], [modules imported behind TYPE_CHECKING])``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nested: list[tuple[str, int]] = []
    type_checking: list[str] = []

    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if isinstance(node, ast.ImportFrom) and node.module:
            # "from pkg import mod" imports pkg.mod when it is a module
            return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        return []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                type_checking.extend(n for stmt in ast.walk(child) for n in names(stmt))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                nested.extend((n, child.lineno) for n in names(child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return nested, type_checking


def test_no_hidden_imports_in_the_gateway_and_the_control_client():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).glob("*.py"))]
    mods = {_module_name(p): p for p in files}
    assert "btbctl.engine.gateway.dataplane" in mods and "btbctl.engine.control.client" in mods
    hidden, guarded = [], []
    for name, path in mods.items():
        nested, tc = _nested_imports(path)
        hidden += [(name, m, line) for m, line in nested if m in mods and m != name and (name, m) not in ALLOWED]
        # type-only imports of the gateway's and the client's own modules would hide a cycle (a third-party type
        # kept off the import path for start-up time, such as httpx's client classes, is fine)
        guarded += [(name, m) for m in tc if m in mods]
    assert guarded == [], f"TYPE_CHECKING imports of the packages' own modules: {guarded}"
    assert hidden == [], hidden
