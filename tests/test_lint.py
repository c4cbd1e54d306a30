"""Lint and types stay at zero findings: ruff's configured rule set (pyproject.toml [tool.ruff]: pycodestyle, pyflakes,
import order, bugbear) over the whole repository, and mypy (pyproject.toml [tool.mypy]) over the package, which holds
the typed seams: every function that takes the spec or the rank environment says so, and the checker holds it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_no_ruff_findings():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "--no-cache", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[dev]')")
def test_no_mypy_findings(tmp_path):
    # a fresh cache each run: a stale one from another checkout must not hide a finding
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "mypy-cache"), "swiftslurm"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
