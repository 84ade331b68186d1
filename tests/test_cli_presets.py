"""``btbctl presets``: tables and stable JSON of the cost-model presets."""

from __future__ import annotations

import json

import pytest

from btbctl.commands.app import main
from btbctl.engine.costmodel import FABRICS, GPUS, MODELS


def _run(capsys, *argv):
    with pytest.raises(SystemExit) as ei:
        main(list(argv))
    cap = capsys.readouterr()
    return ei.value.code, cap.out, cap.err


def test_presets_json_has_stable_keys_and_every_preset(capsys):
    code, out, err = _run(capsys, "presets", "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert list(data) == ["models", "gpus", "fabrics"]
    assert [m["name"] for m in data["models"]] == list(MODELS)
    assert [g["name"] for g in data["gpus"]] == list(GPUS)
    assert [f["name"] for f in data["fabrics"]] == list(FABRICS)
    assert list(data["models"][0]) == [
        "name",
        "total_params",
        "active_params",
        "dtype_bytes",
        "kv_dtype_bytes",
        "layers",
        "kv_heads",
        "head_dim",
        "attn_dim",
        "kv_bytes_per_token",
        "kv_kb_per_token",
        "weight_bytes",
        "context_tokens",
        "source",
    ]
    assert list(data["gpus"][0]) == [
        "name",
        "flop_per_s",
        "hbm_bytes",
        "hbm_bytes_per_s",
        "pcie_bytes_per_s",
        "nic_bytes_per_s",
        "source",
    ]
    assert list(data["fabrics"][0]) == ["name", "bytes_per_s", "source"]
    llama = next(m for m in data["models"] if m["name"] == "llama-3.3-70b")
    assert llama["kv_bytes_per_token"] == 327_680
    assert llama["kv_kb_per_token"] == 327.68 and llama["context_tokens"] == 131072
    h100 = next(g for g in data["gpus"] if g["name"] == "h100")
    assert h100["hbm_bytes"] == 80e9 and h100["nic_bytes_per_s"] == 50e9
    assert all(x["source"] for x in data["models"] + data["gpus"] + data["fabrics"])


def test_presets_human_tables(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = _run(capsys, "presets")
    assert code == 0
    for needle in ("Model presets", "GPU presets", "Fabrics", "llama-3.3-70b", "327680", "h200", "rdma-8x400g"):
        assert needle in out
    row = next(line for line in out.splitlines() if line.strip().startswith("llama-3.3-70b"))
    assert row.split()[-2:] == ["327.7", "131,072"]  # kB (decimal, as GB everywhere) per token, context
