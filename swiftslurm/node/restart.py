"""In-job restart: after a training step fails, start it again inside the same allocation (pure, plus its record).

The supervisor (``node/batch/supervise.py``) runs the training step, and when it ends non-zero asks two questions here:
what happened (``cause_of``: over srun's own error lines, the ranks' failure records, the watchdog's hang
verdict and the nodes Slurm reports down) and what to do (``decide_restart``: again, on which nodes, or stop).
Each answer is one record in ``<task dir>/restarts.json`` (``records/restarts.py``: ``record_restart``), which
``status``, ``doctor`` and ``plot`` read there (``read_restarts``).

A node is dropped when it cannot be used again (Slurm marked it down, its rank died with a hardware-looking
error, it failed the restart's probe, the watchdog named it as the rank that stopped) and a spare
(``slurm.spare_nodes``) can take its place; a down node is dropped even without a spare, and then the run stops
(there is no smaller world to resume into here). Without a spare, a named culprit of a hang or a hardware error
keeps its place: the restart may still clear it, and ``max_restarts`` bounds the attempts either way.

Walltime stops (``requeues.json``), a refused start (the preflight's exit 4) and a clean end are never restarted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import hostlist

from ..records.restarts import RestartRecord, job_restarts, no_progress_streak, read_restarts, record_restart  # noqa: F401  (the supervisor's door to its record)

if TYPE_CHECKING:
    from ..spec.model import JobSpec

# srun's own line when a task ends badly: "srun: error: node2: task 1: Killed", "... tasks 0-1: Exited with exit code 1"
SRUN_ERROR = re.compile(r"^srun: error: (?P<node>[A-Za-z0-9][A-Za-z0-9._-]*): tasks? (?P<tasks>[0-9][0-9,\-]*): (?P<msg>.+?)\s*$")
# what a node failure looks like from srun's side (the node, not the program, went away)
NODE_LOST = re.compile(r"node fail|Node failure|not responding|lost connection|Unable to contact slurm node|is DOWN", re.I)
# a rank that died of the hardware under it: do not restart it on the same node when a spare can take its place
# a verdict on the node's hardware: ECC, an Xid, a GPU fallen off the bus. Not "Bus error" (SIGBUS is also an exhausted
# /dev/shm or a truncated mmapped file) nor ncclUnhandledCudaError (any CUDA error inside NCCL): those are rank failures
HARDWARE = re.compile(r"uncorrectable ECC|ECC error|\bXid\b|fallen off the bus|cudaErrorECCUncorrectable|NVLink error|GPU is lost", re.I)
HANG, NODE_FAILURE, HARDWARE_FAULT, RANK_KILLED, RANK_FAILED, PROBE = "hang", "node_failure", "hardware", "rank_killed", "rank_failed", "probe"


@dataclass(frozen=True)
class SrunError:
    node: str
    tasks: str  # "1", "0-1"
    message: str  # "Killed", "Exited with exit code 1"

    def line(self) -> str:
        return f"task {self.tasks} on {self.node}: {self.message}"


# srun's line when Slurm lost a node of the step (a node set DOWN, a dead slurmd): "srun: error: Node failure on node3"
SRUN_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (?P<node>[A-Za-z0-9][A-Za-z0-9._-]*)\s*$")


def parse_srun_error(line: str) -> SrunError | None:
    """srun's report of a task that ended badly, or of a node it lost, from one line of its stderr (pure)."""
    m = SRUN_ERROR.match(line.strip())
    if m:
        return SrunError(m["node"], m["tasks"], m["msg"])
    lost = SRUN_NODE_FAILURE.match(line.strip())
    return SrunError(lost["node"], "-", "Node failure") if lost else None


@dataclass(frozen=True)
class StepEnd:
    """What is known about a training step that ended (the supervisor gathers it; ``cause_of`` reads it)."""

    rc: int
    nodes: tuple[str, ...]  # the nodes it ran on
    srun_errors: tuple[SrunError, ...] = ()
    failures: tuple[tuple[int, str, str], ...] = ()  # (rank, node, what) from the ranks' records of this step
    hang: dict[str, Any] | None = None  # the watchdog's verdict (logs/hang.json) written during this step
    down: tuple[str, ...] = ()  # of ``nodes``, those Slurm now reports down, drained or failed


