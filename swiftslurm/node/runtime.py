"""The on-node entry point: what every rank runs (`swiftslurm run`, and the submitit callable).

Requeue = rerun: every step is idempotent. Read the task from the plan, derive the rank's
distributed environment, check the allocation, install the USR2 flag handler, log, preflight, then
either run the spec's ``train.command`` as a child with the derived env, or train in-process from
the newest verified checkpoint. After a walltime stop rank 0 requeues the job (node/requeue.py); a
stop that is not requeued ends every rank with NOT_REQUEUED_EXIT and the reason in requeues.json.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PreflightFailed, RuntimeEnvError, SwiftSlurmError
from ..fsutil import open_append
from ..records import failures as failure
from ..slurm import distenv
from ..taskdir import attempt_header
from . import banner, ownership, restart, signals
from .requeue import newest_committed_step, walltime_exit

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv
    from ..spec.model import JobSpec

POLL_S = 0.2
STOP_GRACE_S = 10.0  # a command asked to stop (TERM) gets this long before KILL
TRAINER_PACKAGES = ("torch", "transformers", "deepspeed")  # third-party, of the optional [train] extra


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
    """Run one rank of one task of a plan. Returns the exit code (0 after a walltime requeue,
    NOT_REQUEUED_EXIT after a walltime stop that was not requeued)."""
    return run_task_outcome(plan_path, task_index, mode)[0]


def run_task_outcome(plan_path: str, task_index: int, mode: str = "train") -> tuple[int, failure.Failure | None]:
    """``run_task``, and why this rank failed when it knows: the record it wrote (records/failures.py) for a failed
    preflight (rank 0) or an exception (which is raised on, after the record)."""
    if mode not in ("train", "preflight"):
        raise RuntimeEnvError(f"unknown run mode {mode!r}", mode, "use 'train' or 'preflight'")
    data, task, ds_config = _read_task(plan_path, task_index)
    shrunk = restart.step_spec(task.spec, os.environ)  # a shrunk in-job restart: fewer nodes, a smaller global batch
    if shrunk is not task.spec:
        task, ds_config = dataclasses.replace(task, spec=shrunk), restart.step_ds_config(ds_config, shrunk)
    spec = task.spec
    if mode == "train" and not spec.has_training:
        raise RuntimeEnvError("the plan's spec has no [train] table: nothing to train", plan_path,
                              "add [train] to the spec and submit again; `swiftslurm preflight SPEC` runs a spec without it")
    distenv.check_spec_env(spec.env)
    # MASTER_ADDR/MASTER_PORT: the spec's [env] is the one explicit choice; inherited ones are ignored
    dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
    distenv.check_allocation(dist, spec)
    ownership.claim(task.output_dir, dist.rank, dist.requeue_id or dist.job_id, dist.node)  # one live job per dir
    failure.clear_failure(task.output_dir, dist.rank)  # an earlier run's reason is not this run's
    try:
        return _run_claimed(data, task, ds_config, dist, mode)
    except Exception as exc:
        why = failure.from_exception(exc, dist.rank, dist.node, dist.job_id)
        failure.write_failure(task.output_dir, why)
        if isinstance(exc, SwiftSlurmError) and _ends_with_its_code(exc):
            return exc.exit_code, why
        raise


def _ends_with_its_code(exc: SwiftSlurmError) -> bool:
    """A failure every rank agreed on whose exit code says what happened (a GRPO reward function raised: 70): the
    rank exits with that code, as after a failed preflight, instead of a traceback."""
    from ..train.tasks.rewards import RewardFailed

    return isinstance(exc, RewardFailed)


def _run_claimed(data, task, ds_config, dist: DistEnv, mode: str) -> tuple[int, failure.Failure | None]:
    """Everything after this rank holds the task dir: log, banner, preflight, then train or the command."""
    spec = task.spec
    signals.install(forward_term=bool(spec.train.command))
    out_dir = task.output_dir
    start_step = newest_committed_step(out_dir)  # the progress guard: did this attempt commit anything newer?
    Path(out_dir, "logs").mkdir(parents=True, exist_ok=True)
    log = banner.setup_logging(dist, out_dir)
    banner.enable_stack_dumps(dist, out_dir)
    from ..train.health.watchdog import ATTEMPT_ENV

    restarts = os.environ.get(ATTEMPT_ENV, "0")
    log.info("%s", attempt_header(dist.job_id, dist.restart_count, int(restarts) if restarts.isdigit() else 0, ",".join(dist.nodes)))
    log.info("%s", dist.summary())

    resume = None if spec.train.command else _resume_point(out_dir) or (
        f"train.resume_from = {spec.train.resume_from}{' (weights only)' if spec.train.resume_weights_only else ''}, "
        "verified by rank 0 at train start" if spec.train.resume_from else None)
    shown = "- (train.command runs your own script)" if spec.train.command else (resume or "none (fresh start)")
    banner.print_banner(dist, spec, out_dir, mode, shown, task.decisions)

    if spec.preflight.checks or mode == "preflight":
        if not _preflight(dist, spec, out_dir, mode, log, ds_config):
            return PreflightFailed.exit_code, _preflight_failed(dist, out_dir, log)
        if mode == "preflight":
            return 0, None

    if dist.rank == 0 and dist.executor != "torchrun":  # torchrun's agent store already listens on MASTER_PORT
        check_master_port(dist, log)
    the_env = distenv.child_env(os.environ, dist, spec.env, log_dir=str(Path(out_dir, "logs")), pg_timeout_s=spec.train.ddp_timeout)
    if spec.train.command:
        # Slurm signals every process of a job step (proctrack), the child included: forwarding as
        # well would deliver twice, and a second USR2 can kill a child already past its handlers.
        # submitit's local executor signals only the ranks it started: there we forward.
        forward = dist.executor != "slurm"
        if signals.stop_requested():  # the walltime signal came while this rank started: nothing ran, nothing to save
            log.warning("walltime signal received before train.command started: not starting it")
            return walltime_exit(dist, spec, out_dir, log, step=None, start_step=start_step), None
        code = run_command(spec.train.command, the_env, cwd=command_cwd(spec, data.get("base_dir")), dist=dist, out_dir=out_dir, log=log, forward=forward)
        if signals.stop_requested():
            return walltime_exit(dist, spec, out_dir, log, step=None, start_step=start_step), None
        return code, None  # the command's own last words in the log say why, better than a record could
    return _train(dist, spec, ds_config, out_dir, True, the_env, log, start_step), None


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


def _resume_point(out_dir: str) -> str | None:
    """What the banner shows as the resume point. Not the decision: that is one for all ranks, made once the
    trainer's process group exists (rank 0 verifies, every rank checks it can read it: train.resume)."""
    from ..checkpoint import list_checkpoints

    listed = list_checkpoints(out_dir)
    return f"the newest verified, chosen by rank 0 at train start (newest here: {listed[0]})" if listed else None


