"""What doctor's findings add to the node-health ledger (pure): the culprit nodes of a hang, the nodes that lost a
rank to a signal or went down, and nodes a preflight blamed. Only for Slurm jobs (a local run's "node" is this
machine), and never a rank the OOM killer ended (host memory is the job's setting, not the node's health)."""

from __future__ import annotations

from ..ledger import Entry
from .evidence import TaskRun
from .findings import Finding


def _reason(f: Finding) -> str:
    if f.code == "node_failure" and f.evidence and f.evidence[0].file == "preflight/report.json":
        return "preflight"
    return f.code


def ledger_entries(findings: list[Finding], runs: list[TaskRun]) -> list[Entry]:
    by_task = {r.task: r for r in runs}
    oom_tasks = {f.task for f in findings if f.code == "host_oom"}
    out: list[Entry] = []
    for f in findings:
        run = by_task.get(f.task)
        if f.code not in ("hang", "node_failure") or run is None or run.executor != "slurm" or not f.nodes:
            continue
        reason = _reason(f)
        if reason == "node_failure" and f.task in oom_tasks:
            continue
        for node in f.nodes:
            out.append(Entry(node, reason, f.what[:300], run.job_id, 0.0, run.task_dir))
    return out
