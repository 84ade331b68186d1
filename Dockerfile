# btbctl with its dependencies: the gateway, the node agents and emulated workers. It is the `image` of a cluster
# file's [kubernetes] section (examples/cluster-k8s.toml: registry.example.com/btbctl:0.1.0). From the repository
# root:
#
#   docker build -t registry.example.com/btbctl:0.1.0 .
#
# SGLang workers use the other image, deploy/images/sglang-btbctl.Dockerfile. The base is pinned to an exact Python
# release (3.11, the version the test suite runs on): a moving tag such as python:3.11-slim would change the image
# under the same name. Bump it deliberately.
FROM python:3.11.13-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

COPY pyproject.toml setup.py README.md /opt/btbctl-src/
COPY btbctl /opt/btbctl-src/btbctl
# every dependency has wheels for amd64 and arm64; gcc compiles the routing core (setup.py; README "Compiled core"
# gives its speed-up) and goes with the sources once installed; --version names the build
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && cd /opt/btbctl-src \
 && python3 -m pip install . \
 && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
 && cd / && rm -rf /opt/btbctl-src \
 && python3 -m btbctl --version

# Runs as root: the node agent creates its socket in a host directory (kubernetes.agent_socket_dir) that the SGLang
# workers, root in SGLang's image, open. The manifests give every container its command line.
CMD ["python3", "-m", "btbctl", "--help"]
