"""One name for every file a job leaves in its output dirs (in the spirit of submitit's ``JobPaths``).

Writers and readers both take their names from here, so a rename is one line and no reader guesses.
``TaskPaths(task_dir)`` gives the paths of one task dir; the constants are the names relative to it.
Pure: nothing here touches the filesystem.

The layout (``docs/ARCHITECTURE.md`` has the same list with who writes what)::

    <job.output_dir>/swiftslurm-plan.json      the plan every node reads
    <job.output_dir>/submission.json           what was sent: job ids, arrays, executor, time
    <job.output_dir>/.swiftslurm-submit.lock   held while a submit writes the records
    <task dir>/spec.json                       the task's resolved spec
    <task dir>/.swiftslurm.lock                each rank locks its byte while it runs
    <task dir>/.swiftslurm-owner.json          which job holds the lock
    <task dir>/logs/rank-<r>.log               rank r > 0 (rank 0 writes to the job's stdout)
    <task dir>/logs/submitit/<stamp>/          submitit's own files (logs, result pickles)
    <task dir>/preflight/report.json           the preflight report (busbw.png beside it)
    <task dir>/runs/                           TensorBoard event files
    <task dir>/metrics.jsonl                   one JSON object per logging step
    <task dir>/train-summary.json              the end-of-training summary
    <task dir>/logs/failure-rank-<r>.json      why rank r gave up (a failed preflight, an exception)
    <task dir>/requeues.json                   one record per walltime stop
    <task dir>/chain.json                      the singleton chain's job ids (slurm.continue_with = "singleton")
    <task dir>/.swiftslurm-stops/              per-job stop markers
    <task dir>/restarts.json                   one record per in-job restart decision (time, cause, nodes, step)
    <task dir>/logs/hang.json                  the watchdog's verdict that ended a hung step (to be restarted)
    <task dir>/checkpoint-save.json            how long saves took (the deadline save)
    <task dir>/.swiftslurm-verified.json       what this job verified (retention)
    <task dir>/checkpoint-<step>/              verified checkpoints; latest names the newest
    <task dir>/latest_best                     names the best checkpoint by the eval metric (kept by retention)
    <task dir>/.staging-checkpoint-<step>/     being written; never read as a checkpoint
    <task dir>/resume-source/checkpoint-<N>/   train.resume_from imported on the fly
    <task dir>/universal/                      universal-checkpoint conversions
    <task dir>/.swiftslurm-cache/              tokenized data, preference data, vision-language token counts
    <task dir>/.swiftslurm-tracker.json        the W&B / MLflow run ids this task's training continues
    <task dir>/wandb/                          W&B's own run dirs (unless WANDB_DIR says elsewhere)
    <job.output_dir>/mlruns/                   the MLflow file store (unless MLFLOW_TRACKING_URI says elsewhere)
    <job.output_dir>/.swiftslurm-tracker-sweep.json   a sweep's MLflow parent run (its .lock beside it)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PLAN_FILE = "swiftslurm-plan.json"
SUBMISSION_FILE = "submission.json"
SUBMIT_LOCK_FILE = ".swiftslurm-submit.lock"
TASK_SPEC_FILE = "spec.json"
LOCK_FILE = ".swiftslurm.lock"
OWNER_FILE = ".swiftslurm-owner.json"
LOGS_DIR = "logs"
SUBMITIT_DIR = "logs/submitit"
PREFLIGHT_DIR = "preflight"
PREFLIGHT_REPORT = "preflight/report.json"
RUNS_DIR = "runs"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "train-summary.json"
FAILURE_GLOB = "failure-rank-*.json"  # under LOGS_DIR
REQUEUES_FILE = "requeues.json"
CHAIN_FILE = "chain.json"
STOPS_DIR = ".swiftslurm-stops"
RESTARTS_FILE = "restarts.json"
HANG_FILE = "logs/hang.json"
SAVE_FILE = "checkpoint-save.json"
VERIFIED_CACHE_FILE = ".swiftslurm-verified.json"
LATEST_NAME = "latest"
LATEST_BEST_NAME = "latest_best"  # the best checkpoint by train.metric_for_best_model (checkpoint/best.py)
RESUME_SOURCE_DIR = "resume-source"
UNIVERSAL_DIR = "universal"
SAVE_LINK_DIR = ".swiftslurm-save"
TOKEN_CACHE_DIR = ".swiftslurm-cache/tokenized"
VL_LENGTHS_DIR = ".swiftslurm-cache/vl-lengths"  # packed vision-language rows: each record's token count (data/vision.py)
PREFERENCE_CACHE_DIR = ".swiftslurm-cache/preference"
SPLIT_CACHE_DIR = ".swiftslurm-cache/split"  # train.eval_split: the training and eval parts of the records
TRACKER_FILE = ".swiftslurm-tracker.json"
WANDB_RUNS_DIR = "wandb"  # wandb.init(dir=<task dir>) writes its run dirs (offline-run-*) here
MLFLOW_STORE_DIR = "mlruns"  # under job.output_dir: one store for every task of a sweep
SWEEP_TRACKER_FILE = ".swiftslurm-tracker-sweep.json"  # under job.output_dir
SWEEP_TRACKER_LOCK = ".swiftslurm-tracker-sweep.lock"  # under job.output_dir
PROMPT_CACHE_DIR = ".swiftslurm-cache/prompts"  # task = "grpo": the Arrow copy of the prompts


def rank_log_name(rank: int) -> str:
    return f"{LOGS_DIR}/rank-{rank}.log"


def failure_name(rank: int) -> str:
    return f"failure-rank-{rank}.json"  # under LOGS_DIR


@dataclass(frozen=True)
class TaskPaths:
    """The paths of one task dir (``root``) that take an argument; the rest are the constants above joined to it."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    def rank_log(self, rank: int) -> Path:
        return self.root / rank_log_name(rank)

    def failure(self, rank: int) -> Path:
        return self.root / LOGS_DIR / failure_name(rank)


# ---------------------------------------------------------------- the line that opens each attempt in a rank's log

ATTEMPT_MARK = "swiftslurm attempt"
ATTEMPT_LINE = re.compile(ATTEMPT_MARK + r" (?P<key>[\w.-]+) \(job (?P<job>\S+), requeue (?P<requeue>\d+), restart (?P<restart>\d+)\)")


def attempt_header(job_id: str, requeues: int, restarts: int, nodes: str) -> str:
    """The first words every rank logs when it starts (node/runtime.py); ``logs --attempt N`` reads them (watch/logs.py)."""
    return f"{ATTEMPT_MARK} {job_id}.{requeues}.{restarts} (job {job_id}, requeue {requeues}, restart {restarts}) on {nodes}"

