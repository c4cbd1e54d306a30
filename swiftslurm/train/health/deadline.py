"""Deadline-aware saving: save and stop for requeue before the USR2 signal when a later save would not fit.

The walltime signal comes ``slurm.signal_grace_s`` before the job's end; a save slower than that (minus a
step) is killed at the walltime and the job ends TIMEOUT instead of requeued. Rank 0 reads the job's end time
from Slurm once per start (``slurm.commands.job_end_time``; a requeue is a new start) and keeps the measured
step time and save time (this run's last save, else ``checkpoint-save.json`` of an earlier start). After each
step ``decide`` (pure) says whether one more step and a save (after this step's own save, at a save point) would
still end before the deadline; when not, the trainer saves now (or lets this step's save be the last) and stops
for requeue, exactly as on the signal. The signal, if it comes first, is
handled as always. Every save logs ``deadline_margin_s``: the seconds between the end of that save and the
job's end time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ...checkpoint import savetime

if TYPE_CHECKING:
    from ...slurm.distenv import DistEnv
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")
RESERVE_S = 5.0  # after the save: stop the ranks, record and call `scontrol requeue`
HEADROOM = savetime.HEADROOM  # a save may take 25% longer than the last one


@dataclass(frozen=True)
class Verdict:
    stop: bool  # save at this step (if it is not a save point already) and stop for requeue
    margin_s: float | None  # seconds that would be left at the end if training went on (None: unknown)
    reason: str


def decide(now: float, end_time: float | None, step_s: float | None, save_s: float | None, saving: bool = False,
           reserve_s: float = RESERVE_S, headroom: float = HEADROOM) -> Verdict:
    """Stop for requeue after this step (pure) when, with saves of ``save_s`` (plus ``headroom``) and steps of
    ``step_s``, going on could not end with a save ``reserve_s`` before ``end_time``:

    - at a step that saves anyway (``saving``: a regular or forced save point): when after this save one more step
      and another save would not fit, this save is the last one: stop after it;
    - at any other step: when one more step and a save would not fit, save now and stop.
    A regular save point further ahead is covered step by step: the step before it finds its save would not fit."""
    if end_time is None:
        return Verdict(False, None, "no end time from Slurm")
    if save_s is None or step_s is None:
        return Verdict(False, None, "no save or step measured yet")
    save = save_s * headroom
    ahead = save if saving else 0.0  # the save this step makes anyway
    margin = end_time - now - ahead - step_s - save - reserve_s
    if margin >= 0:
        return Verdict(False, margin, f"one more step and a save leave {margin:.1f} s")
    what = "after this save, one more" if saving else "one more"
    return Verdict(True, margin, f"the job ends in {end_time - now:.0f} s: {what} step ({step_s:.1f} s) and a save "
                   f"({save_s:.1f} s, +{(headroom - 1) * 100:.0f}%) would not fit")


class DeadlineWatch:
    """Rank 0's view of the deadline; ``due()`` is polled with the walltime flag after each step (every rank: the
    others have no end time and answer False; the trainer's all-reduce spreads rank 0's answer)."""

    def __init__(self, end_time: float | None, last_step_s: Callable[[], float | None], save_s: float | None,
                 clock: Callable[[], float] = time.time, reserve_s: float = RESERVE_S):
        self.reserve_s = reserve_s  # after the last save: the requeue, and the trackers' close at a walltime stop
        self.end_time = end_time
        self.last_step_s = last_step_s
        self.save_s = save_s
        self.clock = clock
        self.steps: deque[float] = deque(maxlen=5)
        self.fired = False

    def saved(self, seconds: float) -> None:
        self.save_s = seconds

    def margin_s(self) -> float | None:
        """Seconds from now to the job's end (after a save: that save's margin)."""
        return None if self.end_time is None else round(self.end_time - self.clock(), 3)

    def due(self, saving: bool = False) -> bool:
        """After a step (``saving``: it is a save point anyway): True when the trainer should save and stop now."""
        if self.end_time is None or self.fired:
            return False
        step = self.last_step_s()
        if step is not None:
            self.steps.append(step)
        verdict = decide(self.clock(), self.end_time, max(self.steps) if self.steps else None, self.save_s, saving,
                         reserve_s=self.reserve_s)
        if verdict.stop:
            self.fired = True
            log.warning("deadline: %s; %s, before the walltime signal, then stopping for requeue", verdict.reason,
                        "this save is the last" if saving else "saving now")
        return verdict.stop


def watch_for(spec: JobSpec, dist: DistEnv, output_dir: str, last_step_s: Callable[[], float | None]) -> DeadlineWatch:
    """The watch of this start: rank 0 of a Slurm job with ``checkpoint.deadline_save`` reads the end time once."""
    end_time = None
    if spec.checkpoint.deadline_save and dist.rank == 0 and dist.executor == "slurm":
        from ...errors import SwiftSlurmError
        from ...slurm import commands

        try:
            end_time = commands.job_end_time(dist.requeue_id or dist.job_id)
        except SwiftSlurmError as exc:  # squeue missing or slow: the signal still works
            log.warning("deadline: cannot read the job's end time (%s); saving on the walltime signal only", exc)
        if end_time is not None:
            log.warning("deadline: the job ends at %s (in %.0f s); a save is made before the signal when the next one "
                        "would not fit", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end_time)), end_time - time.time())
    record = savetime.read_save(output_dir) or {}
    from ..tracking.identity import PAUSE_CLOSE_S, wanted

    reserve = RESERVE_S + (PAUSE_CLOSE_S if wanted(spec) else 0.0)  # W&B / MLflow are closed before the requeue
    return DeadlineWatch(end_time, last_step_s, record.get("save_s"), reserve_s=reserve)
