"""Where the SGLang harness lives and the environment that serves SGLang on a CPU (one definition; the harness
script prints it with ``python tests/sglang_cpu/harness.py env VENV``).

Standard library only: the script runs it with any Python, and the tests import it from either venv.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

#: The SGLang release the harness pins (scripts/sglang-venv.sh).
SGLANG_VERSION = "0.5.23"
#: The folder of the stand-in module (``sglang_cpu_standin.py``); the venv's ``.pth`` hook imports it from there.
STANDIN_DIR = Path(__file__).resolve().parent
#: The environment variable that switches the stand-in on (its value: :data:`STANDIN_DIR`).
STANDIN_ENV = "BTBCTL_SGLANG_CPU_STANDIN"
#: When set, the stand-in appends one JSON line per replaced function's first call in each process to this file.
STANDIN_LOG_ENV = "BTBCTL_SGLANG_CPU_STANDIN_LOG"


def venv_dir() -> Path:
    """The harness venv: ``$BTBCTL_SGLANG_VENV``, else ``~/.cache/btbctl/venv-sglang-<version>``."""
    env = os.environ.get("BTBCTL_SGLANG_VENV")
    return Path(env) if env else Path.home() / ".cache" / "btbctl" / f"venv-sglang-{SGLANG_VERSION}"


#: The checkout this harness belongs to.
CHECKOUT = STANDIN_DIR.parents[1]


def cpu_env(venv: Path) -> dict[str, str]:
    """What a process needs to serve SGLang 0.5.23 on a CPU from ``venv``: the CPU engine (SGLang's
    ``is_cpu()`` is true only with it), no hub, the page-key hash extension compiled by the harness, the stand-in,
    and this checkout first on ``PYTHONPATH``: the venv is shared by every checkout (it is keyed by SGLang's version
    only), so the btbctl an SGLang server loads as its L3 backend is the checkout's that set the environment, not
    whichever checkout last installed itself into the venv."""
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "HF_HUB_OFFLINE": "1",
        "TORCH_EXTENSIONS_DIR": str(venv / "torch-extensions"),
        STANDIN_ENV: str(STANDIN_DIR),
        "PYTHONPATH": str(CHECKOUT),
    }


def missing(venv: Path) -> str | None:
    """Why ``venv`` cannot serve (one line naming the command that builds it), or None when it can."""
    if not (venv / "bin" / "python").exists():
        return f"no SGLang harness venv at {venv}: run scripts/sglang-venv.sh"
    if not (venv / "tiny-llama" / "config.json").exists():
        return f"the harness venv {venv} has no tiny model yet: run scripts/sglang-venv.sh"
    return None


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "env":
        sys.exit("usage: harness.py env VENV_DIR")
    for k, v in cpu_env(Path(sys.argv[2])).items():
        print(f"export {k}={shlex.quote(v)}")
