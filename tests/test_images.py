"""The container images' Dockerfiles, checked without a container engine (docs/sglang-install.md): each base image
is pinned (an exact version tag or a digest, never ``latest``), every file a ``COPY`` takes is in the repository and
in the build context (``.dockerignore``), and the SGLang image installs the backend with exactly the command the
docs give (which is also the one ``btbctl doctor`` prints). The images themselves are never built here."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from btbctl.engine.launcher.doctor import L3_INSTALL

ROOT = Path(__file__).resolve().parents[1]
#: Dockerfile -> the ``[kubernetes]`` key of the image it builds; both are built with the repository root as context.
IMAGES = {"Dockerfile": "image", "deploy/images/sglang-btbctl.Dockerfile": "sglang_image"}
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
#: An exact release tag: a full ``X.Y.Z`` version (optionally ``v``-prefixed), then variant suffixes.
_EXACT_TAG = re.compile(r"^v?\d+\.\d+\.\d+(\.post\d+)?([-.][A-Za-z0-9_.-]+)?$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1].strip() + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: a continuation line ends the file"
    return out


def pinned(ref: str) -> bool:
    """Whether an image reference is pinned: a digest, or an exact version tag (never ``latest``, no variables)."""
    if "$" in ref:
        return False
    if _DIGEST.search(ref):
        return True
    name = ref.rsplit("/", 1)[-1]
    tag = name.partition(":")[2]
    return bool(tag) and tag != "latest" and bool(_EXACT_TAG.match(tag))


def _dockerignore_pattern(pattern: str) -> re.Pattern[str]:
    rx = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            rx += ".*"
            i += 2
        elif pattern[i] == "*":
            rx += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            rx += "[^/]"
            i += 1
        else:
            rx += re.escape(pattern[i])
            i += 1
    return re.compile(rx + "$")


def in_context(rel: str) -> bool:
    """Whether ``.dockerignore`` keeps ``rel`` in the build context (the last matching pattern wins; a pattern that
    matches a folder matches what is inside it)."""
    ignore = ROOT / ".dockerignore"
    if not ignore.exists():
        return True
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    kept = True
    for line in ignore.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rx = _dockerignore_pattern(line.lstrip("!").strip("/"))
        if any(rx.match(c) for c in candidates):
            kept = negate
    return kept


def documented_install() -> str:
    """The install command of docs/sglang-install.md: the first console block that installs with ``--no-deps``,
    which must be that one line."""
    text = (ROOT / "docs" / "sglang-install.md").read_text(encoding="utf-8")
    for block in re.findall(r"```console\n(.*?)```", text, flags=re.S):
        if "pip install --no-deps" in block:
            lines = [ln for ln in block.strip().splitlines() if ln.strip()]
            assert len(lines) == 1, f"the install block of docs/sglang-install.md must be one command: {lines}"
            return lines[0].strip()
    raise AssertionError("docs/sglang-install.md has no console block with `pip install --no-deps`")


def _tracked(rel: str) -> bool:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--", rel], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return bool(out.stdout.strip())


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_dockerfile_base_is_pinned_and_copies_exist(dockerfile):
    steps = instructions(ROOT / dockerfile)
    bases = [next(a for a in args.split() if not a.startswith("--")) for w, args in steps if w == "FROM"]
    assert bases, f"{dockerfile} has no FROM"
    for ref in bases:
        assert pinned(ref), f"{dockerfile}: base image {ref!r} is not pinned to an exact tag or digest"
    copies = [args for w, args in steps if w in ("COPY", "ADD")]
    assert copies, f"{dockerfile} copies nothing from the checkout"
    for args in copies:
        words = [a for a in args.split() if not a.startswith("--")]
        assert not any(a.startswith("--from") for a in args.split()), f"{dockerfile}: multi-stage COPY {args!r}"
        for src in words[:-1]:
            assert (ROOT / src).exists(), f"{dockerfile}: COPY source {src} is not in the repository"
            assert _tracked(src), f"{dockerfile}: COPY source {src} is not tracked by git"
            assert in_context(src), f"{dockerfile}: COPY source {src} is left out by .dockerignore"


def test_sglang_image_installs_the_backend_with_the_documented_command():
    cmd = documented_install()
    assert cmd == L3_INSTALL.format(python="python3")  # what `btbctl doctor` tells a user to run
    runs = [args for w, args in instructions(ROOT / "deploy/images/sglang-btbctl.Dockerfile") if w == "RUN"]
    assert [r for r in runs if cmd in r], f"no RUN of the sglang image runs {cmd!r}: {runs}"
    assert not [r for r in runs if "pip install" in r and cmd not in r], runs  # and no other install
    # the SGLang release the contract tests check btbctl against (their venv's pin)
    checked = re.search(r"^SGLANG_VERSION=(\S+)$", (ROOT / "scripts/sglang-venv.sh").read_text(), flags=re.M)
    base = next(a for w, a in instructions(ROOT / "deploy/images/sglang-btbctl.Dockerfile") if w == "FROM")
    assert checked and base.startswith(f"lmsysorg/sglang:v{checked[1]}-"), (base, checked)
    # the README's install advice is the same command
    assert f"`{cmd}`" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_btbctl_image_installs_with_dependencies():
    runs = [args for w, args in instructions(ROOT / "Dockerfile") if w == "RUN"]
    installs = [r for r in runs if "-m pip install ." in r]
    assert installs and not any("--no-deps" in r for r in installs), runs


def test_images_are_named_where_they_are_used():
    """The Kubernetes example names each image with the Dockerfile that builds it; deploy/README.md and the docs
    list both Dockerfiles."""
    example = (ROOT / "examples" / "cluster-k8s.toml").read_text(encoding="utf-8")
    for dockerfile, key in IMAGES.items():
        line = next((ln for ln in example.splitlines() if ln.startswith(f"{key} = ")), "")
        assert dockerfile in line, f"examples/cluster-k8s.toml: {key} does not name {dockerfile}: {line!r}"
        for doc in ("deploy/README.md", "docs/sglang-install.md"):
            assert dockerfile.rpartition("/")[2] in (ROOT / doc).read_text(encoding="utf-8"), (doc, dockerfile)


def test_checks_catch_what_they_should():
    assert pinned("python:3.11.13-slim-bookworm") and pinned("lmsysorg/sglang:v0.5.23-cu129-amd64")
    assert pinned("registry:5000/x/python@sha256:" + "a" * 64) and pinned("lmsysorg/sglang:v0.5.5.post3-cu129")
    for ref in ("python", "python:latest", "python:3.11-slim", "python:3", "lmsysorg/sglang:${TAG}", "r:5000/x"):
        assert not pinned(ref), ref
    assert in_context("btbctl/sglang_l3/store.py") and in_context("pyproject.toml")
    assert not in_context("tests/test_images.py") and not in_context("btbctl/__pycache__/x.pyc")
