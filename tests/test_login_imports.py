"""Login-side commands never import torch (nor deepspeed, transformers): on a login node each costs seconds
and gigabytes, and may not be installed at all (the [train] extra is optional).

Each command runs in its own interpreter on real inputs (the shipped example specs, a real local submission,
the captured run of tests/data/watch_run); a sitecustomize on PYTHONPATH records ``sys.modules`` at exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm.jobs.send import submit_plan
from swiftslurm.plan import make_plan
from swiftslurm.spec import parse_toml, validate_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.toml"))
HEAVY = ("torch", "deepspeed", "transformers")

RECORDER = """
import atexit, json, os, sys

def _record():
    with open(os.environ["SWIFTSLURM_TEST_MODULES"], "w") as fh:
        json.dump(sorted({name.partition(".")[0] for name in sys.modules}), fh)

atexit.register(_record)
"""

SPEC = """
[job]
name = "login"
output_dir = "{out}"
[slurm]
tasks_per_node = 1
[train]
command = ["{python}", "-c", "print('trained')"]
[preflight]
checks = []
"""


@pytest.fixture(scope="module")
def recorder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recorder")
    (folder / "sitecustomize.py").write_text(RECORDER)
    return folder


@pytest.fixture(scope="module")
def submitted(tmp_path_factory) -> Path:
    """The output dir of a real (local) submission that ran to its end."""
    tmp = tmp_path_factory.mktemp("login")
    raw = parse_toml(SPEC.format(out=tmp / "out", python=sys.executable))
    sub = submit_plan(make_plan(validate_spec(raw), raw, base_dir=str(tmp), source="login.toml"), executor="local")
    states = sub.wait(timeout_s=120)
    assert states == {"0": "COMPLETED"}, states
    return tmp / "out"


def modules_at_exit(recorder: Path, tmp_path: Path, *args: str) -> set[str]:
    record = tmp_path / "modules.json"
    env = {**os.environ, "SWIFTSLURM_TEST_MODULES": str(record), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(recorder), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"swiftslurm {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return set(json.loads(record.read_text()))


@pytest.mark.parametrize("args", [["validate", *EXAMPLES]] + [["plan", spec] for spec in EXAMPLES] + [["nodes"]],
                         ids=lambda args: " ".join(args[:2]))
def test_spec_commands_never_import_torch(recorder, tmp_path, args):
    assert EXAMPLES and not set(HEAVY) & modules_at_exit(recorder, tmp_path, *args)


@pytest.mark.parametrize("command", ["status", "logs", "doctor"])
def test_run_commands_never_import_torch(recorder, submitted, tmp_path, command):
    assert not set(HEAVY) & modules_at_exit(recorder, tmp_path, command, str(submitted))


@pytest.mark.parametrize("command", ["logs", "doctor"])
def test_commands_on_a_trained_run_never_import_torch(recorder, tmp_path, command):
    run = shutil.copytree(ROOT / "tests" / "data" / "watch_run", tmp_path / "run")
    assert not set(HEAVY) & modules_at_exit(recorder, tmp_path, command, str(run))


def test_the_recorder_sees_torch_when_it_is_imported(recorder, tmp_path):
    """The check itself works: a command that does import torch is seen doing it."""
    record = tmp_path / "modules.json"
    env = {**os.environ, "SWIFTSLURM_TEST_MODULES": str(record), "PYTHONPATH": os.pathsep.join([str(recorder), str(ROOT)])}
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True, timeout=120)
    assert "torch" in json.loads(record.read_text())
