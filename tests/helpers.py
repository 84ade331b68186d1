"""Helpers shared by several test files."""

from __future__ import annotations

import math

import pytest

from btbctl.commands.app import main


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
