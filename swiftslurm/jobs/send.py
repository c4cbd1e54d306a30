"""Send a plan: submitit submissions (a Slurm job, one sbatch array per allocation group, or local processes).

``submit_plan(plan)`` only sends what ``make_plan`` built: it refuses an output dir that an active
job owns, writes the plan and each task's resolved spec, submits each group of ``plan.groups``
through submitit (one sbatch call each), and records the submission in
``plan.output_dir/submission.json`` (every array's job id and the global tasks it covers) so
``status``/``cancel`` work from the output dir alone (the record and the tasks' state: ``record``).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from .. import slurm
from ..errors import SubmissionError, SwiftSlurmError, ToolMissing
from ..fsutil import atomic_write_text
from ..node.entry import TaskFailed, run_rank  # noqa: F401 -- TaskFailed re-exported
from ..plan import ArrayLimits, ArrayPart, Group, Plan, write_plan
from ..quoting import sbatch_escape, shell_quote
from ..taskdir import SUBMIT_LOCK_FILE, TASK_SPEC_FILE

# the record of what was sent, and its tasks' state (re-exported: callers import them from here too)
from . import index
from .record import SUBMISSION_FILE, Submission, TaskStatus, load_records, load_submission, process_start, records_path, update_record  # noqa: F401

EXECUTORS = ("auto", "slurm", "local")


def resolve_executor(executor: str) -> str:
    """``auto`` -> ``slurm`` when sbatch is on PATH, else ``local``; ``slurm`` without sbatch is refused."""
    if executor not in EXECUTORS:
        raise SubmissionError(f"unknown executor {executor!r}", executor, "use --executor auto, slurm or local")
    if executor == "auto":
        return "slurm" if slurm.have_slurm() else "local"
    if executor == "slurm" and not slurm.have_slurm():
        raise ToolMissing("--executor slurm needs 'sbatch' on PATH", "no sbatch", "run on a Slurm login node, or use --executor local")
    return executor


# ---------------------------------------------------------------- sending


def _write_task_specs(plan: Plan) -> None:
    """Each task's resolved spec in its own dir (indented for people; compact for big sweeps)."""
    indent = 2 if len(plan.tasks) <= 64 else None
    for task in plan.tasks:
        out = Path(task.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / TASK_SPEC_FILE, json.dumps(task.to_json(), indent=indent) + "\n")  # a link there: replaced


