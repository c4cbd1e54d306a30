"""TARGET -> the tasks to diagnose: an output dir (its latest submission), one task dir, or a Slurm job id
(found through the paths Slurm recorded for it: its log files and working dir)."""

from __future__ import annotations

from pathlib import Path

from .. import slurm
from ..errors import SwiftSlurmError
from ..submission import SUBMISSION_FILE, Submission, load_submission
from ..watch.target import TaskRef, refs, resolve
from .evidence import TaskRun, read_task

SLACK_S = 5.0  # log lines this much older than the submission still count (clocks of two nodes)


def runs_of(target: str) -> list[TaskRun]:
    if Path(target).is_dir():
        sub, tasks = resolve(target)
    else:
        sub, tasks = _by_job_id(target)
    states = _states(sub)
    since = sub.submitted_at - SLACK_S if sub is not None and sub.submitted_at else None
    out = []
    for ref in tasks:
        state, nodes, restarts = states.get(ref.task, ("", "", 0))
        run = read_task(ref.task, ref.task_dir, ref.folder, ref.job_id, since, state, nodes, restarts)
        run.executor = sub.executor if sub is not None else ""
        out.append(run)
    return out


def _states(sub: Submission | None) -> dict[int, tuple[str, str, int]]:
    if sub is None:
        return {}
    try:
        return {int(s.task): (s.state, s.nodes, s.restarts) for s in sub.statuses()}
    except (SwiftSlurmError, OSError, ValueError):
        return {}  # Slurm not answering: the files still tell most


def _by_job_id(job_id: str) -> tuple[Submission, list[TaskRef]]:
    base = job_id.split("_")[0]
    if not (base.isascii() and base.isdigit()):
        raise SwiftSlurmError("not a job id nor an output dir", job_id,
                              "pass a Slurm job id such as 123 (or 123_4), or the job.output_dir of a submitted spec")
    for path in slurm.job_paths(job_id):
        for parent in [Path(path), *Path(path).parents]:
            if (parent / SUBMISSION_FILE).is_file():
                sub = load_submission(str(parent))
                tasks = [t for t in refs(sub) if t.job_id == job_id or (t.job_id.split("_")[0] == job_id)]
                if tasks:
                    return sub, tasks
    raise SwiftSlurmError(f"cannot find where job {job_id} wrote", "Slurm records no path of it under a swiftslurm output dir",
                          "pass the job's output dir (job.output_dir) instead")
