"""What the training tests send and read back, in one place: the tiny model's [train] block, the submit, and the run
reader (losses per step, the last step, restarts, requeues), by the file names the product writes (``taskdir``).

    from runs import TINY_TRAIN, losses, submit
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from swiftslurm.taskdir import METRICS_FILE, REQUEUES_FILE, RESTARTS_FILE, SUBMISSION_FILE

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"

# the [train] lines of the tiny model trained whole under ZeRO-2 on the demo data (``{data}``: the dataset's path,
# filled in by the template's .format): follow it with the test's own keys
TINY_TRAIN = """model = "tiny-llama"
dataset = ["{data}"]
train_type = "full"
deepspeed = "zero2"
gradient_checkpointing = false
per_device_train_batch_size = 2
"""


# a Slurm job of 1 CPU rank a node on the test cluster's partition: what [slurm] of a cluster test starts from
ONE_RANK_A_NODE = {"partition": "debug", "nodes": 1, "tasks_per_node": 1, "cpus_per_task": 1}
QUIET = {"checkpoint": {"forced_save_fractions": []}, "preflight": {"checks": []}}  # no forced saves, no preflight


def tiny_spec(name: str, out: Path | str, *, data: Path | str = DATA, **tables: dict) -> str:
    """The TOML of a spec that trains the tiny model of ``TINY_TRAIN`` on ``data`` into ``out``: ``tables`` are its
    tables (``slurm={...}``, ``train={...}`` added to the tiny model's keys, ``env={...}``, ...), in that order."""
    train = {"model": "tiny-llama", "dataset": [str(data)], "train_type": "full", "deepspeed": "zero2",
             "gradient_checkpointing": False, "per_device_train_batch_size": 2, **tables.pop("train", {})}
    first = {"job": {"name": name, "output_dir": str(out)}, **({"slurm": tables.pop("slurm")} if "slurm" in tables else {})}
    return to_toml({**first, "train": train, **tables})


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)


def to_toml(data: dict) -> str:
    """TOML of a spec's tables (a nested dict in a table: its sub-table)."""
    lines = []
    for table, body in data.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in body.items() if not isinstance(v, dict)]
        for k, v in body.items():
            if isinstance(v, dict):
                lines.append(f"[{table}.{k}]")
                lines += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
    return "\n".join(lines) + "\n"


def submit(spec: Path, out: Path, *, executor: str = "slurm", timeout: float = 120) -> str:
    """``swiftslurm submit SPEC`` (from the checkout's root); the id of the job it sent into ``out``."""
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", executor],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((out / SUBMISSION_FILE).read_text())["submissions"][-1]["job_ids"][0]


def metrics(out: Path) -> list[dict]:
    """Every row of the task dir's metrics.jsonl, in the order written ([] before the first)."""
    path = out / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def losses(out: Path) -> dict[int, list[float]]:
    """Every training-loss value logged per step (a step logged again after a resume appears twice)."""
    per_step: dict[int, list[float]] = {}
    for row in metrics(out):
        if "loss" in row:
            per_step.setdefault(int(row["step"]), []).append(row["loss"])
    return per_step


def last_step(out: Path) -> int:
    """The highest step a training loss was logged at (0 before the first, or while the file is half-written)."""
    try:
        return max(losses(out), default=0)
    except (OSError, ValueError):
        return 0


def restarts(out: Path) -> list[dict]:
    """The in-job restarts recorded in the task dir ([] when none)."""
    path = out / RESTARTS_FILE
    return json.loads(path.read_text()) if path.exists() else []


def requeues(out: Path) -> list[dict]:
    """The walltime requeues recorded in the task dir ([] when none)."""
    path = out / REQUEUES_FILE
    return json.loads(path.read_text()) if path.exists() else []


def explain(out: Path, logs: int = 3) -> str:
    """The last lines of the newest rank logs (and Slurm's own output) of a run, and its restarts: for a failure."""
    paths = sorted((out / "logs").rglob("*.err")) + sorted(out.glob("slurm-*.out"))
    tails = [f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]) for p in paths[-logs:]]
    return "\n".join(tails) + f"\nrestarts: {restarts(out)}"
