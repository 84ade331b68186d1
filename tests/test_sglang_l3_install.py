"""btbctl's L3 backend installed the supported way, ``pip install --no-deps``, into a bare environment: SGLang's
scheduler imports ``btbctl.sglang_l3`` and builds :class:`~btbctl.sglang_l3.store.BtbL3Store` with nothing of
btbctl's dependencies there (docs/sglang-install.md).

A wheel of this checkout is built (from a copy, so the checkout gets no ``build/``), installed with ``--no-deps``
into a fresh venv that has no packages at all, and a probe in that venv does what SGLang 0.5.23's
``StorageBackendFactory`` does (import ``module_path``, ``getattr`` the class, ``cls(storage_config, {})``, then
``register_mem_pool_host``) and asks the store something with no agent running. torch and SGLang are small
stand-ins here (the real ones are checked by ``tests/test_sglang_contract_store.py``); the probe reports every
module it loaded, which must be the standard library, btbctl's own backend and the two stand-ins.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

#: Builds and installs a wheel (several seconds of packaging): run with the slow stage.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
#: Seconds each pip step may take (the wheel build fetches setuptools when this environment has none that fits).
PIP_TIMEOUT_S = 90

# Stand-ins for what BtbL3Store takes from SGLang's environment: torch.arange/int64 (v1 page size) and SGLang's
# HiCacheStorage, HiCacheStorageConfig (srt/mem_cache/hicache_storage.py) and version.
STANDINS = {
    "torch/__init__.py": "int64 = 'torch.int64'\n\n\ndef arange(n, dtype=None):\n    return list(range(n))\n",
    "sglang/__init__.py": "",
    "sglang/version.py": "__version__ = '0.5.23'\n",
    "sglang/srt/__init__.py": "",
    "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/hicache_storage.py": """
from dataclasses import dataclass, field


@dataclass
class HiCacheStorageConfig:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    is_page_first_layout: bool = True
    model_name: str = "m"
    extra_config: dict = field(default_factory=dict)


class HiCacheStorage:
    def register_mem_pool_host(self, mem_pool_host):
        self.mem_pool_host = mem_pool_host
""",
}

PROBE = r"""
import sys
before = set(sys.modules)
import btbctl.sglang_l3                                   # the factory's importlib.import_module(module_path)
from btbctl.sglang_l3 import client, config, keys, wire
light = sorted(set(sys.modules) - before)
sys.path.insert(0, sys.argv[1])                           # SGLang's environment: torch and sglang (stand-ins)
cls = getattr(btbctl.sglang_l3, "BtbL3Store")             # getattr(module, class_name)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig


class Pool:                                               # a page_first host pool of 2 buffers of 4 KiB per page
    page_size, layout, dtype = 64, "page_first", "torch.bfloat16"

    def get_page_buffer_meta(self, indices):
        return [0, 0], [4096, 4096]


extra = {"backend_name": "btb", "module_path": "btbctl.sglang_l3", "class_name": "BtbL3Store", "interface_v1": 1,
         "agent_socket": sys.argv[2], "timeout_s": 0.5}
store = cls(HiCacheStorageConfig(extra_config=extra), {})
store.register_mem_pool_host(Pool())
hits = store.batch_exists(["0" * 64])                     # no agent: a miss, not an error
store.close()
import json
loaded = sorted(set(sys.modules) - before)
print(json.dumps({"file": btbctl.__file__, "subclass": issubclass(cls, HiCacheStorage), "ns_id": store.ns_id,
                  "page_bytes": store.page_bytes, "hits": hits, "light": light, "loaded": loaded,
                  "stdlib": sorted(sys.stdlib_module_names)}))
"""


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env, **kw)


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _setuptools_fits() -> bool:
    """This environment can build the wheel without an index (pyproject.toml's build-system needs setuptools>=77)."""
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(p) for p in setuptools.__version__.split(".")[:1]) >= (77,)


def _wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "btbctl", src / "btbctl", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
    offline = ["--no-build-isolation", "--no-index"] if _setuptools_fits() else ["--timeout", "10", "--retries", "0"]
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *offline, "-w", str(tmp / "dist"), str(src)]
    try:
        proc = _run(argv)
    except subprocess.TimeoutExpired:
        pytest.skip(f"building btbctl's wheel took over {PIP_TIMEOUT_S} s (no package index reachable?)")
    if proc.returncode != 0:
        if offline[0] == "--no-build-isolation":
            pytest.fail(f"building btbctl's wheel failed: {_last_line(proc)}")
        pytest.skip(f"cannot build btbctl's wheel here: needs setuptools>=77 or a package index ({_last_line(proc)})")
    (wheel,) = (tmp / "dist").glob("btbctl-*.whl")
    return wheel


def test_no_deps_install_imports_only_the_standard_library(tmp_path):
    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    if made.returncode != 0 or not python.exists():
        pytest.skip(f"cannot create a venv with {sys.executable}: {_last_line(made)}")
    wheel = _wheel(tmp_path)
    # pip of this environment installs into the bare venv (--python: pip >= 22.3), as `python -m pip` would there
    argv = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        str(wheel),
    ]
    proc = _run(argv)
    assert proc.returncode == 0, proc.stderr
    site = json.loads(_run([str(python), "-c", "import json, sys; print(json.dumps(sys.path))"]).stdout)
    assert not any(p.startswith(str(ROOT)) for p in site), site  # the checkout is not on the venv's path

    standins = tmp_path / "standins"
    for rel, text in STANDINS.items():
        (standins / rel).parent.mkdir(parents=True, exist_ok=True)
        (standins / rel).write_text(text)
    sock = str(tmp_path / "no-agent.sock")
    proc = _run([str(python), "-I", "-c", PROBE, str(standins), sock], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])

    assert Path(got["file"]).is_relative_to(venv), got["file"]  # the installed copy, not the checkout
    assert got["subclass"] and len(got["ns_id"]) == 16 and got["page_bytes"] == 8192 and got["hits"] == 0
    stdlib = set(got["stdlib"])

    def foreign(mods: list[str], allowed: tuple[str, ...]) -> list[str]:
        return [m for m in mods if m.split(".")[0] not in stdlib and m.split(".")[0] not in allowed]

    # import btbctl.sglang_l3 (and its client, config, keys, wire): the standard library and nothing else
    assert foreign(got["light"], ("btbctl",)) == []
    # the store built and used as SGLang does: plus torch and SGLang, nothing else
    assert foreign(got["loaded"], ("btbctl", "torch", "sglang")) == []
    ours = [m for m in got["loaded"] if m.split(".")[0] == "btbctl"]
    assert all(m in ("btbctl", "btbctl.sglang_l3") or m.startswith("btbctl.sglang_l3.") for m in ours), ours
    assert "btbctl.sglang_l3.store" in ours
