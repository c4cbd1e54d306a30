"""Experiment trackers (train.report_to = wandb / mlflow) across requeues, against the real libraries: wandb 0.31 in
offline mode (its run files read by tests/wandb_records.py) and an MLflow file store (its metric files read directly).

- pure: a sweep's two tasks get one group and their own names, one MLflow store, a config without [env]; when a start
  continues the run; the run-id file refuses a planted id; a missing library is refused at validate and on the node;
- in one process, no training: two tasks of a sweep nest under one MLflow parent run and share a W&B group; a task
  started again continues both runs and sends only the steps it had not sent (a replay after an older checkpoint);
- on the Slurm cluster: ONE training (2 ranks) stopped by the walltime signal once and requeued is ONE W&B run and ONE
  MLflow run, each step of its loss logged exactly once, 1..max_steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for_job
from runs import ONE_RANK_A_NODE, QUIET, tiny_spec
from test_login_imports import HEAVY, modules_at_exit, recorder  # noqa: F401 (recorder: the fixture)
from wandb_records import run_facts

from swiftslurm.errors import SpecError
from swiftslurm.plan import make_plan, write_plan
from swiftslurm.spec import parse_toml, validate_spec
from swiftslurm.taskdir import METRICS_FILE, MLFLOW_STORE_DIR, TRACKER_FILE, WANDB_RUNS_DIR
from swiftslurm.train.tracking import identity as idt
from swiftslurm.train.tracking import runfile

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"

SWEEP = """
[job]
name = "trk-sweep"
output_dir = "{out}"
[train]
model = "tiny-llama"
dataset = ["{data}"]
report_to = ["wandb", "mlflow", "tensorboard"]
max_steps = 4
[env]
WANDB_API_KEY = "not-a-config-value"
[sweep]
"train.learning_rate" = [1e-4, 3e-4]
"""


def sweep_tasks(tmp_path: Path):
    """The two tasks of a sweep, its plan file written where the nodes read it (as submit does)."""
    raw = parse_toml(SWEEP.format(out=tmp_path / "out", data=DATA))
    plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path))
    write_plan(plan)
    return plan.tasks


def dist_env(job_id: str, world_size: int = 1):
    from swiftslurm.slurm.distenv import DistEnv

    return DistEnv(rank=0, local_rank=0, world_size=world_size, local_world_size=world_size, node_rank=0, nnodes=1,
                   nodes=("localhost",), node="localhost", master_addr="127.0.0.1", master_port=29500, job_id=job_id,
                   requeue_id=job_id, array_task_id=None, restart_count=0, gpus=(), executor="slurm")


def test_a_sweeps_tasks_share_a_group_and_a_store_and_each_has_its_own_name(tmp_path):
    first, second = sweep_tasks(tmp_path)
    indices = [runfile.sweep_task(t.output_dir) for t in (first, second)]
    assert indices == [0, 1] and runfile.sweep_task(tmp_path / "out") is None  # the job's own dir is no task of it
    names = [idt.identity(t.spec, i, {}) for t, i in zip((first, second), indices, strict=True)]
    assert [(n.name, n.group, n.project, n.experiment, n.task) for n in names] == [
        ("trk-sweep/0", "trk-sweep", "trk-sweep", "trk-sweep", 0), ("trk-sweep/1", "trk-sweep", "trk-sweep", "trk-sweep", 1)]
    store = f"file:{tmp_path / 'out' / MLFLOW_STORE_DIR}"  # one file store for the whole sweep, under job.output_dir
    assert [idt.env_defaults(t.spec, t.output_dir, i, {}) for t, i in zip((first, second), indices, strict=True)] == [
        {"MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}] * 2
    assert idt.env_defaults(first.spec, first.output_dir, 0, {"MLFLOW_TRACKING_URI": "http://mlflow:5000"}) == {}
    mine = idt.identity(first.spec, 0, {"WANDB_PROJECT": "p", "MLFLOW_EXPERIMENT_NAME": "e"})
    assert (mine.project, mine.experiment) == ("p", "e")
    alone = idt.identity(first.spec, None, {})  # no sweep: the job name, no group
    assert (alone.name, alone.group) == ("trk-sweep", None)
    configs = [idt.config(t.spec, 2, n.task) for t, n in zip((first, second), names, strict=True)]
    assert [c["train.learning_rate"] for c in configs] == [1e-4, 3e-4] and [c["sweep.task"] for c in configs] == [0, 1]
    assert configs[0]["world_size"] == 2 and not any("not-a-config-value" in str(v) for v in configs[0].values())
    assert idt.wanted(first.spec) == ("wandb", "mlflow")


def test_a_start_continues_the_run_of_the_same_training_only():
    kept = {"job_id": "100", "wandb": "abcd1234"}
    assert idt.continues(kept, resumed_own_checkpoint=True, job_id="200")  # a resubmitted spec resuming its checkpoint
    assert idt.continues(kept, resumed_own_checkpoint=False, job_id="100")  # a requeue or restart before any checkpoint
    assert not idt.continues(kept, resumed_own_checkpoint=False, job_id="200")  # another job starting fresh: a new training
    assert not idt.continues(None, resumed_own_checkpoint=True, job_id="100")


def test_the_run_id_file_takes_only_run_ids_it_can_trust(tmp_path):
    path = tmp_path / TRACKER_FILE
    runfile.write_ids(path, {"job_id": "77_3", "wandb": "k3j4h5g6", "mlflow": "0123456789abcdef0123456789abcdef"})
    assert runfile.read_ids(path) == {"job_id": "77_3", "wandb": "k3j4h5g6", "mlflow": "0123456789abcdef0123456789abcdef"}
    for planted in ('{"wandb": "../../other/run"}', '{"mlflow": "' + "a" * 65 + '"}', '{"wandb": 12345678}', "[1]", "{", "x" * 5000):
        path.write_text(planted)
        assert runfile.read_ids(path) is None, planted
    path.unlink()
    os.mkfifo(path)  # never blocks on a FIFO planted where the file belongs
    assert runfile.read_ids(path) is None
    assert runfile.read_ids(tmp_path / "none") is None


def test_a_missing_tracker_library_is_refused_at_validate_and_on_the_node(tmp_path, monkeypatch):
    from swiftslurm.jobs.prepare import prepare

    spec = tmp_path / "spec.toml"
    spec.write_text(SWEEP.format(out=tmp_path / "out", data=DATA))
    prepare(spec, base_dir=str(tmp_path))  # installed here: fine
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what find_spec sees when a package cannot be imported
    with pytest.raises(SpecError) as refused:
        prepare(spec, base_dir=str(tmp_path))
    assert "train.report_to: report_to names mlflow, which is not installed" in str(refused.value)
    assert "pip install 'swiftslurm[tracking]'" in str(refused.value)
    with_python = spec.read_text().replace("[train]", '[slurm]\npython = "/elsewhere/bin/python"\n[train]')
    spec.write_text(with_python)  # the ranks run another interpreter: only the node can tell
    prepare(spec, base_dir=str(tmp_path))
    with pytest.raises(idt.TrackerUnavailable, match="report_to names mlflow"):
        idt.check_installed(sweep_tasks(tmp_path)[0].spec)


def test_validate_checks_the_tracker_libraries_without_importing_them(recorder, tmp_path):  # noqa: F811
    spec = tmp_path / "spec.toml"
    spec.write_text(SWEEP.format(out=tmp_path / "out", data=DATA))
    assert not modules_at_exit(recorder, tmp_path, "validate", str(spec)) & {*HEAVY, "wandb", "mlflow"}


class _State:
    """The TrainerState fields the callback reads."""

    def __init__(self, step: int, max_steps: int = 10) -> None:
        self.global_step, self.max_steps, self.is_world_process_zero = step, max_steps, True


def _start(task, job_id: str, resumed: bool, steps: list[int]) -> dict[str, str]:
    """One start of a task's training without the training: open its trackers, log ``steps``, close (paused)."""
    from swiftslurm.train.tracking.session import open_trackers

    with contextlib.ExitStack() as stack:
        (callback,) = open_trackers(task.spec, dist_env(job_id), task.output_dir, resumed, stack)
        for step in steps:
            callback.on_log(None, _State(step), None, logs={"loss": 1.0 / step, "epoch": 0.1 * step, "note": "text"})
    settle_trackers()
    return runfile.read_ids(Path(task.output_dir) / TRACKER_FILE) or {}


