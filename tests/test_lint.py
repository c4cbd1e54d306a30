"""Lint: pyflakes' findings (ruff's F rules: unused imports and names, undefined names, f-strings without
placeholders, ...) stay at zero. The wider rule set in pyproject.toml ([tool.ruff]) is reported, not yet enforced."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[dev]')")
def test_no_pyflakes_findings():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--output-format", "concise", "--no-cache", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
