#!/usr/bin/env bash
# Build (or reuse) the SGLang 0.5.23 harness of btbctl's tests: a virtual environment with SGLang and a torch that
# runs on the CPU, able both to run SGLang's own cache code (the contract tests, pytest marker `sglang`) and to serve a
# real `python -m sglang.launch_server` on a CPU-only machine (the real-server tests, marker `sglang_server`).
#
#   scripts/sglang-venv.sh [VENV_DIR]    # default: $BTBCTL_SGLANG_VENV or ~/.cache/btbctl/venv-sglang-0.5.23
#   scripts/sglang-venv.sh --env         # print the exports that serve SGLang on this CPU (builds first if needed)
#
# What it makes, once, keyed by the SGLang version (a stamp file records what was built; later runs only reinstall
# this checkout of btbctl):
# - the venv: torch==2.14.1 / torchvision==0.29.1 (pinned with a constraints file so nothing pulls another build),
#   SGLang with --no-deps (its full dependency set is the CUDA stack) and the packages its server imports, at
#   SGLang's own pins where it pins them;
# - a one-line `btbctl-sglang-cpu-standin.pth` in the venv: when BTBCTL_SGLANG_CPU_STANDIN names
#   tests/sglang_cpu, every Python process of the venv installs the test-only stand-in for the two CUDA-bound pieces
#   (tests/sglang_cpu/sglang_cpu_standin.py says what it replaces); without that variable the venv is stock SGLang;
# - SGLang's page-key hash extension, compiled into VENV/torch-extensions (TORCH_EXTENSIONS_DIR);
# - the tests' model, VENV/tiny-llama (tests/sglang_cpu/tiny_model.py: random weights, seeded, no hub);
# - a link examples/sglang-cpu -> VENV, which examples/cluster-sglang-cpu.toml names (python, model).
# The venv is shared by every checkout (keyed by SGLang's version); btbctl is installed into it editable for its
# dependencies, and the exports of --env put the checkout that printed them first on PYTHONPATH.
# About 5 minutes and 6.8 GB the first time (g++, ninja and libssl-dev are installed with apt-get when missing and
# running as root). Prints the venv's python path on the last line. Exit status 3: the venv cannot be built here (the
# reason is printed); anything else non-zero is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
print_env=0
if [ "${1:-}" = "--env" ]; then
    print_env=1
    shift
fi
VENV="${1:-${BTBCTL_SGLANG_VENV:-$HOME/.cache/btbctl/venv-sglang-$SGLANG_VERSION}}"
STAMP="sglang=$SGLANG_VERSION torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION deps=4 serve=1"

cant() { echo "sglang-venv: cannot build the SGLang venv: $*" >&2; exit 3; }

# The exports that serve SGLang on a CPU with the stand-in (one definition: tests/sglang_cpu/harness.py).
cpu_env() { python3 tests/sglang_cpu/harness.py env "$VENV"; }

command -v python3 >/dev/null || cant "python3 is missing"
if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null || [ ! -e /usr/include/openssl/sha.h ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends g++ ninja-build libssl-dev >/dev/null \
            || cant "apt-get could not install g++, ninja-build, libssl-dev"
    else
        cant "g++, ninja and libssl-dev are needed (SGLang compiles its page-key hasher)"
    fi
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$constraints"

# --env on a built harness: print at once (the exports put this checkout first on PYTHONPATH, see harness.py)
if [ "$print_env" = 1 ] && [ "$(cat "$VENV/.btbctl-stamp" 2>/dev/null)" = "$STAMP" ] && [ -f "$VENV/tiny-llama/.made" ]; then
    ln -sfn "$VENV" examples/sglang-cpu
    cpu_env
    exit 0
fi

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.btbctl-stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || cant "python3 -m venv failed"
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" -c "$constraints" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
        || cant "torch==$TORCH_VERSION is not installable here"
    "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" || cant "sglang==$SGLANG_VERSION is not installable here"
    # What SGLang's cache code and its server import, at SGLang 0.5.23's own pins where it has them.
    "${pip[@]}" -c "$constraints" numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
        pydantic pyzmq tqdm ipython aiohttp dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
        compressed-tensors==0.18.0 gguf openai==2.8.0 partial_json_parser datasets ninja \
        transformers==5.19.0 tokenizers==0.23.2 xgrammar==0.2.7 jsonschema soundfile==0.13.1 'python-dateutil<3' \
        fastapi 'uvicorn>=0.51' uvloop setproctitle python-multipart interegular einops prometheus-client \
        || cant "SGLang's Python dependencies are not installable here"
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # The stand-in hook: inert unless BTBCTL_SGLANG_CPU_STANDIN names the folder holding sglang_cpu_standin.py.
    echo 'import os, sys; d = os.environ.get("BTBCTL_SGLANG_CPU_STANDIN"); d and (sys.path.insert(0, d), __import__("sglang_cpu_standin").install())' \
        > "$site/btbctl-sglang-cpu-standin.pth"
    echo "$STAMP" > "$VENV/.btbctl-stamp"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" -e '.[test]' \
    || cant "btbctl does not install into the SGLang venv"
"$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage, btbctl.sglang_l3.store" \
    || cant "SGLang's storage module does not import in the venv"
# The page-key hash extension (SGLang compiles it on the first HiCache request otherwise, about 8 s per server).
TORCH_EXTENSIONS_DIR="$VENV/torch-extensions" "$VENV/bin/python" -c \
    "from sglang.srt.mem_cache.cpp_utils.native_hash import _load_native_hash_module as m; m()" >/dev/null 2>&1 \
    || cant "SGLang's page-key hash extension does not compile"
if [ ! -f "$VENV/tiny-llama/.made" ] || ! cmp -s tests/sglang_cpu/tiny_model.py "$VENV/tiny-llama/.made"; then
    rm -rf "$VENV/tiny-llama"
    HF_HUB_OFFLINE=1 "$VENV/bin/python" tests/sglang_cpu/tiny_model.py "$VENV/tiny-llama" >/dev/null 2>&1 \
        || cant "the tests' tiny model could not be made"
    cp tests/sglang_cpu/tiny_model.py "$VENV/tiny-llama/.made"
fi
# The server must import with the stand-in (and only with it: a stock import fails on sgl_kernel, the CUDA-only kernels).
( eval "$(cpu_env)"; "$VENV/bin/python" -c "import sglang.srt.entrypoints.http_server" ) >/dev/null 2>&1 \
    || cant "SGLang's server does not import with the CPU stand-in"
ln -sfn "$VENV" examples/sglang-cpu
if [ "$print_env" = 1 ]; then
    cpu_env
    exit 0
fi
echo "$VENV/bin/python"
