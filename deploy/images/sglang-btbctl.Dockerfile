# SGLang 0.5.23 with btbctl's HiCache L3 backend (btbctl.sglang_l3, loaded by SGLang with
# --hicache-storage-backend dynamic). It is the `sglang_image` of a cluster file's [kubernetes] section
# (examples/cluster-k8s.toml: registry.example.com/sglang-btb:0.5.23). From the repository root:
#
#   docker build -f deploy/images/sglang-btbctl.Dockerfile -t registry.example.com/sglang-btb:0.5.23 .
#
# The base is pinned to an exact tag, and its SGLang must be the version btbctl's page keys and store were checked
# against: 0.5.23 (tests/test_sglang_contract_keys.py and tests/test_sglang_contract_store.py, in the venv of
# scripts/sglang-venv.sh). Move both together. The tag (CUDA 12.9, amd64) was not pulled where this file was written;
# check it exists for your platform, or take the same release's tag for your CUDA version and architecture.
FROM lmsysorg/sglang:v0.5.23-cu129-amd64

COPY pyproject.toml README.md /opt/btbctl-src/
COPY btbctl /opt/btbctl-src/btbctl
# Only the backend: it needs the standard library and SGLang's own torch, so --no-deps leaves every package SGLang
# pinned as it is (docs/sglang-install.md). PIP_BREAK_SYSTEM_PACKAGES: SGLang lives in the image's system Python.
RUN cd /opt/btbctl-src \
 && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-deps . \
 && cd / && rm -rf /opt/btbctl-src \
 && python3 -c "import btbctl.sglang_l3"
