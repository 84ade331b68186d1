"""The routing core's compiled build (README, "Compiled core").

``pip install .`` compiles :data:`COMPILED_MODULES` with mypyc (``setup.py`` reads this file without importing the
package) where mypyc and a C compiler are there; an editable install, ``BTBCTL_PURE_PYTHON=1`` or a missing compiler
leaves them plain Python. Both behave the same (the suite's stored routes and summaries are the check); the compiled
one decides faster (README "Compiled core" gives the figures of ``benchmarks/bench_decision.py``). Standard library
only.
"""

from __future__ import annotations

import importlib.util

#: The modules of a routing decision: the copy types, the detector, the cost model, btb_plus and the policy deriving
#: from it, the gateway's fleet state.
COMPILED_MODULES = (
    "btbctl.engine.copies",
    "btbctl.engine.detector",
    "btbctl.engine.costmodel",
    "btbctl.engine.policies.btb_plus",
    "btbctl.engine.policies.clairvoyant",
    "btbctl.engine.gateway.state",
)


def compiled_modules() -> dict[str, bool]:
    """``{module: whether this installation runs it compiled}`` for :data:`COMPILED_MODULES` (found, not imported;
    their packages are)."""
    out = {}
    for name in COMPILED_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        out[name] = bool(origin) and not str(origin).endswith(".py")
    return out


def core_build() -> str:
    """``compiled`` (every module of :data:`COMPILED_MODULES`), ``plain Python`` (none) or ``partly compiled``."""
    got = compiled_modules().values()
    return "compiled" if all(got) else "plain Python" if not any(got) else "partly compiled"
