#!/usr/bin/env bash
# Build (or reuse) a virtual environment with SGLang 0.5.23 and CPU-capable torch for btbctl's contract tests
# (tests/sglang_contract, pytest marker `sglang`), and install this checkout of btbctl into it.
#
#   scripts/sglang-venv.sh [VENV_DIR]      # default: $BTBCTL_SGLANG_VENV or ~/.cache/btbctl/venv-sglang-0.5.23
#   VENV_DIR/bin/python -m pytest -m sglang tests/sglang_contract
#
# About 100 s and 6 GB the first time; later runs only reinstall btbctl (a stamp file records what was built).
# torch==2.14.1 / torchvision==0.29.1 are pinned with a constraints file so that nothing pulls another (CUDA) build.
# SGLang goes in with --no-deps (its full dependency set is the CUDA stack); the packages its L2/L3 cache code
# imports are listed below. Its page-key hasher compiles a small C++ extension on first use: g++, ninja and
# libssl-dev must be present (installed here with apt-get when missing and running as root).
# Prints the venv's python path on the last line. Exit status 3: the venv cannot be built here (the reason is
# printed); anything else non-zero is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.23
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
VENV="${1:-${BTBCTL_SGLANG_VENV:-$HOME/.cache/btbctl/venv-sglang-$SGLANG_VERSION}}"
STAMP="sglang=$SGLANG_VERSION torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION deps=3"

cant() { echo "sglang-venv: cannot build the SGLang venv: $*" >&2; exit 3; }

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

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.btbctl-stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || cant "python3 -m venv failed"
    pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
    "${pip[@]}" -c "$constraints" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
        || cant "torch==$TORCH_VERSION is not installable here"
    "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION" || cant "sglang==$SGLANG_VERSION is not installable here"
    "${pip[@]}" -c "$constraints" numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec \
        pydantic pyzmq tqdm ipython aiohttp transformers dill apache-tvm-ffi==0.1.11 sentencepiece \
        compressed-tensors gguf openai partial_json_parser datasets ninja \
        || cant "SGLang's Python dependencies are not installable here"
    echo "$STAMP" > "$VENV/.btbctl-stamp"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" -e '.[test]' \
    || cant "btbctl does not install into the SGLang venv"
"$VENV/bin/python" -c "import sglang.srt.mem_cache.hicache_storage, btbctl.sglang_l3.store" \
    || cant "SGLang's storage module does not import in the venv"
echo "$VENV/bin/python"
