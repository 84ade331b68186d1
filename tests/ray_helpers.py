"""A local Ray for the tests of one module (marker ``ray``).

``local_ray = local_ray_fixture()`` at a test module's top level gives it a module-scoped fixture: a Ray started
once for the module with 2 CPUs and no dashboard, shut down after its last test. Without the ``ray`` extra the
tests that use it skip with the reason. ``btbctl.engine.executor`` finds this Ray already running and uses it as it
is, so the tests go through the same code as ``--ray`` without paying for a Ray start per test.
"""

from __future__ import annotations

import logging

import pytest

#: Why Ray tests skip where Ray is missing.
SKIP_REASON = "needs Ray: pip install -e '.[ray]' (the test extra includes it)"


def local_ray_fixture():
    """A module-scoped fixture yielding the ``ray`` module with a local Ray running (2 CPUs)."""

    @pytest.fixture(scope="module")
    def local_ray():
        ray = pytest.importorskip("ray", reason=SKIP_REASON)
        if ray.is_initialized():  # pragma: no cover - a previous module's Ray still up
            ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        try:
            yield ray
        finally:
            ray.shutdown()

    return local_ray
