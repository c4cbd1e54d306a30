"""A non-editable install carries every module, the sbatch templates and the DeepSpeed presets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT), "-w", str(out)],
        check=True, capture_output=True, text=True, cwd=out,
    )
    (whl,) = out.glob("swiftslurm-*.whl")
    return whl


def test_wheel_holds_every_module_template_and_preset(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for src in (ROOT / "swiftslurm").rglob("*.py"):
        assert str(src.relative_to(ROOT)) in names, f"{src} is not packaged"
    for tpl in (ROOT / "templates").glob("*.j2"):
        assert f"swiftslurm/templates/{tpl.name}" in names
    presets = sorted(p.name for p in (ROOT / "ds_config").glob("*.json"))
    assert len(presets) == 8
    for p in presets:
        assert f"swiftslurm/ds_config/{p}" in names


def test_installed_wheel_validates_and_plans_outside_the_repo(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    env = {**os.environ, "PYTHONPATH": str(site)}
    examples = sorted(str(p) for p in (ROOT / "examples").glob("*.toml"))
    # run from the repo root (relative dataset paths), but import swiftslurm from the installed copy
    # (-P: the current directory does not shadow it)
    probe = subprocess.run([sys.executable, "-P", "-c", "import swiftslurm; print(swiftslurm.__file__)"],
                           env=env, capture_output=True, text=True, cwd=ROOT)
    assert probe.stdout.startswith(str(site)), probe.stdout
    r = subprocess.run([sys.executable, "-P", "-m", "swiftslurm", "validate", *examples], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr + r.stdout
    r = subprocess.run([sys.executable, "-P", "-m", "swiftslurm", "plan", "examples/sweep.toml", "--json"], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert len(plan["tasks"]) == 4 and plan["deepspeed"][0]["zero_optimization"]["stage"] == 2
    assert "#SBATCH" in plan["sbatch"]
