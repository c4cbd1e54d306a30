"""Why a task failed, in one line: what ``submit --wait``, ``status`` and ``logs --errors`` show first.

The structured source first: the failure records the ranks wrote (``records/failures.py``: a failed preflight's
check with its fix, an exception's message), the earliest of this submission. Without one (a killed rank, a
``train.command`` that exited non-zero), the last words of rank 0's stderr (submitit's ``<job>_0_log.err``),
skipping what can never be a reason: table borders and rows, rules, progress bars, blank lines, the
launchers' and the runtime's own INFO lines (``logs.last_words``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..fsutil import Unreadable, read_tail
from ..records.failures import Failure, read_failures
from .logs import last_words

TAIL_BYTES = 64 << 10  # rank 0's stderr is read from its last 64 KiB (a traceback and the lines before it)
CLOCK_SKEW_S = 60.0  # a node's clock may run behind the login node's: records this much before the submit count


@dataclass(frozen=True)
class TaskFailure:
    text: str  # one line: what, then ". HINT: fix" when known
    rank: int | None  # the rank that said it (None: scraped from rank 0's stderr, which may quote another)
    source: str  # "record" | "log"
    record: Failure | None = None


def recorded(task_dir: str, since: float = 0.0) -> list[Failure]:
    """The task's failure records of the submission made at ``since`` (0: all), earliest first."""
    return read_failures(task_dir, since - CLOCK_SKEW_S if since else 0.0) if task_dir else []


def task_failure(task_dir: str, folder: str = "", job_id: str = "", since: float = 0.0) -> TaskFailure | None:
    """The first real reason this task failed, or None when neither a record nor rank 0's stderr says one."""
    records = recorded(task_dir, since)
    if records:
        first = records[0]
        return TaskFailure(first.line() + (f" (rank {first.rank})" if first.rank else ""), first.rank, "record", first)
    if not (folder and job_id):
        return None
    try:
        raw, _ = read_tail(Path(folder) / f"{job_id}_0_log.err", 0, TAIL_BYTES)
    except (OSError, Unreadable):
        return None
    said = last_words(raw.decode("utf-8", "replace").splitlines())
    return TaskFailure(said, None, "log") if said else None
