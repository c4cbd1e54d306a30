"""How far each task is: step / max_steps, loss, throughput, ETA, elapsed, checkpoint, requeues.

Read from what the ranks already write, and tolerant of every file being absent or torn (a task that has
not started, a ``train.command`` that writes no metrics, a line cut mid-write):

- ``metrics.jsonl`` (rank 0, one row per logging step: ``step``, ``time``, ``loss``, ``tokens_per_s``,
  ``useful_tokens_per_s`` with packing);
- ``train-summary.json`` (the trainer's end of training: ``global_step``, ``final_loss``);
- ``requeues.json`` (walltime stops), ``checkpoint-<step>/`` (newest verified, and its ``trainer_state.json``);
- the plan (``swiftslurm-plan.json``: each task's overrides and ``train.max_steps``).

``progress_of`` and ``total_of`` are pure over those values; ``TaskFiles`` is the reading edge. A requeued
task logs again from its resume step: the rows after a step that did not grow are a new *segment*; the bar
continues from the last step, the requeue count rises, and the ETA uses the current segment's pace only.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .. import fsutil, slurm
from ..plan import PLAN_FILE
from ..taskdir import METRICS_FILE, REQUEUES_FILE, SUMMARY_FILE

# Slurm's final states (slurm.FINAL_STATES, the one list) but COMPLETED; UNKNOWN: Slurm lost the job
FAILED_STATES = (slurm.FINAL_STATES - {"COMPLETED"}) | {"UNKNOWN"}
RATE_WINDOW = 20  # logging rows of the current segment that the pace (steps per second) is measured over


@dataclass
class Progress:
    """One task's line in `status` / `submit --wait` (and its JSON)."""

    task: int
    state: str
    job_id: str = ""
    nodes: str = ""
    output_dir: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)
    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None  # the last logged loss
    best_loss: float | None = None  # the lowest logged loss
    final_loss: float | None = None  # the last loss of a COMPLETED task
    tokens_per_s: float | None = None  # useful (non-padding) tokens/s when the trainer logs them, else tokens/s
    tokens_kind: str = ""  # "useful_tokens_per_s" | "tokens_per_s" | ""
    eta_s: float | None = None
    elapsed_s: float | None = None
    restarts: int = 0
    checkpoint: str | None = None  # the newest verified checkpoint's path
    best: bool = False  # the lowest final loss of a sweep
    stop_reason: str | None = None  # a walltime stop that was not requeued, in the runtime's words
    restart_note: str | None = None  # in-job restarts: how many and the last cause, or why the last failure was not restarted
    held: str | None = None  # state HELD: Slurm holds it in the queue (its reason), and how to release or cancel it
    hold_reason: str | None = None  # state HELD: Slurm's pending reason code, for scripts ("JobHeldUser", "PartitionConfig")
    last_save: dict[str, Any] | None = None  # checkpoint-save.json: the last save's phases, grace advice
    eval_loss: float | None = None  # the last logged eval_loss (train.eval_*)
    router_load: float | None = None  # an MoE model's last router_load_max: tokens per expert, max/mean, the worst layer
    best_values: dict[str, float] = field(default_factory=dict)  # every logged metric's best value (`status --sort`)
    sort_metric: str = ""  # the metric `status --sort` ranked by ("" = the sweep's final loss)

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.max_steps:
            return None
        return min(1.0, max(0.0, self.step / self.max_steps))

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None  # NaN/inf are not JSON
        out["checkpoint"] = Path(self.checkpoint).name if self.checkpoint else None
        return out


@dataclass
class Total:
    """The line under an array's tasks."""

    tasks: int
    done: int  # COMPLETED
    failed: int  # in a final state other than COMPLETED
    running: int
    step: int | None
    max_steps: int | None
    tokens_per_s: float | None  # the running tasks' throughput, summed
    eta_s: float | None  # the last running task's ETA (array tasks run side by side)
    elapsed_s: float | None

    @property
    def fraction(self) -> float | None:
        if self.step is None or not self.max_steps:
            return None
        return min(1.0, self.step / self.max_steps)


# ---------------------------------------------------------------- pure


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _step(row: dict[str, Any]) -> int | None:
    s = row.get("step")
    return int(s) if isinstance(s, (int, float)) and not isinstance(s, bool) and s >= 0 else None


