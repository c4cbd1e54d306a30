"""What a TARGET names, for every command that takes one (`status`, `cancel`, `logs`, `plot`, `doctor`).

- an output dir: its latest recorded submission and all its tasks;
- one task dir of a sweep: found through the parent's record, that task alone;
- a dir some run wrote without a record (a hand-submitted script): that dir as task 0, no submission (``status``
  and ``cancel`` take its jobs from what its ranks recorded: ``hand_run``);
- a Slurm job id (``123``, ``123_4``): ``through_record`` finds the output dir through the paths Slurm recorded
  for the job (its logs, its working dir) and that record's tasks of the job (doctor); otherwise the job as Slurm
  knows it, with no dirs (``status``, ``cancel``: they act on exactly the ids named).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .. import slurm
from ..errors import SwiftSlurmError
from ..fsutil import DIRECTORY, FILE, RECORD_CAP, UNREACHABLE, Unreadable, path_kind, read_json
from ..taskdir import OWNER_FILE, PLAN_FILE
from . import index as job_index
from .record import SUBMISSION_FILE, Submission, load_records, load_submission


@dataclass(frozen=True)
class TaskRef:
    task: int
    task_dir: str
    job_id: str = ""  # submitit's id of the task: its log files are <folder>/<job_id>_<rank>_log.*
    folder: str = ""  # the submission's submitit folder


def refs(sub: Submission, only: str | None = None) -> list[TaskRef]:
    out = []
    for index, (job_id, task_dir) in enumerate(zip(sub.job_ids, sub.task_dirs, strict=False)):
        if only is None or (task_dir and Path(task_dir).resolve() == Path(only).resolve()):
            out.append(TaskRef(index, task_dir, job_id, sub.folder))
    return out


def resolve(target: str, *, through_record: bool = True, dirs_only: bool = False) -> tuple[Submission | None, list[TaskRef]]:
    """The submission (None when no record covers a dir) and the tasks ``target`` names (see the module's list).
    ``dirs_only``: only a dir will do (`logs`, `plot` read files)."""
    path = Path(target)
    is_dir = _is_dir(target)
    if not is_dir and dirs_only:
        raise SwiftSlurmError("logs and plots are read from an output dir", f"{target} is not a directory",
                              "pass the job.output_dir of a submitted spec (or one task dir of a sweep)")
    if not is_dir:
        job_id = _job_id(target)
        if through_record:
            return _by_job_id(job_id)
        sub = bare_job(job_id)
        return sub, refs(sub)
    if path_kind(path / SUBMISSION_FILE) == FILE:
        sub = load_submission(str(path)).rooted_at(str(path))
        return sub, refs(sub)
    for parent in path.resolve().parents:
        if path_kind(parent / SUBMISSION_FILE) == FILE:
            sub = load_submission(str(parent)).rooted_at(str(parent))
            found = refs(sub, only=str(path))
            if found:
                return sub, found
    return None, [TaskRef(0, str(path))]


def submission_of(target: str, *, as_recorded: bool = False) -> Submission:
    """The submission ``status`` and ``cancel`` act on: an output dir's latest record, a dir a hand-submitted script
    ran in (``hand_run``), or a job id as Slurm knows it. A dir's record is read as the named dir's
    (``Submission.rooted_at``); ``as_recorded`` keeps the dirs it names (``cancel`` checks that they are this one)."""
    if _is_dir(target):
        # anything under the record's name is the record: a FIFO or a link there is refused as one, not skipped
        recorded = os.path.lexists(Path(target) / SUBMISSION_FILE)
        if not recorded:
            return hand_run(target)
        sub = load_submission(target)
        return sub if as_recorded else sub.rooted_at(target)
    return bare_job(_job_id(target))


def hand_run(output_dir: str) -> Submission:
    """A dir with no submission record that a script ran in (``swiftslurm render -o FILE``, then ``sbatch FILE``):
    its tasks are the plan's task dirs inside it (the dir itself without a plan), each one's job the one its rank 0
    recorded as holding it (``.swiftslurm-owner.json``). All of it is read as data: a task dir outside the dir, an
    unreadable record or an id that is not a Slurm job id is left out. The result has no submitit folder, so
    ``cancel`` signals the jobs and writes no record."""
    root = Path(output_dir).resolve()
    dirs, ids = [], []
    for task_dir in _plan_task_dirs(root) or [root]:
        job_id = _owner_job_id(task_dir)
        if job_id:
            dirs.append(str(task_dir))
            ids.append(job_id)
    if not ids:
        raise SwiftSlurmError("no submission recorded here, and no job has run in this dir yet", str(root),
                              "a script submitted by hand shows here once its rank 0 started; until then pass the job id "
                              "sbatch printed (swiftslurm status 123)")
    return Submission("slurm", ids, str(root), dirs, "", submitted_at=0.0)


def not_proven_here(sub: Submission) -> str | None:
    """For ``cancel`` of a hand run: why one of its jobs is not provably the one that ran in its dir (an owner record
    is a file anyone with write access could have written), else None. Slurm's own paths of the job (its log file,
    which a rendered script writes into the output dir, or its working dir) must lie in the dir."""
    root = Path(sub.output_dir).resolve()
    for job_id in sub.slurm_job_ids:
        paths = [Path(p).resolve() for p in slurm.job_paths(job_id) if p.startswith("/")]
        if not any(p == root or root in p.parents for p in paths):
            return f"job {job_id} is named by {OWNER_FILE} here, but Slurm records none of its paths under {root}"
    return None


def _plan_task_dirs(root: Path) -> list[Path]:
    try:
        tasks = read_json(root / PLAN_FILE, RECORD_CAP).get("tasks")
    except (OSError, Unreadable):
        return []
    found = []
    for task in tasks if isinstance(tasks, list) else []:
        where = task.get("output_dir") if isinstance(task, dict) else None
        if isinstance(where, str) and where and "\0" not in where:
            path = Path(where).resolve()
            if (path == root or root in path.parents) and path not in found:  # never read outside the dir
                found.append(path)
    return found


def _owner_job_id(task_dir: Path) -> str:
    try:
        job_id = read_json(task_dir / OWNER_FILE, RECORD_CAP).get("job_id")
    except (OSError, Unreadable):
        return ""
    if not isinstance(job_id, str):
        return ""
    base, _, task = job_id.partition("_")
    ok = base.isascii() and base.isdigit() and len(job_id) < 32 and (not task or (task.isascii() and task.isdigit()))
    return job_id if ok else ""  # a local run's id (not a Slurm job), or anything else


def _is_dir(target: str) -> bool:
    """``target`` is a directory; a path that cannot be looked at (a name too long, a parent it may not search) is
    refused with why, never taken for a job id."""
    kind = path_kind(target)
    if kind.startswith(UNREACHABLE):
        raise SwiftSlurmError("cannot look at the output dir named", f"{target}: {kind}",
                              "check the path (each name at most 255 bytes) and its permissions, or pass the Slurm job id")
    return kind == DIRECTORY


def _job_id(target: str) -> str:
    base = target.split("_")[0]
    if not (base.isascii() and base.isdigit()):
        raise SwiftSlurmError("not a job id nor an output dir", target,
                              "pass a Slurm job id such as 123 (or 123_4), or the job.output_dir of a submitted spec")
    return target


def bare_job(job_id: str) -> Submission:
    """A Slurm job id (``123`` or ``123_4``) as a Submission with no output dirs: its array tasks as sacct/squeue list them."""
    records = slurm.job_records([job_id.split("_")[0]])
    ids = sorted((j for j in records if slurm.is_of(j, job_id)), key=_job_sort_key)
    if not ids:
        remembered = _remembered(job_id)
        if remembered is not None:  # Slurm forgot it (no accounting, or purged): its dir's record still knows it
            return remembered[0]
        raise SwiftSlurmError(f"Slurm knows no job {job_id}", "neither sacct nor squeue lists it", "check the id with `sacct -X`, or pass the job's output dir")
    return Submission("slurm", ids, "", [""] * len(ids), "", submitted_at=0.0)


def _job_sort_key(job_id: str) -> tuple[int, int]:
    base, _, idx = job_id.partition("_")
    return (int(base) if base.isdigit() else 0, int(idx) if idx.isdigit() else -1)


def _by_job_id(job_id: str) -> tuple[Submission, list[TaskRef]]:
    """A job id -> the record of the output dir Slurm's recorded paths lie in, and its tasks of that job."""
    for path in slurm.job_paths(job_id):
        for parent in [Path(path), *Path(path).parents]:
            if path_kind(parent / SUBMISSION_FILE) == FILE:  # a parent of another user's may not be searchable
                sub = load_submission(str(parent)).rooted_at(str(parent))
                tasks = [t for t in refs(sub) if t.job_id == job_id or (t.job_id.split("_")[0] == job_id)]
                if tasks:
                    return sub, tasks
    remembered = _remembered(job_id)
    if remembered is not None:
        return remembered
    raise SwiftSlurmError(f"cannot find where job {job_id} wrote",
                          f"Slurm records no path of it under a swiftslurm output dir, and {job_index.index_path()} names none",
                          "pass the job's output dir (job.output_dir) instead")


def _remembered(job_id: str) -> tuple[Submission, list[TaskRef]] | None:
    """The submission and tasks of ``job_id`` through this user's job index (``index.py``): only a dir whose own
    submission record holds the id counts, newest record first."""
    for where in job_index.output_dirs_of(job_id):
        try:
            if path_kind(Path(where) / SUBMISSION_FILE) != FILE:
                continue
            records = load_records(where)
        except SwiftSlurmError:  # a damaged record there: not where to read
            continue
        for record in reversed(records):
            try:
                sub = Submission.from_json(record).rooted_at(where)
            except ValueError:
                continue
            tasks = [t for t in refs(sub) if t.job_id == job_id or t.job_id.split("_")[0] == job_id]
            if tasks:
                return sub, tasks
    return None
