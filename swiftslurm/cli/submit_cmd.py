"""`swiftslurm submit`, `status`, `cancel`: rich output around jobs/send.py (the CLI's thin layer)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .. import slurm
from ..jobs.record import Submission, TaskStatus
from ..jobs.send import resolve_executor, submit_plan
from ..jobs.target import submission_of
from ..plan import Plan
from .plan_view import avoided_lines
from .watch_cmd import _STYLE, MAX_ROWS, counts_caption


def _says_auto(console: Console, requested: str, kind: str) -> None:
    if requested == "auto":
        why = "sbatch is on PATH" if kind == "slurm" else "no sbatch on PATH: one node, no Slurm"
        console.print(f"executor: [bold]{kind}[/] (auto: {why})", highlight=False)


def _summary(sub: Submission, plan: Plan) -> Panel:
    from ..slurm.render import index_ranges

    n = len(plan.tasks)
    first_dir = plan.tasks[0].output_dir
    ids = sub.job_ids
    if sub.executor == "slurm" and len(plan.groups) > 1:
        job = ", ".join(f"{a['job_id']} (tasks {index_ranges(a['tasks'])})" for a in sub.arrays[:8]) + (" ..." if len(sub.arrays) > 8 else "")
    elif sub.executor == "slurm":
        job = f"{sub.slurm_job_ids[0]} (array of {n}: {ids[0]} .. {ids[-1]})" if plan.is_array else ids[0]
    else:
        job = ", ".join(ids[:8]) + (" ..." if len(ids) > 8 else "") + " (local controller pid)"
    where = escape(f"{plan.output_dir}/<task>" if plan.is_array else first_dir)
    shapes = [
        f"{'tasks ' + index_ranges(g.tasks) + ': ' if len(plan.groups) > 1 else ''}{g.slurm.nodes} node(s) x {g.slurm.ranks_per_node} rank(s) "
        f"(world size {g.world_size}), time {escape(g.slurm.time)}"
        for g in plan.groups[:8]
    ]
    lines = [
        f"[bold]{escape(plan.spec.job.name)}[/] submitted via {sub.executor}: job {escape(job)}",
        f"{n} task(s), each {shapes[0]}" if len(shapes) == 1 else f"{n} task(s) in {len(plan.groups)} arrays, one per allocation:",
        *(f"  {line}" for line in (shapes if len(shapes) > 1 else [])),
        f"task dirs:   {where}  (resolved spec: spec.json)",
        f"logs:        {escape(str(sub.folder))}  and <task dir>/logs/",
        "checkpoints: <task dir>/checkpoint-<step>/    TensorBoard: <task dir>/runs/",
        f"follow:      swiftslurm status {escape(_q(plan.output_dir))}   (or submit with --wait)",
        *avoided_lines(sub.avoided, plan),
        *local_limits(sub.executor, plan),
    ]
    # paths must survive a narrow or non-terminal console: fold long lines instead of cropping them
    return Panel.fit(Text.from_markup("\n".join(lines), overflow="fold"), title="swiftslurm submit")


def local_limits(executor: str, plan: Plan) -> list[str]:
    """What the spec asks for that the local executor does not do (markup): in-job restarts and spare nodes need the
    supervisor in a Slurm batch script; said once in the panel instead of silently running without them."""
    s = plan.spec.slurm
    if executor != "local" or not (s.max_restarts or s.spare_nodes):
        return []
    asked = ", ".join(part for part in (f"slurm.max_restarts = {s.max_restarts}" if s.max_restarts else "",
                                        f"slurm.spare_nodes = {s.spare_nodes}" if s.spare_nodes else "") if part)
    return [f"[yellow]note:[/]        {escape(asked)}: in-job restarts need Slurm (the batch script's supervisor); "
            "this local run has none: a failed rank ends it"]


def _q(path: str) -> str:
    from ..quoting import shell_quote

    return shell_quote(path)


def status_table(rows: list[TaskStatus], title: str = "") -> Table:
    table = Table(title=title or None)
    for col in ("task", "job", "state", "node(s)", "restarts", "elapsed"):
        table.add_column(col, justify="right" if col in ("task", "restarts") else "left")
    shown = rows if len(rows) <= MAX_ROWS else [r for r in rows if r.state != "COMPLETED"][:MAX_ROWS]
    for r in shown:
        style = _STYLE.get(r.state, "red" if slurm.is_final(r.state) else "")
        state = escape(r.state)  # Slurm's words and paths are text, not markup
        cells = [str(r.task), escape(r.job_id), f"[{style}]{state}[/]" if style else state, escape(r.nodes or "-"), str(r.restarts), escape(r.elapsed or "-")]
        table.add_row(*cells)
    if len(shown) < len(rows):
        table.caption = counts_caption(rows)
    return table


def _print_train_summaries(console: Console, sub: Submission, limit: int = 4) -> None:
    """The built-in trainer's end-of-training lines (rank 0 wrote them), for the first few tasks."""
    from ..train.result import read_summary

    for index, task_dir in enumerate(sub.task_dirs[:limit]):
        text = read_summary(task_dir) if task_dir else None
        if text:
            console.print((f"task {index}: " if len(sub.task_dirs) > 1 else "") + text, highlight=False, markup=False)


