"""The gate before training: run the checks, write the report, act on ``preflight.on_failure``.

Called on every rank by ``runtime.run_task``. Rank 0 decides (a pure ``decide`` over the results),
writes ``<output_dir>/preflight/report.json`` and ``busbw.png``, prints the table, and broadcasts the
decision through the preflight store; the other ranks return what rank 0 decided (or False when rank 0
cannot be heard from within the timeout).

On "exclude" (requeue without the bad nodes) the other ranks do not exit until rank 0 says it is done:
under ``srun --kill-on-bad-exit=1`` (the rendered script) their exit, or their death by the SIGTERM the
requeue sends to the job's steps, would make srun kill rank 0 between its Slurm calls.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from ..spec import CHECKS
from .coord import CoordinationError
from .report import build_report, print_report, write_report
from .results import Decision, decide
from .run import GATHER_GRACE_S, run_checks

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv
    from ..spec.model import JobSpec

ACK_WAIT_S = 5
EXCLUDE_WAIT_S = 120  # rank 0's scontrol calls (each bounded by SLURM_TIMEOUT_S), seen from the other ranks


def checks_for(spec: JobSpec, mode: str) -> list[str]:
    """The checks to run: the spec's list; a preflight-only run with an empty list runs them all (pure)."""
    checks: list[str] = list(spec.preflight.checks)
    if not checks and mode == "preflight":
        checks = list(CHECKS)
    return checks


def gate(dist: DistEnv, spec: JobSpec, output_dir: str, mode: str = "train", ds_config: dict | None = None) -> bool:
    """True to go on training. ``mode`` is "train" (on_failure applies) or "preflight" (report only).
    ``ds_config``: the task's DeepSpeed config (the nvme check tests its NVMe offload path)."""
    checks = checks_for(spec, mode)
    if not checks:
        return True
    t0 = time.monotonic()
    try:
        import os

        # [env] reaches os.environ through the launcher; read it from the spec too (test hooks live there)
        outcome = run_checks(dist, spec, output_dir, checks, env={**os.environ, **spec.env}, ds_config=ds_config)
    except CoordinationError as exc:
        print(f"swiftslurm preflight: rank {dist.rank} on {dist.node}: {exc}", file=sys.stderr, flush=True)
        return False
    coord = outcome.coord
    if dist.rank != 0:
        if coord is None:
            return False
        return _fresh_group_for_training(_follow(coord, dist, spec), dist)
    return _fresh_group_for_training(_lead(outcome, dist, spec, output_dir, mode, t0), dist)


def _fresh_group_for_training(proceed: bool, dist: DistEnv) -> bool:
    """Training must init its own process group: never go on with the preflight's still alive in this
    process (it may hold a hung collective). The all-reduce released it already; this is the last word."""
    from .checks.allreduce import release_process_group

    if proceed and not release_process_group():
        print(f"swiftslurm preflight: rank {dist.rank} on {dist.node}: the preflight's process group could not be released "
              "(a collective is hung in it); not training on it", file=sys.stderr, flush=True)
        return False
    return proceed


def _follow(coord: Any, dist: DistEnv, spec: JobSpec) -> bool:
    """A rank other than 0: what rank 0 decided (False when it cannot be heard from in time)."""
    try:
        d = coord.get("decision", time.monotonic() + spec.preflight.timeout_s + GATHER_GRACE_S)
        excluding = bool(d and d.get("action") == "exclude")
        if excluding:  # deaf to the requeue's SIGTERM before rank 0 may send it (it waits for this ack)
            _ignore_term()
        coord.put(f"ack/{dist.rank}", 1)  # rank 0 keeps the store up until everyone has the decision
        if excluding:
            _wait_for_exclusion(coord, dist.rank)
    except CoordinationError:
        d = None
    return bool(d and d.get("proceed"))


