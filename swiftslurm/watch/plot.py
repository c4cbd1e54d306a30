"""`swiftslurm plot`: loss and throughput against step, one line per task, requeue points marked; a task's
``eval_loss`` (``train.eval_*``) dashed in its colour, so a sweep's tasks compare on one chart.

``figure(series)`` is pure over the metrics rows (matplotlib's Agg backend, no display needed); the CLI
saves it. Throughput is useful (non-padding) tokens/s where the trainer logs it, else tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .progress import restart_steps


@dataclass
class Series:
    """One task's curves: its label (index and overrides) and its metrics rows."""

    label: str
    rows: list[dict[str, Any]]
    requeues: list[dict[str, Any]] = field(default_factory=list)


def _points(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for row in rows:
        step, value = row.get("step"), row.get(key)
        if isinstance(step, int) and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            xs.append(step)
            ys.append(float(value))
    return xs, ys


def throughput_key(series: list[Series]) -> str:
    """``useful_tokens_per_s`` when any task logs it, else ``tokens_per_s``."""
    return "useful_tokens_per_s" if any("useful_tokens_per_s" in r for s in series for r in s.rows) else "tokens_per_s"


def figure(series: list[Series], title: str = ""):
    """A two-panel figure (loss; throughput) with one line per series; a requeue is an x on the loss line."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7), constrained_layout=True)
    loss_ax, speed_ax = fig.subplots(2, 1, sharex=True)
    speed_key = throughput_key(series)
    for s in series:
        xs, ys = _points(s.rows, "loss")
        (line,) = loss_ax.plot(xs, ys, label=s.label)
        ex, ey = _points(s.rows, "eval_loss")  # train.eval_*: the held-out loss, dashed, in the task's colour
        if ex:
            loss_ax.plot(ex, ey, linestyle="--", marker="o", markersize=3, color=line.get_color(), label=f"{s.label} eval_loss")
        points = list(zip(xs, ys, strict=True))
        before = [max((pt for pt in points if pt[0] <= step), default=None) for step in restart_steps(s.rows, s.requeues)]
        marks = [m for m in before if m is not None][:50]  # each requeue on the last logged loss before it
        if marks:
            loss_ax.scatter([m[0] for m in marks], [m[1] for m in marks], marker="x", s=60, color=line.get_color(), zorder=3)
        sx, sy = _points(s.rows, speed_key)
        speed_ax.plot(sx, sy, color=line.get_color(), label=s.label)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(title or "training loss (x: requeued here)")
    speed_ax.set_ylabel("useful tokens/s" if speed_key == "useful_tokens_per_s" else "tokens/s")
    speed_ax.set_xlabel("step")
    if len(series) > 1 or any("eval_loss" in r for s in series for r in s.rows):
        loss_ax.legend(fontsize="small", loc="best")
    return fig
