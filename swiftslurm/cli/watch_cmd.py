"""Watching a run: the progress view (`status`, `status --follow`, `submit --wait`), `logs` and `plot`.

A terminal gets a live table with a progress bar per task; anything else (a pipe, CI) gets plain lines,
one per task whose progress moved, at most every ``interval_s`` seconds, and no escape codes.
"""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path, PurePosixPath

from rich import box
from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from .. import slurm
from ..checkpoint.manifest import refuse_inside_sealed
from ..fsutil import check_named_file, write_named_file
from ..jobs.record import Submission, settled
from ..watch.progress import Progress, Total, Watcher, override_text, rank_by, rank_sweep, total_of

_STYLE = {"COMPLETED": "green", "RUNNING": "cyan", "PENDING": "yellow", "REQUEUED": "yellow", "COMPLETING": "cyan", "HELD": "yellow"}
MAX_ROWS = 40  # a 1000-task array shows its first 40 unfinished (or best) tasks and a count of the rest
PLAIN_INTERVAL_S = 10.0


# ---------------------------------------------------------------- formatting (pure)


def hms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600:d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


def clock(seconds: float | None) -> str:
    """sacct's Elapsed format: ``HH:MM:SS``, ``D-HH:MM:SS`` past a day; "" when unknown."""
    if seconds is None:
        return ""
    days, s = divmod(int(round(seconds)), 86400)
    text = f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{days}-{text}" if days else text


def num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def speed(p: Progress | Total, kind: str = "") -> str:
    if p.tokens_per_s is None:
        return "-"
    return f"{p.tokens_per_s:,.0f}" + (" useful" if kind == "useful_tokens_per_s" else "")


def step_text(step: int | None, max_steps: int | None) -> str:
    if step is None:
        return "-"
    if not max_steps:
        return str(step)
    return f"{step}/{max_steps} ({100 * min(step, max_steps) // max_steps}%)"


def ckpt_name(path: str | None) -> str:
    return PurePosixPath(path).name if path else "-"


def is_sweep(rows: list[Progress]) -> bool:
    return any(r.overrides for r in rows)


def plain_line(p: Progress) -> str:
    """One task as a plain line (no escape codes): for pipes and CI logs."""
    parts = [f"task {p.task}"]
    if p.overrides:
        parts.append(override_text(p.overrides))
    parts += [p.state, f"step {step_text(p.step, p.max_steps)}", f"loss {num(p.loss)}"]
    if p.tokens_per_s is not None:
        parts.append(f"{'useful tokens/s' if p.tokens_kind == 'useful_tokens_per_s' else 'tokens/s'} {p.tokens_per_s:.0f}")
    if p.eval_loss is not None:
        parts.append(f"eval_loss {num(p.eval_loss)}")
    if p.router_load is not None:
        parts.append(f"router max/mean {p.router_load:.2f}")
    if p.sort_metric:
        parts.append(f"best {p.sort_metric} {num(p.best_values.get(p.sort_metric))}")
    parts += [f"eta {eta_text(p)}", f"elapsed {hms(p.elapsed_s)}", f"restarts {p.restarts}", f"checkpoint {ckpt_name(p.checkpoint)}"]
    if p.best:
        parts.append("BEST")
    return "  ".join(parts)


def plain_total(t: Total) -> str:
    return (f"total  {t.done}/{t.tasks} completed, {t.running} running, {t.failed} failed  step {step_text(t.step, t.max_steps)}  "
            f"tokens/s {num(t.tokens_per_s, '.0f')}  eta {hms(t.eta_s)}  elapsed {hms(t.elapsed_s)}")


def _bar(step: int | None, max_steps: int | None, state: str):
    if not max_steps:
        return Text("-") if step is None else ProgressBar(total=None, width=8, pulse=state == "RUNNING")
    return ProgressBar(total=max_steps, completed=min(step or 0, max_steps), width=8)


def _progress_cell(step: int | None, max_steps: int | None, state: str) -> Table:
    """A bar and ``6/12`` in one cell."""
    cell = Table.grid(padding=(0, 1))
    cell.add_row(_bar(step, max_steps, state), "-" if step is None else f"{step}/{max_steps}" if max_steps else str(step))
    return cell


RIGHT = ("task", "restarts", "loss", "final loss", "best loss", "eval_loss", "router", "sorted by", "tokens/s")


def ranked(rows: list[Progress], sort: str | None) -> list[Progress]:
    """The rows in the order `status` shows them: by ``sort`` (a metric) when given, a sweep by final loss, else as is."""
    if sort:
        return rank_by(rows, sort)
    return rank_sweep(rows) if is_sweep(rows) else rows


