"""Evaluation while training, the best checkpoint, early stopping and sweeps ranked by a metric (issue 33).

Pure: the held-out split (fixed, sized, written once), the eval keys' rules and HF arguments, the `latest_best`
pointer read defensively and kept by retention, `status --sort` over planted task dirs.
One real run on the Slurm cluster (1 node x 2 CPU ranks, tiny-llama, LoRA, ZeRO-2) proves the rest at once: an
``eval_split`` run evaluates every 2 steps; a learning rate of 1e-12 leaves the weights bit-identical (each update
is below the float32 spacing of the weights), so the first evaluation (step 2) is the best and every later one ties
it; with ``early_stopping_patience = 3`` an uninterrupted run stops at step 8 (each step takes at least 2 s: the
watchdog's test hook, so the signal below lands between steps 4 and 8 on any machine). A walltime USR2 (as Slurm sends it)
after the evaluation at step 4 stops, saves and requeues it; the resumed run must still stop at step 8 (the patience
counter came back: without it, step 10) with ``latest_best`` still at checkpoint-2 (the best so far came back:
without it the first evaluation after the resume would be a new best), the job COMPLETED, the reason in the summary
and `status`, checkpoint-2 kept beside ``keep = 2``, eval_loss in metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import wait_for_job

from swiftslurm import checkpoint as ck
from swiftslurm.cli.watch_cmd import plain_line, progress_table
from swiftslurm.spec import parse_toml, validate_spec
from swiftslurm.spec.load import SpecError
from swiftslurm.train.data.records import DataError
from swiftslurm.train.evaluation import eval_arguments, held_out, split_files
from swiftslurm.watch.progress import Watcher, rank_by

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"


# ---------------------------------------------------------------- the held-out split


def test_held_out_is_the_same_set_every_time_and_sized_by_the_ratio():
    assert held_out(100, 0.1) == held_out(100, 0.1) and len(held_out(100, 0.1)) == 10
    assert held_out(100, 0.1) != held_out(100, 0.1, seed=7)
    assert len(held_out(5, 0.01)) == 1 and len(held_out(3, 0.99)) == 2  # at least one each side
    with pytest.raises(DataError, match="at least 2 records"):
        held_out(1, 0.5)


def test_split_files_partition_the_records_once(tmp_path):
    train, held = split_files([str(DATA)], 0.25, tmp_path)
    original = DATA.read_text().splitlines()
    parts = [json.loads(x) for x in train.read_text().splitlines()], [json.loads(x) for x in held.read_text().splitlines()]
    assert (len(parts[0]), len(parts[1])) == (27, 9)
    assert sorted(map(json.dumps, parts[0] + parts[1])) == sorted(json.dumps(json.loads(x)) for x in original)
    stamp = held.stat().st_mtime_ns
    assert split_files([str(DATA)], 0.25, tmp_path) == (train, held) and held.stat().st_mtime_ns == stamp  # found, not rewritten
    assert split_files([str(DATA)], 0.5, tmp_path)[1] != held  # another ratio is another key


# ---------------------------------------------------------------- the keys


def spec(extra: str, task: str = "sft"):
    return validate_spec(parse_toml(f'[job]\nname = "e"\n[train]\nmodel = "tiny-llama"\ndataset = ["d.jsonl"]\ntask = "{task}"\n'
                                    f'save_steps = 50\n{extra}'))


@pytest.mark.parametrize("extra,said", [
    ("eval_split = 0.1\neval_dataset = ['dev.jsonl']", "both set"),
    ("early_stopping_patience = 3", "early_stopping_patience set without an eval set"),
    ("eval_split = 0.1\nmetric_for_best_model = 'eval_rewards/accuracies'", "task = 'sft' evaluation reports eval_loss"),
    ("eval_split = 0.1\nmetric_for_best_model = 'eval loss; rm'", "a metric's name"),
])
def test_eval_keys_are_refused_with_the_reason(extra, said):
    with pytest.raises(SpecError) as exc:
        spec(extra)
    assert said in str(exc.value)


def test_eval_arguments_default_to_the_save_steps_and_infer_the_direction():
    assert eval_arguments(spec("")) == {}
    args = eval_arguments(spec("eval_split = 0.1\nper_device_train_batch_size = 3"))
    assert args == {"eval_strategy": "steps", "eval_steps": 50, "per_device_eval_batch_size": 3,
                    "metric_for_best_model": "eval_loss", "greater_is_better": False}
    dpo = eval_arguments(spec("eval_split = 0.1\neval_steps = 5\nmetric_for_best_model = 'rewards/accuracies'", task="dpo"))
    assert (dpo["eval_steps"], dpo["metric_for_best_model"], dpo["greater_is_better"]) == (5, "eval_rewards/accuracies", True)


# ---------------------------------------------------------------- latest_best and retention


def commit(out: Path, step: int) -> Path:
    stage = ck.prepare_staging(out, step)
    (stage / "weights.bin").write_bytes(bytes([step]) * 64)
    ck.commit(stage, ck.final_dir(out, step), algo="xxh3", meta={"step": step})
    return ck.final_dir(out, step)


def test_the_best_checkpoint_survives_retention(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2):
        commit(out, step)
    assert ck.point_best(out, 1) == out / "checkpoint-1" and (out / "latest_best").read_text() == "checkpoint-1\n"
    for step in (3, 4, 5):
        commit(out, step)
        ck.prune(out, keep=2, log=None)
    assert sorted(p.name for p in ck.list_checkpoints(out)) == ["checkpoint-1", "checkpoint-4", "checkpoint-5"]
    assert ck.best_checkpoint(out) == out / "checkpoint-1"
    ck.point_best(out, 5)  # a new best: the old one is retention's again
    ck.prune(out, keep=2, log=None)
    assert sorted(p.name for p in ck.list_checkpoints(out)) == ["checkpoint-4", "checkpoint-5"]


@pytest.mark.parametrize("pointer", ["../elsewhere/checkpoint-1", "/etc/checkpoint-1", "checkpoint-9", "latest", "checkpoint-1/.."])
def test_a_pointer_out_of_the_dir_or_to_nothing_names_no_best(tmp_path, pointer):
    out = tmp_path / "out"
    commit(out, 1)
    (tmp_path / "elsewhere" / "checkpoint-1").mkdir(parents=True)
    (out / "latest_best").write_text(pointer + "\n")
    assert ck.best_checkpoint(out) is None


def test_a_symlinked_pointer_or_checkpoint_names_no_best(tmp_path):
    out, other = tmp_path / "out", tmp_path / "other"
    commit(out, 1)
    other.mkdir()
    (other / "ptr").write_text("checkpoint-1\n")
    (out / "latest_best").symlink_to(other / "ptr")
    assert ck.best_checkpoint(out) is None
    (out / "latest_best").unlink()
    (other / "checkpoint-7").mkdir()
    (out / "checkpoint-7").symlink_to(other / "checkpoint-7")
    (out / "latest_best").write_text("checkpoint-7\n")
    assert ck.best_checkpoint(out) is None


# ---------------------------------------------------------------- status --sort over a planted sweep


@dataclass
class Status:
    task: int
    output_dir: str
    state: str = "COMPLETED"
    job_id: str = "1"
    nodes: str = "node1"
    restarts: int = 0
    elapsed: str = "00:01:00"


def test_status_sort_ranks_a_sweep_by_each_tasks_best_value_missing_last(tmp_path):
    planted = {  # task -> metrics rows: eval_loss falls then rises (the best is not the last), accuracy rises
        0: [{"step": 2, "loss": 2.0, "eval_loss": 1.5, "eval_rewards/accuracies": 0.5}, {"step": 4, "loss": 1.0, "eval_loss": 1.9}],
        1: [{"step": 2, "loss": 3.0, "eval_loss": 1.2}, {"step": 4, "loss": 0.5, "eval_loss": 1.3, "eval_rewards/accuracies": 0.9}],
        2: [{"step": 2, "loss": 0.1}],  # never evaluated
        3: [{"step": 2, "loss": 1.0, "eval_loss": float("nan")}, {"step": 4, "eval_loss": 1.4}],
    }
    dirs = {}
    for task, rows in planted.items():
        dirs[task] = tmp_path / str(task)
        dirs[task].mkdir()
        (dirs[task] / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = Watcher(str(tmp_path), [str(d) for d in dirs.values()]).rows([Status(t, str(d)) for t, d in dirs.items()])
    by_eval = rank_by(rows, "eval_loss")
    assert [p.task for p in by_eval] == [1, 3, 0, 2] and [p.best for p in by_eval] == [True, False, False, False]
    assert [p.eval_loss for p in by_eval][:3] == [1.3, 1.4, 1.9]  # the last one logged; the ranking took the best
    assert [p.task for p in rank_by(rows, "eval_rewards/accuracies")] == [1, 0, 2, 3]  # higher is better
    assert [p.task for p in rank_by(rows, "loss")] == [2, 1, 0, 3]
    assert "best eval_loss 1.2000" in plain_line(rank_by(rows, "eval_loss")[0])
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(progress_table(rows, sort="eval_loss"))
    lines = [ln for ln in console.export_text().splitlines() if ln.strip()]
    assert "best eval_loss" in lines[0] and lines[2].lstrip().startswith("1 best") and "1.2000" in lines[2]


# ---------------------------------------------------------------- the cluster run

SPEC = """
[job]
name = "eval-e2e"
output_dir = "{out}"
[slurm]
partition = "debug"
nodes = 1
tasks_per_node = 2
cpus_per_task = 1
time = "00:30:00"
max_requeues = 3
[train]
model = "tiny-llama"
dataset = ["{data}"]
train_type = "lora"
deepspeed = "zero2"
gradient_checkpointing = false
learning_rate = 1e-12
max_steps = 40
max_length = 128
save_steps = 2
logging_steps = 1
eval_split = 0.1
early_stopping_patience = 3
report_to = ["tensorboard"]
[checkpoint]
keep = 2
forced_save_fractions = [0.5]
[preflight]
checks = []
[env]
OMP_NUM_THREADS = "1"
SWIFTSLURM_TEST_MIN_STEP_S = "2.0"
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "250"})


