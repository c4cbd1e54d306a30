"""After a walltime stop: requeue the job, or end the run non-zero with the reason recorded.

Rank 0 decides (``decide_requeue``, pure) and records the outcome in ``<task dir>/requeues.json``; the
other ranks wait for that record before they exit, so that (a) a stop that is not requeued fails every
rank and with it the step and the job (sacct FAILED, not COMPLETED), and (b) under ``srun
--kill-on-bad-exit=1`` no rank's exit kills rank 0 before it has requeued. Rank 0 in turn waits (bounded) until every rank has
reported its stop in ``<task dir>/.swiftslurm-stops/``: Slurm's signal reaches the ranks at different
moments, and rank 0's exit (non-zero) or requeue would otherwise kill a rank still saving.

A report counts only for the run that wrote it: the folder is named by the job id, Slurm's restart count and the
supervisor's in-job restart attempt, and a report older than this process (a job whose id the cluster reused, a
rank 0 that died before clearing the folder) is stale, never taken for a rank that has stopped.

Requeues are counted per job (Slurm keeps the job id, ``123`` or ``123_4``, across requeues), so a new
``submit`` of the same spec starts a new count. Records of an earlier job that had the same id (a
cluster whose job ids restarted) are told apart by SLURM_RESTART_COUNT, which only grows within a job.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..fsutil import atomic_write_text
from ..records.requeues import (
    CANNOT,
    MAX_REACHED,
    NO_PROGRESS,
    REFUSED,
    REQUEUED,
    REQUEUEING,
    no_progress_streak,
    read_requeues,
    same_job,
    walltime_requeues,
    write_requeue,
)
from ..taskdir import STOPS_DIR

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv
    from ..spec.model import JobSpec

# EX_TEMPFAIL: the run stopped early and was not requeued; resubmitting continues it.
NOT_REQUEUED_EXIT = 75
# the progress guard stopped it: attempts in a row committed nothing newer (resubmitting the same spec would loop)
NO_PROGRESS_EXIT = 79
POLL_S = 0.2
# a report's mtime comes from the node (or file server) that wrote it: this much clock skew is forgiven
STALE_SLACK_S = 120.0
STARTED = time.time()  # this process's start (the module is imported as the rank starts): older reports are stale


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    count: int  # walltime requeues of this job so far, including this one when requeue is True
    outcome: str
    message: str


def decide_requeue(done: int, max_requeues: int, executor: str = "slurm") -> RequeueDecision:
    """Pure: requeue again unless this job was already requeued ``max_requeues`` times at walltime
    (or the executor cannot requeue at all)."""
    if executor != "slurm":
        return RequeueDecision(False, done, CANNOT, f"stopped at walltime, not requeued: the {executor} executor cannot requeue; "
                               "resubmit the same spec to continue from the newest verified checkpoint")
    if done < max_requeues:
        return RequeueDecision(True, done + 1, REQUEUEING, f"walltime stop: requeue {done + 1} of at most {max_requeues}")
    return RequeueDecision(
        False, done, MAX_REACHED,
        f"stopped at walltime after {done} requeue(s): max_requeues reached (slurm.max_requeues = {max_requeues}); "
        "resubmit the same spec (or raise slurm.max_requeues) to continue from the newest verified checkpoint",
    )


def guard_decision(streak: int, limit: int, done: int, committed: int | None, save_advice: str | None) -> RequeueDecision | None:
    """The progress guard (pure): stop for good after ``limit`` attempts in a row without progress (0: never)."""
    if not limit or streak < limit:
        return None
    newest = f"newest committed step {committed}" if committed is not None else "no checkpoint committed yet"
    cause = save_advice or ("each attempt reached its walltime before a newer checkpoint committed (the start, or save_steps "
                            "steps and a save, take longer than the allocation leaves)")
    return RequeueDecision(
        False, done, NO_PROGRESS,
        f"stopped for good: no progress in {streak} attempt(s) in a row ({newest}); the last cause was a walltime stop: {cause}; "
        "fix that first (train.save_steps, slurm.signal_grace_s, slurm.time), then resubmit: it continues from the newest "
        "verified checkpoint (slurm.no_progress_attempts sets how many such attempts are allowed)")


def newest_committed_step(out_dir: str) -> int | None:
    """The step of the newest committed ``checkpoint-N`` in ``out_dir`` (names only: nothing hashed), or None."""
    from ..checkpoint import list_checkpoints
    from ..checkpoint.names import step_of

    listed = list_checkpoints(out_dir)
    return step_of(listed[0]) if listed else None


def _stops_dir(out_dir: str, dist: DistEnv) -> Path:
    from ..train.health.watchdog import ATTEMPT_ENV  # the supervisor's in-job restart attempt (absent: 0)

    return Path(out_dir, STOPS_DIR, f"{dist.requeue_id}.{dist.restart_count}.{os.environ.get(ATTEMPT_ENV) or 0}")


def _reported(report: Path) -> bool:
    """``report`` was written by this run: a regular file (``report_stopped`` writes one; a link or a folder of that
    name was put there by something else), not older than this process (less the clock slack)."""
    try:
        st = report.lstat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_mtime >= STARTED - STALE_SLACK_S


def report_stopped(out_dir: str, dist: DistEnv) -> None:
    """This rank has finished its walltime stop (its save, its command): rank 0 may now end the step."""
    where = _stops_dir(out_dir, dist)
    where.mkdir(parents=True, exist_ok=True)
    atomic_write_text(where / f"rank-{dist.rank}", time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def missing_stops(out_dir: str, dist: DistEnv) -> list[int]:
    """The ranks (other than 0) that have not reported their stop yet."""
    where = _stops_dir(out_dir, dist)
    return [r for r in range(1, dist.world_size) if not _reported(where / f"rank-{r}")]


def await_other_ranks(dist: DistEnv, out_dir: str, timeout_s: float, log) -> None:
    """Rank 0: wait up to ``timeout_s`` for every other rank to report its stop, then clear the reports."""
    deadline = time.monotonic() + timeout_s
    missing = missing_stops(out_dir, dist)
    while missing and time.monotonic() < deadline:
        time.sleep(POLL_S)
        missing = missing_stops(out_dir, dist)
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        log.warning("walltime stop: rank(s) %s did not report their stop within %d s; ending the step anyway", shown, timeout_s)
    where = _stops_dir(out_dir, dist)
    shutil.rmtree(where, ignore_errors=True)
    try:
        where.parent.rmdir()  # the last stop of this task dir: leave nothing behind
    except OSError:
        pass


def after_walltime_stop(dist: DistEnv, spec: JobSpec, out_dir: str, log, step: int | None, start_step: int | None = None) -> int:
    """Rank 0: decide, record, requeue. Returns this rank's exit code (0 requeued, NO_PROGRESS_EXIT when the progress
    guard stopped it, else NOT_REQUEUED_EXIT). ``start_step``: the newest committed step when this attempt started."""
    # half the grace: what is left of it after the save must still hold the requeue
    await_other_ranks(dist, out_dir, max(10.0, spec.slurm.signal_grace_s / 2), log)
    records = read_requeues(out_dir)
    done = walltime_requeues(records, dist.requeue_id, dist.restart_count)
    singleton = spec.slurm.continue_with == "singleton" and dist.executor == "slurm"
    chain = [dist.requeue_id]
    if singleton:  # max_requeues bounds the chain's links and requeues together
        from ..records.chains import links_before, read_chains

        chains = read_chains(out_dir)
        done += links_before(chains, dist.requeue_id)
        chain = [link for links in chains if dist.requeue_id in links for link in links[:links.index(dist.requeue_id) + 1]] or chain
    entry: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "job_id": dist.requeue_id, "restart_count": dist.restart_count,
        "global_step": step,
    }
    guard = None
    if not spec.train.command:  # the built-in trainer's checkpoints tell progress; a command's own saves are not ours
        committed = newest_committed_step(out_dir)
        entry.update(start_step=start_step, committed_step=committed)
        earlier = [r for r in records if any(same_job(r, job) for job in chain)
                   and not (same_job(r, dist.requeue_id) and int(r.get("restart_count", 0)) >= dist.restart_count)]
        guard = guard_decision(no_progress_streak([*earlier, entry]), spec.slurm.no_progress_attempts, done, committed,
                               _save_advice(out_dir))
    decision = guard or decide_requeue(done, spec.slurm.max_requeues, dist.executor)
    entry.update(requeued=decision.requeue, outcome=decision.outcome, message=decision.message)
    # written before the requeue: `scontrol requeue` signals this very process
    write_requeue(out_dir, entry)
    if not decision.requeue:
        log.error("%s", decision.message)
        return NO_PROGRESS_EXIT if decision.outcome == NO_PROGRESS else NOT_REQUEUED_EXIT
    log.warning("%s", decision.message)
    from .. import slurm
    from ..errors import SwiftSlurmError

    if singleton:
        return _continue_as_singleton(dist, spec, out_dir, log, entry)
    # `scontrol requeue` has slurmd SIGTERM every process of this job's steps, scontrol itself and this rank
    # included: deaf to it, scontrol lives to print Slurm's answer (and this rank to record it) instead of
    # dying mid-call and being taken for a refusal. The job ends us with SIGKILL after KillWait.
    previous = _ignore_term()
    try:
        slurm.requeue(dist.requeue_id)
    except SwiftSlurmError as exc:
        if slurm.job_restarts(dist.requeue_id) > dist.restart_count:  # its answer was lost, but Slurm did requeue
            entry.update(outcome=REQUEUED, message=f"{decision.message} (Slurm requeued the job although scontrol said: {exc.found or exc.what})")
            write_requeue(out_dir, entry)
            log.warning("%s", entry["message"])
            return 0
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        return _refused(out_dir, entry, log, f"requeue refused by Slurm: {exc.found or exc.what}")
    entry.update(outcome=REQUEUED)
    write_requeue(out_dir, entry)
    return 0


def _refused(out_dir: str, entry: dict[str, Any], log, why: str) -> int:
    """Record a walltime stop that was not continued (``why``); the rank then exits NOT_REQUEUED_EXIT."""
    entry.update(requeued=False, outcome=REFUSED, message=f"stopped at walltime, {why}; resubmit the same spec to "
                 "continue from the newest verified checkpoint")
    write_requeue(out_dir, entry)
    log.error("%s", entry["message"])
    return NOT_REQUEUED_EXIT


def _save_advice(out_dir: str) -> str | None:
    """What the last save's record says when it did not fit the grace (checkpoint/savetime.py), else None."""
    from ..checkpoint.savetime import read_save

    save = read_save(out_dir) or {}
    advice = save.get("advice") if save.get("fits_grace") is False else None
    return str(advice) if advice else None


