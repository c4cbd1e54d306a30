"""A submission's record and its tasks' state: ``submission.json`` in the output dir, read back by ``status``,
``watch``, ``cancel`` and ``doctor`` from the output dir alone.

``Submission`` holds what was sent (executor, job ids, the global tasks each array covers, output dirs, the
submitit folder) and answers for its tasks: Slurm's accounting through ``slurm/`` for a Slurm job, or, where
Slurm has no answer and for the local executor, what each rank left in submitit's folder. Sending lives in
``submit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from .. import slurm
from ..errors import SwiftSlurmError
from ..fsutil import RECORD_CAP, RESULT_CAP, Unreadable, atomic_write_text, process_start, read_json, read_plain_pickle  # noqa: F401 -- process_start re-exported
from ..taskdir import SUBMISSION_FILE

POLL_S = 2.0
# sacct may not know a job for a moment after sbatch returned: PENDING until then, UNKNOWN after this.
UNSEEN_GRACE_S = 120.0


@dataclass
class TaskStatus:
    task: int
    job_id: str
    state: str
    nodes: str = ""
    restarts: int = 0
    elapsed: str = ""
    output_dir: str = ""
    last_save: dict[str, Any] | None = None  # checkpoint-save.json: phases of the last save, grace advice
    stop_reason: str | None = None  # a walltime stop that was not requeued, in the runtime's words
    restart_note: str | None = None  # in-job restarts (restarts.json): how many, the last cause, or why not restarted
    held: str | None = None  # state HELD: Slurm's reason and what to do; the task waits in the queue for a person
    hold_reason: str | None = None  # state HELD: Slurm's pending reason code ("JobHeldUser", "PartitionConfig", ...)


def settled(state: str) -> bool:
    """A task that will not move without a person: ended, lost by Slurm (UNKNOWN), or held in the queue (HELD)."""
    return slurm.is_final(state) or state in ("UNKNOWN", "HELD")


def held_note(job_id: str, reason: str, output_dir: str = "") -> str:
    """A HELD task in one line: Slurm's reason, and the two ways on."""
    return f"held by Slurm ({reason}); `scontrol release {job_id}` lets it run, {_cancel(job_id, output_dir)} ends it"


def never_starts_note(job_id: str, reason: str, output_dir: str = "") -> str:
    """A HELD task Slurm will not start as submitted (``slurm.never_starts``) in one line: the reason and the ways on."""
    return (f"Slurm will not start it as submitted ({reason}); {_cancel(job_id, output_dir)} ends it, to submit again "
            f"with what the partition allows (or `scontrol update JobId={job_id} ...` changes the request in the queue)")


def _cancel(job_id: str, output_dir: str) -> str:
    from ..quoting import shell_quote

    return f"`swiftslurm cancel {shell_quote(output_dir)}`" if output_dir else f"`scancel {job_id}`"


def _last_save(task_dir: str) -> dict[str, Any] | None:
    """The trainer's record of its last checkpoint save (timings, and advice when it outgrew signal_grace_s)."""
    from ..checkpoint.savetime import read_save

    return read_save(task_dir) if task_dir else None


def _walltime_record(task_dir: str, job_id: str) -> tuple[int, str | None]:
    """This job's walltime requeues as the runtime recorded them (``requeues.json``: the count where sacct
    has none), and why its last walltime stop was not requeued (None when it was, or none happened)."""
    from ..records.requeues import read_requeues, stop_reason, walltime_requeues

    records = read_requeues(task_dir) if task_dir else []
    return walltime_requeues(records, job_id), stop_reason(records, job_id)


def _restart_record(task_dir: str, job_id: str) -> tuple[int, str | None]:
    """This job's in-job restarts (``restarts.json``) and one line on the last decision (None without any)."""
    from ..records.restarts import read_restarts, summary

    return summary(read_restarts(task_dir) if task_dir else [], job_id)


# ---------------------------------------------------------------- the record of one submission