def segments(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split metrics rows into runs: a step that does not grow starts a new one (a requeue resumed earlier)."""
    out: list[list[dict[str, Any]]] = []
    last: int | None = None
    for row in rows:
        step = _step(row)
        if step is None:
            continue
        if not out or (last is not None and step <= last and "loss" in row and "loss" in out[-1][-1]):
            out.append([])
        out[-1].append(row)
        last = step
    return out


def restart_steps(rows: list[dict[str, Any]], requeues: list[dict[str, Any]] | None = None) -> list[int]:
    """Steps at which a run stopped and a later one took over (for marking on a plot): the steps
    requeues.json recorded, and where the metrics start a new segment."""
    found = {int(r["global_step"]) for r in requeues or [] if isinstance(r, dict) and isinstance(r.get("global_step"), int)}
    for seg in segments(rows)[:-1]:
        found.add(_step(seg[-1]) or 0)
    return sorted(found)


def pace_steps_per_s(segment: list[dict[str, Any]], since: float | None = None) -> float | None:
    """Steps per wall second over the last RATE_WINDOW rows of one segment logged after ``since`` (the
    last requeue: the wait in the queue is not pace); else from ``step_time_s``."""
    timed = [(s, t) for r in segment if (s := _step(r)) is not None and (t := _finite(r.get("time"))) is not None]
    timed = [(s, t) for s, t in timed if since is None or t >= since][-RATE_WINDOW:]
    if len(timed) >= 2:
        (s0, t0), (s1, t1) = timed[0], timed[-1]
        if s1 > s0 and t1 > t0:
            return (s1 - s0) / (t1 - t0)
    for row in reversed(segment):
        step_time = _finite(row.get("step_time_s"))
        if step_time and step_time > 0:
            return 1.0 / step_time
    return None


def progress_of(task: int, state: str, rows: list[dict[str, Any]], *, max_steps: int | None = None,
                summary: dict[str, Any] | None = None, checkpoint: str | None = None,
                elapsed_s: float | None = None, restarts: int = 0, resumed_at: float | None = None,
                now: float | None = None, **info: Any) -> Progress:
    """A task's progress from its metrics rows, summary and newest checkpoint (pure; ``now`` for the ETA,
    ``resumed_at`` the time of the last walltime stop)."""
    now = time.time() if now is None else now
    from ..checkpoint.names import step_of

    p = Progress(task, state, elapsed_s=elapsed_s, restarts=restarts, max_steps=max_steps, checkpoint=checkpoint, **info)
    checkpoint_step = step_of(checkpoint) if checkpoint else None
    segs = segments(rows)
    summary = summary if isinstance(summary, dict) else {}
    done_step = found if isinstance(found := summary.get("global_step"), int) else None
    candidates = [s for s in (_step(segs[-1][-1]) if segs and segs[-1] else None, checkpoint_step, done_step) if s is not None]
    p.step = max(candidates) if candidates else None
    if p.max_steps is None:
        p.max_steps = next((int(r["max_steps"]) for r in reversed(rows) if isinstance(r.get("max_steps"), int) and r["max_steps"] > 0), None)
    losses = [(_step(r), r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float)) and not isinstance(r.get("loss"), bool)]
    if losses:
        p.loss = float(losses[-1][1])
        finite = [v for _, v in losses if math.isfinite(v)]
        p.best_loss = float(min(finite)) if finite else None
    evals = [v for r in rows if (v := _finite(r.get("eval_loss"))) is not None]
    p.eval_loss = evals[-1] if evals else None
    routed = [v for r in rows if (v := _finite(r.get("router_load_max"))) is not None]
    p.router_load = routed[-1] if routed else None
    p.best_values = best_values(rows)
    if not p.stop_reason and isinstance(summary.get("stop_reason"), str) and summary["stop_reason"]:
        p.stop_reason = summary["stop_reason"]  # an early stop (train.early_stopping_patience), in the trainer's words
    if state == "COMPLETED":
        final = summary.get("final_loss")
        p.final_loss = float(final) if isinstance(final, (int, float)) and not isinstance(final, bool) else p.loss
    for key in ("useful_tokens_per_s", "tokens_per_s"):
        seen = [v for r in rows if (v := _finite(r.get(key))) is not None]
        if seen:
            p.tokens_per_s, p.tokens_kind = seen[-1], key
            break
    if state == "RUNNING" and segs and p.max_steps and p.step is not None:
        pace = pace_steps_per_s(segs[-1], since=resumed_at)
        last_time = _finite(segs[-1][-1].get("time"))
        if pace:
            since = max(0.0, now - last_time) if last_time is not None else 0.0
            p.eta_s = max(0.0, (p.max_steps - p.step) / pace - since)
    elif state == "COMPLETED":
        p.eta_s = 0.0
    return p


def total_of(rows: list[Progress]) -> Total:
    """The array's line: tasks done, steps summed, running throughput summed, the longest ETA."""
    steps = [r.step or 0 for r in rows]
    maxes = [r.max_steps for r in rows]
    known = all(m for m in maxes)
    running = [r for r in rows if r.state == "RUNNING"]
    speeds = [r.tokens_per_s for r in running if r.tokens_per_s is not None]
    etas = [r.eta_s for r in running if r.eta_s is not None]
    elapsed = [r.elapsed_s for r in rows if r.elapsed_s is not None]
    return Total(
        tasks=len(rows),
        done=sum(r.state == "COMPLETED" for r in rows),
        failed=sum(r.state in FAILED_STATES for r in rows),
        running=len(running),
        step=sum(steps) if any(r.step is not None for r in rows) else None,
        max_steps=sum(m or 0 for m in maxes) if known and maxes else None,
        tokens_per_s=sum(speeds) if speeds else None,
        eta_s=max(etas) if etas and len(etas) == len(running) else None,
        elapsed_s=max(elapsed) if elapsed else None,
    )


