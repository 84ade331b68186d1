"""The test-only CPU stand-in for SGLang's CUDA-bound pieces (tests/sglang_cpu/sglang_cpu_standin.py), without
SGLang: it replaces only the names it lists, each call of a replaced kernel raises and is logged as ``kernel`` (the
real-server tests fail on such a line), and the venv's hook leaves a process alone unless the variable is set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_cpu.harness import STANDIN_DIR, STANDIN_ENV, STANDIN_LOG_ENV, cpu_env

#: The one line the harness writes into its venv's site-packages (scripts/sglang-venv.sh).
HOOK = Path(__file__).resolve().parents[1] / "scripts" / "sglang-venv.sh"


def _run(code: str, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in (STANDIN_ENV, STANDIN_LOG_ENV)}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd=tmp_path)


def _hook_line() -> str:
    line = next(x for x in HOOK.read_text().splitlines() if '__import__("sglang_cpu_standin")' in x)
    return line.split("echo '", 1)[1].rsplit("'", 1)[0]


def test_the_kernel_module_holds_only_the_listed_names_and_logs_a_call(tmp_path):
    log = tmp_path / "standin.jsonl"
    code = f"""
import sys
sys.path.insert(0, {str(STANDIN_DIR)!r})
import sglang_cpu_standin as s
s.install()
from sgl_kernel import copy_all_layer_kv_cache_cpu
try:
    from sgl_kernel import fused_add_rmsnorm
except ImportError:
    print("unlisted: ImportError")
try:
    import sgl_kernel.kvcacheio
except ImportError:
    print("submodule: ImportError")
try:
    copy_all_layer_kv_cache_cpu(1, 2)
except NotImplementedError as e:
    print("called:", e)
print(sorted(n for n in dir(sys.modules["sgl_kernel"]) if not n.startswith("_")) == sorted(s.KERNEL_NAMES))
"""
    proc = _run(code, tmp_path, {STANDIN_LOG_ENV: str(log)})
    assert proc.returncode == 0, proc.stderr
    assert "unlisted: ImportError" in proc.stdout and "submodule: ImportError" in proc.stdout
    assert "called: sgl_kernel.copy_all_layer_kv_cache_cpu is a CPU stand-in" in proc.stdout
    assert proc.stdout.strip().endswith("True")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["name"], x["kind"]) for x in lines] == [("sgl_kernel.copy_all_layer_kv_cache_cpu", "kernel")]
    assert "first call of replaced sgl_kernel.copy_all_layer_kv_cache_cpu (kernel)" in proc.stderr


def test_the_venv_hook_is_inert_without_the_variable(tmp_path):
    hook = _hook_line()
    probe = "print('sgl_kernel' in sys.modules, any(type(f).__name__ == '_Finder' for f in sys.meta_path))"
    code = f"{hook}\nimport sys\n{probe}"
    off = _run(code, tmp_path, {})
    assert off.returncode == 0 and off.stdout.split() == ["False", "False"], off
    on = _run(
        code + "\nimport sgl_kernel; print(sgl_kernel.__doc__.split()[0])", tmp_path, {STANDIN_ENV: str(STANDIN_DIR)}
    )
    assert on.returncode == 0 and on.stdout.split() == ["False", "True", "CPU"], on


def test_the_cpu_environment_is_one_definition():
    env = cpu_env(Path("/v"))
    assert env == {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCH_EXTENSIONS_DIR": str(Path("/v") / "torch-extensions"),
        STANDIN_ENV: str(STANDIN_DIR),
        "PYTHONPATH": str(STANDIN_DIR.parents[1]),  # this checkout's btbctl, whoever installed into the venv last
    }