def eval_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [r["step"] for r in rows if "eval_loss" in r]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeued_run_keeps_its_best_checkpoint_and_patience_and_stops_early(tmp_path, slurm_cluster):
    out = tmp_path / "out"
    (tmp_path / "e.toml").write_text(SPEC.format(out=out, data=DATA))
    sent = cli("submit", str(tmp_path / "e.toml"), "--executor", "slurm")
    assert sent.returncode == 0, sent.stdout + sent.stderr
    job = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"][0]
    try:
        deadline = time.monotonic() + 900  # a minute on an idle machine; a loaded one starts ranks far slower
        while 4 not in eval_steps(out):  # the evaluation at step 4 (patience count 1) is logged
            assert time.monotonic() < deadline, f"no evaluation at step 4 in 900 s: {eval_steps(out)}"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)  # the walltime signal, as Slurm sends it
        state = wait_for_job(job, timeout_s=900)
    finally:
        subprocess.run(["scancel", "--name=eval-e2e", job], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in (out / "logs").rglob("*") if p.is_file())
    assert state[job] == "COMPLETED", f"{state}\n{logs[-6000:]}"

    requeues = json.loads((out / "requeues.json").read_text())
    assert len(requeues) == 1 and requeues[0]["requeued"] and 4 < requeues[0]["global_step"] < 8, requeues
    summary = json.loads((out / "train-summary.json").read_text())
    assert summary["global_step"] == 8 and not summary["stopped_for_requeue"], summary  # not 10: the counter came back
    assert summary["stop_reason"].startswith("early stopping: eval_loss did not improve for 3 evaluation(s)"), summary
    assert (summary["best_step"], Path(summary["best_checkpoint"]).name) == (2, "checkpoint-2")
    assert "training stopped early at step 8" in summary["text"]
    assert (out / "latest_best").read_text() == "checkpoint-2\n"  # not moved by the first evaluation after the resume
    kept = sorted(ck.step_of(p) for p in ck.list_checkpoints(out))
    assert kept[0] == 2 and kept[-2:] == [6, 8] and len(kept) == 3, kept  # keep = 2 newest, plus the best
    assert ck.verify(out / "checkpoint-2").ok
    assert sorted(set(eval_steps(out))) == [2, 4, 6, 8]
    assert any(b"eval/loss" in p.read_bytes() for p in (out / "runs").rglob("*tfevents*"))

    status = cli("status", str(out), "--sort", "eval_loss")
    assert status.returncode == 0 and "eval_loss 5." in status.stdout and "best eval_loss 5." in status.stdout, status.stdout + status.stderr
    assert "early stopping: eval_loss did not improve" in status.stdout


