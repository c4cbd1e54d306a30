"""The one door to Slurm: every sbatch/squeue/sacct/scontrol/scancel call lives here.

Calls are argv lists (never a shell string). Parsers of their output are pure functions,
tested on captured real output. Nothing else in swiftslurm runs a Slurm command.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from ..errors import SubmissionError, SwiftSlurmError, ToolMissing
from ..plan import ArrayLimits

SLURM_TIMEOUT_S = 60


def _run(argv: list[str], timeout_s: float = SLURM_TIMEOUT_S, check: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise ToolMissing(
            f"'{argv[0]}' is not on PATH",
            f"PATH has no {argv[0]}",
            "run on a Slurm login node, or use --executor local",
        )
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise SwiftSlurmError(f"'{argv[0]}' did not answer within {timeout_s:.0f} s", " ".join(argv[:3]), "is slurmctld up? try `sinfo`") from None
    if check and proc.returncode != 0:
        raise failed(argv[0], proc)
    return proc


def failed(tool: str, proc: subprocess.CompletedProcess) -> SwiftSlurmError:
    """A Slurm command's non-zero exit, in its own words."""
    return SwiftSlurmError(f"'{tool}' failed (exit {proc.returncode})", (proc.stderr or proc.stdout).strip()[:500], "see Slurm's message above")


def have_slurm() -> bool:
    return shutil.which("sbatch") is not None


def show_hostnames(hostlist: str) -> list[str]:
    """``scontrol show hostnames`` (for cross-checks; swiftslurm itself expands with python-hostlist)."""
    return _run(["scontrol", "show", "hostnames", hostlist]).stdout.split()


def parse_array_limits(text: str) -> ArrayLimits:
    """The array caps in ``scontrol show config`` output (pure): MaxArraySize, and SchedulerParameters'
    ``max_array_tasks``. A missing or unreadable value is no cap."""
    config = parse_scontrol_config(text)
    size = config.get("MaxArraySize", "")
    tasks = None
    for item in config.get("SchedulerParameters", "").split(","):
        key, _, value = item.strip().partition("=")
        if key == "max_array_tasks" and value.isdigit():
            tasks = int(value)
    return ArrayLimits(int(size) if size.isdigit() else None, tasks)


def array_limits() -> ArrayLimits:
    """The cluster's array caps (one ``scontrol show config`` call)."""
    return parse_array_limits(_run(["scontrol", "show", "config"]).stdout)


def requeue(job_id: str) -> None:
    """``scontrol requeue`` one job or one array task (``123_4``)."""
    _run(["scontrol", "requeue", job_id])


def job_restarts(job_id: str) -> int:
    """How often Slurm has requeued job ``job_id`` (``scontrol show job``'s Restarts); -1 when it cannot tell."""
    try:
        proc = _run(["scontrol", "show", "job", "-o", job_id], check=False)
    except SwiftSlurmError:
        return -1
    shown = parse_scontrol_job(proc.stdout) if proc.returncode == 0 else []
    value = shown[0].get("Restarts", "") if shown else ""
    return int(value) if value.isdigit() else -1


# ---------------------------------------------------------------- states

# Job state strings of Slurm 22.05-24.11 (squeue %T, sacct State; src/common/slurm_protocol_defs.c).
ACTIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED",
                           "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT", "POWER_UP_NODE", "UPDATE_DB"})
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "REVOKED"})


def normalize_state(raw: str) -> str:
    """``CANCELLED by 0`` -> ``CANCELLED``; ``CANCELLED+`` (cut by a column width) -> ``CANCELLED``."""
    words = raw.split()
    return (words[0].rstrip("+").upper() if words else "") or "UNKNOWN"


def is_final(state: str) -> bool:
    return normalize_state(state) in FINAL_STATES


# ---------------------------------------------------------------- pure parsers


_PARSABLE_RE = re.compile(r"([0-9]+)(?:;[^;\s]+)?", re.ASCII)


