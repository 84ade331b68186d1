"""Helpers shared by several test files."""

from __future__ import annotations

import math
import random

import pytest

from btbctl.commands.app import main
from btbctl.engine.constants import BtbConstants
from btbctl.engine.copies import carry_out
from btbctl.engine.policies.base import Policy, Route


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run the CLI entry point in-process (with its error funnel); return (exit code, stdout, stderr)."""
    code = 0
    try:
        main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def assert_close(a, b, path: str = "") -> None:
    """Assert two JSON-like values are equal, floats to 1e-9 relative (NaN equals NaN); ``path`` names the spot."""
    if isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys differ"
        for k in a:
            assert_close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, float) or isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def leading_run(chain, blocks) -> int:
    """How many of ``chain``'s first blocks are in ``blocks``, counting up to the first one that is not."""
    n = 0
    for h in chain:
        if h not in blocks:
            break
        n += 1
    return n


class Scripted(Policy):
    """A test policy: routes by ``route_fn(request)``; ``on_arrival(request, view, now_s)`` may read the view and
    return copy plans for the executor. Every copy attempt is recorded in ``results`` as
    ``(plan, target, started)``."""

    name = "scripted"

    def __init__(self, n, route_fn=lambda r: 0, on_arrival=None):
        super().__init__(n, random.Random(0), BtbConstants())
        self.route_fn = route_fn
        self.on_arrival = on_arrival
        self.results = []

    def route(self, req, view, now_s):
        plans = self.on_arrival(req, view, now_s) if self.on_arrival else None
        return Route(self.route_fn(req), tuple(plans or ()))

    def on_copy_result(self, plan, target, started, now_s):
        self.results.append((plan, target, started))


def route(policy, req, view, now_s):
    """Route ``req`` with ``policy`` and carry its copy plans out on ``view.replicate(chain, source, target, now_s,
    hot_since_s)`` (a fake view's executor), reporting each attempt to the policy; returns the chosen replica."""
    r = policy.route(req, view, now_s)
    for plan in r.copies:
        carry_out(plan, lambda t, p=plan: view.replicate(p.prefix, p.source, t, now_s, p.hot_since_s),
                  lambda t, ok, p=plan: policy.on_copy_result(p, t, ok, now_s))
    return r.replica
