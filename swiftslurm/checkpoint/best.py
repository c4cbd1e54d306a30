"""The best checkpoint by the evaluation metric: the ``latest_best`` pointer in an output dir.

The trainer (rank 0, after each commit) points ``<out>/latest_best`` at ``checkpoint-<step>`` of the step whose
evaluation was the best so far (``train.metric_for_best_model``); retention (``discover.prune``) never removes the
checkpoint it names. Like ``latest`` it is one line, written atomically. Reading it is defensive: the file is
data someone may have put there, so :func:`best_checkpoint` takes only a ``checkpoint-<N>`` name of a directory
that lies inside the output dir (never a path out of it, never a symlink elsewhere).
"""

from __future__ import annotations

from pathlib import Path

from ..fsutil import TAG_CAP, atomic_write_text, is_inside, read_text
from ..taskdir import LATEST_BEST_NAME
from .names import final_dir, step_of


def best_checkpoint(output_dir: Path | str) -> Path | None:
    """The checkpoint ``latest_best`` names, when it is a ``checkpoint-<N>`` directory inside ``output_dir``; else
    None (no pointer, an unreadable or foreign one, or a checkpoint retention or a person removed)."""
    out = Path(output_dir)
    try:
        name = read_text(out / LATEST_BEST_NAME, TAG_CAP, follow_symlinks=False).strip()
    except (OSError, ValueError):  # none, or Unreadable
        return None
    if step_of(name) is None or name != Path(name).name:
        return None
    path = out / name
    if not path.is_dir() or not is_inside(out, path):
        return None
    return path


def point_best(output_dir: Path | str, step: int | None) -> Path | None:
    """Point ``latest_best`` at ``checkpoint-<step>`` when it exists and the pointer names another; returns the
    checkpoint it names now. Rank 0, after a commit (so a pointer lost to a kill is rewritten at the next save)."""
    current = best_checkpoint(output_dir)
    if not step:
        return current
    path = final_dir(output_dir, step)
    if not path.is_dir() or path == current:
        return current
    atomic_write_text(Path(output_dir) / LATEST_BEST_NAME, path.name + "\n")
    return path
