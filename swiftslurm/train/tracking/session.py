"""``open_trackers``: rank 0 opens the task's tracker runs before the Trainer starts; the callback sends each step.

Called by the trainer once the start point is agreed (a resume from the task's own checkpoint continues the run).
Rank 0 exports the defaults (``identity.env_defaults``), reads the run-id file, opens each tracker (continued or
new), keeps the ids, and tells every rank whether it could (one broadcast): a tracker that cannot start stops every
rank with the same message instead of leaving the others waiting in the first collective. Closing is on the
trainer's ExitStack: finished, paused (a walltime stop: it continues on the next start) or failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ...errors import SwiftSlurmError
from ...taskdir import WANDB_RUNS_DIR
from . import identity as idt
from . import runfile
from .identity import PAUSE_CLOSE_S, TrackerUnavailable
from .sinks import FAILED, FINISHED, PAUSED, MlflowSink, WandbSink, new_wandb_id, parent_run

if TYPE_CHECKING:
    from ...slurm.distenv import DistEnv
    from ...spec.model import JobSpec
    from .sinks import _Sink

log = logging.getLogger("swiftslurm.train")
CLOSE_TIMEOUT_S = 30.0  # an online tracker flushing at a walltime stop must not eat the signal's grace


class TrackerCallback(TrainerCallback):
    """Sends every Trainer log call (rank 0) at its global step to each open tracker, steps after ``sent_through`` only."""

    def __init__(self, sinks: list[_Sink], sent_through: int) -> None:
        self.sinks = sinks
        self.sent_through = sent_through  # the last step a continued run already has; -1 for a new run
        self.finished = False

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or state.global_step <= self.sent_through:
            return
        values = idt.scalars(logs)
        if values:
            for sink in self.sinks:
                sink.log(state.global_step, values)

    def on_train_end(self, args, state, control, **kwargs):
        self.finished = state.max_steps > 0 and state.global_step >= state.max_steps


def open_trackers(spec: JobSpec, dist: DistEnv, task_dir: str, resumed_own_checkpoint: bool,
                  stack: contextlib.ExitStack) -> list[TrackerCallback]:
    """The tracker callback (rank 0, with trackers in report_to; else none). Every rank calls it: rank 0's verdict
    is broadcast, and a tracker that could not start raises the same TrackerUnavailable on every rank."""
    trackers = idt.wanted(spec)
    if not trackers:
        return []
    callback, error = None, None
    if dist.rank == 0:
        try:
            callback = _open_on_rank_0(spec, dist, task_dir, trackers, resumed_own_checkpoint, stack)
        except SwiftSlurmError as exc:
            error = [exc.exit_code, exc.what, exc.found, exc.hint]
        except Exception as exc:  # noqa: BLE001 -- the run-id file, the sweep lock: rank 0 alone must not leave
            error = [TrackerUnavailable.exit_code, "cannot open the tracker runs on rank 0", f"{type(exc).__name__}: {str(exc)[:300]}",
                     f"check that {task_dir} is writable on the node of rank 0"]
    from ..resume import agree

    error = agree.exchange().broadcast(error)
    if error:
        from ..health.shutdown import shut_down_distributed

        shut_down_distributed()  # every rank raises here: they leave together (health/shutdown.py says why)
        code, what, found, hint = error
        refused = TrackerUnavailable(what, found, hint)
        refused.exit_code = code  # the same message and exit code on every rank
        raise refused
    return [callback] if callback is not None else []


def _open_on_rank_0(spec: JobSpec, dist: DistEnv, task_dir: str, trackers: tuple[str, ...], resumed_own: bool,
                    stack: contextlib.ExitStack) -> TrackerCallback:
    idt.check_installed(spec)  # the node checked before training (node/runtime.py); a direct caller of train() too
    task = runfile.sweep_task(task_dir)
    os.environ.update(idt.env_defaults(spec, task_dir, task, os.environ))  # the one export step of the trackers' defaults
    ident = idt.identity(spec, task, os.environ)
    config = idt.config(spec, dist.world_size, ident.task)
    kept = runfile.read_ids(runfile.task_file(task_dir))
    carry_on = idt.continues(kept, resumed_own, dist.requeue_id or dist.job_id)
    ids = {**(kept if carry_on and kept else {}), "job_id": dist.requeue_id or dist.job_id}
    sent_through = runfile.logged_through(task_dir) if carry_on else -1
    sinks: list[_Sink] = []
    callback = TrackerCallback(sinks, sent_through)
    stack.push(lambda kind, exc, tb: _close(sinks, callback, exc is not None))  # each sink opened below is closed
    for tracker in trackers:
        if tracker == "wandb":
            ids["wandb"] = ids.get("wandb") or new_wandb_id()
            sinks.append(WandbSink.open(ids["wandb"], ident, config, task_dir))
        else:
            sink = MlflowSink.open(ids.get("mlflow"), ident, config, os.environ["MLFLOW_TRACKING_URI"],
                                   lambda client, experiment: _sweep_parent(idt.job_dir(task_dir, task), client, experiment, ident))
            ids["mlflow"] = sink.run_id
            sinks.append(sink)
        runfile.write_ids(runfile.task_file(task_dir), ids)  # kept as soon as it exists: a later failure keeps it
    how = f"continued after step {sent_through}" if carry_on else "new"
    log.warning("trackers: %s (%s%s)", ", ".join(f"{t} run {ids[t]}" for t in trackers), how, _where(trackers, task_dir))
    return callback


def _sweep_parent(job_dir: Path, client: Any, experiment: str, ident: idt.RunIdentity) -> str | None:
    """The sweep's MLflow parent run id, read or created under the sweep lock (the array's tasks start together)."""
    assert ident.group is not None  # only asked for in a sweep
    with runfile.sweep_lock(job_dir):
        kept = runfile.read_ids(runfile.sweep_file(job_dir)) or {}
        parent = parent_run(client, experiment, ident.group, kept.get("mlflow"))
        if parent != kept.get("mlflow"):
            runfile.write_ids(runfile.sweep_file(job_dir), {"mlflow": parent})
    return parent


def _where(trackers: tuple[str, ...], task_dir: str) -> str:
    said = []
    if "wandb" in trackers and os.environ.get("WANDB_MODE") == "offline":
        said.append(f"W&B offline: `wandb sync {Path(task_dir) / WANDB_RUNS_DIR}/offline-run-*` afterwards")
    if "mlflow" in trackers:
        said.append(f"MLflow: {os.environ.get('MLFLOW_TRACKING_URI')}")
    return "; " + "; ".join(said) if said else ""


def _close(sinks: list[_Sink], callback: TrackerCallback | None, failed: bool) -> None:
    """Every open tracker ended as finished, paused or failed, all of them at once within one budget: CLOSE_TIMEOUT_S,
    or PAUSE_CLOSE_S at a walltime stop (the deadline keeps that much for it: the requeue must beat the time limit)."""
    how = FAILED if failed else FINISHED if callback is not None and callback.finished else PAUSED
    deadline = time.monotonic() + (PAUSE_CLOSE_S if how == PAUSED else CLOSE_TIMEOUT_S)
    closing: list[tuple[_Sink, threading.Event]] = []
    for sink in sinks:
        done = threading.Event()

        def close(sink: _Sink = sink, done: threading.Event = done) -> None:
            try:
                sink.close(how)
            except Exception as exc:  # noqa: BLE001 -- closing is best effort: the data is already logged
                log.warning("trackers: closing the %s run failed (%s: %s)", sink.name, type(exc).__name__, str(exc)[:200])
            finally:
                done.set()

        threading.Thread(target=close, name=f"close-{sink.name}", daemon=True).start()
        closing.append((sink, done))
    for sink, done in closing:
        if not done.wait(max(0.0, deadline - time.monotonic())):
            log.warning("trackers: the %s run did not close in time; leaving it (its steps are logged)", sink.name)