def settle_trackers() -> None:
    """Before a test reads the trackers' files: a paused start leaves a close that outlives its budget (PAUSE_CLOSE_S)
    running, so every close is joined. And W&B writes its offline run file from its own service process, which flushes
    and closes the file after run.finish() has returned (under load tests read a file that held no run record yet, or
    a run without its history rows): wandb.teardown() waits for that process, as the atexit hook of a real rank does."""
    import threading

    for thread in threading.enumerate():
        if thread.name.startswith("close-"):
            thread.join(120)
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def mlflow_metric(store: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point the file store holds for ``key`` of ``run_id``, in the order logged."""
    (path,) = store.glob(f"*/{run_id}/metrics/{key}")
    return [(int(step), float(value)) for _, value, step in (line.split() for line in path.read_text().splitlines())]


def mlflow_runs(store: Path) -> dict[str, dict[str, str]]:
    """Every run of the file store: its tags and status (meta.yaml holds RunStatus's number)."""
    from mlflow.entities import RunStatus

    runs = {}
    for meta in store.glob("*/*/meta.yaml"):
        tags = {p.name: p.read_text() for p in (meta.parent / "tags").iterdir()}
        status = next(line.split(": ")[1] for line in meta.read_text().splitlines() if line.startswith("status:"))
        runs[meta.parent.name] = {**tags, "status": RunStatus.to_string(int(status))}
    return runs


def wandb_runs(task_dir: Path) -> list[dict]:
    """Every offline run file of a task dir, read once this process's W&B service has written it (``settle_trackers``)."""
    settle_trackers()
    return [run_facts(f) for f in sorted((task_dir / WANDB_RUNS_DIR).glob("offline-run-*/run-*.wandb"))]


def test_a_sweep_nests_under_one_parent_and_a_restart_continues_each_run_sending_new_steps_only(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, second = sweep_tasks(tmp_path)
    ids0 = _start(first, "500_0", False, [1, 2, 3])
    ids1 = _start(second, "500_1", False, [1])
    store = tmp_path / "out" / MLFLOW_STORE_DIR
    runs = mlflow_runs(store)
    (parent,) = [r for r, tags in runs.items() if "swiftslurm.sweep" in tags]
    assert runs[ids0["mlflow"]]["mlflow.parentRunId"] == runs[ids1["mlflow"]]["mlflow.parentRunId"] == parent
    assert (runs[ids0["mlflow"]]["mlflow.runName"], runs[ids1["mlflow"]]["mlflow.runName"]) == ("trk-sweep/0", "trk-sweep/1")
    assert runs[ids0["mlflow"]]["status"] == "SCHEDULED"  # stopped before its last step, it continues on the next start
    groups = [(r["id"], r["name"], r["group"], r["project"]) for t in (first, second) for r in wandb_runs(Path(t.output_dir))]
    assert groups == [(ids0["wandb"], "trk-sweep/0", "trk-sweep", "trk-sweep"), (ids1["wandb"], "trk-sweep/1", "trk-sweep", "trk-sweep")]

    # task 0 restarts from its checkpoint of step 2 after it had logged step 3 (metrics.jsonl says so): same runs,
    # step 3 replayed but not sent again, 4 and 5 sent
    Path(first.output_dir, METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    again = _start(first, "501_0", True, [3, 4, 5])
    assert (again["wandb"], again["mlflow"], again["job_id"]) == (ids0["wandb"], ids0["mlflow"], "501_0")
    assert [s for s, _ in mlflow_metric(store, ids0["mlflow"], "loss")] == [1, 2, 3, 4, 5]
    assert [s for s, _ in mlflow_metric(store, ids0["mlflow"], "epoch")] == [1, 2, 3, 4, 5]
    starts = wandb_runs(Path(first.output_dir))
    assert [r["id"] for r in starts] == [ids0["wandb"]] * 2  # two offline dirs, one run: `wandb sync` joins them in order
    assert [sorted(r["history"]) for r in starts] == [[1, 2, 3], [4, 5]]
    assert all("train/loss" in row for r in starts for rows in r["history"].values() for row in rows)
    assert len(mlflow_runs(store)) == 3  # parent + two tasks: no new run

    # a new job starting fresh in the same dir is a new training: new runs, every step sent
    fresh = _start(first, "600_0", False, [1])
    assert fresh["wandb"] != ids0["wandb"] and fresh["mlflow"] != ids0["mlflow"]
    assert mlflow_metric(store, fresh["mlflow"], "loss") == [(1, 1.0)]


# ---------------------------------------------------------------- on the Slurm cluster

MAX_STEPS = 16
STOP_AFTER = 4  # the walltime signal is sent once rank 0 logged this step
def cluster_spec(out: Path, steps: int) -> str:
    return tiny_spec("trk-requeue", out, data=DATA,
                     slurm={**ONE_RANK_A_NODE, "tasks_per_node": 2, "time": "00:20:00", "signal_grace_s": 60},
                     train={"max_steps": steps, "max_length": 128, "save_steps": 1000, "logging_steps": 1,
                            "report_to": ["wandb", "mlflow"]},
                     **QUIET, env={"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "SWIFTSLURM_TEST_MIN_STEP_S": "0.25"})


def logged_steps(out: Path) -> list[int]:
    try:
        return [json.loads(line)["step"] for line in (out / METRICS_FILE).read_text().splitlines() if '"loss"' in line]
    except (OSError, ValueError):
        return []


@pytest.mark.slurm
@pytest.mark.slow
def test_one_training_requeued_at_walltime_is_one_tracker_run_with_every_step_once(tmp_path, slurm_cluster):
    out = tmp_path / "out"
    spec = tmp_path / "trk.toml"
    spec.write_text(cluster_spec(out, MAX_STEPS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", "slurm"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"][0]
    try:
        deadline = time.monotonic() + 600
        while not any(s >= STOP_AFTER for s in logged_steps(out)):  # training: steps take at least 0.25 s each
            assert time.monotonic() < deadline, "no training step logged in 10 minutes"
            time.sleep(0.5)
        # what Slurm sends every rank signal_grace_s before the time limit (--signal=USR2@N): stop, save, requeue
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        state = wait_for_job(job, timeout_s=900)
    finally:  # never leave this test's job on the shared cluster (the name guards against a reused id)
        subprocess.run(["scancel", "--name=trk-requeue", job], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((out / "logs").rglob("*.err")))
    assert state[job] == "COMPLETED", f"{state}\n{logs}"
    requeues = json.loads((out / "requeues.json").read_text())  # ours, and on a slow machine the time limit's too
    assert requeues and all(r["requeued"] for r in requeues), requeues
    stops = [r["global_step"] for r in requeues]
    assert STOP_AFTER <= stops[0] and stops == sorted(stops) and stops[-1] < MAX_STEPS, requeues

    ids = json.loads((out / TRACKER_FILE).read_text())
    store = out / MLFLOW_STORE_DIR  # the default: a file store under job.output_dir
    assert list(mlflow_runs(store)) == [ids["mlflow"]]  # one run, opened by rank 0 alone, continued after the requeue
    assert mlflow_runs(store)[ids["mlflow"]]["status"] == "FINISHED"
    assert [s for s, _ in mlflow_metric(store, ids["mlflow"], "loss")] == list(range(1, MAX_STEPS + 1))
    save_steps = [s for s, _ in mlflow_metric(store, ids["mlflow"], "checkpoint_save_s")]
    assert save_steps == [*stops, MAX_STEPS]  # each walltime save and the last one, each once

    starts = wandb_runs(out)
    assert [r["id"] for r in starts] == [ids["wandb"]] * (len(stops) + 1), starts  # one offline dir per start, one run id
    assert {r["name"] for r in starts} == {"trk-requeue"}
    steps = [s for r in starts for s, rows in sorted(r["history"].items()) if any("train/loss" in row for row in rows)]
    assert steps == list(range(1, MAX_STEPS + 1))
    # the axis goes on where each start stopped
    assert [(min(r["history"]), max(r["history"])) for r in starts] == list(zip([1] + [s + 1 for s in stops], [*stops, MAX_STEPS], strict=True))


# ---------------------------------------------------------------- trackers that fail (real MLflow file store, one process)

def test_a_tracker_that_cannot_be_opened_stops_the_start_with_why(tmp_path, monkeypatch):
    """A store MLflow cannot create (a file where its folder would be): the start ends with what, where and the way
    out, not a library traceback; every rank raises the same (rank 0's verdict is broadcast: open_trackers)."""
    from swiftslurm.train.tracking.identity import TrackerUnavailable
    from swiftslurm.train.tracking.session import open_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    (tmp_path / "taken").write_text("a file, not a folder")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'taken' / 'mlruns'}")
    task = sweep_tasks(tmp_path)[0]
    with pytest.raises(TrackerUnavailable) as refused, contextlib.ExitStack() as stack:
        open_trackers(task.spec, dist_env("700_0"), task.output_dir, False, stack)
    err = refused.value
    assert "cannot open the MLflow run" in err.what and str(tmp_path / "taken") in err.found and "MLFLOW_TRACKING_URI" in err.hint
    assert err.exit_code == TrackerUnavailable.exit_code


def test_a_tracker_failing_mid_run_is_said_once_and_training_goes_on_and_an_error_ends_its_run_failed(tmp_path, monkeypatch, caplog):
    from swiftslurm.train.tracking.session import open_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    task = sweep_tasks(tmp_path)[0]
    store = tmp_path / "out" / MLFLOW_STORE_DIR
    with pytest.raises(KeyError), contextlib.ExitStack() as stack:  # the training's own error, after some steps
        (callback,) = open_trackers(task.spec, dist_env("800_0"), task.output_dir, False, stack)
        run_id = runfile.read_ids(Path(task.output_dir) / TRACKER_FILE)["mlflow"]
        callback.on_log(None, _State(1), None, logs={"loss": 1.0})
        (run_dir,) = store.glob(f"*/{run_id}")
        run_dir.rename(run_dir.with_name("away"))  # the store is out of reach for two steps (a server's outage)
        for step in (2, 3):
            callback.on_log(None, _State(step), None, logs={"loss": 1.0 / step})  # never raises into the Trainer
        run_dir.with_name("away").rename(run_dir)
        callback.on_log(None, _State(4), None, logs={"loss": 0.25})  # later steps are tried, and land
        raise KeyError("the training failed")
    said = [r.getMessage() for r in caplog.records if "could not log step" in r.getMessage()]
    assert len(said) == 1 and "mlflow could not log step 2" in said[0] and "training goes on" in said[0], said
    assert [s for s, _ in mlflow_metric(store, run_id, "loss")] == [1, 4]
    assert mlflow_runs(store)[run_id]["status"] == "FAILED"  # an error ends the run FAILED, not SCHEDULED to continue
    assert sorted(wandb_runs(Path(task.output_dir))[0]["history"]) == [1, 2, 3, 4]  # the other tracker got every step