@dataclass(frozen=True)
class Cause:
    kind: str  # hang | node_failure | hardware | rank_killed | rank_failed | probe
    detail: str  # one line, for people
    suspects: tuple[str, ...] = ()  # nodes to replace when a spare can take their place
    gone: tuple[str, ...] = ()  # nodes that cannot run anything again in this job (dropped with or without a spare)


def listed(nodes: Iterable[str]) -> str:
    """Node names as Slurm writes a list of them (``node[1-31,33-65]``): a restart's line at 4096 nodes stays a line."""
    names = list(nodes)
    try:
        return hostlist.collect_hostlist(names)
    except Exception:  # noqa: BLE001 -- a name python-hostlist cannot fold: plain, as given
        return ", ".join(names)


def cause_of(end: StepEnd) -> Cause:
    """Why the step ended (pure): a node Slurm lost, the watchdog's hang verdict, a hardware-looking error, a rank
    that was killed or that failed, first match wins."""
    lost = tuple(dict.fromkeys([*end.down, *(e.node for e in end.srun_errors if NODE_LOST.search(e.message) and e.node in end.nodes)]))
    if lost:
        return Cause(NODE_FAILURE, f"node(s) {listed(lost)} failed or went down (Slurm)", lost, lost)
    if end.hang is not None:
        culprit = str(end.hang.get("node") or "")
        who = f"rank {end.hang.get('rank')} on {culprit}" if culprit else "no rank named"
        return Cause(HANG, f"no training step for {end.hang.get('limit_s', '?')} s (watchdog; {who}): "
                     f"{str(end.hang.get('detail') or '')[:300]}".rstrip(": "), (culprit,) if culprit in end.nodes else ())
    for rank, node, what in end.failures:
        if HARDWARE.search(what):
            return Cause(HARDWARE_FAULT, f"rank {rank} on {node}: {what[:300]}", (node,) if node in end.nodes else ())
    for e in end.srun_errors:
        if HARDWARE.search(e.message):
            return Cause(HARDWARE_FAULT, e.line(), (e.node,) if e.node in end.nodes else ())
    # srun reports tasks in the order they ended: the first one killed is the origin (the others' errors, "connection
    # reset by peer", followed from it); a rank that raised says more in its own record than srun's exit code
    if end.srun_errors and _by_signal(end.srun_errors[0].message):
        return Cause(RANK_KILLED, end.srun_errors[0].line())
    if end.failures:
        rank, node, what = end.failures[0]
        return Cause(RANK_FAILED, f"rank {rank} on {node}: {what[:300]}")
    if end.srun_errors:
        first = end.srun_errors[0]
        return Cause(RANK_KILLED if _by_signal(first.message) else RANK_FAILED, first.line())
    return Cause(RANK_FAILED, f"the training step exited with {end.rc}")


def _by_signal(message: str) -> bool:
    """srun's word for a task a signal ended: "Killed", "Segmentation fault", "Aborted", "Terminated", "... signal N"."""
    return bool(re.search(r"Killed|Segmentation fault|Aborted|Terminated|Bus error|signal", message))


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    nodes: tuple[str, ...]  # where the next step runs (empty when not restarted)
    dropped: tuple[str, ...]  # nodes taken out of the job now
    message: str