def progress_table(rows: list[Progress], title: str = "", with_checkpoint: bool = True, narrow: bool = False,
                   sort: str | None = None) -> Table:
    """The tasks (a sweep: overrides, final and best loss, best first and marked; ``sort``: by that metric's best
    value, in its own column), plus a total under an array. ``narrow``: without the job and node columns."""
    sweep = is_sweep(rows)
    rows = ranked(rows, sort)
    cols = ["task", "overrides", "job", "state", "node(s)", "step", "loss", "final loss", "best loss", "eval_loss", "router", "sorted by", "tokens/s",
            "eta", "elapsed", "restarts", "checkpoint"]
    drop = {*(() if sweep else ("overrides", "final loss", "best loss")), *(("job", "node(s)") if narrow else ()),
            *(() if with_checkpoint else ("checkpoint",)), *(() if any(r.eval_loss is not None for r in rows) else ("eval_loss",)),
            *(() if any(r.router_load is not None for r in rows) else ("router",)), *(() if sort else ("sorted by",))}
    cols = [c for c in cols if c not in drop]
    table = Table(title=title or None, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in cols:
        name = "ckpt" if narrow and col == "checkpoint" else f"best {sort}" if col == "sorted by" else col
        table.add_column(name, justify="right" if col in RIGHT else "left",
                         no_wrap=col == "step", min_width=14 if col == "step" else None)
    shown = rows if len(rows) <= MAX_ROWS else ([r for r in rows if r.state != "COMPLETED"] if not sweep else rows)[:MAX_ROWS]
    for r in shown:
        style = _STYLE.get(r.state, "red" if slurm.is_final(r.state) else "")
        cells: dict[str, RenderableType] = {
            "task": f"{r.task}" + (" best" if r.best else ""), "overrides": override_text(r.overrides), "job": r.job_id,
            "state": f"[{style}]{r.state}[/]" if style else r.state, "node(s)": r.nodes or "-",
            "step": _progress_cell(r.step, r.max_steps, r.state), "loss": num(r.loss), "final loss": num(r.final_loss),
            "best loss": num(r.best_loss), "eval_loss": num(r.eval_loss), "sorted by": num(r.best_values.get(sort or "")),
            "router": f"{r.router_load:.2f}" if r.router_load is not None else "-",
            "tokens/s": speed(r, r.tokens_kind), "eta": eta_text(r), "elapsed": hms(r.elapsed_s),
            "restarts": str(r.restarts), "checkpoint": ckpt_name(r.checkpoint).removeprefix("checkpoint-" if narrow else ""),
        }
        table.add_row(*(cells[c] for c in cols), style="bold" if r.best else None)
    if len(rows) > 1:
        t = total_of(rows)
        cells = {"task": "total", "state": f"{t.done}/{t.tasks} done", "step": _progress_cell(t.step, t.max_steps, "RUNNING" if t.running else ""),
                 "tokens/s": speed(t), "eta": hms(t.eta_s), "elapsed": hms(t.elapsed_s)}
        table.add_row(*(cells.get(c, "") for c in cols), style="dim")
    if len(shown) < len(rows):
        table.caption = counts_caption(rows)
    return table


def counts_caption(rows) -> str:
    """``40 tasks: 3 COMPLETED, 37 RUNNING`` under a table that shows only some of them."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    return f"{len(rows)} tasks: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))


def eta_text(p: Progress) -> str:
    return "-" if slurm.is_final(p.state) else hms(p.eta_s)


def job_title(sub: Submission) -> str:
    ids = sub.slurm_job_ids if sub.executor == "slurm" else sub.job_ids[:4]
    return f"{sub.executor} job {', '.join(ids)}"


# ---------------------------------------------------------------- status, follow


def progress_rows(sub: Submission, watcher: Watcher | None = None) -> list[Progress]:
    watcher = watcher or Watcher(sub.output_dir, sub.task_dirs)
    return watcher.rows(sub.statuses())


FAILED_NOTES = 3  # tasks whose reason `status` and `submit --wait` print under the table


def failed_tasks(rows: list[Progress]) -> list[int]:
    """Tasks that ended in failure (not COMPLETED, not CANCELLED by someone, not still running)."""
    return [r.task for r in rows if slurm.is_final(r.state) and r.state not in ("COMPLETED", "CANCELLED")]


def failure_text(sub: Submission, task: int) -> str | None:
    """Why ``task`` of ``sub`` failed, in one line (watch/failure.py: the rank's record, else its last words)."""
    from ..watch.failure import task_failure

    if task >= len(sub.job_ids):
        return None
    task_dir = sub.task_dirs[task] if task < len(sub.task_dirs) else ""
    found = task_failure(task_dir, sub.folder, sub.job_ids[task], sub.submitted_at)
    return found.text if found else None


def status_json(sub: Submission, rows: list[Progress], sort: str | None = None) -> dict:
    rows = ranked(rows, sort)
    failed = set(failed_tasks(rows))
    return {
        "executor": sub.executor,
        "job_ids": sub.slurm_job_ids if sub.executor == "slurm" else sub.job_ids,
        "output_dir": sub.output_dir or None,
        "tasks": [
            {**r.to_json(), "elapsed": clock(r.elapsed_s), "output_dir": r.output_dir or None,
             "latest_checkpoint": r.checkpoint, "failure": failure_text(sub, r.task) if r.task in failed else None}
            for r in rows
        ],
        "total": total_of(rows).__dict__ if len(rows) > 1 else None,
    }


class PlainFollower:
    """Plain periodic lines: a task's line when its state, step, restarts or checkpoint changed, at most every
    ``interval_s`` per task (the last state of every task is always printed by ``finish``)."""

    def __init__(self, console: Console, interval_s: float = PLAIN_INTERVAL_S) -> None:
        self.console = console
        self.interval_s = interval_s
        self.shown: dict[int, tuple] = {}
        self.when: dict[int, float] = {}
        self.total_when = 0.0

    def update(self, rows: list[Progress]) -> None:
        now = time.monotonic()
        moved = False
        for r in rows:
            key = (r.state, r.step, r.restarts, r.checkpoint)
            if self.shown.get(r.task) != key and now - self.when.get(r.task, -1e9) >= self.interval_s:
                self._print(plain_line(r))
                self.shown[r.task], self.when[r.task], moved = key, now, True
        if moved and len(rows) > 1 and now - self.total_when >= self.interval_s:
            self._print(plain_total(total_of(rows)))
            self.total_when = now

    def finish(self, rows: list[Progress]) -> None:
        """Every task's last state not yet printed (a sweep: best first), and the total."""
        for r in rank_sweep(rows) if is_sweep(rows) else rows:
            if self.shown.get(r.task) != (r.state, r.step, r.restarts, r.checkpoint) or r.best:
                self._print(plain_line(r))
        if len(rows) > 1:
            self._print(plain_total(total_of(rows)))

    def _print(self, line: str) -> None:
        self.console.print(f"[{time.strftime('%H:%M:%S')}] {line}", highlight=False, markup=False, soft_wrap=True)


def follow_progress(console: Console, sub: Submission, interval_s: float | None = None, timeout_s: float | None = None) -> dict[str, str]:
    """Follow a submission until every task ended: a live table on a terminal, plain lines elsewhere.
    Returns task -> final state (as ``Submission.wait``)."""
    watcher = Watcher(sub.output_dir, sub.task_dirs)
    latest: list[list[Progress]] = [[]]
    title = job_title(sub)

    def rows_of(statuses) -> list[Progress]:
        latest[0] = watcher.rows(statuses)
        return latest[0]

    if console.is_terminal:
        with Live(Text("waiting for the job ..."), console=console, refresh_per_second=2, transient=False) as live:
            states = sub.wait(timeout_s=timeout_s,
                              on_update=lambda st: live.update(progress_table(rows_of(st), title, bool(sub.output_dir), console.width < 120)))
        return states
    plain = PlainFollower(console, PLAIN_INTERVAL_S if interval_s is None else interval_s)
    console.print(f"following {title} (plain lines every {plain.interval_s:g} s at most)", highlight=False, markup=False)
    states = sub.wait(timeout_s=timeout_s, on_update=lambda st: plain.update(rows_of(st)))
    plain.finish(latest[0])
    return states


def held_notes(sub: Submission, states: dict[str, str]) -> dict[str, str]:
    """Task -> its HELD note, for the tasks ``states`` (a wait's end) has as HELD."""
    if "HELD" not in states.values():
        return {}
    return {str(r.task): r.held for r in sub.statuses() if r.held and states.get(str(r.task)) == "HELD"}


def status_view(console: Console, sub: Submission, as_json: bool, sort: str | None = None) -> int:
    rows = progress_rows(sub) if sub.output_dir else Watcher("", []).rows(sub.statuses())
    if sort and rows and not any(sort in r.best_values for r in rows):  # sorted by nothing: say so, and what there is
        from ..errors import did_you_mean

        logged = sorted({k for r in rows for k in r.best_values})
        close = did_you_mean(sort, logged)
        print(f"note: no task has logged {sort!r} (yet), so the order is the tasks' own"
              + (f"; {close}" if close else "") + (f"; logged: {', '.join(logged)}" if logged else ""), file=sys.stderr)
    if as_json:
        sys.stdout.write(json.dumps(status_json(sub, rows, sort), indent=2) + "\n")
        return 0
    if not console.is_terminal:  # a pipe: a line per task, nothing cropped to 80 columns
        console.print(job_title(sub), highlight=False, markup=False)
        for r in ranked(rows, sort):
            console.print(plain_line(r), highlight=False, markup=False, soft_wrap=True)
        if len(rows) > 1:
            console.print(plain_total(total_of(rows)), highlight=False, markup=False, soft_wrap=True)
    else:
        console.print(progress_table(rows, job_title(sub), with_checkpoint=bool(sub.output_dir), narrow=console.width < 120, sort=sort))
    print_notes(console, rows)
    print_failures(console, sub, failed_tasks(rows))
    return 0


def print_failures(console: Console, sub: Submission, tasks: list[int]) -> None:
    """Under the table: why the first FAILED_NOTES failed tasks failed, one line each."""
    for task in tasks[:FAILED_NOTES]:
        why = failure_text(sub, task)
        if why:
            console.print(f"  task {task}: {why}", highlight=False, markup=False, soft_wrap=True)


def print_notes(console: Console, rows: list[Progress]) -> None:
    """Under the table: why a walltime stop was not requeued, in-job restarts, a task Slurm holds, and a last save
    that outgrew signal_grace_s."""
    for r in rows:
        where = f"task {r.task}: " if len(rows) > 1 or r.stop_reason else ""
        if r.stop_reason:
            console.print(f"task {r.task}: {r.stop_reason}", highlight=False, markup=False, soft_wrap=True)
        if r.restart_note:
            console.print(f"task {r.task}: {r.restart_note}", highlight=False, markup=False, soft_wrap=True)
        if r.held:
            console.print(f"task {r.task}: {r.held}", style="yellow", highlight=False, markup=False, soft_wrap=True)
        if r.last_save and r.last_save.get("advice"):
            console.print(f"warning: {where}{r.last_save['advice']}", style="yellow", highlight=False, markup=False, soft_wrap=True)


# ---------------------------------------------------------------- logs


def note_unfollowed(sub: Submission | None) -> None:
    """Say which task dirs a record names outside its own output dir: they are not read (``Submission.rooted_at``)."""
    if sub is not None and sub._unfollowed:
        shown = ", ".join(sub._unfollowed[:4]) + (f" and {len(sub._unfollowed) - 4} more" if len(sub._unfollowed) > 4 else "")
        print(f"note: the record here names dirs outside {sub.output_dir}, not read: {shown}", file=sys.stderr)


def logs_command(console: Console, target: str, rank: int | None, node: str | None, task: int | None,
                 follow: bool, tail: int | None, errors: bool, poll_s: float = 1.0, attempt: int | None = None) -> int:
    from ..jobs.target import resolve
    from ..watch import logs as L

    sub, refs = resolve(target, dirs_only=True)
    note_unfollowed(sub)
    if task is not None:
        refs = [r for r in refs if r.task == task]
        if not refs:
            from ..errors import SwiftSlurmError

            raise SwiftSlurmError(f"no task {task} here", target, "`swiftslurm status TARGET` lists the tasks")
    task_nodes = {}
    if sub is not None:
        for st in sub.statuses():
            if st.nodes and "," not in st.nodes and "[" not in st.nodes:
                task_nodes[st.task] = st.nodes
    reader = L.Reader([(r.task, r.task_dir, r.folder, r.job_id) for r in refs], task_nodes)
    many = len(refs) > 1
    budget = L.SCAN_BYTES if tail is None else max(64 << 10, tail * 1024)
    read = reader.new_lines(budget)
    key = _attempt_key(read, attempt) if attempt is not None else None
    per_source = [L.select(lines, rank, node, attempt=key) for lines in read]
    if (rank is not None or node is not None) and not any(per_source) and not follow:  # say so, not silence
        by_rank = rank is not None
        held = sorted({str(ln.rank) if by_rank else ln.node for lines in read for ln in lines if by_rank or ln.node},
                      key=int if by_rank else None)
        what = f"{'ranks' if by_rank else 'nodes'} {', '.join(held)}" if held else "no line yet"
        print(f"note: no log lines of {f'rank {rank}' if by_rank else f'node {node}'} here; the logs hold {what}", file=sys.stderr)
    if errors:
        from ..watch.failure import recorded

        since = sub.submitted_at if sub is not None else 0.0
        records = [(r.task, f) for r in refs for f in recorded(r.task_dir, since)[:1]]
        return _print_errors(console, L.find_errors(per_source), many, sum(1 for _ in per_source), records)
    lines = L.interleave(per_source)
    if tail is not None:
        lines = lines[-tail:] if tail > 0 else []
    for ln in lines:
        console.print(f"{ln.prefix(many)} {ln.text}", highlight=False, markup=False, soft_wrap=True)
    while follow:
        done = sub is None or all(settled(s.state) for s in sub.statuses())
        for ln in L.interleave([L.select(lines, rank, node, attempt=key) for lines in reader.new_lines()]):
            console.print(f"{ln.prefix(many)} {ln.text}", highlight=False, markup=False, soft_wrap=True)
        if done and sub is not None:
            break
        time.sleep(poll_s)
    return 0


def _attempt_key(read, attempt: int) -> str:
    """The key of the ``attempt``-th attempt (1-based) the logs hold; one message naming those there are, else."""
    from ..watch import logs as L

    held = L.attempts(ln for lines in read for ln in lines)
    if attempt > len(held):
        from ..errors import SwiftSlurmError

        listed = ", ".join(f"{i} = {key}" for i, key in enumerate(held, start=1)) or "none (logs written before attempts were marked)"
        raise SwiftSlurmError(f"no attempt {attempt} in these logs", f"attempts (job.requeues.restarts): {listed}",
                              "pick one of them; `swiftslurm status` shows the requeues and restarts")
    return held[attempt - 1]


def _print_errors(console: Console, reports, many: bool, files: int, records: list | None = None) -> int:
    """The reason each task's ranks recorded (records/failures.py) first, then the errors found in the logs."""
    for task, rec in records or []:
        console.print(Text(f"{'task ' + str(task) + ' ' if many else ''}failed: ", style="bold red") + Text(rec.line())
                      + Text(f"  (recorded by rank {rec.rank} {rec.node or '?'}, logs/failure-rank-{rec.rank}.json)", style="dim"),
                      highlight=False, soft_wrap=True)
    if not reports:
        console.print(f"no errors found in {files} log file(s)", highlight=False)
        return 0
    if records:
        console.print("")
    first = reports[0]
    console.print(f"{len(reports)} error(s); the first printed by rank {first.rank} ({first.node or '?'})"
                  f"{' of task ' + str(first.task) if many else ''} at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(first.time))}",
                  highlight=False, markup=False)
    for rep in reports:
        where = f"[{'task ' + str(rep.task) + ' ' if many else ''}rank {rep.rank} {rep.node or '?'}]"
        console.print(Text(f"\n{where} {time.strftime('%H:%M:%S', time.localtime(rep.time))}", style="bold red"))
        for line in rep.lines:
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
        if rep.also:
            console.print(f"  (also printed by rank{'s' if len(rep.also) > 1 else ''} {', '.join(map(str, rep.also))})", highlight=False, markup=False)
    return 0


# ---------------------------------------------------------------- plot


def plot_command(console: Console, target: str, out: Path | None) -> int:
    from ..jobs.target import resolve
    from ..watch.plot import Series, figure
    from ..watch.progress import TaskFiles, plan_tasks

    sub, refs = resolve(target, dirs_only=True)
    note_unfollowed(sub)
    planned = plan_tasks(sub.output_dir) if sub is not None else {}
    series = []
    for ref in refs:
        files = TaskFiles(ref.task_dir)
        overrides = planned.get(ref.task_dir, {}).get("overrides") or {}
        label = f"task {ref.task}" + (f" {override_text(overrides)}" if overrides else "")
        series.append(Series(label, files.metrics(), files.requeues()))
    if not any(s.rows for s in series):
        from ..errors import SwiftSlurmError

        raise SwiftSlurmError("nothing to plot yet", f"no metrics.jsonl rows under {target}",
                              "the built-in trainer writes metrics.jsonl at every logging step; wait for the first one (train.logging_steps)")
    where = Path(sub.output_dir if sub is not None and len(refs) > 1 else refs[0].task_dir)
    path = out or where / "metrics.png"
    check_named_file(path)  # before the drawing: a link, a FIFO or another user's file there is refused
    refuse_inside_sealed(path)  # ... and a file inside a committed checkpoint (it would no longer verify)
    fig = figure(series, title=f"{target}: loss (x: requeued here)")
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    write_named_file(path, png.getvalue())
    console.print(f"wrote {path}", highlight=False, markup=False)
    return 0