def _lead(outcome: Any, dist: DistEnv, spec: JobSpec, output_dir: str, mode: str, t0: float) -> bool:
    """Rank 0: decide, write the report, tell the other ranks, act on the decision."""
    coord = outcome.coord
    decision = exclusion_allowed(decide(outcome.results, spec.preflight.on_failure, dist.nodes, mode), dist, spec)
    meta = {
        "job_id": dist.job_id, "mode": mode, "on_failure": spec.preflight.on_failure,
        "restart_count": getattr(dist, "restart_count", 0), "executor": getattr(dist, "executor", ""),
        **outcome.meta, "wall_s": round(time.monotonic() - t0, 2),
    }
    report = build_report(outcome.results, decision, meta)
    write_report(output_dir, report)
    _print(report)
    remember_failed_nodes(outcome.results, dist, output_dir)
    if coord is not None:
        coord.put("decision", decision.to_json())
        coord.gather("ack", list(range(1, dist.world_size)), time.monotonic() + ACK_WAIT_S)
    if decision.action == "exclude":
        from .. import slurm
        from ..errors import SwiftSlurmError

        previous = _ignore_term()  # the requeue signals this job's own steps
        try:
            merged = slurm.exclude_and_requeue(dist.requeue_id, list(decision.exclude))
            print(f"swiftslurm preflight: job {dist.requeue_id} requeued with ExcNodeList={merged}", file=sys.stderr, flush=True)
        except SwiftSlurmError as exc:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            report["decision"] = Decision("abort", False, reason=f"could not exclude and requeue: {exc.message()}").to_json()
            write_report(output_dir, report)
            print(f"swiftslurm preflight: {report['decision']['reason']}", file=sys.stderr, flush=True)
        finally:
            if coord is not None:  # the other ranks may exit now
                coord.put("exclude/done", 1)
                coord.gather("exclude/ack", list(range(1, dist.world_size)), time.monotonic() + ACK_WAIT_S)
    elif decision.action == "warn":
        print(f"swiftslurm preflight WARNING: {decision.reason}", file=sys.stderr, flush=True)
    return decision.proceed


def ledger_entries(results: list[Any], dist: DistEnv, output_dir: str) -> list[Any]:
    """The node-health ledger entries for failed checks (pure): the blamed nodes of a Slurm job, unless every node of a
    multi-node job is blamed (a fault that is not any node's: a firewall, a threshold set too high) or the failure is a
    port of this job that another process holds."""
    from ..ledger import Entry
    from .results import blamed_nodes

    # a port this job derived that another process holds is the job's bad luck, not the node's health: the next job
    # derives other ports (data["port_taken"]: the MASTER_PORT check, the preflight store's bind)
    bad = [r for r in results if not r.ok and r.blocking and not r.data.get("port_taken")]
    blamed = blamed_nodes(bad)
    if not blamed or getattr(dist, "executor", "") != "slurm" or (len(dist.nodes) > 1 and set(dist.nodes) <= set(blamed)):
        return []
    out = []
    for node in blamed:
        mine = [r for r in bad if node in r.nodes]
        detail = "; ".join(f"{r.check} {r.node}: {r.observed}" for r in mine[:3])[:300]
        out.append(Entry(node, "preflight", detail, str(dist.requeue_id), 0.0, output_dir))
    return out


def remember_failed_nodes(results: list[Any], dist: DistEnv, output_dir: str) -> None:
    """Record the blamed nodes in the ledger (a later submit avoids them); a ledger that cannot be written is a
    warning, never the reason a job stops."""
    from .. import ledger
    from ..errors import SwiftSlurmError

    entries = ledger_entries(results, dist, output_dir)
    if not entries:
        return
    try:
        ledger.record(entries)
        print(f"swiftslurm preflight: recorded {', '.join(e.node for e in entries)} in the node-health ledger "
              f"{ledger.ledger_path()} (`swiftslurm nodes`)", file=sys.stderr, flush=True)
    except (SwiftSlurmError, OSError) as exc:
        print(f"swiftslurm preflight WARNING: could not record the failing nodes in the ledger: {exc}", file=sys.stderr, flush=True)


def exclusion_allowed(decision: Decision, dist: DistEnv, spec: JobSpec) -> Decision:
    """An "exclude" decision becomes "abort" where a requeue cannot help (pure): not under Slurm, or once
    the job was requeued slurm.max_requeues times already (a node that keeps failing, or an exclusion Slurm
    keeps refusing, must end the job, not requeue it forever)."""
    if decision.action != "exclude":
        return decision
    executor = getattr(dist, "executor", "slurm")
    if executor != "slurm":
        return Decision("abort", False, reason=f"on_failure = 'exclude' needs Slurm (this is the {executor} executor): {decision.reason}")
    restarts, limit = getattr(dist, "restart_count", 0), spec.slurm.max_requeues
    if restarts >= limit:
        return Decision("abort", False, reason=f"not requeueing: the job was requeued {restarts} time(s) already "
                        f"(slurm.max_requeues = {limit}): {decision.reason}")
    return decision


def _ignore_term() -> Any:
    """Ignore SIGTERM; the previous handler (None where handlers cannot be set: not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        return None


def _wait_for_exclusion(coord: Any, rank: int) -> None:
    """A rank other than 0 after an "exclude" decision: stay alive, deaf to the requeue's SIGTERM, until rank 0
    has requeued the job and set its ExcNodeList (or its store is gone)."""
    if coord.get("exclude/done", time.monotonic() + EXCLUDE_WAIT_S) is not None:
        coord.put(f"exclude/ack/{rank}", 1)


def _print(report: dict) -> None:
    from rich.console import Console

    print_report(Console(width=160, highlight=False), report)