def decide_restart(done: int, max_restarts: int, cause: Cause, current: Iterable[str], allocation: Iterable[str],
                   excluded: Iterable[str], need: int, shrink: bool = False) -> RestartDecision:
    """Restart again unless ``max_restarts`` were made already or too few usable nodes are left (pure).

    ``current``: the failed step's nodes; ``allocation``: the job's (spares included); ``excluded``: dropped earlier.
    Surviving nodes keep their place; a dropped one is replaced by the first unused node of the allocation. With
    ``shrink`` (slurm.shrink_on_failure) and no spare left, the step restarts on the nodes that remain.
    """
    current, allocation = tuple(current), tuple(allocation)
    out = set(excluded)
    if done >= max_restarts:
        return RestartDecision(False, (), (), f"not restarted: max_restarts reached (slurm.max_restarts = {max_restarts}, "
                               f"{done} restart(s) made) after: {cause.detail}")
    spare = [n for n in allocation if n not in out and n not in current and n not in cause.suspects and n not in cause.gone]
    drop = tuple(dict.fromkeys([*cause.gone, *(n for n in cause.suspects if len(spare) >= len(set(cause.suspects) | set(cause.gone)))]))
    keep = [n for n in current if n not in drop]
    nodes = tuple(keep + spare[: max(0, need - len(keep))])
    if len(nodes) < need and shrink and nodes:
        return RestartDecision(True, nodes, drop, f"restart {done + 1} of at most {max_restarts} on {len(nodes)} of {need} node(s) "
                               f"({listed(nodes)}; dropped {listed(drop)}; no spare left, slurm.shrink_on_failure): fewer "
                               f"data-parallel ranks from here on, after: {cause.detail}")
    if len(nodes) < need:
        return RestartDecision(False, (), drop, f"not restarted: {cause.detail}; {len(nodes)} usable node(s) left of the {need} "
                               f"training needs (no spare left). HINT: give the job spares (slurm.spare_nodes), or resubmit; "
                               f"the run continues from the newest verified checkpoint")
    how = f" on {listed(nodes)}" + (f" (dropped {listed(drop)})" if drop else "")
    return RestartDecision(True, nodes, drop, f"restart {done + 1} of at most {max_restarts}{how} after: {cause.detail}")


def progress_guard(streak: int, limit: int, cause: Cause, committed: int | None) -> RestartDecision | None:
    """Not restarted when ``limit`` attempts in a row made no progress (``slurm.no_progress_attempts``; 0: never)."""
    if not limit or streak < limit:
        return None
    newest = f"newest committed step {committed}" if committed is not None else "no checkpoint committed yet"
    return RestartDecision(False, (), (), f"not restarted, stopped for good: no progress in {streak} attempt(s) in a row ({newest}); "
                           f"the last cause was: {cause.detail}. Restarting would fail the same way: fix the cause, then "
                           "resubmit (slurm.no_progress_attempts sets how many such attempts are allowed)")


STEP_NODES_ENV = "SWIFTSLURM_STEP_NODES"  # the step's environment after a shrink: how many nodes it runs on
PROBE_MASTER_ENV = "SWIFTSLURM_PROBE_MASTER"  # the restart probe's: the next step's master node (its MASTER_PORT is checked)


def step_spec(spec: JobSpec, environ: Mapping[str, str]) -> JobSpec:
    """The spec a rank of a shrunk step checks its allocation against: ``slurm.nodes`` from the supervisor (pure).
    Only fewer nodes, and only where the spec allows it; otherwise the spec as it is."""
    raw = environ.get(STEP_NODES_ENV, "")
    if not (raw.isascii() and raw.isdigit()) or not spec.slurm.shrink_on_failure or not 0 < int(raw) < spec.slurm.nodes:
        return spec
    return spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"nodes": int(raw)})})


def step_ds_config(ds_config: dict[str, Any], spec: JobSpec) -> dict[str, Any]:
    """The plan's DeepSpeed dict for a step of ``spec`` (``step_spec``'s): after a shrink, ``train_batch_size`` is
    micro x accumulation x the smaller world, the value HF Trainer checks the dict against (pure). Fewer
    data-parallel ranks make a smaller global batch; micro-batch and accumulation stay what the spec says."""
    if not ds_config or "train_batch_size" not in ds_config:
        return ds_config
    t = spec.train
    return {**ds_config, "train_batch_size": t.per_device_train_batch_size * t.gradient_accumulation_steps * spec.world_size}