@dataclass
class Submission:
    executor: str  # "slurm" | "local"
    job_ids: list[str]  # per task, in global task order: "123", "123_4", or a local controller pid
    output_dir: str
    task_dirs: list[str]
    folder: str  # submitit folder of this submission
    mode: str = "train"
    submitted_at: float = field(default_factory=time.time)
    source: str = ""
    cancelled: bool = False
    ranks_per_task: int = 1  # local: a task is COMPLETED only when this many ranks reported success
    job_name: str = ""  # Slurm: a record under our id with another name is a later job (cluster reset)
    # One entry per sbatch call (per allocation group, or per part of a group split under the site's array cap):
    # {"job_id": "123" (Slurm array/job id, "" locally), "tasks": [global task indices], "ranks_per_task": N}
    arrays: list[dict[str, Any]] = field(default_factory=list)
    # local: controller pid -> its start time (/proc/PID/stat field 22): a pid reused by another process is not ours
    pid_starts: dict[str, int] = field(default_factory=dict)
    cwd: str = ""  # local: where submit ran, the controllers' working dir (cancel checks it: _why_not_ours)
    # the node-health ledger's exclusion, one entry per allocation group it concerned: {"group": i, **Avoidance.to_json()}
    avoided: list[dict[str, Any]] = field(default_factory=list)
    _jobs: list[Any] | None = field(default=None, repr=False, compare=False)  # submitit jobs, this process only
    # rooted_at: the recorded task dirs that lie outside the recorded output dir, not followed
    _unfollowed: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def rooted_at(self, directory: str) -> Submission:
        """This record read as the record of ``directory``, the dir the user named: each task dir and the submitit
        folder recorded under the recorded output dir is taken at the same place under ``directory`` (a run dir that
        was copied or moved is read where it is now, never at its old place), and one recorded outside it is not
        followed ("": nothing is read there; ``_unfollowed`` names them). Pure: nothing is looked at on disk."""
        here = os.path.normpath(os.path.abspath(directory))
        there = os.path.normpath(self.output_dir) if os.path.isabs(self.output_dir) else here
        unfollowed: list[str] = []

        def moved(path: str) -> str:
            if not path:
                return path
            full = os.path.normpath(path if os.path.isabs(path) else os.path.join(there, path))
            if full == there:
                return here
            if full.startswith(there.rstrip(os.sep) + os.sep):
                return os.path.join(here, os.path.relpath(full, there))
            unfollowed.append(path)
            return ""

        task_dirs, folder = [moved(t) for t in self.task_dirs], moved(self.folder)
        return dataclasses.replace(self, output_dir=here, task_dirs=task_dirs, folder=folder, _unfollowed=tuple(unfollowed))

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        out["submitted_iso"] = datetime.fromtimestamp(self.submitted_at, timezone.utc).isoformat(timespec="seconds")
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Submission":
        """A record as written by ``to_json``; ValueError naming the first field of another shape (a record
        read back from a shared dir may hold anything)."""
        keys = {f for f in cls.__dataclass_fields__ if not f.startswith("_")}
        _check_record(data)
        return cls(**{k: v for k, v in data.items() if k in keys})

    @property
    def slurm_job_ids(self) -> list[str]:
        """What sacct/squeue/scancel take: each array job id once, or the single job ids."""
        return sorted({j.split("_")[0] for j in self.job_ids}, key=lambda j: (len(j), j))

    def ranks_of(self, task: int) -> int:
        """How many ranks task ``task`` runs (its group's allocation)."""
        for array in self.arrays:
            if task in array.get("tasks", ()):
                return int(array.get("ranks_per_task", self.ranks_per_task))
        return self.ranks_per_task

    # ---------------------------------------------------------------- status

    def current_job_ids(self) -> list[str]:
        """Per task, the job running its training now: the newest link of a singleton chain (node/chain.py) that
        began with the submitted job, else the submitted job itself."""
        if self.executor != "slurm":
            return list(self.job_ids)
        from ..records.chains import newest, read_chains

        return [newest(read_chains(d), jid)[-1] if d else jid for jid, d in zip(self.job_ids, self.task_dirs, strict=False)]

    def statuses(self) -> list[TaskStatus]:
        rows = self._slurm_statuses() if self.executor == "slurm" else self._local_statuses()
        for row, first in zip(rows, self.job_ids, strict=False):
            requeues, row.stop_reason = _walltime_record(row.output_dir, row.job_id)
            in_job, row.restart_note = _restart_record(row.output_dir, row.job_id)
            row.restarts = max(row.restarts, requeues) + in_job
            if row.job_id != first:  # a singleton chain: its earlier links are continuations too
                from ..records.chains import newest, read_chains

                row.restarts += len(newest(read_chains(row.output_dir), first)) - 1
            row.last_save = _last_save(row.output_dir)  # a small JSON: cheap
        return rows

    def _slurm_statuses(self) -> list[TaskStatus]:
        current = self.current_job_ids()
        records = slurm.job_records(sorted({*self.slurm_job_ids, *(j.split("_")[0] for j in current)}))
        self._refresh_cancelled()
        return self._rows_from(records, current)

    def _refresh_cancelled(self) -> None:
        """`swiftslurm cancel DIR` from another process marks the record: a killed rank's error means CANCELLED."""
        if not self.cancelled and self.output_dir:
            self.cancelled = any(r.get("folder") == self.folder and r.get("cancelled") for r in load_records(self.output_dir))

    def _rows_from(self, records: dict[str, slurm.JobRecord], job_ids: list[str] | None = None) -> list[TaskStatus]:
        """Task rows from sacct/squeue records; where they have none, from the result files the ranks left.
        ``job_ids``: each task's current job (``current_job_ids``), the submitted ones by default."""
        unseen = "UNKNOWN" if time.time() - self.submitted_at > UNSEEN_GRACE_S else "PENDING"
        rows = []
        for index, (jid, task_dir) in enumerate(zip(job_ids or self.job_ids, self.task_dirs, strict=False)):
            rec = slurm.task_record(records, jid)
            if rec is not None and self.job_name and rec.name and rec.name != self.job_name:
                rec = None  # the id now belongs to another job: Slurm forgot ours
            if rec is None or rec.state == "UNKNOWN":
                # sacct down or missing, and squeue no longer lists it: what the ranks left says how it ended
                left = _result_state(Path(self.folder), jid, self.ranks_of(index)) if self.folder else None
                if left == "FAILED" and self.cancelled:
                    left = "CANCELLED"  # the ranks we cancelled left errors behind
                rows.append(TaskStatus(index, jid, left or unseen, output_dir=task_dir))
            elif (why := slurm.held_reason(rec)) is not None:
                rows.append(TaskStatus(index, jid, "HELD", rec.nodes, rec.restarts, rec.elapsed, task_dir,
                                       held=held_note(jid, why, self.output_dir), hold_reason=rec.reason or rec.state))
            elif (why := slurm.never_starts(rec)) is not None:
                rows.append(TaskStatus(index, jid, "HELD", rec.nodes, rec.restarts, rec.elapsed, task_dir,
                                       held=never_starts_note(jid, why, self.output_dir), hold_reason=rec.reason))
            else:
                rows.append(TaskStatus(index, jid, rec.state, rec.nodes, rec.restarts, rec.elapsed, task_dir))
        return rows

    def _local_statuses(self) -> list[TaskStatus]:
        live = {str(j.job_id): j for j in (self._jobs or [])}
        self._refresh_cancelled()
        rows = []
        for index, (jid, task_dir) in enumerate(zip(self.job_ids, self.task_dirs, strict=False)):
            state = _local_state(Path(self.folder), jid, live.get(jid), self.cancelled, self.ranks_of(index), self.pid_starts.get(jid))
            elapsed = _local_elapsed(Path(self.folder), jid, state, self.submitted_at)
            rows.append(TaskStatus(index, jid, state, "localhost", 0, elapsed, task_dir))
        return rows

    def states(self) -> dict[str, str]:
        return {str(row.task): row.state for row in self.statuses()}

    def wait(self, timeout_s: float | None = None, on_update: Callable[[list[TaskStatus]], None] | None = None, poll_s: float = POLL_S) -> dict[str, str]:
        """Poll until every task is in a final state (or ``timeout_s`` passed): task index -> state.

        On timeout the states are returned as they are (some not final); the job keeps running.
        A Slurm task that neither sacct nor squeue has listed for UNSEEN_GRACE_S ends the wait as UNKNOWN, and one
        that Slurm holds in the queue (it starts only once a person releases it, or changes a request Slurm will not start
        as it is) as HELD: ``settled``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            rows = self.statuses()
            if on_update is not None:
                on_update(rows)
            if all(settled(r.state) for r in rows):
                return {str(r.task): r.state for r in rows}
            if deadline is not None and time.monotonic() >= deadline:
                return {str(r.task): r.state for r in rows}
            time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))

    def is_active(self) -> bool:
        """Some task is pending (held, too), running or requeued (UNKNOWN, Slurm lost it, is not active)."""
        return any(not slurm.is_final(r.state) and r.state != "UNKNOWN" for r in self.statuses())

    def cancel(self) -> None:
        """Stop the job: scancel its Slurm jobs, or SIGTERM each local controller that is provably the one
        this record launched (``_why_not_ours``). CancelRefused, before anything is signalled or written,
        when a recorded pid is alive but cannot be proven ours; a pid no longer running needs no signal."""
        if self.executor == "slurm":
            # a chain's newest links; only under this job's name: an id Slurm has since given to another job is not ours
            slurm.scancel(sorted({j.split("_")[0] for j in self.current_job_ids()}), name=self.job_name)
        else:
            import signal

            live = [int(jid) for jid in self.job_ids if jid.isdigit() and _alive(int(jid)) and not _reused(int(jid), self.pid_starts.get(jid))]
            for pid in live:
                why = _why_not_ours(pid, self)
                if why:
                    raise CancelRefused("cancel refused: not a process this submission started", why,
                                        f"nothing was signalled; if it is yours, stop it with `kill {pid}`")
            for pid in live:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)  # the submitit controller forwards it to the ranks
        self.cancelled = True
        if self.output_dir and self.folder:  # a hand-submitted run (no submitit folder) gets no record written
            update_record(self)


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _local_elapsed(folder: Path, job_id: str, state: str, submitted_at: float) -> str:
    """The local executor's clock: from the submission to now while it runs, to the last rank's result once it ended."""
    if state == "RUNNING":
        return _hms(time.time() - submitted_at)
    ends = []
    for pattern in (f"{job_id}_*_result.pkl", f"{job_id}_*_log.*"):  # killed ranks leave no result: their logs' last write
        for path in folder.glob(pattern):
            with contextlib.suppress(OSError):
                ends.append(path.stat().st_mtime)
        if ends:
            break
    return _hms(max(ends) - submitted_at) if ends and max(ends) >= submitted_at else ""


def _local_state(folder: Path, job_id: str, job: Any, cancelled: bool, ranks: int, started: int | None = None) -> str:
    """A local job from submitit's files: every rank's result pickle says success -> COMPLETED."""
    if job is not None:
        running = job._process is not None and job._process.poll() is None
    else:
        running = _same_process(int(job_id), started) if job_id.isdigit() else False
    if running:
        return "RUNNING"
    left = _result_state(folder, job_id, ranks)
    if left == "COMPLETED":
        return left
    return "CANCELLED" if cancelled else "FAILED"


def _result_state(folder: Path, job_id: str, ranks: int) -> str | None:
    """How a finished task ended, from the result file each rank's submitit wrapper wrote.

    COMPLETED when ``ranks`` results all say success, FAILED when any says error; None when
    fewer than ``ranks`` results exist (still running, or killed before it could write one).
    """
    outcomes = []
    for path in sorted(folder.glob(f"{job_id}_*_result.pkl")):
        try:  # plain values only: a result pickle someone else wrote never runs code here
            result = read_plain_pickle(path, RESULT_CAP)
        except (Unreadable, OSError):  # torn, foreign or hostile: not a success
            result = None
        outcomes.append(result[0] if isinstance(result, (tuple, list)) and result else "error")
    if any(o != "success" for o in outcomes):
        return "FAILED"
    return "COMPLETED" if outcomes and len(outcomes) >= ranks else None


class CancelRefused(SwiftSlurmError):
    """A local cancel that cannot prove the process it would signal is the job's: nothing is signalled (exit 3)."""

    exit_code = 3


