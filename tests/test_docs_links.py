"""Relative links in the repository's Markdown point at files the repository holds (not at ignored build output)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return set(out.stdout.splitlines())


def test_markdown_links_resolve_to_tracked_files():
    tracked = _tracked()
    docs = [p for p in tracked if p.endswith(".md") and (p.startswith("docs/") or p.startswith("examples/"))]
    broken = []
    for doc in docs:
        for target in LINK.findall((ROOT / doc).read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (ROOT / doc).parent / target
            rel = (
                path.resolve().relative_to(ROOT.resolve()).as_posix()
                if path.resolve().is_relative_to(ROOT.resolve())
                else None
            )
            if rel is None or not path.exists() or (path.is_file() and rel not in tracked):
                broken.append(f"{doc}: {target}")
    assert not broken, broken
