"""The run-id files: which tracker runs a task's training continues, and a sweep's MLflow parent run.

``<task dir>/.swiftslurm-tracker.json``: ``{"job_id": "123", "wandb": "k3j4h5g6", "mlflow": "<32 hex>"}``.
``<job.output_dir>/.swiftslurm-tracker-sweep.json``: ``{"mlflow": "<parent run id>"}``, created under a lock by
the first task of a sweep that gets there. Both are read through fsutil (a regular file, a size cap, plain JSON)
and every id must have a run id's shape; a file that fails either is reported and replaced by a new run. Written
atomically. Also here: the last step rank 0 already logged (``metrics.jsonl``), below which nothing is sent again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from ...fsutil import METRICS_CAP, TAG_CAP, Unreadable, atomic_write_text, json_lines, read_json, read_tail
from ...taskdir import METRICS_FILE, PLAN_FILE, SWEEP_TRACKER_FILE, SWEEP_TRACKER_LOCK, TRACKER_FILE
from .identity import TRACKERS, valid_run_id

log = logging.getLogger("swiftslurm.train")


def read_ids(path: str | Path) -> dict[str, str] | None:
    """The ids a run-id file holds (``job_id`` and one per tracker), None when there is none; a damaged or foreign
    file, or an id of the wrong shape, is said once and read as none (a new run replaces it)."""
    try:
        raw = read_json(path, TAG_CAP)
    except FileNotFoundError:
        return None
    except Unreadable as exc:
        log.warning("trackers: %s; starting new tracker runs", exc)
        return None
    ids: dict[str, str] = {}
    for key, value in raw.items():
        if key not in (*TRACKERS, "job_id"):
            continue
        good = valid_run_id(value)
        if good is None:
            log.warning("trackers: %s: %s = %r is not a run id ([A-Za-z0-9_-], at most 64); starting new tracker runs",
                        path, key, str(value)[:80])
            return None
        ids[key] = good
    return ids


def write_ids(path: str | Path, ids: dict[str, str]) -> None:
    atomic_write_text(Path(path), json.dumps(ids, sort_keys=True) + "\n")


def sweep_task(task_dir: str | Path) -> int | None:
    """The sweep task index of a task dir, None outside a sweep. The task's spec no longer holds [sweep]; the plan's
    layout tells: a sweep's task dir is ``<job.output_dir>/<index>``, the plan file in its parent, none in it."""
    task_dir = Path(task_dir)
    if not (task_dir.name.isascii() and task_dir.name.isdigit()) or (task_dir / PLAN_FILE).exists():
        return None
    return int(task_dir.name) if (task_dir.parent / PLAN_FILE).is_file() else None


def task_file(task_dir: str | Path) -> Path:
    return Path(task_dir) / TRACKER_FILE


def sweep_file(job_dir: str | Path) -> Path:
    return Path(job_dir) / SWEEP_TRACKER_FILE


@contextlib.contextmanager
def sweep_lock(job_dir: str | Path) -> Iterator[None]:
    """Held while a sweep task reads or creates the parent run: the tasks of an array start together."""
    fd = os.open(Path(job_dir) / SWEEP_TRACKER_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def logged_through(task_dir: str | Path) -> int:
    """The highest step rank 0 logged (``metrics.jsonl``, its newest part): a continued run sends only later steps,
    so steps replayed after a resume from an older checkpoint reach the trackers once. 0 when none."""
    try:
        data, _ = read_tail(Path(task_dir) / METRICS_FILE, 0, METRICS_CAP)
    except FileNotFoundError:
        return 0
    except Unreadable as exc:
        log.warning("trackers: %s; every step of this run is sent", exc)
        return 0
    steps = [_step(row) for _, row in json_lines(data, finite=False)]
    return max((s for s in steps if s is not None), default=0)


def _step(row: Any) -> int | None:
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