def follow(console: Console, sub: Submission, timeout_s: float | None = None, interval_s: float | None = None) -> int:
    """Live progress until every task ends (plain lines off a terminal); 0 only if all COMPLETED, else 1."""
    from .watch_cmd import FAILED_NOTES, failure_text, follow_progress, held_notes

    states = follow_progress(console, sub, interval_s=interval_s, timeout_s=timeout_s)
    _print_train_summaries(console, sub)
    bad = {t: s for t, s in states.items() if s != "COMPLETED"}
    if bad:
        console.print(f"[red]{len(bad)} of {len(states)} task(s) did not complete:[/] " + escape(", ".join(f"task {t} {s}" for t, s in list(bad.items())[:10])),
                      highlight=False)
        held = held_notes(sub, bad)
        for t in list(bad)[:FAILED_NOTES]:
            why = held.get(t) or failure_text(sub, int(t))  # Slurm holds it; else the rank's recorded reason, else its last real line
            if why:
                console.print(f"  task {t}: {why}", highlight=False, markup=False)
        console.print(f"logs: {sub.folder}  (errors by rank: swiftslurm logs {_q(sub.output_dir)} --errors)" if sub.output_dir else f"logs: {sub.folder}",
                      highlight=False)
        return 1
    console.print(f"[green]all {len(states)} task(s) COMPLETED[/]")
    return 0


def submit_command(console: Console, plan: Plan, executor: str, wait: bool, as_json: bool = False) -> int:
    kind = resolve_executor(executor)
    if as_json:
        import json
        import sys

        sub = submit_plan(plan, executor=kind)
        sys.stdout.write(json.dumps(sub.to_json(), indent=2) + "\n")
        return 0
    _says_auto(console, executor, kind)
    sub = submit_plan(plan, executor=kind)
    console.print(_summary(sub, plan), soft_wrap=False)  # wrap inside the panel, never crop a path
    if not wait:
        return 0
    return follow(console, sub)


def status_command(console: Console, target: str, as_json: bool, follow_: bool = False, interval_s: float | None = None,
                   sort: str | None = None) -> int:
    """One look (a table with progress, or JSON; ``sort``: ranked by that metric); with ``follow_`` the live view until
    the job ends (exit 1 if a task failed)."""
    from .watch_cmd import note_unfollowed, status_view

    sub = submission_of(target)
    note_unfollowed(sub)
    if follow_:
        return follow(console, sub, interval_s=interval_s)
    return status_view(console, sub, as_json, sort=sort)


def cancel_command(console: Console, target: str) -> int:
    from ..jobs.record import CancelRefused

    sub = submission_of(target, as_recorded=True)
    if sub.executor == "local" and Path(sub.output_dir).resolve() != Path(target).resolve():
        # a record is data: one that claims another dir's job is not this dir's to stop
        raise CancelRefused("cancel refused: the record here names another output dir", f"{target}/submission.json says {sub.output_dir}",
                            f"cancel from that dir (swiftslurm cancel {sub.output_dir}); nothing was signalled")
    if sub.output_dir and not sub.folder:  # a hand-submitted run: its job ids came from files in the dir
        from ..jobs.target import not_proven_here

        why = not_proven_here(sub)
        if why:
            raise CancelRefused("cancel refused: not provably this dir's job", why,
                                "nothing was signalled; cancel it by id (swiftslurm cancel JOBID) if it is yours")
    sub.cancel() if sub.output_dir else slurm.scancel(sub.slurm_job_ids)
    console.print(f"cancelled {sub.executor} job {', '.join(sub.slurm_job_ids if sub.executor == 'slurm' else sub.job_ids)}", highlight=False, markup=False)
    return 0
