"""How long the last checkpoint save took, phase by phase, and whether a walltime save fits the grace period.

The walltime signal comes ``slurm.signal_grace_s`` before the end; the trainer finishes the step it is in,
then saves. A save longer than ``signal_grace_s`` minus one step is killed at the walltime, and the job
ends TIMEOUT instead of requeued. Rank 0 writes ``<task output dir>/checkpoint-save.json`` after every
save; the trainer logs the advice and ``swiftslurm status`` shows it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import SAVE_FILE

PHASES = ("write", "fsync", "hash", "commit", "prune")  # keys ``<phase>_s`` in the record
# also in the record: ``stall_s``, the part of the save the training stood still for (all of it unless async_save)
HEADROOM = 1.25  # the suggested grace period covers one step + one save with 25% to spare


def suggested_grace_s(save_s: float, step_s: float) -> int:
    """A ``signal_grace_s`` that covers one step plus one save with headroom, rounded up to 10 s (pure)."""
    return int(math.ceil((save_s + step_s) * HEADROOM / 10.0) * 10)


def grace_advice(save_s: float, step_s: float, signal_grace_s: float) -> str | None:
    """None when a save of ``save_s`` after a step of ``step_s`` fits in ``signal_grace_s``, else what to set (pure)."""
    if save_s <= signal_grace_s - step_s:
        return None
    return (f"the last checkpoint save took {save_s:.1f} s; with one step of {step_s:.1f} s that is more than "
            f"slurm.signal_grace_s = {signal_grace_s:g} s allows, so a walltime save may be killed (job ends TIMEOUT, "
            f"not requeued). HINT: set slurm.signal_grace_s = {suggested_grace_s(save_s, step_s)}")


def record_save(output_dir: Path | str, step: int, save_s: float, phases_s: dict[str, float], step_s: float | None,
                signal_grace_s: float) -> dict[str, Any]:
    """Write the record of the save that just finished (rank 0) and return it. ``save_s`` is the whole save
    (barriers included); ``phases_s`` its parts by name (``PHASES``)."""
    total = float(save_s)
    step_s = float(step_s or 0.0)
    record = {
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "save_s": round(total, 3),
        **{f"{k}_s": round(float(v), 3) for k, v in phases_s.items()},
        "step_s": round(step_s, 3),
        "signal_grace_s": signal_grace_s,
        "fits_grace": grace_advice(total, step_s, signal_grace_s) is None,
        "advice": grace_advice(total, step_s, signal_grace_s),
    }
    atomic_write_text(Path(output_dir) / SAVE_FILE, json.dumps(record, indent=2))
    return record


def read_save(output_dir: Path | str) -> dict[str, Any] | None:
    """The last save's record of a task output dir, or None (no save yet, or unreadable)."""
    try:
        return read_json(Path(output_dir) / SAVE_FILE, RECORD_CAP)
    except (OSError, ValueError):  # none yet, or Unreadable
        return None
