"""``dry-run --setup NAME`` and the ``setup`` config key: a named setup fills the cluster, explicit keys win."""

from __future__ import annotations

import json

import pytest

from btbctl.engine.dryrun import DryRunConfig, load_dryrun_config, validate_config
from btbctl.engine.errors import ConfigError
from btbctl.engine.setups import SETUPS
from helpers import run_cli as run

SMALL = ["--bursts", "1", "--burst-size", "40", "--decoys", "4"]


pytestmark = pytest.mark.usefixtures("cli_env")  # fixed terminal width (tests/conftest.py)


def cluster_of(capsys, *argv):
    code, out, err = run(capsys, "dry-run", *SMALL, "--policies", "round_robin", "--format", "json", *argv)
    assert code == 0, err
    return json.loads(out)["cluster"]


def test_setup_flag_fills_the_cluster(capsys):
    assert cluster_of(capsys, "--setup", "glm52_h100x8") == {
        "model": "glm-5.2-like",
        "gpu": "h100",
        "gpus_per_replica": 8,
        "replicas": 4,
        "nic_gbps": 400.0,
    }
    assert cluster_of(capsys, "--setup", "dense1t_b300x4")["nic_gbps"] == 800.0


def test_flags_override_the_setup(capsys):
    c = cluster_of(capsys, "--setup", "dense1t_b300x4", "--replicas", "2", "--nic-gbps", "100")
    assert c == {"model": "dense-1t", "gpu": "b300", "gpus_per_replica": 4, "replicas": 2, "nic_gbps": 100.0}


def test_setup_in_a_file_and_on_the_command_line(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('setup = "glm52_h100x8"\n[cluster]\nreplicas = 2\n')
    loaded = load_dryrun_config(cfg)
    assert (loaded.cluster.model, loaded.cluster.gpus_per_replica, loaded.cluster.replicas) == ("glm-5.2-like", 8, 2)
    # the flag's setup replaces the file's, but the file's explicit cluster key still wins
    c = cluster_of(capsys, "-c", str(cfg), "--setup", "70b_h100x4")
    assert (c["model"], c["gpu"], c["gpus_per_replica"], c["replicas"]) == ("llama-3.3-70b", "h100", 4, 2)


def test_unknown_setup_is_one_line_naming_the_flag_or_file(capsys, tmp_path):
    code, out, err = run(capsys, "dry-run", *SMALL, "--setup", "nope")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--setup" in err and "'nope'" in err and all(name in err for name in SETUPS)
    cfg = tmp_path / "c.toml"
    cfg.write_text('setup = "nope"\n')
    with pytest.raises(ConfigError) as e:
        load_dryrun_config(cfg)
    assert e.value.key == "setup" and e.value.path == str(cfg)


def test_without_setup_nothing_changes():
    assert validate_config({}).cluster == DryRunConfig().cluster
    cfg = validate_config({"setup": "kimi_k2_h100x8"})
    assert cfg.with_overrides({"seed": 3}).cluster == cfg.cluster


def test_infersim_dry_run_on_a_setup(capsys):
    # 120 requests over 60 s: two arrivals within BTB's 1 s window, so it fires
    code, out, err = run(
        capsys,
        "dry-run",
        "--bursts",
        "1",
        "--burst-size",
        "120",
        "--decoys",
        "4",
        "--setup",
        "70b_h100x4",
        "--fidelity",
        "infersim",
        "--policies",
        "cache_aware,btb",
        "--format",
        "json",
    )
    assert code == 0, err
    r = json.loads(out)
    assert r["fidelity"] == "infersim"
    ca, btb = (s["ttft_s"]["mean"] for s in r["results"])
    assert btb < ca


def test_infersim_checks_the_fit_with_all_of_hbm(capsys):
    # GLM-5.2-like (372 GB of int4 weights) on 5 x H100 fits only without SGLang's memory fraction, as in Infer-Sim
    args = [
        "dry-run",
        *SMALL,
        "--setup",
        "glm52_h100x8",
        "--gpus-per-replica",
        "5",
        "--policies",
        "cache_aware",
        "--format",
        "json",
    ]
    code, _, err = run(capsys, *args)
    assert code == 2 and "--gpus-per-replica" in err
    code, out, err = run(capsys, *args, "--fidelity", "infersim")
    assert code == 0, err
    assert json.loads(out)["cluster"]["gpus_per_replica"] == 5