def parse_sbatch_parsable(text: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER`` (federation, ``--clusters``), after any warning lines."""
    for line in reversed(text.splitlines()):
        m = _PARSABLE_RE.fullmatch(line.strip())
        if m:
            return m.group(1)
    raise SwiftSlurmError("could not read a job id from sbatch's answer", repr(text[:200]), "run `sbatch --parsable FILE` by hand to see what it says")


MAX_ARRAY_EXPANSION = 1_000_000


def expand_job_ids(job_id: str) -> list[str]:
    """One sacct/squeue JobID as the array tasks it stands for.

    ``123`` -> [``123``]; ``123_4`` -> [``123_4``]; ``123_[2-4,7%2]`` -> [``123_2``, ``123_3``, ``123_4``, ``123_7``].
    """
    job_id = job_id.strip()
    base, sep, rest = job_id.partition("_")
    if not sep or not rest.startswith("[") or not rest.endswith("]"):
        return [job_id]
    body = rest[1:-1].split("%")[0]
    out: list[str] = []
    for part in body.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdecimal() or not lo.isascii() or (dash and not (hi.isdecimal() and hi.isascii())):
            return [job_id]
        last = int(hi if dash else lo)
        if last - int(lo) > MAX_ARRAY_EXPANSION:
            return [job_id]  # not an array we submitted (MaxArraySize is far below this)
        for i in range(int(lo), last + 1):
            out.append(f"{base}_{i}")
    return out


# JobName last: a name may hold '|' (other users' jobs), so it takes the rest of the line.
SACCT_FIELDS = ("JobID", "State", "ExitCode", "NodeList", "Elapsed", "Start", "End", "JobName")


@dataclass(frozen=True)
class JobRecord:
    """One Slurm job (or array task) as sacct/squeue report it."""

    job_id: str  # "123" or "123_4"
    state: str  # normalized: COMPLETED, RUNNING, ...
    exit_code: str = ""
    nodes: str = ""  # Slurm hostlist, "None assigned" -> ""
    elapsed: str = ""
    restarts: int = 0  # earlier runs of this job id (requeues)
    name: str = ""  # job name: after a cluster reset job ids restart at 1, so an id alone is not enough
    reason: str = ""  # squeue's reason (%r) for a live job: why it is pending ("Resources", "JobHeldAdmin", ...)


def parse_sacct(text: str, fields: tuple[str, ...] = SACCT_FIELDS) -> dict[str, JobRecord]:
    """``sacct -X -D -P -n --format=<fields>`` output -> latest record per job id, requeues counted.

    With ``-D`` every run of a requeued job is a line (earlier ones say REQUEUED); the last line
    of a job id is its current run. Array ranges (``123_[2-9%4]``, pending) are expanded.
    """
    col = {name: i for i, name in enumerate(fields)}
    runs: dict[str, list[list[str]]] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.endswith("|") and line.count("|") == len(fields):
            line = line[:-1]  # `sacct -p` ends every line with a separator; `-P` does not
        cells = line.split("|", len(fields) - 1) if fields[-1] == "JobName" else line.split("|")
        if len(cells) < len(fields):
            continue
        job_id = cells[col["JobID"]].strip()
        if "." in job_id or job_id == "JobID":
            continue  # a step (123.batch, 123.extern, 123.0) or a header, not a job
        for jid in expand_job_ids(job_id):
            runs.setdefault(jid, []).append(cells)
    out: dict[str, JobRecord] = {}
    for jid, rows in runs.items():
        last = rows[-1]
        nodes = last[col["NodeList"]] if "NodeList" in col else ""
        out[jid] = JobRecord(
            job_id=jid,
            state=normalize_state(last[col["State"]]),
            exit_code=last[col["ExitCode"]] if "ExitCode" in col else "",
            nodes="" if nodes.startswith("None") else nodes,
            elapsed=last[col["Elapsed"]] if "Elapsed" in col else "",
            restarts=len(rows) - 1,
            name=last[col["JobName"]] if "JobName" in col else "",
        )
    return out


SQUEUE_FORMAT = "%i|%T|%N|%M|%r|%j"


def parse_squeue(text: str) -> dict[str, JobRecord]:
    """``squeue -h -r -o '%i|%T|%N|%M|%r|%j'`` output -> record per job id (pending arrays expanded)."""
    out: dict[str, JobRecord] = {}
    for line in text.splitlines():
        cells = line.split("|", 5)
        if len(cells) < 4 or cells[0].strip() in ("", "JOBID"):
            continue
        name = cells[5] if len(cells) > 5 else ""
        for jid in expand_job_ids(cells[0].strip()):
            out[jid] = JobRecord(jid, normalize_state(cells[1]), "", cells[2].strip(), cells[3].strip(), name=name,
                                 reason=cells[4].strip() if len(cells) > 4 else "")
    return out


# Pending reasons (squeue %r) of a job that stays in the queue until a person acts: it never starts by itself.
# "launch failed requeued held": the job's start failed on its node (or met a `scontrol reconfigure`) and Slurm held it.
LAUNCH_FAILED_HELD = "launch failed requeued held"
HELD_REASONS = {
    LAUNCH_FAILED_HELD: "its start failed on the node and Slurm held it",
    "JobHeldAdmin": "an administrator holds it",
    "JobHeldUser": "held by its user (`scontrol hold`, or sbatch --hold)",
    "JobHoldMaxRequeue": "held after Slurm requeued it the most times it may",
    "job requeued in held state": "requeued in held state (`scontrol requeuehold`)",
}


# Pending reasons of a job Slurm will not start as it was submitted: it waits until the job, or its partition, QOS or
# account, is changed by a person, so a wait for it would never end. "PartitionConfig" is captured from the test
# cluster (tests/data/slurm/22.05/squeue_launch_failed_held.txt: a job asking more CPUs than a node of its partition
# has); the others are Slurm's documented codes for limits a job's own request breaks (not ones that other jobs' usage
# lifts: ``AssocGrp*``, ``QOSGrp*``, ``Resources`` and ``ReqNodeNotAvail`` pass by themselves).
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than its partition offers (a node's CPUs, memory or GPUs, or more nodes)",
    "BadConstraints": "no node has the features or the mix of resources it asks for",
    "PartitionTimeLimit": "its time limit is over its partition's MaxTime",
    "DependencyNeverSatisfied": "a job it depends on ended so that its dependency can never be met",
    "InvalidAccount": "its account is not valid, or not allowed on its partition",
    "InvalidQOS": "its QOS is not valid, or not allowed on its partition",
    "QOSMaxWallDurationPerJobLimit": "its time limit is over its QOS's MaxWall",
    "AssocMaxWallDurationPerJobLimit": "its time limit is over its association's MaxWall",
    "QOSMaxNodePerJobLimit": "it asks for more nodes than its QOS allows a job",
    "AssocMaxNodesPerJobLimit": "it asks for more nodes than its association allows a job",
    "QOSMaxCpuPerJobLimit": "it asks for more CPUs than its QOS allows a job",
    "AssocMaxCpuPerJobLimit": "it asks for more CPUs than its association allows a job",
    "QOSMaxGRESPerJob": "it asks for more GPUs (GRES) than its QOS allows a job",
    "QOSMaxMemoryPerJob": "it asks for more memory than its QOS allows a job",
}


def held_reason(rec: JobRecord) -> str | None:
    """Why a pending job is held (its squeue reason in words), or None: a held job waits for `scontrol release`."""
    if rec.state == "REQUEUE_HOLD":
        return f"REQUEUE_HOLD: {HELD_REASONS['job requeued in held state']}"
    return _pending_reason(rec, HELD_REASONS)


def never_starts(rec: JobRecord) -> str | None:
    """Why a pending job will not start as submitted (its squeue reason in words, ``NEVER_STARTS``), or None."""
    return _pending_reason(rec, NEVER_STARTS)


def _pending_reason(rec: JobRecord, table: dict[str, str]) -> str | None:
    """A pending job's squeue reason with its words in ``table`` ("reason: words"), or None."""
    words = table.get(rec.reason) if rec.state == "PENDING" else None
    return f"{rec.reason}: {words}" if words else None


def merge_records(sacct: dict[str, JobRecord], squeue: dict[str, JobRecord]) -> dict[str, JobRecord]:
    """sacct is the record of finished runs and requeues; squeue is fresher for live ones."""
    out = dict(sacct)
    for jid, live in squeue.items():
        acc = sacct.get(jid)
        if acc is None:
            out[jid] = live
        elif not is_final(acc.state) or acc.restarts:
            out[jid] = JobRecord(jid, live.state, acc.exit_code, live.nodes or acc.nodes, live.elapsed or acc.elapsed, acc.restarts,
                                 acc.name or live.name, live.reason)
    return out


# ---------------------------------------------------------------- calls


def sbatch(script_path: str, extra: list[str] | None = None, env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable [extra] FILE`` -> job id; a refusal is a SubmissionError with Slurm's reason. ``env``: the
    environment sbatch runs in (and the job inherits); None = this process's."""
    proc = _run(["sbatch", "--parsable", *(extra or []), script_path], check=False, env=env)
    if proc.returncode != 0:
        raise refusal(proc.stderr or proc.stdout)
    return parse_sbatch_parsable(proc.stdout)


def refusal(slurm_message: str) -> SubmissionError:
    """Slurm's own words for a refused submission, as one SubmissionError."""
    lines = [ln.strip() for ln in slurm_message.strip().splitlines() if ln.strip()]
    reason = "; ".join(ln.removeprefix("sbatch: error: ") for ln in lines if "error" in ln.lower()) or "; ".join(lines)
    return SubmissionError(
        "Slurm refused the submission",
        reason[:800] or "(sbatch gave no reason)",
        "check partition/account/qos/nodes/time against `sinfo` and `sacctmgr show assoc`; `swiftslurm plan SPEC` shows what was asked",
    )


def is_of(job_id: str, asked: str) -> bool:
    """Is the row ``job_id`` (sacct/squeue's JobID) the asked job ``123`` (itself or a task ``123_4``) or the asked
    task ``123_4``? ``sacct -j 123`` also lists a task of another array whose raw id is 123 (``98_0``: a split-off
    array task takes the next free id, and Slurm hands an id out again once it forgot the job), which is not it."""
    return job_id == asked or ("_" not in asked and job_id.partition("_")[0] == asked)


def task_record(records: dict[str, JobRecord], job_id: str) -> JobRecord | None:
    """The record of ``job_id`` (``123``, or an array task ``123_4``) among ``records`` (pure). An array cancelled
    before any of its tasks started is one sacct row under its bare id (``123``, no ``_[0-3]`` range; captured:
    tests/data/slurm/sacct_array_cancelled_pending.txt): that row stands for each of its tasks without a row."""
    found = records.get(job_id)
    base, sep, _ = job_id.partition("_")
    return records.get(base) if found is None and sep else found


def records_of(records: dict[str, JobRecord], job_ids: list[str]) -> dict[str, JobRecord]:
    """Only the records of the asked jobs (``is_of``)."""
    return {jid: rec for jid, rec in records.items() if any(is_of(jid, asked) for asked in job_ids)}


def job_records(job_ids: list[str]) -> dict[str, JobRecord]:
    """Current record of each job (``123``) or array (``123`` covers ``123_*``), from sacct and squeue."""
    if not job_ids:
        return {}
    joined = ",".join(sorted(set(job_ids)))
    acc = _run(["sacct", "-X", "-D", "-P", "-n", "-j", joined, f"--format={','.join(SACCT_FIELDS)}"], check=False)
    live = _run(["squeue", "-h", "-r", "-j", joined, "-o", SQUEUE_FORMAT], check=False)
    sacct_records = parse_sacct(acc.stdout) if acc.returncode == 0 else {}
    squeue_records = parse_squeue(live.stdout) if live.returncode == 0 else {}
    if acc.returncode != 0 and live.returncode != 0:
        raise SwiftSlurmError("neither sacct nor squeue could report the job", (acc.stderr or live.stderr).strip()[:300],
                              "is slurmctld up (`sinfo`)? is accounting configured (`sacct`)?")
    return records_of(merge_records(sacct_records, squeue_records), job_ids)


def scancel(job_ids: list[str], name: str = "") -> None:
    """``scancel`` jobs or array tasks (``123`` cancels every task of array 123). ``name``: only those of that job
    name (``--name``): Slurm hands an id out again once it forgot the job (``is_of``), and a record's id may by then
    be another job of the same user, which must not be stopped."""
    if not job_ids:
        return
    proc = _run(["scancel", *([f"--name={name}"] if name else []), *job_ids], check=False)
    errors = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    # with --name, a job that already ended is "Invalid job id specified" (exit 1); without, scancel says nothing
    if proc.returncode != 0 and not (errors and all(ln.rstrip().endswith("Invalid job id specified") for ln in errors)):
        raise failed("scancel", proc)


# ---------------------------------------------------------------- the job's end time (deadline-aware saving)

_NO_END = {"", "N/A", "NONE", "UNKNOWN", "UNLIMITED", "INVALID"}


def parse_end_time(text: str) -> float | None:
    """``squeue -h -j ID -o %e`` output -> the end time as epoch seconds, or None when Slurm gives none (pure).

    Slurm prints local time, ``2026-12-01T10:45:03``; ``N/A``/``Unknown``/``NONE`` mean no end time (pending, or
    no time limit). Only the first line counts (one job).
    """
    import datetime

    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    if first.upper() in _NO_END:
        return None
    try:
        return datetime.datetime.strptime(first, "%Y-%m-%dT%H:%M:%S").timestamp()  # naive: local time, as squeue prints
    except ValueError:
        return None


def job_end_time(job_id: str) -> float | None:
    """When Slurm will end job ``job_id`` (``123`` or ``123_4``), as epoch seconds; None when it cannot tell."""
    proc = _run(["squeue", "-h", "-j", job_id, "-o", "%e"], check=False)
    return parse_end_time(proc.stdout) if proc.returncode == 0 else None


# ---------------------------------------------------------------- preflight: exclude bad nodes and requeue


_SHOW_KEY_RE = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_job(text: str) -> list[dict[str, str]]:
    """``scontrol show job [-o]`` output -> one dict of ``Key: value`` per job (pure).

    Values may hold spaces (``Command=/runs/my run/job.sh``, a ``Comment``) and ``=`` (``TRES=cpu=4,node=1``):
    a key is a word followed by ``=`` after whitespace, and a key's first occurrence wins, so a comment
    that says ``ExcNodeList=x`` after the real field cannot replace it.
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if any(ln[0].isspace() for ln in lines):  # the multi-line layout: indented continuation lines, a blank line between jobs
        records = [" ".join(block.split("\n")) for block in re.split(r"\n\s*\n", text.strip())]
    else:  # `-o`: one job per line
        records = lines
    out = []
    for record in records:
        fields: dict[str, str] = {}
        keys = list(_SHOW_KEY_RE.finditer(record))
        for k, m in enumerate(keys):
            end = keys[k + 1].start() if k + 1 < len(keys) else len(record)
            fields.setdefault(m.group(1), record[m.end():end].strip())
        if fields:
            out.append(fields)
    return out


def shown_id(fields: dict[str, str]) -> str:
    """The id sacct/squeue show for a ``scontrol show job`` record: ``ArrayJobId_ArrayTaskId`` for an array task
    (its ``JobId`` is the raw id), else ``JobId`` (pure)."""
    array, task = fields.get("ArrayJobId", ""), fields.get("ArrayTaskId", "")
    return f"{array}_{task}" if array and task else fields.get("JobId", "")


def parse_scontrol_config(text: str) -> dict[str, str]:
    """``scontrol show config`` output -> ``{Key: value}`` (pure); section titles and status lines are skipped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        key = key.strip()
        if sep and key and " " not in key:
            out.setdefault(key, value.strip())
    return out


def show_config() -> dict[str, str]:
    """The controller's configuration (``scontrol show config``)."""
    return parse_scontrol_config(_run(["scontrol", "show", "config"]).stdout)


def parse_exc_node_list(show_job: str) -> str:
    """``ExcNodeList`` from ``scontrol show job -o`` output; "" when it is ``(null)`` or empty (pure)."""
    jobs = parse_scontrol_job(show_job)
    value = jobs[0].get("ExcNodeList", "") if jobs else ""
    return "" if value in ("(null)", "") else value


def parse_req_node_list(show_job: str) -> str:
    """``ReqNodeList`` (sbatch --nodelist) from ``scontrol show job -o`` output; "" when none (pure)."""
    jobs = parse_scontrol_job(show_job)
    value = jobs[0].get("ReqNodeList", "") if jobs else ""
    return "" if value in ("(null)", "") else value


def merge_exclude(current: str, nodes: list[str]) -> str:
    """A hostlist of the job's current excluded nodes plus ``nodes`` (pure)."""
    import hostlist

    names = set(hostlist.expand_hostlist(current)) if current else set()
    return hostlist.collect_hostlist(sorted(names | set(nodes)))


def required_among(req_node_list: str, nodes: list[str]) -> list[str]:
    """The ``nodes`` the job requires by name (--nodelist): excluding one leaves it pending forever (pure)."""
    import hostlist

    required = set(hostlist.expand_hostlist(req_node_list)) if req_node_list else set()
    return sorted(required & set(nodes))


def exclude_and_requeue(job_id: str, nodes: list[str]) -> str:
    """Requeue a running job (or array task ``123_4``) with ``nodes`` added to its ExcNodeList.

    Slurm only updates ExcNodeList of a pending job. ``requeue`` then ``update``, never
    ``requeuehold``/``release``: whatever fails or is killed between the calls, the job is never left
    held. The update lands before the rerun can start: a requeued job stays COMPLETING (unschedulable)
    while the caller, one of its processes, is alive. Called from inside the job: the caller must
    ignore SIGTERM meanwhile, since the requeue signals the job's own steps. Returns the new
    ExcNodeList; a SwiftSlurmError says whether the job was requeued without the exclusion.
    """
    show = _run(["scontrol", "show", "job", "-o", job_id]).stdout
    required = required_among(parse_req_node_list(show), nodes)
    if required:
        raise SwiftSlurmError(
            f"cannot exclude {','.join(required)}: the job requires it by name",
            f"ReqNodeList={parse_req_node_list(show)}",
            "remove the node from slurm.nodelist (sbatch --nodelist); the job was not requeued",
        )
    merged = merge_exclude(parse_exc_node_list(show), nodes)
    _run(["scontrol", "requeue", job_id])
    try:
        _run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={merged}"])
    except SwiftSlurmError as exc:
        raise SwiftSlurmError(
            f"job {job_id} was requeued, but Slurm refused ExcNodeList={merged}", exc.found,
            "it reruns without the exclusion; set slurm.exclude in the spec and resubmit",
        ) from None
    return merged


# ---------------------------------------------------------------- the nodes a job may get (the ledger's exclusion)

UNUSABLE_STATES = ("down", "drain", "drng", "fail", "maint", "inval", "futr", "unk", "npc", "reboot")


def parse_sinfo_nodes(text: str, partition: str | None) -> list[str]:
    """The usable nodes of ``partition`` (None: the default one, marked ``*``) from ``sinfo -h -N -o %N|%P|%t``
    (pure). Down, drained, failed or not responding (``*``) nodes are not usable; a powered-down one (``idle~``) is
    booted for a job, so it is."""
    out: list[str] = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        node, part, state = parts
        mine = part.endswith("*") if partition is None else part.rstrip("*") == partition
        if mine and not state.endswith("*") and not state.rstrip("~#!%$@^-+").lower().startswith(UNUSABLE_STATES):
            out.append(node)
    return sorted(set(out))


def partition_nodes(partition: str | None) -> list[str] | None:
    """The usable nodes of a partition (None: the default partition); None when sinfo does not answer."""
    proc = _run(["sinfo", "-h", "-N", "-o", "%N|%P|%t"], check=False)
    return parse_sinfo_nodes(proc.stdout, partition) if proc.returncode == 0 else None


# ---------------------------------------------------------------- where a job wrote (doctor JOB_ID)


def parse_batch_script(show_job: str) -> str:
    """``Command`` (the batch script's path as sbatch was given it, absolute) from ``scontrol show job -o`` output;
    "" when none is shown (pure)."""
    jobs = parse_scontrol_job(show_job)
    value = jobs[0].get("Command", "") if jobs else ""
    return "" if value in ("(null)", "") else value


def batch_script(job_id: str) -> str:
    """The path of the batch script job ``job_id`` was submitted from (the singleton chain resubmits it); "" when
    slurmctld does not say."""
    return parse_batch_script(_run(["scontrol", "show", "job", "-o", job_id]).stdout)


def submit_line_paths(line: str) -> list[str]:
    """The absolute paths in sacct's SubmitLine, the sbatch command line as it was run (pure): the script (submitit's
    lies in the output dir), ``--output=/...``, ``--chdir=/...``. Slurm joins the words with spaces, so a path
    holding one is not found whole."""
    paths = []
    for word in line.split():
        value = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
        if value.startswith("/"):
            paths.append(value)
    return paths


def job_paths(job_id: str) -> list[str]:
    """Paths a job wrote to or ran in (StdErr, StdOut, WorkDir), from ``scontrol show job`` while slurmctld
    remembers it (MinJobAge after its end, 300 s by default), then sacct's WorkDir and the paths of its SubmitLine;
    [] when neither knows the job."""
    show = _run(["scontrol", "show", "job", "-o", job_id], check=False)
    paths: list[str] = []
    if show.returncode == 0:
        for fields in parse_scontrol_job(show.stdout):
            if is_of(shown_id(fields), job_id):
                paths += [fields[k] for k in ("StdErr", "StdOut", "WorkDir") if fields.get(k)]
    if not paths:
        acc = _run(["sacct", "-X", "-P", "-n", "-j", job_id, "--format=JobID,WorkDir,SubmitLine"], check=False)
        for row in [ln.split("|", 2) for ln in acc.stdout.splitlines()] if acc.returncode == 0 else []:
            if len(row) >= 2 and is_of(row[0].strip(), job_id):  # SubmitLine may hold "|": it is the rest of the row
                paths += [p for p in [row[1].strip(), *submit_line_paths(row[2] if len(row) == 3 else "")] if p]
    return list(dict.fromkeys(paths))
