"""Which tasks a TARGET of `logs` / `plot` means: an output dir (its latest submission), one task dir of a
sweep (found through the parent's record), or a dir some run wrote without a record (a hand-submitted script)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import SwiftSlurmError
from ..submission import SUBMISSION_FILE, Submission, load_submission


@dataclass(frozen=True)
class TaskRef:
    task: int
    task_dir: str
    job_id: str = ""  # submitit's id of the task: its log files are <folder>/<job_id>_<rank>_log.*
    folder: str = ""  # the submission's submitit folder


def refs(sub: Submission, only: str | None = None) -> list[TaskRef]:
    out = []
    for index, (job_id, task_dir) in enumerate(zip(sub.job_ids, sub.task_dirs)):
        if only is None or (task_dir and Path(task_dir).resolve() == Path(only).resolve()):
            out.append(TaskRef(index, task_dir, job_id, sub.folder))
    return out


def resolve(target: str) -> tuple[Submission | None, list[TaskRef]]:
    """The submission (None when no record covers the dir) and the tasks ``target`` names."""
    path = Path(target)
    if not path.is_dir():
        raise SwiftSlurmError(
            "logs and plots are read from an output dir", f"{target} is not a directory",
            "pass the job.output_dir of a submitted spec (or one task dir of a sweep)",
        )
    if (path / SUBMISSION_FILE).is_file():
        sub = load_submission(str(path))
        return sub, refs(sub)
    for parent in path.resolve().parents:
        if (parent / SUBMISSION_FILE).is_file():
            sub = load_submission(str(parent))
            found = refs(sub, only=str(path))
            if found:
                return sub, found
    return None, [TaskRef(0, str(path))]
