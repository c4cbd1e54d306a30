"""The on-node entry point: what every rank runs (`swiftslurm run`, and the submitit callable).

Requeue = rerun: every step is idempotent. Read the task from the plan, derive the rank's
distributed environment, check the allocation, install the USR2 flag handler, log, preflight, then
either run the spec's ``train.command`` as a child with the derived env, or train in-process from
the newest verified checkpoint. After a walltime stop rank 0 requeues the job; every rank exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import banner, ownership, signals
from ..slurm import distenv
from ..errors import PreflightFailed, RuntimeEnvError
from ..fsutil import atomic_write_text

REQUEUES_FILE = "requeues.json"
POLL_S = 0.2


# ---------------------------------------------------------------- entry points


def run_from_cli(plan_file: Path | None, task: int | None) -> int:
    """`swiftslurm run [--plan P] [--task N]`; defaults $SWIFTSLURM_PLAN, $SWIFTSLURM_TASK, $SLURM_ARRAY_TASK_ID, 0."""
    plan_path = str(plan_file) if plan_file is not None else os.environ.get("SWIFTSLURM_PLAN", "")
    if not plan_path:
        raise RuntimeEnvError(
            "no plan to run",
            "neither --plan nor $SWIFTSLURM_PLAN is set",
            "`swiftslurm run --plan OUTPUT_DIR/swiftslurm-plan.json` (submit and render set this for you)",
        )
    if task is None:
        raw = os.environ.get("SWIFTSLURM_TASK") or os.environ.get("SLURM_ARRAY_TASK_ID") or "0"
        if not (raw.isascii() and raw.isdigit()):
            raise RuntimeEnvError("the task index is not a number", repr(raw), "pass --task N")
        task = int(raw)
    return run_task(plan_path, task)


def run_task(plan_path: str, task_index: int, mode: str = "train") -> int:
    """Run one rank of one task of a plan. Returns the exit code (0 after a walltime requeue)."""
    if mode not in ("train", "preflight"):
        raise RuntimeEnvError(f"unknown run mode {mode!r}", mode, "use 'train' or 'preflight'")
    data, task, ds_config = _read_task(plan_path, task_index)
    spec = task.spec
    distenv.check_spec_env(spec.env)
    # MASTER_ADDR/MASTER_PORT: the spec's [env] is the one explicit choice; inherited ones are ignored
    dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
    distenv.check_allocation(dist, spec)
    ownership.claim(task.output_dir, dist.rank, dist.requeue_id or dist.job_id, dist.node)  # one live job per dir
    signals.install(forward_term=bool(spec.train.command))
    out_dir = task.output_dir
    Path(out_dir, "logs").mkdir(parents=True, exist_ok=True)
    log = banner.setup_logging(dist, out_dir)
    banner.enable_stack_dumps(dist, out_dir)
    log.info("%s", dist.summary())

    resume = None if spec.train.command else _resume_point(out_dir, log)
    shown = "- (train.command runs your own script)" if spec.train.command else (resume or "none (fresh start)")
    banner.print_banner(dist, spec, out_dir, mode, shown)

    if spec.preflight.checks or mode == "preflight":
        if not _preflight(dist, spec, out_dir, mode, log):
            return PreflightFailed.exit_code
        if mode == "preflight":
            return 0

    if dist.rank == 0:
        check_master_port(dist, log)
    the_env = distenv.child_env(os.environ, dist, spec.env, log_dir=str(Path(out_dir, "logs")))
    if spec.train.command:
        # Slurm signals every process of a job step (proctrack), the child included: forwarding as
        # well would deliver twice, and a second USR2 can kill a child already past its handlers.
        # submitit's local executor signals only the ranks it started: there we forward.
        forward = dist.executor != "slurm"
        code = run_command(spec.train.command, the_env, cwd=data.get("base_dir") or None, dist=dist, out_dir=out_dir, log=log, forward=forward)
        if signals.stop_requested() and dist.rank == 0:
            after_walltime_stop(dist, spec, out_dir, log, step=None)
            return 0
        return code
    return _train(dist, spec, ds_config, out_dir, resume, the_env, log)


# ---------------------------------------------------------------- steps


def _read_task(plan_path: str, index: int):
    from ..plan import read_plan_task

    try:
        data, task, ds_config = read_plan_task(plan_path, index)
    except FileNotFoundError:
        raise RuntimeEnvError("the plan file does not exist", plan_path, "every node must see job.output_dir (a shared filesystem)") from None
    except IndexError:
        raise RuntimeEnvError(f"the plan has no task {index}", plan_path, "the array task id must be below the number of sweep combinations") from None
    except (ValueError, KeyError) as exc:
        raise RuntimeEnvError("the plan file is not a swiftslurm plan", f"{plan_path}: {exc}", "re-create it with `swiftslurm submit`") from None
    return data, task, ds_config


def _resume_point(out_dir: str, log) -> str | None:
    try:
        from ..checkpoint import newest_verified
    except ImportError:
        log.info("checkpoint module not installed: starting fresh")
        return None
    found = newest_verified(out_dir, log=log.warning)
    return str(found) if found else None


def _preflight(dist, spec, out_dir: str, mode: str, log) -> bool:
    try:
        from ..preflight import gate
    except ImportError:
        log.info("preflight module not installed: skipping preflight checks")
        return True
    return bool(gate(dist, spec, out_dir, mode))


def check_master_port(dist, log) -> None:
    """Rank 0, right before the rendezvous it hosts: a busy MASTER_PORT is a RuntimeEnvError with the fix
    (the other ranks would otherwise wait out the rendezvous timeout); one in the ephemeral range a warning."""
    try:
        from ..preflight import ports
    except ImportError:
        return
    result = ports.check_master_port(dist.node, dist.master_port, ports.ephemeral_range())
    if not result.ok:
        raise RuntimeEnvError("MASTER_PORT is busy on the master node", result.observed, result.hint)
    if result.hint:
        log.warning("%s. HINT: %s", result.observed, result.hint)


def run_command(argv: list[str], env: dict[str, str], cwd: str | None, dist, out_dir: str, log, forward: bool = True) -> int:
    """The user's command as a child of this rank; its exit code (128+sig if killed). With ``forward``,
    USR2/TERM this process receives are passed on to the child (else only recorded).

    Rank 0's child writes to this process's stdout/stderr; other ranks' to logs/rank-<r>.log.
    """
    log_file = None
    if dist.rank != 0:
        log_file = open(banner.rank_log_path(out_dir, dist.rank), "ab")
    try:
        try:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
        except OSError as exc:
            raise RuntimeEnvError(f"cannot start train.command ({exc.strerror})", " ".join(argv), "check the program name and that it is on PATH on every node") from None
        log.info("started train.command pid %d: %s", proc.pid, " ".join(argv))
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            for signum in signals.take_received():
                name = signal.Signals(signum).name
                if forward:
                    log.info("forwarding %s to the command", name)
                    proc.send_signal(signum)
                else:
                    log.info("%s received (Slurm delivers it to the command too)", name)
    finally:
        if log_file:
            log_file.close()
    log.info("train.command exited with %d", code)
    return 128 - code if code < 0 else code


def _train(dist, spec, ds_config, out_dir: str, resume: str | None, the_env: dict[str, str], log) -> int:
    try:
        from ..train import sft
    except ImportError as exc:
        raise RuntimeEnvError("the trainer is not installed", str(exc), "reinstall swiftslurm, or set train.command to run your own script") from None
    os.environ.clear()
    os.environ.update(the_env)  # the one export step, for the in-process trainer
    # Slurm sends the walltime USR2 to every process of the step, children included: a `ninja` building a
    # DeepSpeed op at that moment died of it and failed the job. Block USR2 while training (children inherit
    # the mask, so they are immune) and read it from the pending set at each step boundary instead.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

    def should_stop() -> bool:
        return signals.stop_requested() or signal.SIGUSR2 in signal.sigpending()

    result = sft.train(spec, dist, ds_config, out_dir, resume, should_stop)
    # Training is over: a walltime USR2 arriving now (e.g. during interpreter teardown, when CPython has
    # already restored the default handler, which kills) must not fail the job. SIG_IGN survives teardown.
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    except ValueError:  # not the main thread: no handler was installed either
        pass
    if getattr(result, "stopped_for_requeue", False):
        if dist.rank == 0:
            after_walltime_stop(dist, spec, out_dir, log, step=getattr(result, "global_step", None))
        return 0
    log.info("training finished at step %s", getattr(result, "global_step", "?"))
    return 0


# ---------------------------------------------------------------- walltime requeue


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    count: int  # requeues so far, including this one when requeue is True
    message: str


def decide_requeue(recorded: int, restart_count: int, max_requeues: int) -> RequeueDecision:
    """Pure: requeue again unless this job was already requeued ``max_requeues`` times.

    ``recorded`` counts entries in requeues.json, ``restart_count`` is SLURM_RESTART_COUNT; the larger wins
    (the file survives a lost restart count; the count survives a lost file).
    """
    done = max(recorded, restart_count)
    if done < max_requeues:
        return RequeueDecision(True, done + 1, f"walltime stop: requeue {done + 1} of at most {max_requeues}")
    return RequeueDecision(
        False,
        done,
        f"walltime stop: not requeued, the job was requeued {done} time(s) (slurm.max_requeues = {max_requeues}); "
        "resubmit the same spec to continue from the newest verified checkpoint",
    )


def read_requeues(out_dir: str) -> list[dict[str, Any]]:
    path = Path(out_dir, REQUEUES_FILE)
    try:
        records = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return []
    return records if isinstance(records, list) else []


def after_walltime_stop(dist, spec, out_dir: str, log, step: int | None) -> RequeueDecision:
    """Rank 0: record the stop in requeues.json and requeue the job (or say why not)."""
    records = read_requeues(out_dir)
    decision = decide_requeue(len(records), dist.restart_count, spec.slurm.max_requeues)
    records.append(
        {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "job_id": dist.requeue_id,
            "restart_count": dist.restart_count,
            "global_step": step,
            "requeued": decision.requeue and dist.executor == "slurm",
            "message": decision.message,
        }
    )
    atomic_write_text(Path(out_dir, REQUEUES_FILE), json.dumps(records, indent=2))
    log.warning("%s", decision.message)
    if decision.requeue and dist.executor == "slurm":
        from .. import slurm
        from ..errors import SwiftSlurmError

        try:
            slurm.requeue(dist.requeue_id)
        except SwiftSlurmError as exc:  # the batch script may have requeued it already
            log.warning("scontrol requeue %s failed: %s", dist.requeue_id, exc.message())
    elif decision.requeue:
        log.warning("the local executor cannot requeue; rerun `swiftslurm submit` to resume")
    return decision
