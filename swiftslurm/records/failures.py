"""Why a rank gave up, as a record: ``<task dir>/logs/failure-rank-<r>.json``.

A rank's log ends in whatever was printed last: a table border of the banner, a progress bar, submitit's
traceback around ``TaskFailed``. The reason itself (the preflight check that failed and its fix, an
exception's message) is written here, atomically, by the rank that knows it: rank 0 for the preflight's
decision, any rank for an exception of its own. ``submit --wait``, ``status`` and ``logs --errors`` show the
earliest record of the current submission before anything scraped from a log (``watch/failure.py``).

A rank removes its own record when it starts (requeue = rerun: a stale reason must not outlive its run);
readers also skip records older than the submission they report on. A ``train.command`` that exits non-zero
leaves no record: its own last words in the log say more than its exit code.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..fsutil import Unreadable, atomic_write_text, read_json
from ..taskdir import TaskPaths, failure_name

FAILURE_NAME = re.compile(r"^failure-rank-(\d{1,9})\.json$")
KINDS = ("preflight", "exception", "startup")
WHAT_CHARS = 1000  # one exception message can be pages long (a CUDA OOM, a config dump)
HINT_CHARS = 600


@dataclass(frozen=True)
class Failure:
    rank: int
    node: str
    job_id: str
    time: float  # epoch seconds when the rank gave up
    kind: str  # "preflight" | "exception" | "startup" (the start-up watch ran out: train/health/startup.py)
    what: str  # one line: "preflight: ports localhost: 'nc' not found on PATH", "ValueError: bad shape"
    hint: str = ""  # the fix, when the code that failed knew one

    def line(self) -> str:
        """``what. HINT: hint`` on one line: what a person reads first."""
        return self.what + (f". HINT: {self.hint}" if self.hint else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def failure_path(task_dir: str | Path, rank: int) -> Path:
    return TaskPaths(task_dir).failure(rank)


def one_line(text: str, limit: int) -> str:
    """Whitespace (newlines of a multi-line message) folded to single spaces, cut at ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def from_exception(exc: BaseException, rank: int, node: str, job_id: str, when: float | None = None) -> Failure:
    """An exception as a record (pure): ``Type: message`` and, for our own errors, their hint."""
    from ..errors import SwiftSlurmError

    if isinstance(exc, SwiftSlurmError):
        what, hint = exc.what + (f" (found: {exc.found})" if exc.found else ""), exc.hint
    else:
        message = str(exc)
        what, hint = f"{type(exc).__name__}: {message}" if message else type(exc).__name__, ""
    return Failure(rank, node, job_id, time.time() if when is None else when, "exception",
                   one_line(what, WHAT_CHARS), one_line(hint, HINT_CHARS))


def write_failure(task_dir: str | Path, failure: Failure) -> None:
    """The record, atomically. A dir that cannot be written costs the record, never the rank's real error."""
    path = failure_path(task_dir, failure.rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(failure.to_json()) + "\n")
    except OSError:
        pass


def clear_failure(task_dir: str | Path, rank: int) -> None:
    """This rank's record of an earlier run of the same task (the rank holds the dir's lock: it is ours)."""
    try:
        failure_path(task_dir, rank).unlink()
    except OSError:
        pass


def _from_json(data: Any, rank: int) -> Failure | None:
    """A record's shape checked: any other shape is not a record (None)."""
    if not isinstance(data, dict) or data.get("rank") != rank or data.get("kind") not in KINDS:
        return None
    when, what = data.get("time"), data.get("what")
    if isinstance(when, bool) or not isinstance(when, (int, float)) or not isinstance(what, str) or not what.strip():
        return None
    texts = [data.get(k, "") for k in ("node", "job_id", "hint")]
    if not all(isinstance(t, str) for t in texts):
        return None
    node, job_id, hint = texts
    return Failure(rank, one_line(node, 200), one_line(job_id, 100), float(when), data["kind"],
                   one_line(what, WHAT_CHARS), one_line(hint, HINT_CHARS))


def read_failures(task_dir: str | Path, since: float = 0.0, limit: int = 64) -> list[Failure]:
    """The task's records written at or after ``since`` (the submission's time), earliest first, rank order on
    ties: the first is likely the cause. Unreadable or malformed records are skipped (at most ``limit`` read)."""
    logs = Path(task_dir) / "logs"
    try:
        ranks = sorted(int(m.group(1)) for m in (FAILURE_NAME.match(p.name) for p in logs.iterdir()) if m)
    except OSError:
        return []
    found = []
    for rank in ranks[:limit]:
        name = failure_name(rank)
        try:
            record = _from_json(read_json(logs / name, 64 * 1024), rank)
        except (OSError, Unreadable):
            continue
        if record is not None and record.time >= since:
            found.append(record)
    return sorted(found, key=lambda f: (f.time, f.rank))
