"""Job steps inside an allocation, for the in-job restart: where a step runs, and which nodes Slurm lost.

``placement(nodes, ranks_per_node)`` is the srun options that put a step on exactly those nodes (pure);
``start_step(argv, env)`` starts one (``srun`` as an argv list, its stderr piped for the supervisor to read);
``node_states(nodes)`` asks ``sinfo`` how Slurm sees them, parsed by ``parse_node_states`` (pure).

A step started right after one that lost a node can be refused as "Requested nodes are busy": the old step's
processes may still be ending on a surviving node, and after Slurm resized the job for the lost node it can go on
counting the old step's CPUs as used for good (Slurm 22.05: "unable to update job's core use information due to
job resizing"; a step asking for explicit CPUs per task on that node is refused from then on, while a plain
``srun`` waits for a wake-up that never comes). So a step started after a failure asks with ``--immediate``
(``STEP_START_S``), is asked for again while Slurm says busy (``busy``), and after ``SETTLE_S`` of refusals
with ``--overlap`` too (the failed step is gone; only its count is left).
"""

from __future__ import annotations

import re
import subprocess
import time

from .commands import UNUSABLE_STATES, _run

PROBE_TIMEOUT_S = 120
PROBE_CONCURRENCY = 32  # probe steps at once: 64 pipes (under a 1024 soft limit at any allocation size), 32 step requests
STEP_START_S = 5  # srun --immediate for a step after a failure: refused when not started in this long, then asked again
RETRY_PAUSE_S = 1.0
SETTLE_S = 10.0  # refused as busy for this long after a failure: the next try shares the CPUs (--overlap)
# srun --immediate's refusal when Slurm counts the nodes' CPUs as used by a step (one ending, or one gone after a resize)
BUSY = re.compile(r"Unable to create step for job \S+: .*(busy|temporarily)", re.I)


def after_failure(refused_for: float | None) -> list[str]:
    """srun options of a step started after a failure that Slurm has refused as busy for ``refused_for`` seconds
    (None: not refused yet) (pure)."""
    return [f"--immediate={STEP_START_S}"] + (["--overlap"] if refused_for is not None and refused_for >= SETTLE_S else [])


def busy(stderr: str) -> bool:
    """srun's stderr says Slurm refused the step only because its nodes are still busy (pure)."""
    return any(BUSY.search(line) for line in stderr.splitlines())


def placement(nodes: tuple[str, ...], ranks_per_node: int) -> list[str]:
    """srun options for a step of ``len(nodes) x ranks_per_node`` tasks on exactly ``nodes`` (pure). Explicit counts:
    the batch environment's SLURM_NTASKS / SLURM_NNODES describe the whole allocation, spares included."""
    return [f"--nodes={len(nodes)}", f"--ntasks={len(nodes) * ranks_per_node}", f"--ntasks-per-node={ranks_per_node}",
            f"--nodelist={','.join(nodes)}"]


def with_options(srun_argv: list[str], options: list[str]) -> list[str]:
    """``srun OPTIONS... rest``: options right after the program name, so they come before the command (pure)."""
    if not srun_argv or srun_argv[0].rsplit("/", 1)[-1] != "srun":
        raise ValueError(f"not an srun command line: {srun_argv[:3]}")
    return [srun_argv[0], *options, *srun_argv[1:]]


def start_step(argv: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Start ``srun ...`` (stdout passed through, stderr piped, line by line, for srun's own error lines)."""
    return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)


def parse_node_states(text: str) -> dict[str, str]:
    """``sinfo -h -N -o %N|%t`` -> {node: state} (pure; a node listed twice, in two partitions, once)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        node, sep, state = line.strip().partition("|")
        if sep and node:
            out[node] = state.strip()
    return out


def unusable(state: str) -> bool:
    """A state in which a node cannot run a step: down, drained, failed, not responding (``*``) (pure)."""
    return state.endswith("*") or state.rstrip("~#!%$@^-+").lower().startswith(UNUSABLE_STATES)


LOST_STATES = ("down", "fail", "npc", "unk")  # what a lost node shows; drain, drng, maint, reboot are an admin's doing


def lost(state: str) -> bool:
    """A node this run lost: down, failed (or failing), not responding (``*``). A drained or draining node, or one in
    maintenance, is an admin's decision about later work, not a failure of this run's (pure)."""
    return state.endswith("*") or state.rstrip("~#!%$@^-+").lower().startswith(LOST_STATES)


QUERY_TIMEOUT_S = 20.0  # one answer of sinfo/scontrol for a restart decision; asked twice, then "unknown"
QUERY_TRIES = 2


def _ask(argv: list[str]) -> subprocess.CompletedProcess | None:
    """A query slurmctld may be too busy to answer: tried ``QUERY_TRIES`` times, None when it never answered."""
    from ..errors import SwiftSlurmError, ToolMissing

    for attempt in range(QUERY_TRIES):
        try:
            return _run(argv, timeout_s=QUERY_TIMEOUT_S, check=False)
        except ToolMissing:
            raise
        except SwiftSlurmError:  # no answer in time
            if attempt + 1 < QUERY_TRIES:
                time.sleep(1.0)
    return None


def node_states(nodes: tuple[str, ...]) -> dict[str, str]:
    """How Slurm sees ``nodes`` now; {} when sinfo does not answer (an error, or no answer twice in time)."""
    if not nodes:
        return {}
    proc = _ask(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N|%t"])
    return parse_node_states(proc.stdout) if proc is not None and proc.returncode == 0 else {}


def job_nodes(job_id: str) -> tuple[str, ...] | None:
    """The nodes a job holds now (``scontrol show job``: a node Slurm lost under ``--no-kill`` leaves the list); None
    when it does not answer."""
    from .commands import parse_scontrol_job, show_hostnames

    proc = _ask(["scontrol", "show", "job", "-o", job_id])
    jobs = parse_scontrol_job(proc.stdout) if proc is not None and proc.returncode == 0 else []
    hostlist = jobs[0].get("NodeList", "") if jobs else ""
    if not hostlist or hostlist == "(null)":
        return None
    try:
        return tuple(show_hostnames(hostlist))
    except Exception:  # noqa: BLE001 -- advice only: the caller falls back to sinfo
        return None


def probe(nodes: tuple[str, ...], command: list[str], env: dict[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, subprocess.CompletedProcess]:
    """``command`` as one single-task step on each node, all at once (the restart's short preflight): node -> its result
    (exit 124 when it did not end in time). One step per node, so a node Slurm cannot start a step on fails alone.
    A step Slurm refuses because the node is still busy (the failed step ending there) is asked for again until
    ``timeout_s``; the last refusal is the node's result then."""
    start = time.monotonic()
    deadline = start + timeout_s
    out: dict[str, subprocess.CompletedProcess] = {}
    todo = list(nodes)
    refused = False
    while todo:
        options = after_failure(time.monotonic() - start if refused else None)
        batch, later = todo[:PROBE_CONCURRENCY], todo[PROBE_CONCURRENCY:]  # bounded: two pipes a step, and slurmctld
        procs = {n: subprocess.Popen(["srun", *placement((n,), 1), *options, "--unbuffered", *command], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace") for n in batch}
        todo = later
        for node, proc in procs.items():
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out[node] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                out[node] = subprocess.CompletedProcess(proc.args, 124, stdout, stderr)
            if out[node].returncode != 0 and busy(out[node].stderr) and time.monotonic() + RETRY_PAUSE_S < deadline:
                todo.append(node)
                refused = True
        if todo and not later:
            time.sleep(RETRY_PAUSE_S)
    return out