def _preflight(dist: DistEnv, spec: JobSpec, out_dir: str, mode: str, log, ds_config=None) -> bool:
    from ..preflight import gate  # our own module: a broken import fails the rank, it never skips the checks

    return bool(gate(dist, spec, out_dir, mode, ds_config))


def _preflight_failed(dist: DistEnv, out_dir: str, log) -> failure.Failure | None:
    """After a preflight that stops training: rank 0 records why (the report it just wrote: the first failed
    check and its fix) and says it as its last log line; the other ranks say whose decision it was."""
    if dist.rank != 0:
        log.warning("not training: rank 0's preflight decided so (its report: preflight/report.json)")
        return None
    from ..fsutil import Unreadable, read_json
    from ..preflight.report import REPORT_DIR, REPORT_JSON, failure_of

    try:
        report = read_json(Path(out_dir, REPORT_DIR, REPORT_JSON))
    except (OSError, Unreadable):
        report = {}
    found = failure_of(report) if report.get("job_id") == dist.job_id else None
    what, hint = found or ("preflight: no decision was reached (the lines above say why)", "")
    why = failure.Failure(dist.rank, dist.node, dist.job_id, time.time(), "preflight", what, hint)
    failure.write_failure(out_dir, why)
    log.error("not training: %s", why.line())
    return why


def check_master_port(dist: DistEnv, log) -> None:
    """Rank 0, right before the rendezvous it hosts: a busy MASTER_PORT is a RuntimeEnvError with the fix
    (the other ranks would otherwise wait out the rendezvous timeout); one in the ephemeral range a warning."""
    from ..preflight.checks import ports

    result = ports.check_master_port(dist.node, dist.master_port, ports.ephemeral_range())
    if not result.ok:
        raise RuntimeEnvError("MASTER_PORT is busy on the master node", result.observed, result.hint)
    if result.hint:
        log.warning("%s. HINT: %s", result.observed, result.hint)


def command_cwd(spec: JobSpec, base_dir: str | None) -> str | None:
    """Where ``train.command`` runs: ``container.workdir`` inside a container that names one (the host's
    submit dir may not be mounted there, or be only an empty mount-point parent), else the submit dir."""
    c = spec.container
    if c is not None and c.workdir:
        return c.workdir
    return base_dir or None


