"""A new training task is one module plus its row in each of the two registries, and nothing else.

On a copy of this checkout's package, the test adds a throwaway task the way docs/ARCHITECTURE.md says: a module
``train/tasks/throwaway.py`` (SFT's class under another name), a row in ``swiftslurm/tasks.py`` (what the spec, the
rules, sizing and validate's scan read) and a row in ``train/tasks/__init__.py`` (the class that trains). Then the
copy validates a spec with ``task = "throwaway"`` (the scan its row names counts the records) and trains one step on
the local executor. A task name registered nowhere is still refused with the list of the registered ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"

MODULE = '''"""A throwaway task of tests/test_new_task.py: SFT under another name."""

from .sft import SFTTask


class ThrowawayTask(SFTTask):
    name = "throwaway"
'''
SPEC_ROW = '    Task("throwaway", "a test\'s throwaway task", data="tokens", counts="throwaway record(s)"),\n'
RUNTIME_ROW = '    "throwaway": ("throwaway", "ThrowawayTask"),\n'

SPEC = f"""
[job]
name = "throwaway"
output_dir = "{{out}}"
[train]
model = "tiny-llama"
task = "{{task}}"
dataset = ["{DATA}"]
max_steps = 1
max_length = 128
per_device_train_batch_size = 2
report_to = ["none"]
[preflight]
checks = []
[env]
OMP_NUM_THREADS = "1"
"""


def _add_row(path: Path, after: str, row: str) -> None:
    """Insert ``row`` as the first line after the line that starts with ``after`` (a registry's opening)."""
    text = path.read_text()
    at = text.index(after)
    at = text.index("\n", at) + 1
    path.write_text(text[:at] + row + text[at:])


@pytest.fixture(scope="module")
def copy_with_task(tmp_path_factory) -> Path:
    """This checkout's package (with its templates and DeepSpeed configs) copied, plus the throwaway task."""
    src = tmp_path_factory.mktemp("src")
    shutil.copytree(ROOT / "swiftslurm", src / "swiftslurm", ignore=shutil.ignore_patterns("__pycache__"))
    for extra in ("templates", "ds_config"):
        shutil.copytree(ROOT / extra, src / extra)
    shutil.copy(ROOT / "setup.cfg", src / "setup.cfg")
    pkg = src / "swiftslurm"
    (pkg / "train" / "tasks" / "throwaway.py").write_text(MODULE)
    _add_row(pkg / "tasks.py", "TASKS: dict[str, Task] = {", SPEC_ROW)
    _add_row(pkg / "train" / "tasks" / "__init__.py", "TASKS: dict[str, tuple[str, str]] = {", RUNTIME_ROW)
    return src


def swiftslurm(src: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


@pytest.mark.slow
def test_a_task_added_as_one_module_and_two_rows_validates_and_trains_a_step(copy_with_task, tmp_path):
    out = tmp_path / "out"
    (tmp_path / "s.toml").write_text(SPEC.format(out=out, task="throwaway"))

    checked = swiftslurm(copy_with_task, "validate", "s.toml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    records = sum(1 for line in DATA.read_text().splitlines() if line.strip())
    assert f"dataset: {records:,} throwaway record(s)" in checked.stdout + checked.stderr

    ran = swiftslurm(copy_with_task, "submit", "s.toml", "--executor", "local", "--wait", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    summary = json.loads((out / "train-summary.json").read_text())
    assert (summary["task"], summary["global_step"]) == ("throwaway", 1)


def test_a_task_registered_nowhere_is_refused_with_the_registered_names(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC.format(out=tmp_path / "out", task="throwaway"))
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", "s.toml"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    assert "train.task" in said and "'sft'" in said and "'grpo'" in said and "throwaway" in said, said
    assert not (tmp_path / "out").exists()


def test_each_task_adds_its_own_summary_line_and_a_metric_never_logged_reads_n_a():
    from swiftslurm.train.result import TrainResult, summary

    def line_after_loss(**fields) -> str:
        result = TrainResult(global_step=3, final_loss=0.5, tokens_per_s=None, stopped_for_requeue=False, **fields)
        return summary(result, "/out", 1.0).splitlines()[2]

    assert line_after_loss(task="dpo", reward_accuracy=0.75) == \
        "  reward accuracy (chosen scored above rejected, last logged step): 0.750"
    assert line_after_loss(task="rm", reward_accuracy=None, reward_margin=1.5) == \
        "  reward accuracy (chosen scored above rejected, last logged step): n/a; margin 1.500"
    assert line_after_loss(task="grpo", rewards=(0.1, None)) == "  mean reward: first 0.1000 -> last n/a (logged steps)"
    assert line_after_loss(task="sft").startswith("  throughput: ")  # no line of its own
