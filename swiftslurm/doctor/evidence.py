"""The reading edge: one task's files as plain values (``TaskRun``), tolerant of every file being absent or torn.

Rank logs are stamped and tagged with their node by ``watch.logs``; every line keeps its file and line number,
so a finding can point at it. Only lines written by the latest submission count (a task dir's rank logs grow
across resubmissions). Everything else here is a JSON file the runtime, the trainer or the preflight wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsutil
from ..checkpoint.savetime import read_save
from ..records.requeues import read_requeues
from ..records.restarts import read_restarts
from ..slurm.distenv import FR_DUMP_NAME
from ..taskdir import METRICS_FILE, SUMMARY_FILE, TASK_SPEC_FILE
from ..train.health import frtrace
from ..watch import logs as L

PREFLIGHT_REPORT = ("preflight", "report.json")


@dataclass(frozen=True)
class Line:
    """One log line with where it is: file (as shown), 1-based line number, rank, node, time."""

    file: str
    number: int
    rank: int
    node: str
    time: float
    text: str


@dataclass
class TaskRun:
    """What one task left, as values: the rules are pure over it."""

    task: int
    task_dir: str
    state: str = ""  # Slurm's (or the local executor's) state; "" unknown
    nodes: str = ""  # the allocation's hostlist, as Slurm says it
    job_id: str = ""
    end_time: float | None = None  # when the run stopped (a running one: now)
    lines: list[list[Line]] = field(default_factory=list)  # per log file, in file order
    metrics: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (line number, row)
    summary: dict[str, Any] | None = None
    preflight: dict[str, Any] | None = None
    requeues: list[dict[str, Any]] = field(default_factory=list)
    in_job: list[dict[str, Any]] = field(default_factory=list)  # restarts.json: in-job restarts (node/restart.py)
    save: dict[str, Any] | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # the task's resolved spec (spec.json), {} when absent
    restarts: int = 0
    executor: str = ""  # "slurm" | "local" (the submission's), "" unknown
    flight: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its flight-recorder dump (frtrace)
    held: str = ""  # state HELD: Slurm's reason and the ways on (jobs/record.held_note)
    hold_reason: str = ""  # state HELD: Slurm's pending reason code (TaskStatus.hold_reason)

    @property
    def all_lines(self) -> list[Line]:
        return [ln for lines in self.lines for ln in lines]

    def rank_nodes(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for ln in self.all_lines:
            if ln.node:
                out[ln.rank] = ln.node
        return out

    def step_at(self, when: float) -> int | None:
        """The last step rank 0 logged at or before ``when`` (None before the first)."""
        step = None
        for _, row in self.metrics:
            t, s = row.get("time"), row.get("step")
            if isinstance(t, (int, float)) and isinstance(s, int) and t <= when:
                step = s
        return step

    def train(self, key: str, default: Any = None) -> Any:
        return (self.spec.get("train") or {}).get(key, default)


# ---------------------------------------------------------------- readers


def read_json(path: Path) -> Any:
    """A small JSON record of a task dir, or None: missing, or unreadable (damaged, over its cap, not a regular file)."""
    try:
        return fsutil.read_json(path, fsutil.RECORD_CAP, expect=None)
    except (OSError, ValueError):
        return None


def read_metrics(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Rows of metrics.jsonl with their line numbers (its last METRICS_CAP bytes); torn or foreign lines are skipped."""
    try:
        data, start = fsutil.read_tail(path, 0, fsutil.METRICS_CAP)
    except (OSError, ValueError):
        return []
    first: int | None = 1
    if start > 0:  # the head was skipped: drop the partial first line, count the lines before it
        cut = data.find(b"\n") + 1
        data = data[cut:]
        try:
            before = _lines_before(path, start + cut)
            first = None if before is None else 1 + before
        except OSError:
            pass
    rows = fsutil.json_lines(data, source=path, first_line=first or 1, finite=False)
    return [(number if first else 0, row) for number, row in rows if isinstance(row, dict)]


# A skipped head larger than this is not read to number the lines after it: a finding then cites the file without a
# line (a 2 GiB log took 6 s of reading here, 50 s on a loaded machine); within it, a count is a fraction of a second.
LINE_COUNT_CAP = 64 << 20


