"""Honest units on a live fleet: emulated workers' modelled HBM reaches the control API and the dashboard."""

from __future__ import annotations

from types import SimpleNamespace

from btbctl.engine.costmodel import GPUS, MODELS
from btbctl.engine.gateway.reports import Reports
from btbctl.engine.gateway.state import WorkerState


def _emulated_worker() -> WorkerState:
    m = MODELS["llama-3.3-70b"]
    w = WorkerState(0, "http://127.0.0.1:1", "w0", healthy=True)
    w.info = {
        "model": "llama",
        "page_size": 256,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "weight_bytes": m.weight_bytes,
        "hbm_total_bytes": 4 * GPUS["h100"].hbm_bytes,
        "kv_bytes_scale": 65536,
    }
    w.loads = {"used_tokens": 4096, "max_tokens": 100000}
    return w


def test_fleet_rows_carry_the_modelled_hbm_of_emulated_workers():
    m = MODELS["llama-3.3-70b"]
    row = Reports(SimpleNamespace()).worker(_emulated_worker())
    assert row.hbm_modelled is True and row.hbm_total_bytes == 4 * GPUS["h100"].hbm_bytes
    assert row.hbm_used_bytes == m.weight_bytes + 4096 * m.kv_bytes_per_token
    assert row.kv_bytes_scale == 65536 and row.kv_bytes_per_token == m.kv_bytes_per_token
    plain = WorkerState(1, "http://127.0.0.1:2", "w1", healthy=True)
    dumped = Reports(SimpleNamespace()).worker(plain).model_dump()
    assert "hbm_used_bytes" not in dumped and "kv_bytes_scale" not in dumped  # left out, not null


async def test_the_dashboard_shows_modelled_hbm_instead_of_nvml_unavailable():
    from btbctl.engine.control.schema import FleetAnswer
    from btbctl.engine.dashboard.control_source import ControlApiSource

    row = Reports(SimpleNamespace()).worker(_emulated_worker())
    fleet = FleetAnswer.model_construct(workers=[row])
    src = ControlApiSource.__new__(ControlApiSource)
    src._local = False
    rows, note = await src._gpus(fleet)
    assert note is None and len(rows) == 1 and rows[0].source == "model" and rows[0].total_bytes > 0
