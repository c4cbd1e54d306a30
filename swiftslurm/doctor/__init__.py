"""`swiftslurm doctor`: what a finished, failed or stuck job left behind, read into findings.

Each rule turns the files of one task (rank logs, submitit logs, ``metrics.jsonl``, ``train-summary.json``,
``preflight/report.json``, ``requeues.json``, ``checkpoint-save.json``, the Slurm state) into ``Finding``s:
what happened, the evidence (file, line, rank, node, step), the cause and the fix (the spec keys to change),
each under a stable ``code``. Reads files only; prints nothing (cli/doctor_cmd.py prints).
"""

from .diagnose import diagnose, diagnose_task
from .findings import CODES, Evidence, Finding, ordered

__all__ = ["CODES", "Evidence", "Finding", "ordered", "diagnose", "diagnose_task"]