@pytest.mark.slow
def test_two_ranks_evaluate_to_the_one_rank_mean_and_a_new_best_is_saved_between_saves(tmp_path):
    """The same weights (a learning rate of 1e-12 leaves them bit-identical) evaluated on 2 ranks and on 1: 5 held-out
    records (eval_split = 0.14 of 36, unpacked, one a batch), so 2 ranks pad one record that must not count. And the
    first evaluation, at step 3 with save_steps = 4, is a new best: it is saved as checkpoint-3, which latest_best names."""
    from runs import metrics, tiny_spec

    from swiftslurm import checkpoint as ck
    from swiftslurm.train.launch import launch

    got = {}
    for ranks in (2, 1):
        out = tmp_path / f"r{ranks}"
        spec = tmp_path / f"r{ranks}.toml"
        spec.write_text(tiny_spec(f"eval-{ranks}", out, slurm={"tasks_per_node": ranks}, train={
            "per_device_train_batch_size": 2 // ranks, "learning_rate": 1e-12, "max_steps": 3, "max_length": 128,
            "packing": False, "save_steps": 4, "logging_steps": 1, "eval_split": 0.14, "eval_steps": 3,
            "per_device_eval_batch_size": 1, "report_to": ["none"]}, checkpoint={"forced_save_fractions": []}, preflight={"checks": []}))
        procs = launch(str(spec), str(out), nprocs=ranks, timeout_s=600)
        assert all(p.returncode == 0 for p in procs), procs[0].stdout[-4000:]
        (row,) = [r for r in metrics(out) if "eval_loss" in r]
        got[ranks] = row["eval_loss"]
        assert row["step"] == 3 and ck.verify(out / "checkpoint-3").ok, sorted(p.name for p in out.iterdir())
        assert (out / "latest_best").read_text().strip() == "checkpoint-3"
    assert got[2] == pytest.approx(got[1], rel=1e-6), got