def controller_argv(folder: str) -> list[str]:
    """What submitit's local executor runs as a job's controller, after the interpreter (its ``start_controller``)."""
    return ["-m", "submitit.local._local", folder]


def _alive(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (whoever it is)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reused(pid: int, started: int | None) -> bool:
    """The recorded process has ended and its pid now names another one (the start times differ): nothing to stop."""
    return started is not None and process_start(pid) != started


def _why_not_ours(pid: int, sub: "Submission") -> str | None:
    """None when the live process ``pid`` is the controller ``sub`` launched, else why not (one line).

    A record is data anyone may write, start time included (it can be copied from /proc): the process must
    also run submitit's controller on this record's own folder (under its output dir), from the dir submit
    ran in, as this user."""
    started = sub.pid_starts.get(str(pid))
    if started is None:
        return f"the record names pid {pid} without its start time: it cannot be told from another process"
    if not _same_process(pid, started):
        return f"pid {pid} is not the process that started at the time the record says"
    if not sub.folder or not sub.output_dir or Path(sub.output_dir) not in Path(sub.folder).parents:
        return f"the record's submitit folder {sub.folder!r} is not under its output dir {sub.output_dir!r}"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd")
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError as exc:
        return f"pid {pid} cannot be inspected ({exc.strerror or exc}): not a process of this user's"
    args = [a.decode("utf-8", "replace") for a in (argv[:-1] if argv and not argv[-1] else argv)]
    if uid != os.getuid():
        return f"pid {pid} belongs to another user (uid {uid})"
    if args[1:] != controller_argv(sub.folder) or "python" not in Path(args[0] if args else "").name:
        shown = " ".join(args)[:160] or "(no command line)"
        return f"pid {pid} runs `{shown}`, not this submission's submitit controller"
    recorded = sub.cwd if isinstance(sub.cwd, str) else ""
    if not recorded or os.path.realpath(recorded) != cwd:
        return f"pid {pid} works in {cwd}, not in {recorded or '(no dir recorded)'} where this job was submitted"
    return None


def _same_process(pid: int, started: int | None) -> bool:
    """Process ``pid`` is alive, not a zombie, and is the one that started at ``started``.

    Without a recorded start time the pid cannot be told apart from a later process that reuses it: not ours.
    """
    if started is None or process_start(pid) != started:
        return False
    try:  # a zombie (exited, not reaped) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---------------------------------------------------------------- records on disk

# Each field of a record and the shape it must have (a list's items in the second place).
_RECORD_SHAPE: dict[str, tuple[type | tuple[type, ...], type | tuple[type, ...] | None]] = {
    "executor": (str, None), "job_ids": (list, str), "output_dir": (str, None), "task_dirs": (list, str),
    "folder": (str, None), "mode": (str, None), "submitted_at": ((int, float), None), "source": (str, None),
    "cancelled": (bool, None), "ranks_per_task": (int, None), "job_name": (str, None), "arrays": (list, dict),
    "pid_starts": (dict, int), "avoided": (list, dict),
}
_REQUIRED = ("executor", "job_ids", "output_dir", "task_dirs", "folder")


def _check_record(data: Any) -> None:
    """ValueError unless ``data`` has the shape of a submission record (types only: values are checked where used)."""
    if not isinstance(data, dict):
        raise ValueError(f"a submission record is a JSON object, found a {type(data).__name__}")
    for key in _REQUIRED:
        if key not in data:
            raise ValueError(f"a submission record without {key!r}")
    for key, (kind, item) in _RECORD_SHAPE.items():
        if key not in data:
            continue
        value = data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{key!r} is a {type(value).__name__} in a submission record")
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        if item is not None and not all(isinstance(v, item) for v in items):
            raise ValueError(f"{key!r} holds items of another kind in a submission record")
    for array in data.get("arrays", ()):
        tasks, ranks = array.get("tasks", []), array.get("ranks_per_task", 1)
        if not (isinstance(tasks, list) and all(isinstance(t, int) for t in tasks) and isinstance(ranks, int) and 0 < ranks < 1 << 20):
            raise ValueError("'arrays' holds an entry of another shape in a submission record")
    if not 0 < data.get("ranks_per_task", 1) < 1 << 20:
        raise ValueError("'ranks_per_task' is out of range in a submission record")


def records_path(output_dir: str) -> Path:
    return Path(output_dir) / SUBMISSION_FILE


def _write_records(output_dir: str, records: list[dict[str, Any]]) -> None:
    atomic_write_text(records_path(output_dir), json.dumps({"submissions": records}, indent=2) + "\n")


def load_records(output_dir: str) -> list[dict[str, Any]]:
    path = records_path(output_dir)
    try:
        records = read_json(path, RECORD_CAP).get("submissions", [])
        if not isinstance(records, list):
            raise Unreadable(path, "'submissions' is not a list")
        for record in records:
            _check_record(record)
    except FileNotFoundError:
        return []
    except Unreadable as exc:
        raise SwiftSlurmError("the submission record is unreadable", str(exc), "it is rewritten by the next `swiftslurm submit`") from None
    except ValueError as exc:
        raise SwiftSlurmError("the submission record is unreadable", f"{path}: {exc}", "it is rewritten by the next `swiftslurm submit`") from None
    return records


def load_submission(output_dir: str) -> Submission:
    """The latest submission recorded in an output dir."""
    records = load_records(output_dir)
    if not records:
        raise SwiftSlurmError("no submission recorded here", str(records_path(output_dir)), "pass the job.output_dir of a submitted spec, or a job id")
    return Submission.from_json(records[-1])


def update_record(sub: Submission) -> None:
    records = load_records(sub.output_dir)
    for i, rec in enumerate(records):
        if rec.get("folder") == sub.folder:
            records[i] = sub.to_json()
            break
    else:
        records.append(sub.to_json())
    _write_records(sub.output_dir, records)