def run_command(argv: list[str], env: dict[str, str], cwd: str | None, dist: DistEnv, out_dir: str, log, forward: bool = True) -> int:
    """The user's command as a child of this rank; its exit code (128+sig if killed). With ``forward``,
    USR2/TERM this process receives are passed on to the child (else only recorded).

    Rank 0's child writes to this process's stdout/stderr; other ranks' to logs/rank-<r>.log.
    """
    log_file = None
    if dist.rank != 0:
        log_file = open_append(banner.rank_log_path(out_dir, dist.rank))
    proc = None
    try:
        try:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT if log_file else None)
        except OSError as exc:
            raise RuntimeEnvError(f"cannot start train.command ({exc.strerror})", " ".join(argv),
                                  "check the program name and that it is on PATH on every node") from None
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
    except BaseException:  # Ctrl-C, a failed wait, ...: never leave the command running without its rank
        if proc is not None and proc.poll() is None:
            log.warning("stopping train.command pid %d: this rank is exiting", proc.pid)
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    finally:
        if log_file:
            log_file.close()
    log.info("train.command exited with %d", code)
    return 128 - code if code < 0 else code


def _train(dist: DistEnv, spec: JobSpec, ds_config, out_dir: str, resume: str | bool | None, the_env: dict[str, str], log,
           start_step: int | None = None) -> int:
    """Train in this process, its start (imports, op builds, model load, DeepSpeed's start) under the start-up watch."""
    from ..train.health import startup

    def stuck(what: str) -> None:
        why = failure.Failure(dist.rank, dist.node, dist.job_id, time.time(), "startup", what, startup_hint(what))
        failure.write_failure(out_dir, why)
        log.error("not training: %s", why.line())

    with startup.watching(startup.limit_s(spec.train.ddp_timeout), stuck):
        startup.mark("importing the training stack")
        return _train_watched(dist, spec, ds_config, out_dir, resume, the_env, log, start_step)


def startup_hint(what: str) -> str:
    """The fix for a start-up stuck as ``what`` says (pure)."""
    if "torch's build lock" in what:
        return "delete that lock file if no build of the op is running (torch waits on it forever)"
    if "op build lock" in what:
        return "the rank named holds the build: look at its job (a build takes minutes, not hours)"
    return ("the stacks above, in this rank's log, show where it waits; raise train.ddp_timeout if the start is "
            "only slow (a large model from a slow filesystem)")


def _train_watched(dist: DistEnv, spec: JobSpec, ds_config, out_dir: str, resume: str | bool | None, the_env: dict[str, str], log,
                   start_step: int | None) -> int:
    from ..train import run  # our own: a broken import fails the rank with its traceback
    from ..train.health import startup
    from ..train.kernels import opbuild

    # the [train] extra is optional: say which of its packages is missing instead of a traceback mid-training
    missing = [name for name in TRAINER_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeEnvError("the built-in trainer needs packages that are not installed", ", ".join(missing),
                              "pip install 'swiftslurm[train]' on every node, or set train.command to run your own script")
    from ..train.tracking.identity import check_installed

    check_installed(spec)  # report_to = wandb / mlflow: their libraries, on every rank before anything loads
    ops_dir, ours = opbuild.cache_dir(the_env, dist.node)
    the_env = {**the_env, opbuild.EXTENSIONS_ENV: ops_dir}
    os.environ.clear()
    os.environ.update(the_env)  # the one export step, for the in-process trainer
    # Slurm sends the walltime USR2 to every process of the step, children included: a `ninja` building a
    # DeepSpeed op at that moment died of it and failed the job. Block USR2 while training (children inherit
    # the mask, so they are immune) and read it from the pending set at each step boundary instead.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

    def should_stop() -> bool:
        return signals.stop_requested() or signal.SIGUSR2 in signal.sigpending()

    from ..train.build import prepare_device_env

    cuda = prepare_device_env()  # DS_ACCELERATOR before DeepSpeed is imported
    opbuild.ensure_built(opbuild.needed_ops(ds_config, cuda), ops_dir, ours, dist.node, startup.mark)
    result = run.train(spec, dist, ds_config, out_dir, resume, should_stop)
    # Training is over: a walltime USR2 arriving now (e.g. during interpreter teardown, when CPython has
    # already restored the default handler, which kills) must not fail the job. SIG_IGN survives teardown.
    try:
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    except ValueError:  # not the main thread: no handler was installed either
        pass
    if getattr(result, "stopped_for_requeue", False):
        return walltime_exit(dist, spec, out_dir, log, step=getattr(result, "global_step", None), start_step=start_step)
    log.info("training finished at step %s", getattr(result, "global_step", "?"))
    return 0
