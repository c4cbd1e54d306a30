"""Every rule over every task: the findings of a TARGET, most important first."""

from __future__ import annotations

from typing import Callable

from .evidence import TaskRun
from .findings import Finding, ordered
from .rules.hang import hang
from .rules.jobrules import held, node_failure, walltime_loop
from .rules.logrules import ckpt_missing_keys, cuda_oom, device_mismatch, host_oom, nccl_timeout, startup_hang
from .rules.metricrules import diverged, nan_grad_norm, router_collapse, speed
from .rules.restartrules import in_job_restarts
from .rules.slowrules import straggler

RULES: tuple[Callable[[TaskRun], list[Finding]], ...] = (
    hang, startup_hang, held, node_failure, host_oom, cuda_oom, device_mismatch, ckpt_missing_keys, nccl_timeout, nan_grad_norm,
    diverged, router_collapse, walltime_loop, straggler, speed, in_job_restarts,
)


def diagnose_task(run: TaskRun) -> list[Finding]:
    """The findings of one task (pure over what was read)."""
    return ordered([f for rule in RULES for f in rule(run)])


def diagnose(runs: list[TaskRun]) -> list[Finding]:
    return ordered([f for run in runs for f in diagnose_task(run)])
