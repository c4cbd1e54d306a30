"""`swiftslurm preflight SPEC`: a diagnostic job with the allocation the spec asks for, no training.

Submits the plan in mode "preflight" (every rank runs the checks, rank 0 writes
``<task dir>/preflight/report.json`` and ``busbw.png``), follows it with a live table, then prints
each task's report. Exit 0 when every check passed, 4 (PreflightFailed) otherwise. A preflight that
gives up waiting (its time limit plus QUEUE_GRACE_S, Ctrl-C, an error) cancels its job: it leaves
nothing queued behind. An output dir an active job owns is refused (exit 3) before anything is touched.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape

from ..errors import PreflightFailed
from ..fsutil import FILE, path_kind, write_named_file
from ..plan import Plan
from ..preflight.report import REPORT_DIR, REPORT_JSON, print_report, read_report

QUEUE_GRACE_S = 600  # how long the job may wait in the queue on top of its own time limit


def _report_path(task_dir: str) -> Path:
    return Path(task_dir) / REPORT_DIR / REPORT_JSON


def summary(reports: list[dict[str, Any] | None], states: dict[str, str], job_ids: list[str], executor: str, wall_s: float) -> dict[str, Any]:
    """The --json document: every task's report (None where the job wrote none) and the verdict (pure)."""
    return {
        "ok": all(r is not None and r.get("ok") for r in reports),
        "executor": executor,
        "job_ids": job_ids,
        "states": states,
        "wall_s": round(wall_s, 1),
        "tasks": reports,
    }


def preflight_command(console: Console, plan: Plan, executor: str, json_file: Path | None, timeout_s: float | None = None) -> int:
    """``timeout_s``: how long to wait for the job (default: its time limit plus QUEUE_GRACE_S)."""
    from .. import slurm
    from ..jobs.send import refuse_if_owned, submit_plan
    from .submit_cmd import status_table

    t0 = time.monotonic()
    refuse_if_owned(plan)  # before the old reports are removed: they may belong to a live job
    for task in plan.tasks:  # never mistake an older run's report for this one's
        _report_path(task.output_dir).unlink(missing_ok=True)
    sub = submit_plan(plan, executor=executor, mode="preflight")
    s = plan.spec.slurm
    console.print(
        f"preflight job {', '.join(sub.job_ids)} via {sub.executor}: {len(plan.tasks)} task(s) x {s.nodes} node(s) x "
        f"{s.ranks_per_node} rank(s); checks: {', '.join(plan.spec.preflight.checks) or 'all'}",
        highlight=False,
    )
    title = f"preflight job {', '.join(sub.slurm_job_ids) if sub.executor == 'slurm' else sub.executor}"
    limit = max(g.slurm.time_limit_s for g in plan.groups) + QUEUE_GRACE_S if timeout_s is None else timeout_s
    states: dict[str, str] = {}
    try:
        with Live(status_table([], "waiting for the preflight job"), console=console, refresh_per_second=2, transient=True) as live:
            states = sub.wait(timeout_s=limit, on_update=lambda rows: live.update(status_table(rows, title)))
    except KeyboardInterrupt:
        _give_up(console, sub, "interrupted")
        raise
    except BaseException as exc:
        _give_up(console, sub, f"stopped waiting ({type(exc).__name__})")
        raise
    waiting = {k: v for k, v in states.items() if not slurm.is_final(v) and v != "UNKNOWN"}
    if waiting:
        held = "HELD" in waiting.values()
        _give_up(console, sub, "Slurm holds it" if held else f"gave up after {limit:.0f} s")
        raise PreflightFailed(
            "the preflight job was held in the queue by Slurm; it was cancelled" if held else
            f"the preflight job did not finish within {limit:.0f} s; it was cancelled",
            "job state: " + ", ".join(f"task {k} {v}" for k, v in list(waiting.items())[:10]),
            "check the queue (`squeue`, `sinfo`) or the job logs under " + sub.folder,
        )
    reports: list[dict[str, Any] | None] = []
    for task in plan.tasks:
        path = _report_path(task.output_dir)
        report = read_report(path) if path_kind(path) == FILE else None
        reports.append(report)
        if report is not None:
            label = f"task {task.index}: " if plan.is_array else ""
            print_report(console, report, title=escape(f"{label}preflight on {', '.join(report.get('nodes', []))} ({path.parent})"))
    wall = time.monotonic() - t0
    doc = summary(reports, states, sub.job_ids, sub.executor, wall)
    if json_file is not None:
        write_named_file(json_file, json.dumps(doc, indent=2))
        console.print(f"report JSON: {json_file}", highlight=False, markup=False)
    console.print(f"preflight total wall time {wall:.1f} s (submit to report)", highlight=False)
    missing = [t.index for t, r in zip(plan.tasks, reports, strict=True) if r is None]
    if missing:
        raise PreflightFailed(
            f"the preflight job wrote no report for task(s) {', '.join(map(str, missing))}",
            "job state: " + ", ".join(f"task {k} {v}" for k, v in states.items()),
            f"see the job logs under {sub.folder} and <task dir>/logs/",
        )
    if not doc["ok"]:
        failed = sum(r["failed"] for r in reports if r)
        console.print(f"[bold red]preflight failed:[/] {failed} check(s); the rows marked FAIL name the node and the fix", highlight=False)
        return PreflightFailed.exit_code
    console.print("[green]preflight passed[/]")
    return 0


def _give_up(console: Console, sub, why: str) -> None:
    """Cancel a preflight job we stop following, so nothing is left queued or running."""
    from ..errors import SwiftSlurmError

    try:
        sub.cancel()
    except SwiftSlurmError as exc:
        console.print(f"{why}: could not cancel preflight job {', '.join(sub.job_ids)}: {exc.what}", highlight=False, markup=False)
        return
    console.print(f"{why}: preflight job {', '.join(sub.slurm_job_ids if sub.executor == 'slurm' else sub.job_ids)} cancelled", highlight=False, markup=False)