def _ignore_term() -> Any:
    """Ignore SIGTERM (children started now inherit it); the previous handler, None off the main thread."""
    try:
        return signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        return None


def _continue_as_singleton(dist: DistEnv, spec: JobSpec, out_dir: str, log, entry: dict[str, Any]) -> int:
    """Rank 0, slurm.continue_with = "singleton": submit the next link of the chain (node/chain.py) instead of a requeue."""
    import os

    from ..errors import SwiftSlurmError
    from .chain import continue_job, record_entry

    name = os.environ.get("SLURM_JOB_NAME") or spec.job.name
    try:
        new_id = continue_job(dist.requeue_id, name, out_dir, os.environ, os.getcwd())
    except (SwiftSlurmError, ValueError, OSError) as exc:
        why = f"{exc.what}: {exc.found}" if isinstance(exc, SwiftSlurmError) else str(exc)
        return _refused(out_dir, entry, log, f"the singleton continuation was refused: {why}")
    entry = record_entry(entry, new_id)
    write_requeue(out_dir, entry)
    log.warning("%s", entry["message"])
    return 0


def await_walltime_decision(dist: DistEnv, out_dir: str, timeout_s: float, log) -> int:
    """Ranks other than 0: wait for rank 0's record of this stop; the exit code it implies. On a
    requeue Slurm ends this process meanwhile; without a record in ``timeout_s`` the stop counts as not
    requeued."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in read_requeues(out_dir):
            if r.get("job_id") == dist.requeue_id and r.get("restart_count") == dist.restart_count and r.get("outcome") != REQUEUEING:
                return 0 if r.get("requeued") else NO_PROGRESS_EXIT if r.get("outcome") == NO_PROGRESS else NOT_REQUEUED_EXIT
        time.sleep(POLL_S)
    log.error("walltime stop: rank 0 recorded no requeue within %d s; ending as not requeued", timeout_s)
    return NOT_REQUEUED_EXIT


def walltime_exit(dist: DistEnv, spec: JobSpec, out_dir: str, log, step: int | None, start_step: int | None = None) -> int:
    """Every rank after a walltime stop: rank 0 decides and requeues, the others wait for its word."""
    if dist.rank == 0:
        return after_walltime_stop(dist, spec, out_dir, log, step, start_step)
    report_stopped(out_dir, dist)
    return await_walltime_decision(dist, out_dir, max(30.0, float(spec.slurm.signal_grace_s)), log)
