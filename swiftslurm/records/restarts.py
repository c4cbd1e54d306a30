"""``<task dir>/restarts.json``: one record an in-job restart decision (the supervisor writes it,
``node/batch/supervise.py`` through ``node/restart.py``), its read and its queries, and the one count of attempts
without progress that requeues and restarts share. Pure but for the read and the write, through fsutil.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import RESTARTS_FILE


def progressed(start: Any, committed: Any) -> bool | None:
    """Whether an attempt that started at committed step ``start`` and ended at ``committed`` committed anything newer
    (pure); None when ``committed`` is not a step (a record not of our shape). Shared by requeues (``requeue.made_progress``) and restarts."""
    if committed is not None and not (isinstance(committed, int) and not isinstance(committed, bool)):
        return None
    if committed is None:
        return False
    return not (isinstance(start, int) and not isinstance(start, bool) and committed <= start)


def streak_without_progress(attempts: Iterable[bool | None]) -> int:
    """How many of the last attempts, in a row, made no progress (``False``); ``None`` (a record that does not say)
    ends the count like a progress does (pure). The one count of requeues and restarts."""
    streak = 0
    for made in reversed(list(attempts)):
        if made is not False:
            break
        streak += 1
    return streak


def no_progress_streak(records: list[dict[str, Any]], start: int | None, committed: int | None) -> int:
    """How many step attempts in a row, ending with this one (``start`` -> ``committed``), committed no newer
    checkpoint (pure); ``records``: this job's earlier restart records, oldest first."""
    earlier = [progressed(r.get("start_step"), r.get("resume_step")) if "start_step" in r else None for r in records]
    return streak_without_progress([*earlier, progressed(start, committed)])


def read_restarts(out_dir: str | Path) -> list[dict[str, Any]]:
    """The restart records of a task dir, oldest first ([] when missing or not ours)."""
    try:
        records = read_json(Path(out_dir, RESTARTS_FILE), RECORD_CAP, expect=list)
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and isinstance(r.get("job_id", ""), str) and isinstance(r.get("restarted", False), bool)]


@dataclass(frozen=True)
class RestartRecord:
    job_id: str
    attempt: int  # this job's restarts before this one
    cause: str
    detail: str
    nodes: list[str]  # the failed step's nodes
    restarted: bool
    next_nodes: list[str]
    dropped: list[str]
    resume_step: int | None  # the newest checkpoint on disk when the step is restarted (rank 0 verifies it)
    message: str
    exit_code: int
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    start_step: int | None = None  # the newest checkpoint on disk when the failed step started (the progress guard)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def record_restart(out_dir: str | Path, record: RestartRecord) -> None:
    atomic_write_text(Path(out_dir, RESTARTS_FILE), json.dumps(read_restarts(out_dir) + [record.to_json()], indent=2))


def job_restarts(records: list[dict[str, Any]], job_id: str) -> list[dict[str, Any]]:
    """Pure: this job's records (a job keeps its id across in-job restarts)."""
    return [r for r in records if r.get("job_id") == job_id]


def summary(records: list[dict[str, Any]], job_id: str) -> tuple[int, str | None]:
    """Pure, for ``status``: how often this job restarted in place, and one line on the last decision."""
    mine = job_restarts(records, job_id)
    made = sum(1 for r in mine if r.get("restarted"))
    if not mine:
        return 0, None
    last = mine[-1]
    if not last.get("restarted"):
        return made, str(last.get("message") or "not restarted")
    at = f", resumed from step {last['resume_step']}" if isinstance(last.get("resume_step"), int) else ""
    return made, f"restarted in place {made} time(s); last: {last.get('cause')}: {str(last.get('detail'))[:200]}{at}"