def rank_sweep(rows: list[Progress]) -> list[Progress]:
    """A sweep's rows, best first: COMPLETED by final loss, then the rest by their last loss, then no loss.

    The lowest finite final loss is marked ``best`` (none is marked before a task completed).
    """
    def key(p: Progress) -> tuple:
        final, last = _finite(p.final_loss), _finite(p.loss)
        return (final is None, final if final is not None else 0.0, last is None, last if last is not None else 0.0, p.task)

    ranked = sorted(rows, key=key)
    for p in ranked:
        p.best = False
    if ranked and _finite(ranked[0].final_loss) is not None:
        ranked[0].best = True
    return ranked


def best_values(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each numeric metric's best logged value: the lowest of a loss or a time, the highest of the rest
    (``spec.eval_rules.greater_is_better``, the rule the trainer's best checkpoint uses). Pure."""
    from ..spec.eval_rules import greater_is_better

    out: dict[str, float] = {}
    for row in rows:
        for key, raw in row.items():
            value = _finite(raw)
            if value is None or key in ("step", "time", "epoch"):
                continue
            old = out.get(key)
            if old is None or (value > old if greater_is_better(key) else value < old):
                out[key] = value
    return out


def rank_by(rows: list[Progress], metric: str) -> list[Progress]:
    """The tasks best first by ``metric`` (each task's best logged value of it: lowest for a loss or a time,
    highest otherwise), tasks that never logged it last; the first with a value is marked ``best``."""
    from ..spec.eval_rules import greater_is_better

    sign = -1.0 if greater_is_better(metric) else 1.0

    def key(p: Progress) -> tuple:
        value = p.best_values.get(metric)
        return (value is None, sign * value if value is not None else 0.0, p.task)

    ranked = sorted(rows, key=key)
    for p in ranked:
        p.best, p.sort_metric = False, metric
    if ranked and metric in ranked[0].best_values:
        ranked[0].best = True
    return ranked


def elapsed_seconds(text: str) -> float | None:
    """sacct/squeue ``Elapsed`` (``[D-]HH:MM:SS``, ``M:SS``) -> seconds; None when empty or unreadable."""
    from ..spec.model import time_limit_s

    text = (text or "").strip()
    if not text or text in ("-", "INVALID"):
        return None
    try:
        return float(time_limit_s(text.split(".")[0]))
    except ValueError:
        return None


def override_text(overrides: dict[str, Any]) -> str:
    """``learning_rate=0.0002 lora_rank=16`` (numbers as the TOML gave them)."""
    return " ".join(f"{k}={_value_text(v)}" for k, v in overrides.items())


def _value_text(v: Any) -> str:
    if isinstance(v, float):
        return format(v, "g")
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def last_requeue_time(requeues: list[dict[str, Any]]) -> float | None:
    """Epoch seconds of the newest walltime stop in requeues.json (``%Y-%m-%dT%H:%M:%S%z``), else None."""
    from datetime import datetime

    for record in reversed(requeues):
        try:
            return datetime.strptime(str(record.get("time")), "%Y-%m-%dT%H:%M:%S%z").timestamp()
        except (ValueError, AttributeError):
            continue
    return None


# ---------------------------------------------------------------- reading (the edge)


def read_json(path: Path) -> Any:
    """A small JSON record of a task dir, or None: missing, or unreadable (damaged, over its cap, not a regular file)."""
    try:
        return fsutil.read_json(path, fsutil.RECORD_CAP, expect=None)
    except (OSError, ValueError):
        return None


class TaskFiles:
    """Reads one task dir's files, remembering what it read (a follow loop re-reads only appended metrics)."""

    def __init__(self, task_dir: str) -> None:
        self.dir = Path(task_dir)
        self._offset = 0
        self._rows: list[dict[str, Any]] = []

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl so far (a torn last line waits for the next call)."""
        path = self.dir / METRICS_FILE
        try:  # a regular file only; beyond METRICS_CAP its newest rows
            chunk, start = fsutil.read_tail(path, self._offset, fsutil.METRICS_CAP)
        except (OSError, ValueError):
            return self._rows
        if start < self._offset:  # rewritten (a new run in the same dir): read again
            self._offset, self._rows = 0, []
        if start > self._offset:  # skipped ahead: drop the partial first line
            cut = chunk.find(b"\n") + 1
            chunk, start = chunk[cut:], start + cut
        end = chunk.rfind(b"\n") + 1
        self._rows.extend(row for _, row in fsutil.json_lines(chunk[:end], source=path, finite=False) if isinstance(row, dict))
        self._offset = start + end
        return self._rows

    def summary(self) -> dict[str, Any] | None:
        data = read_json(self.dir / SUMMARY_FILE)
        return data if isinstance(data, dict) else None

    def requeues(self) -> list[dict[str, Any]]:
        data = read_json(self.dir / REQUEUES_FILE)
        return data if isinstance(data, list) else []

    def newest_checkpoint(self) -> str | None:
        """The newest committed checkpoint: its manifest, file list and sizes check out. Not hashed: `status`
        must answer in seconds beside a terabyte checkpoint; resume and `swiftslurm verify` hash it."""
        from ..checkpoint import list_checkpoints
        from ..checkpoint.verify import verify

        try:
            for ckpt in list_checkpoints(self.dir):
                if verify(ckpt, contents=False).ok:
                    return str(ckpt)
        except OSError:
            return None
        return None

    def checkpoint_max_steps(self, checkpoint: str | None) -> int | None:
        """``max_steps`` the HF Trainer recorded in a checkpoint (epochs-based runs: the plan has none)."""
        if not checkpoint:
            return None
        state = read_json(Path(checkpoint) / "trainer_state.json")
        value = state.get("max_steps") if isinstance(state, dict) else None
        return value if isinstance(value, int) and value > 0 else None


def plan_tasks(output_dir: str) -> dict[str, dict[str, Any]]:
    """task output dir -> {"overrides", "max_steps"} from the plan file (empty when there is none)."""
    data = read_json(Path(output_dir) / PLAN_FILE) if output_dir else None
    out: dict[str, dict[str, Any]] = {}
    for entry in (data or {}).get("tasks", []) if isinstance(data, dict) else []:
        if not isinstance(entry, dict):
            continue
        train = ((entry.get("spec") or {}).get("train") or {}) if isinstance(entry.get("spec"), dict) else {}
        out[str(entry.get("output_dir", ""))] = {
            "overrides": entry.get("overrides") if isinstance(entry.get("overrides"), dict) else {},
            "max_steps": train.get("max_steps") if isinstance(train.get("max_steps"), int) else None,
        }
    return out


class Watcher:
    """Progress rows of a submission's tasks, re-read cheaply on every poll of a follow loop."""

    def __init__(self, output_dir: str, task_dirs: Iterable[str]) -> None:
        self.plan = plan_tasks(output_dir)
        self.files = {d: TaskFiles(d) for d in task_dirs if d}

    def rows(self, statuses: Iterable[Any], now: float | None = None) -> list[Progress]:
        """``statuses``: objects with task, job_id, state, nodes, restarts, elapsed, output_dir (submission.TaskStatus)."""
        out = []
        for st in statuses:
            info = dict(task=st.task, state=st.state, elapsed_s=elapsed_seconds(st.elapsed), now=now,
                        job_id=st.job_id, nodes=st.nodes, output_dir=st.output_dir,
                        stop_reason=getattr(st, "stop_reason", None), last_save=getattr(st, "last_save", None),
                        restart_note=getattr(st, "restart_note", None), held=getattr(st, "held", None),
                        hold_reason=getattr(st, "hold_reason", None))
            files = self.files.get(st.output_dir)
            if files is None:
                out.append(progress_of(rows=[], restarts=st.restarts, **info))
                continue
            planned = self.plan.get(st.output_dir, {})
            ckpt = files.newest_checkpoint()
            requeues = files.requeues()
            out.append(progress_of(
                rows=files.metrics(), max_steps=planned.get("max_steps") or files.checkpoint_max_steps(ckpt),
                summary=files.summary(), checkpoint=ckpt, restarts=st.restarts,  # this job's requeues (submit.statuses)
                resumed_at=last_requeue_time(requeues), overrides=planned.get("overrides", {}), **info,
            ))
        return out