def _lines_before(path: Path, offset: int) -> int | None:
    """How many lines a log has before byte ``offset`` (only counted when the head was skipped), None past
    ``LINE_COUNT_CAP``: unknown, never guessed."""
    if offset > LINE_COUNT_CAP:
        return None
    count = 0
    with fsutil.open_regular(path) as fh:
        while fh.tell() < offset:
            chunk = fh.read(min(1 << 20, offset - fh.tell()))
            if not chunk:
                break
            count += chunk.count(b"\n")
    return count


def read_log(src: L.Source, root: Path, since: float | None, nodes: dict[int, str]) -> list[Line]:
    """A log file's lines (its last ``SCAN_BYTES``), stamped, with file and line number; lines older than ``since`` dropped."""
    text, end = L.read_text(src.path)
    if not text:
        return []
    try:
        mtime = src.path.stat().st_mtime
        before = _lines_before(src.path, end - len(text.encode("utf-8", "replace"))) if src.path.stat().st_size > L.SCAN_BYTES else 0
    except OSError:
        mtime, before = time.time(), 0
    try:
        shown = str(src.path.relative_to(root))
    except ValueError:
        shown = str(src.path)
    stamped = L.stamp_lines(text, src, mtime, nodes)
    return [Line(shown, 0 if before is None else before + 1 + i, ln.rank, ln.node, ln.time, ln.text) for i, ln in enumerate(stamped)
            if since is None or ln.time >= since]


def submitit_sources(task: int, task_dir: str, folder: str, job_id: str) -> list[L.Source]:
    """Log files of a task; without a submission record, the newest submitit folder's files under the task dir."""
    found = L.sources(task, task_dir, folder, job_id)
    if folder:
        return found
    base = Path(task_dir, "logs", "submitit")
    folders = sorted([p for p in base.iterdir() if p.is_dir()] if base.is_dir() else [])
    for candidate in ([folders[-1]] if folders else []) + [base]:
        for path in sorted(candidate.glob("*_log.*")):
            m = L.SUBMITIT_LOG.match(path.name)
            if m:
                found.append(L.Source(path, task, int(m.group("rank"))))
    return found


def read_task(task: int, task_dir: str, folder: str = "", job_id: str = "", since: float | None = None,
              state: str = "", nodes: str = "", restarts: int = 0) -> TaskRun:
    """Everything one task left under ``task_dir`` (and in its submitit logs)."""
    root = Path(task_dir)
    run = TaskRun(task, task_dir, state=state, nodes=nodes, job_id=job_id, restarts=restarts)
    rank_nodes: dict[int, str] = {}
    per_file = [read_log(src, root, since, rank_nodes) for src in submitit_sources(task, task_dir, folder, job_id)]
    # a line before its file's first rank tag has no node yet: its rank's node from any file
    run.lines = [[ln if ln.node else Line(ln.file, ln.number, ln.rank, rank_nodes.get(ln.rank, ""), ln.time, ln.text) for ln in lines]
                 for lines in per_file if lines]
    run.metrics = read_metrics(root / METRICS_FILE)
    summary = read_json(root / SUMMARY_FILE)
    run.summary = summary if isinstance(summary, dict) else None
    report = read_json(root.joinpath(*PREFLIGHT_REPORT))
    run.preflight = report if isinstance(report, dict) else None
    run.requeues = read_requeues(task_dir)
    run.in_job = read_restarts(task_dir)
    run.save = read_save(task_dir)
    spec = read_json(root / TASK_SPEC_FILE)
    run.spec = spec.get("spec") or {} if isinstance(spec, dict) else {}
    env = found if isinstance(found := run.spec.get("env"), dict) else {}
    prefix = str(env.get(frtrace.PREFIX_ENV) or root / "logs" / FR_DUMP_NAME)  # distenv.child_env's default
    run.flight = frtrace.read_dumps(prefix, since)
    run.end_time = time.time() if state in ("RUNNING", "COMPLETING") else _last_write(run)
    return run


def _last_write(run: TaskRun) -> float | None:
    """When the run last wrote anything: its logs' and metrics' newest line."""
    times = [lines[-1].time for lines in run.lines if lines]
    times += [float(r["time"]) for _, r in run.metrics[-1:] if isinstance(r.get("time"), (int, float))]
    return max(times) if times else None
