"""Under CI=true only a named hardware skip stands (tests/conftest.py), and .ci/skips.py fails a JUnit report
with any other skip: a throwaway suite with every kind of skip, run with this conftest."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SKIPS = '''
import pytest
from conftest import needs_hardware

@pytest.mark.skipif(True, reason="needs a thing")
def test_mark(): pass

def test_body(): pytest.skip("skipped in the body")

def test_importorskip(): pytest.importorskip("no_such_module_xyz")

@pytest.fixture
def fx(): pytest.skip("skipped in a fixture")

def test_fixture(fx): pass

@needs_hardware("2 CUDA GPUs", False)
def test_gpu(): pass

def test_ok(): pass
'''
MODULE_IMPORTORSKIP = 'import pytest\npytest.importorskip("no_such_module_xyz")\ndef test_never(): pass\n'
MODULE_SKIP = 'import pytest\npytest.skip("not here", allow_module_level=True)\ndef test_never(): pass\n'
MODULE_MARK = 'import pytest\npytestmark = pytest.mark.skipif(True, reason="module mark")\ndef test_m(): pass\n'


def run_suite(tmp_path: Path, ci: bool) -> tuple[subprocess.CompletedProcess, dict[str, str], Path]:
    suite = tmp_path / ("ci" if ci else "dev")
    suite.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", suite)
    for name, text in (("test_skips", SKIPS), ("test_mod_imp", MODULE_IMPORTORSKIP), ("test_mod_skip", MODULE_SKIP), ("test_mod_mark", MODULE_MARK)):
        (suite / f"{name}.py").write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    report = suite / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[case.get("name")] = kinds[0] if kinds else "passed"
    return proc, outcomes, report


def check_report(report: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "skips.py"), str(report)], capture_output=True, text=True, timeout=60)


def test_under_ci_every_skip_but_named_hardware_fails(tmp_path):
    proc, outcomes, report = run_suite(tmp_path, ci=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert outcomes == {"test_mark": "error", "test_body": "failure", "test_importorskip": "failure", "test_fixture": "error",
                        "test_gpu": "skipped", "test_ok": "passed", "test_mod_imp": "error", "test_mod_skip": "error",
                        "test_m": "error"}, proc.stdout
    assert "CI=true: only a test that needs hardware CI cannot have may skip" in proc.stdout
    assert "skipped at" in proc.stdout and "Skipped: needs a thing" in proc.stdout
    assert check_report(report).returncode == 0  # the one skip left is the named hardware one


def test_outside_ci_skips_stay_skips_and_the_ci_check_names_each(tmp_path):
    proc, outcomes, report = run_suite(tmp_path, ci=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert outcomes == {name: ("passed" if name == "test_ok" else "skipped") for name in outcomes} and len(outcomes) == 9, outcomes
    check = check_report(report)
    assert check.returncode == 1, check.stderr
    assert "skipped (hardware): test_skips::test_gpu: needs hardware CI does not have: 2 CUDA GPUs" in check.stderr
    for reason in ("needs a thing", "skipped in the body", "no_such_module_xyz", "skipped in a fixture", "not here", "module mark"):
        assert f": {reason}" in check.stderr or reason in check.stderr, (reason, check.stderr)
    assert "7 test(s) skipped for a reason other than missing hardware" in check.stderr, check.stderr
