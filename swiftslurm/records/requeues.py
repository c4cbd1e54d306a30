"""``<task dir>/requeues.json``: one record a walltime stop (rank 0 writes it, ``node/requeue.py``), its read and its
queries (how often a job was requeued, why its last stop was not, whether an attempt made progress). Pure but for
the read and the write, through fsutil; ``status``, ``doctor`` and ``plot`` read it here, never through the writer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import REQUEUES_FILE
from .restarts import progressed, streak_without_progress

# outcome of one walltime stop; "requeueing" is written just before `scontrol requeue`, which kills the ranks
REQUEUED, REQUEUEING, MAX_REACHED, REFUSED, CANNOT = "requeued", "requeueing", "max_requeues", "refused", "cannot_requeue"
NO_PROGRESS = "no_progress"


def made_progress(record: dict[str, Any]) -> bool | None:
    """Whether the attempt a stop record ends committed a checkpoint newer than the one it started from (pure);
    None for a record that does not say (written before the guard existed, or not of our shape)."""
    if "committed_step" not in record:
        return None
    return progressed(record.get("start_step"), record.get("committed_step"))


def no_progress_streak(records: list[dict[str, Any]]) -> int:
    """How many of the last stop records, in a row, ended an attempt with no progress (pure)."""
    return streak_without_progress(made_progress(record) for record in records)


def read_requeues(out_dir: str) -> list[dict[str, Any]]:
    try:
        records = read_json(Path(out_dir, REQUEUES_FILE), RECORD_CAP, expect=list)
    except (OSError, ValueError):  # missing, or Unreadable (damaged, foreign, not a regular file): no record
        return []
    return [r for r in records if isinstance(r, dict) and _plain_record(r)]


def _plain_record(record: dict[str, Any]) -> bool:
    """A record of the shape we write: the fields we compare are strings or ints (anything else is not ours)."""
    count = record.get("restart_count", 0)
    return isinstance(record.get("job_id", ""), (str, int)) and isinstance(count, int) and not isinstance(count, bool)


def same_job(record: dict[str, Any], job_id: str) -> bool:
    rid = str(record.get("job_id", ""))
    return rid == job_id or rid == f"local-{job_id}"


def job_records(records: list[dict[str, Any]], job_id: str, restart_count: int | None = None) -> list[dict[str, Any]]:
    """Pure: the records of this job's runs before run ``restart_count`` (all of this job's with None)."""
    return [r for r in records if same_job(r, job_id) and (restart_count is None or int(r.get("restart_count", 0)) < restart_count)]


def walltime_requeues(records: list[dict[str, Any]], job_id: str, restart_count: int | None = None) -> int:
    """Pure: how often this job was requeued at walltime (a record whose run was followed by another)."""
    return sum(1 for r in job_records(records, job_id, restart_count) if r.get("outcome", REQUEUED if r.get("requeued") else "") in (REQUEUED, REQUEUEING))


def stop_reason(records: list[dict[str, Any]], job_id: str) -> str | None:
    """Pure: why this job's last walltime stop was not requeued, or None (for `swiftslurm status`)."""
    mine = job_records(records, job_id)
    if mine and not mine[-1].get("requeued"):
        return str(mine[-1].get("message") or "stopped at walltime, not requeued")
    return None


def write_requeue(out_dir: str, entry: dict[str, Any]) -> None:
    """Add or replace (same job and restart count) this run's record."""
    records = [r for r in read_requeues(out_dir)
               if not (r.get("job_id") == entry["job_id"] and r.get("restart_count") == entry["restart_count"])]
    atomic_write_text(Path(out_dir, REQUEUES_FILE), json.dumps(records + [entry], indent=2))
