"""What submitit ships to the nodes: ``run_rank`` (``runtime.run_task`` on one rank) and the error it raises.

Both submit paths name this callable (submitit pickles it by reference), so it lives with the on-node code.
"""

from __future__ import annotations


class TaskFailed(RuntimeError):
    """Raised on a node so the Slurm step (and submitit's result) records the failure."""


def run_rank(plan_path: str, task_index: int, mode: str = "train") -> int:
    """The submitit callable: ``runtime.run_task`` on one rank; a non-zero exit fails the step, with the reason
    this rank recorded (a failed preflight's check and fix) in the message: the last line of the rank's log."""
    from .runtime import run_task_outcome

    code, why = run_task_outcome(plan_path, task_index, mode)
    if code != 0:
        raise TaskFailed(f"task {task_index} ({mode}) exited with code {code} on this rank" + (f": {why.line()}" if why else ""))
    return code
