"""Send a plan: one submitit submission (a Slurm job, one sbatch array for a sweep, or local processes).

``submit_plan(plan)`` only sends what ``make_plan`` built: it writes the plan and each task's
resolved spec, submits through submitit, and records the submission in
``plan.output_dir/submission.json`` so ``status``/``cancel`` work from the output dir alone.
State queries go through ``slurm/`` (Slurm) or submitit's result files (local).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from . import slurm
from .errors import SubmissionError, SwiftSlurmError, ToolMissing
from .plan import Plan, write_plan
from .quoting import shell_quote
from .fsutil import atomic_write_text

SUBMISSION_FILE = "submission.json"
TASK_SPEC_FILE = "spec.json"
EXECUTORS = ("auto", "slurm", "local")
POLL_S = 2.0
# sacct may not know a job for a moment after sbatch returned: PENDING until then, UNKNOWN after this.
UNSEEN_GRACE_S = 120.0


class TaskFailed(RuntimeError):
    """Raised on a node so the Slurm step (and submitit's result) records the failure."""


def run_rank(plan_path: str, task_index: int, mode: str = "train") -> int:
    """The submitit callable: ``runtime.run_task`` on one rank; a non-zero exit fails the step."""
    from .node.runtime import run_task

    code = run_task(plan_path, task_index, mode)
    if code != 0:
        raise TaskFailed(f"task {task_index} ({mode}) exited with code {code} on this rank")
    return code


def resolve_executor(executor: str) -> str:
    """``auto`` -> ``slurm`` when sbatch is on PATH, else ``local``; ``slurm`` without sbatch is refused."""
    if executor not in EXECUTORS:
        raise SubmissionError(f"unknown executor {executor!r}", executor, "use --executor auto, slurm or local")
    if executor == "auto":
        return "slurm" if slurm.have_slurm() else "local"
    if executor == "slurm" and not slurm.have_slurm():
        raise ToolMissing("--executor slurm needs 'sbatch' on PATH", "no sbatch", "run on a Slurm login node, or use --executor local")
    return executor


# ---------------------------------------------------------------- what a task looks like now


@dataclass
class TaskStatus:
    task: int
    job_id: str
    state: str
    nodes: str = ""
    restarts: int = 0
    elapsed: str = ""
    output_dir: str = ""
    checkpoint: str | None = None
    last_save: dict[str, Any] | None = None  # checkpoint-save.json: phases of the last save, grace advice


def newest_checkpoint(task_dir: str) -> str | None:
    """The newest verified checkpoint of a task (None before the checkpoint module exists or saved one)."""
    try:
        from .checkpoint import newest_verified
    except ImportError:
        return None
    try:
        found = newest_verified(task_dir)
    except (OSError, SwiftSlurmError):
        return None
    return str(found) if found else None


def _last_save(task_dir: str) -> dict[str, Any] | None:
    """The trainer's record of its last checkpoint save (timings, and advice when it outgrew signal_grace_s)."""
    from .checkpoint.savetime import read_save

    return read_save(task_dir) if task_dir else None


def _requeue_count(task_dir: str) -> int:
    """Walltime requeues the runtime recorded (``requeues.json``): the count where sacct has none."""
    try:
        data = json.loads(Path(task_dir, "requeues.json").read_text())
    except (OSError, ValueError):
        return 0
    return len(data) if isinstance(data, list) else len(data.get("requeues", [])) if isinstance(data, dict) else 0


# ---------------------------------------------------------------- the record of one submission


@dataclass
class Submission:
    executor: str  # "slurm" | "local"
    job_ids: list[str]  # per task, in task order: "123", "123_4", or a local controller pid
    output_dir: str
    task_dirs: list[str]
    folder: str  # submitit folder of this submission
    mode: str = "train"
    submitted_at: float = field(default_factory=time.time)
    source: str = ""
    cancelled: bool = False
    ranks_per_task: int = 1  # local: a task is COMPLETED only when this many ranks reported success
    job_name: str = ""  # Slurm: a record under our id with another name is a later job (cluster reset)
    _jobs: list[Any] | None = field(default=None, repr=False, compare=False)  # submitit jobs, this process only

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["submitted_iso"] = datetime.fromtimestamp(self.submitted_at, timezone.utc).isoformat(timespec="seconds")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Submission":
        keys = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        return cls(**{k: v for k, v in data.items() if k in keys})

    @property
    def slurm_job_ids(self) -> list[str]:
        """What sacct/squeue/scancel take: the array job id once, or the single job ids."""
        return sorted({j.split("_")[0] for j in self.job_ids})

    # ---------------------------------------------------------------- status

    def statuses(self, with_checkpoints: bool = False) -> list[TaskStatus]:
        rows = self._slurm_statuses() if self.executor == "slurm" else self._local_statuses()
        for row in rows:
            row.restarts = max(row.restarts, _requeue_count(row.output_dir))
            if with_checkpoints:
                row.checkpoint = newest_checkpoint(row.output_dir)
                row.last_save = _last_save(row.output_dir)
        return rows

    def _slurm_statuses(self) -> list[TaskStatus]:
        return self._rows_from(slurm.job_records(self.slurm_job_ids))

    def _rows_from(self, records: dict[str, slurm.JobRecord]) -> list[TaskStatus]:
        """Task rows from sacct/squeue records (pure but for the clock)."""
        unseen = "UNKNOWN" if time.time() - self.submitted_at > UNSEEN_GRACE_S else "PENDING"
        rows = []
        for index, (jid, task_dir) in enumerate(zip(self.job_ids, self.task_dirs)):
            rec = records.get(jid)
            if rec is not None and self.job_name and rec.name and rec.name != self.job_name:
                rec = None  # the id now belongs to another job: Slurm forgot ours
            if rec is None:
                rows.append(TaskStatus(index, jid, unseen, output_dir=task_dir))
            else:
                rows.append(TaskStatus(index, jid, rec.state, rec.nodes, rec.restarts, rec.elapsed, task_dir))
        return rows

    def _local_statuses(self) -> list[TaskStatus]:
        live = {str(j.job_id): j for j in (self._jobs or [])}
        if not self.cancelled and self.output_dir:  # `swiftslurm cancel DIR` from another process
            self.cancelled = any(r.get("folder") == self.folder and r.get("cancelled") for r in load_records(self.output_dir))
        rows = []
        for index, (jid, task_dir) in enumerate(zip(self.job_ids, self.task_dirs)):
            state = _local_state(Path(self.folder), jid, live.get(jid), self.cancelled, self.ranks_per_task)
            elapsed = _hms(time.time() - self.submitted_at) if state == "RUNNING" else ""
            rows.append(TaskStatus(index, jid, state, "localhost", 0, elapsed, task_dir))
        return rows

    def states(self) -> dict[str, str]:
        return {str(row.task): row.state for row in self.statuses()}

    def wait(self, timeout_s: float | None = None, on_update: Callable[[list[TaskStatus]], None] | None = None, poll_s: float = POLL_S) -> dict[str, str]:
        """Poll until every task is in a final state (or ``timeout_s`` passed): task index -> state.

        On timeout the states are returned as they are (some not final); the job keeps running.
        A Slurm task that neither sacct nor squeue has listed for UNSEEN_GRACE_S ends the wait as UNKNOWN.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            rows = self.statuses()
            if on_update is not None:
                on_update(rows)
            if all(slurm.is_final(r.state) or r.state == "UNKNOWN" for r in rows):  # UNKNOWN: Slurm lost it
                return {str(r.task): r.state for r in rows}
            if deadline is not None and time.monotonic() >= deadline:
                return {str(r.task): r.state for r in rows}
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def cancel(self) -> None:
        if self.executor == "slurm":
            slurm.scancel(self.slurm_job_ids)
        else:
            import signal

            for jid in self.job_ids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(jid), signal.SIGTERM)  # the submitit controller forwards it to the ranks
        self.cancelled = True
        if self.output_dir:
            _update_record(self)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _local_state(folder: Path, job_id: str, job: Any, cancelled: bool, ranks: int) -> str:
    """A local job from submitit's files: every rank's result pickle says success -> COMPLETED."""
    results = sorted(folder.glob(f"{job_id}_*_result.pkl"))
    if job is not None:
        running = job._process is not None and job._process.poll() is None
    else:
        running = _pid_alive(int(job_id)) if job_id.isdigit() else False
    if running:
        return "RUNNING"
    if not results:
        return "CANCELLED" if cancelled else "FAILED"
    import pickle

    outcomes = []
    for path in results:
        try:
            with path.open("rb") as fh:
                outcomes.append(pickle.load(fh)[0])
        except Exception:  # a torn or foreign pickle: not a success
            outcomes.append("error")
    if len(outcomes) < ranks:
        return "CANCELLED" if cancelled else "FAILED"
    return "COMPLETED" if all(o == "success" for o in outcomes) else ("CANCELLED" if cancelled else "FAILED")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


# ---------------------------------------------------------------- records on disk


def _records_path(output_dir: str) -> Path:
    return Path(output_dir) / SUBMISSION_FILE


def _write_records(output_dir: str, records: list[dict[str, Any]]) -> None:
    atomic_write_text(_records_path(output_dir), json.dumps({"submissions": records}, indent=2) + "\n")


def load_records(output_dir: str) -> list[dict[str, Any]]:
    try:
        return list(json.loads(_records_path(output_dir).read_text()).get("submissions", []))
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as exc:
        raise SwiftSlurmError("the submission record is unreadable", f"{_records_path(output_dir)}: {exc}", "it is rewritten by the next `swiftslurm submit`") from None


def load_submission(output_dir: str) -> Submission:
    """The latest submission recorded in an output dir."""
    records = load_records(output_dir)
    if not records:
        raise SwiftSlurmError("no submission recorded here", str(_records_path(output_dir)), "pass the job.output_dir of a submitted spec, or a job id")
    return Submission.from_json(records[-1])


def _update_record(sub: Submission) -> None:
    records = load_records(sub.output_dir)
    for i, rec in enumerate(records):
        if rec.get("folder") == sub.folder:
            records[i] = sub.to_json()
            break
    else:
        records.append(sub.to_json())
    _write_records(sub.output_dir, records)


# ---------------------------------------------------------------- sending


def _write_task_specs(plan: Plan) -> None:
    """Each task's resolved spec in its own dir (indented for people; compact for big sweeps)."""
    indent = 2 if len(plan.tasks) <= 64 else None
    for task in plan.tasks:
        out = Path(task.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / TASK_SPEC_FILE).write_text(json.dumps(task.to_json(), indent=indent) + "\n")


def env_setup_lines(plan: Plan) -> list[str]:
    """``export NAME=VALUE`` for the [env] table, each value through the one quoting function."""
    return [f"export {name}={shell_quote(value)}" for name, value in plan.env.items()]


def slurm_parameters(plan: Plan) -> dict[str, Any]:
    """submitit SlurmExecutor parameters carrying exactly ``render.sbatch_directives(plan)``."""
    from .slurm.render import sbatch_directives

    s = plan.spec.slurm
    native = {"job-name": "job_name", "partition": "partition", "qos": "qos", "constraint": "constraint", "exclude": "exclude", "account": "account", "nodelist": "nodelist"}
    counts = {"nodes": "nodes", "ntasks-per-node": "ntasks_per_node", "cpus-per-task": "cpus_per_task", "gpus-per-node": "gpus_per_node"}
    params: dict[str, Any] = {
        "time": max(1, math.ceil(s.time_limit_s / 60)),  # submitit's own timeout bookkeeping (minutes)
        "signal_delay_s": s.signal_grace_s,  # submitit writes --signal=USR2@N (every rank gets it, not B:)
        "setup": env_setup_lines(plan),
        "array_parallelism": s.array_parallelism or max(1, len(plan.tasks)),
        "wckey": None,  # submitit's default "submitit" fails on clusters that enforce wckeys
    }
    additional: dict[str, Any] = {}
    for key, value in sbatch_directives(plan):
        if key in native:
            params[native[key]] = value
        elif key in counts:
            params[counts[key]] = int(value)
        elif key == "signal":
            continue
        else:
            additional[key] = True if value is None else value  # mem, time (exact), reservation, requeue, open-mode, extra
    params["additional_parameters"] = additional
    return params


def _executor(kind: str, plan: Plan, folder: Path):
    import submitit

    s = plan.spec.slurm
    if kind == "slurm":
        ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=s.max_requeues)
        ex.update_parameters(**slurm_parameters(plan))
        return ex
    if s.nodes > 1:
        raise SubmissionError(
            "the local executor runs one node", f"slurm.nodes = {s.nodes}", "use --executor slurm on a cluster, or set slurm.nodes = 1 to try it here"
        )
    ex = submitit.LocalExecutor(folder=folder, max_num_timeout=s.max_requeues)
    # No `setup` lines here: with them submitit starts the controller through `sh -c`, and the pid it
    # reports is the shell's, which a cancel cannot stop. [env] goes in through _local_env instead.
    params: dict[str, Any] = {
        "tasks_per_node": s.ranks_per_node,
        "timeout_min": max(1, math.ceil(s.time_limit_s / 60)),
        "signal_delay_s": s.signal_grace_s,
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    ex.update_parameters(**params)
    return ex


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


def submit_plan(plan: Plan, executor: str = "auto", mode: str = "train") -> Submission:
    """Write the plan and each task's spec, submit every task (one sbatch array for a sweep), record it."""
    from .slurm.render import render_sbatch

    kind = resolve_executor(executor)
    write_plan(plan, render_sbatch(plan))
    _write_task_specs(plan)
    folder = new_folder(plan.output_dir)
    ex = _executor(kind, plan, folder)
    n = len(plan.tasks)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), _local_env(kind, plan.env):  # submitit echoes sbatch's stderr; we say it once
            if plan.is_array:
                jobs = ex.map_array(run_rank, [plan.plan_path] * n, list(range(n)), [mode] * n)
            else:
                jobs = [ex.submit(run_rank, plan.plan_path, 0, mode)]
    except SwiftSlurmError:
        raise
    except Exception as exc:  # submitit wraps sbatch's refusal (FailedJobError / FailedSubmissionError)
        if kind == "slurm":
            raise slurm.refusal(str(exc) or stderr.getvalue()) from None
        raise SubmissionError("the local executor could not start the job", f"{type(exc).__name__}: {exc}", "see the logs under " + str(folder)) from None
    sub = Submission(
        executor=kind,
        job_ids=[str(j.job_id) for j in jobs],
        output_dir=plan.output_dir,
        task_dirs=[t.output_dir for t in plan.tasks],
        folder=str(folder),
        mode=mode,
        source=plan.source,
        ranks_per_task=plan.spec.slurm.nodes * plan.spec.slurm.ranks_per_node,
        job_name=plan.spec.job.name,
        _jobs=jobs,
    )
    _update_record(sub)
    return sub
