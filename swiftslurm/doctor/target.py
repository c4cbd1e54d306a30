"""TARGET -> the tasks to diagnose: an output dir (its latest submission), one task dir, or a Slurm job id
(found through the paths Slurm recorded for it: its log files and working dir)."""

from __future__ import annotations

from ..errors import SwiftSlurmError
from ..jobs.record import Submission
from ..jobs.target import resolve
from .evidence import TaskRun, read_task

SLACK_S = 5.0  # log lines this much older than the submission still count (clocks of two nodes)


def runs_of(target: str) -> list[TaskRun]:
    sub, tasks = resolve(target, through_record=True)
    states = _states(sub)
    since = sub.submitted_at - SLACK_S if sub is not None and sub.submitted_at else None
    out = []
    for ref in tasks:
        state, nodes, restarts, held, hold_reason = states.get(ref.task, ("", "", 0, None, None))
        run = read_task(ref.task, ref.task_dir, ref.folder, ref.job_id, since, state, nodes, restarts)
        run.executor = sub.executor if sub is not None else ""
        run.held, run.hold_reason = held or "", hold_reason or ""
        out.append(run)
    return out


def _states(sub: Submission | None) -> dict[int, tuple[str, str, int, str | None, str | None]]:
    if sub is None:
        return {}
    try:
        return {int(s.task): (s.state, s.nodes, s.restarts, s.held, s.hold_reason) for s in sub.statuses()}
    except (SwiftSlurmError, OSError, ValueError):
        return {}  # Slurm not answering: the files still tell most