def slurm_parameters(plan: Plan, group: Group | None = None, tasks: tuple[int, ...] | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters carrying exactly ``render.sbatch_directives(plan, group)``.

    ``tasks``: the global tasks of the array sent (a part of a split group; default the group's)."""
    from ..slurm.launch import launch_for, setup_lines, supervisor_setup
    from ..slurm.render import one_group, sbatch_directives

    group = one_group(plan, group)
    s = group.slurm
    native = {"job-name": "job_name", "partition": "partition", "qos": "qos", "constraint": "constraint", "exclude": "exclude", "account": "account",
              "nodelist": "nodelist"}
    counts = {"nodes": "nodes", "ntasks-per-node": "ntasks_per_node", "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node"}
    params: dict[str, Any] = {
        "time": max(1, math.ceil(s.time_limit_s / 60)),  # submitit's own timeout bookkeeping (minutes)
        "signal_delay_s": s.signal_grace_s,  # submitit writes --signal=USR2@N (every rank gets it, not B:)
        # [env] exports, then slurm.setup verbatim, then container env; with max_restarts the supervisor's srun function
        "setup": setup_lines(plan, group) + supervisor_setup(plan, group, tuple(group.tasks if tasks is None else tasks)),
        "array_parallelism": s.array_parallelism or max(1, len(group.tasks)),
        "wckey": None,  # submitit's default "submitit" fails on clusters that enforce wckeys
        # srun of Slurm 22.05-23.02 does not inherit --cpus-per-task: without -c each rank is bound to one CPU
        "srun_args": [f"--cpus-per-task={s.cpus_per_task}"],
    }
    additional: dict[str, Any] = {}
    for key, value in sbatch_directives(plan, group):
        if key in native:
            params[native[key]] = value
        elif key in counts:
            assert value is not None, key  # a count always carries its number (render.sbatch_directives)
            params[counts[key]] = int(value)
        elif key == "signal":
            continue
        else:
            # mem, time (exact), reservation, requeue, open-mode, extra; submitit shlex-quotes the value, sbatch unescapes it
            additional[key] = True if value is None else sbatch_escape(value)
    params["additional_parameters"] = additional
    params["srun_args"] += list(launch_for(plan, group).srun_args)  # pyxis: --container-image ... on the srun line
    return params


def python_command(plan: Plan, group: Group, local: bool = False) -> str:
    """submitit's ``python=``: ``[apptainer exec ... IMAGE] PYTHON``, shell-quoted.

    Locally there is no batch script to hold ``slurm.setup`` (and container env) lines: they run in a
    ``bash -c`` in front of each rank ([env] reaches the ranks through ``_local_env``).
    """
    from ..slurm.launch import launch_for, passthrough_lines

    command = launch_for(plan, group).command()
    lines = [*group.slurm.setup, *passthrough_lines(plan)]
    if local and lines:
        script = "\n".join([*lines, 'exec "$@"'])
        command = f"bash -c {shell_quote(script)} swiftslurm-setup {command}"
    return command


def _executor(kind: str, plan: Plan, folder: Path, group: Group, tasks: tuple[int, ...] | None = None):
    import submitit

    s = group.slurm
    if kind == "slurm":
        # each rank holds the walltime USR2 from its first line until swiftslurm's handler is in (node/hold.py)
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=s.max_requeues, python=f"{python_command(plan, group)} -m swiftslurm.node.hold")
        ex.update_parameters(**slurm_parameters(plan, group, tasks))
        return ex
    if s.nodes > 1:
        raise SubmissionError(
            "the local executor runs one node", f"slurm.nodes = {s.nodes} (tasks {', '.join(map(str, group.tasks[:8]))})",
            "use --executor slurm on a cluster, or set slurm.nodes = 1 to try it here"
        )
    if plan.container is not None and plan.container.runtime == "pyxis":
        raise SubmissionError(
            "a pyxis container starts through srun, which the local executor does not use", f"container.runtime = 'pyxis' ({plan.container.image})",
            "use --executor slurm on a cluster with pyxis, or runtime = \"apptainer\" to run the image here",
        )
    local = submitit.LocalExecutor(folder=folder, max_num_timeout=s.max_requeues, python=python_command(plan, group, local=True))
    # No `setup` lines here: with them submitit starts the controller through `sh -c`, and the pid it
    # reports is the shell's, which a cancel cannot stop. [env] goes in through _local_env instead.
    params: dict[str, Any] = {
        "tasks_per_node": s.ranks_per_node,
        "timeout_min": max(1, math.ceil(s.time_limit_s / 60)),
        "signal_delay_s": s.signal_grace_s,
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    local.update_parameters(**params)
    return local


@contextlib.contextmanager
def _local_env(kind: str, env: dict[str, str]):
    """The local executor's export step: its controller copies os.environ when it starts.

    [env] is set for the submission call only, then the previous values come back.
    """
    if kind != "local" or not env:
        yield
        return
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_folder(output_dir: str) -> Path:
    """A fresh submitit folder per submission: job ids restart at 1 on a fresh cluster."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    folder = Path(output_dir) / "logs" / "submitit" / stamp
    folder.mkdir(parents=True, exist_ok=False)
    return folder


# ---------------------------------------------------------------- one live job per output dir


def _overlaps(a: str, b: str) -> bool:
    pa, pb = Path(a), Path(b)
    return pa == pb or pa in pb.parents or pb in pa.parents


def active_owner(plan: Plan) -> Submission | None:
    """A recorded submission that is still pending/running/requeued and writes where ``plan`` would.

    Looks at the records of the plan's output dir and of its task dirs (a job submitted into one of them).
    Reads only. A parent's record is never read here: it may be anyone's (``parent_holder`` asks its lock).
    """
    ours = [t.output_dir for t in plan.tasks]
    places = [plan.output_dir, *ours]
    seen: set[str] = set()
    for place in places:
        if place in seen or not records_path(place).is_file():
            continue
        seen.add(place)
        for rec in reversed(load_records(place)):
            sub = Submission.from_json(rec)
            theirs = sub.task_dirs or [sub.output_dir]
            if sub.output_dir != plan.output_dir and not any(_overlaps(a, b) for a in ours for b in theirs if a and b):
                continue
            try:
                if sub.is_active():
                    return sub
            except ToolMissing:  # a Slurm record seen from a machine without Slurm: cannot be asked here
                continue
    return None


def parent_holder(output_dir: str) -> tuple[str, dict[str, Any]] | None:
    """A dir above ``output_dir`` whose lock a live job holds (its output dir holds ours), with the owner.

    Shared parents (``/scratch``) hold records anyone may have written: only a lock really held counts, and
    nothing a record names is read or trusted (no folder, no job id, no pickle)."""
    from ..node.ownership import holder

    for above in Path(output_dir).absolute().parents:
        owner = holder(above)
        if owner is not None:
            return str(above), owner
    return None


def _owned(found: str, hint: str) -> SubmissionError:
    return SubmissionError("an active job already owns this output dir", found, hint)


def refuse_if_inside_a_live_job(plan: Plan) -> None:
    """SubmissionError (exit 3) when a live job's lock is held in a dir above the plan's output dir (reads only)."""
    from ..node.ownership import describe
    from ..quoting import shell_quote

    above = parent_holder(plan.output_dir)
    if above is not None:
        raise _owned(f"{above[0]}, a dir above {plan.output_dir}, is in use by {describe(above[1])}",
                     f"wait for it, give this spec a job.output_dir outside it, or stop it (swiftslurm cancel {shell_quote(above[0])})")


def refuse_if_owned(plan: Plan) -> None:
    """SubmissionError (exit 3) when an active job owns the plan's output dir, one of its task dirs, or a dir above.

    Checked before anything is written; a finished or cancelled job's dir may be reused.
    """
    from ..node.ownership import describe, holder
    from ..quoting import shell_quote

    refuse_if_inside_a_live_job(plan)
    sub = active_owner(plan)
    if sub is not None:
        ids = sub.slurm_job_ids if sub.executor == "slurm" else sub.job_ids
        when = datetime.fromtimestamp(sub.submitted_at).strftime("%Y-%m-%d %H:%M:%S")
        raise _owned(f"{sub.executor} job {', '.join(ids)} ({sub.mode}, submitted {when}) is not finished; it writes to {sub.output_dir}",
                     f"wait for it, give this spec another job.output_dir, or stop it: swiftslurm cancel {shell_quote(sub.output_dir)}")
    for task in plan.tasks:  # a job started some other way (plain sbatch of a rendered script) holds the task dir's lock
        owner = holder(task.output_dir)
        if owner is not None:
            raise _owned(f"{task.output_dir} is in use by {describe(owner)}", "wait for it, give this spec another job.output_dir, "
                         f"or stop it (scancel, or swiftslurm cancel {shell_quote(plan.output_dir)})")


@contextlib.contextmanager
def _submitting(output_dir: str):
    """Serialise submissions into one output dir (check, then send) across processes."""
    import fcntl

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(output_dir) / SUBMIT_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ---------------------------------------------------------------- sending


def _send_part(kind: str, plan: Plan, folder: Path, part: ArrayPart, mode: str) -> list[Any]:
    """One submission call (one sbatch array, or one job without a sweep): its submitit jobs.

    submitit numbers a part's array tasks 0..n-1 and passes each its global task index.
    """
    group = part.group
    ex = _executor(kind, plan, folder, group, tuple(part.tasks))
    n = len(part.tasks)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), _local_env(kind, plan.env):  # submitit echoes sbatch's stderr; we say it once
            if plan.is_array:
                return list(ex.map_array(run_rank, [plan.plan_path] * n, list(part.tasks), [mode] * n))
            return [ex.submit(run_rank, plan.plan_path, part.tasks[0], mode)]
    except SwiftSlurmError:
        raise
    except Exception as exc:  # submitit wraps sbatch's refusal (FailedJobError / FailedSubmissionError)
        if kind == "slurm":
            raise slurm.refusal(str(exc) or stderr.getvalue()) from None
        raise SubmissionError("the local executor could not start the job", f"{type(exc).__name__}: {exc}", "see the logs under " + str(folder)) from None


def _stop_sent(kind: str, sent: list[list[Any]]) -> None:
    """A later group was refused: take back the groups already sent (no half submissions)."""
    ids = [str(j.job_id) for jobs in sent for j in jobs]
    with contextlib.suppress(SwiftSlurmError):
        if kind == "slurm":
            slurm.scancel(sorted({i.split("_")[0] for i in ids}))
        else:
            for jobs in sent:
                for job in jobs:
                    with contextlib.suppress(Exception):
                        job.cancel()


MAX_ARRAY_SIZE_ENV = "SWIFTSLURM_MAX_ARRAY_SIZE"


def array_limits(kind: str, environ: dict[str, str] | None = None) -> ArrayLimits:
    """The site's array caps, read once per submit: ``scontrol show config`` (Slurm only).

    ``$SWIFTSLURM_MAX_ARRAY_SIZE`` overrides MaxArraySize (for tests, and for sites whose config cannot be read).
    """
    env = os.environ if environ is None else environ
    limits = ArrayLimits()
    if kind == "slurm":
        with contextlib.suppress(SwiftSlurmError):  # unreadable config: send unsplit, sbatch says what it refuses
            limits = slurm.array_limits()
    raw = env.get(MAX_ARRAY_SIZE_ENV, "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
            raise SubmissionError(f"${MAX_ARRAY_SIZE_ENV} is not a positive whole number", repr(raw),
                                  f"unset it, or set it to the site's MaxArraySize (e.g. {MAX_ARRAY_SIZE_ENV}=1001)")
        limits = ArrayLimits(int(raw), limits.max_array_tasks)
    return limits


def _parts(plan: Plan, limits: ArrayLimits) -> list[ArrayPart]:
    try:
        return plan.arrays(limits)
    except ValueError as exc:
        raise SubmissionError("this site does not run job arrays", str(exc),
                              "submit one task at a time (no [sweep]), or ask the admins about MaxArraySize") from None


def avoid_bad_nodes(plan: Plan) -> tuple[Plan, list[dict[str, Any]]]:
    """The plan with the ledger's recently failed nodes excluded (slurm.avoid_bad_nodes), and what was decided."""
    from .. import ledger

    if not any(g.slurm.avoid_bad_nodes for g in plan.groups):
        return plan, []
    try:
        entries = ledger.read()
    except SwiftSlurmError as exc:
        raise SubmissionError(exc.what, exc.found, exc.hint + "; or set slurm.avoid_bad_nodes = false") from None

    def nodes_of(partition: str | None) -> list[str] | None:
        try:
            return slurm.partition_nodes(partition)
        except SwiftSlurmError:
            return None

    plan, decisions = ledger.avoid_in_plan(plan, entries, nodes_of)
    return plan, [{"group": g, **d.to_json()} for g, d in decisions]


def submit_plan(plan: Plan, executor: str = "auto", mode: str = "train") -> Submission:
    """Refuse a dir an active job owns; exclude the ledger's bad nodes (Slurm, training); write the plan and each
    task's spec; send one array per group (several where the site caps arrays); record it."""
    from ..slurm.render import render_all

    kind = resolve_executor(executor)
    avoided: list[dict[str, Any]] = []
    if kind == "slurm" and mode == "train":  # a preflight-only run is how a node gets tested again: never avoided
        plan, avoided = avoid_bad_nodes(plan)
    limits = array_limits(kind) if plan.is_array else ArrayLimits()
    parts = _parts(plan, limits)
    scripts = render_all(plan, limits=limits)
    refuse_if_inside_a_live_job(plan)  # before the output dir is made: nothing is written inside a live job's dir
    with _submitting(plan.output_dir):
        refuse_if_owned(plan)
        write_plan(plan, scripts, limits)
        _write_task_specs(plan)
        folder = new_folder(plan.output_dir)
        sent: list[list[Any]] = []
        for part in parts:
            try:
                sent.append(_send_part(kind, plan, folder, part, mode))
            except SwiftSlurmError:
                _stop_sent(kind, sent)
                raise
        job_ids = [""] * len(plan.tasks)
        for part, jobs in zip(parts, sent, strict=True):
            for index, job in zip(part.tasks, jobs, strict=True):
                job_ids[index] = str(job.job_id)
        jobs_flat = [j for jobs in sent for j in jobs]
        sub = Submission(
            executor=kind,
            job_ids=job_ids,
            output_dir=plan.output_dir,
            task_dirs=[t.output_dir for t in plan.tasks],
            folder=str(folder),
            mode=mode,
            source=plan.source,
            ranks_per_task=plan.spec.slurm.nodes * plan.spec.slurm.ranks_per_node,
            job_name=plan.spec.job.name,
            arrays=[
                {"job_id": str(jobs[0].job_id).split("_")[0] if kind == "slurm" else "", "tasks": list(part.tasks),
                 "ranks_per_task": part.group.world_size, "group": part.group.index}
                for part, jobs in zip(parts, sent, strict=True)
            ],
            avoided=avoided,
            pid_starts={str(j.job_id): start for j in jobs_flat if kind == "local" and (start := process_start(int(j.job_id))) is not None},
            cwd=os.getcwd() if kind == "local" else "",  # the controllers' working dir: cancel checks it
            _jobs=jobs_flat,
        )
        update_record(sub)
    if kind == "slurm":
        _index(sub)
    return sub


def _index(sub: Submission) -> None:
    """This user's job index (``index.py``): found again by JOBID after Slurm forgot the job."""
    try:
        index.remember(sub.job_ids, sub.job_name, sub.output_dir)
    except OSError as exc:  # the submission stands; only the lookup by id after Slurm forgets it is lost
        logging.getLogger("swiftslurm").warning("could not add job(s) %s to %s: %s", ",".join(sub.job_ids), index.index_path(), exc)
