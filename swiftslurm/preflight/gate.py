"""The gate before training: run the checks, write the report, act on ``preflight.on_failure``.

Called on every rank by ``runtime.run_task``. Rank 0 decides (a pure ``decide`` over the results),
writes ``<output_dir>/preflight/report.json`` and ``busbw.png``, prints the table, and broadcasts the
decision through the preflight store; the other ranks return what rank 0 decided (or False when rank 0
cannot be heard from within the timeout).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from .coord import CoordinationError
from .report import build_report, print_report, write_report
from .results import Decision, decide
from .run import GATHER_GRACE_S, run_checks

ACK_WAIT_S = 5
ALL_CHECKS = ("ports", "allreduce", "iperf3", "nvme", "gpu", "disk", "sharedfs")


def checks_for(spec: Any, mode: str) -> list[str]:
    """The checks to run: the spec's list; a preflight-only run with an empty list runs them all (pure)."""
    checks = list(spec.preflight.checks)
    if not checks and mode == "preflight":
        checks = list(ALL_CHECKS)
    return checks


def gate(dist: Any, spec: Any, output_dir: str, mode: str = "train") -> bool:
    """True to go on training. ``mode`` is "train" (on_failure applies) or "preflight" (report only)."""
    checks = checks_for(spec, mode)
    if not checks:
        return True
    t0 = time.monotonic()
    try:
        import os

        # [env] reaches os.environ through the launcher; read it from the spec too (test hooks live there)
        outcome = run_checks(dist, spec, output_dir, checks, env={**os.environ, **spec.env})
    except CoordinationError as exc:
        print(f"swiftslurm preflight: rank {dist.rank} on {dist.node}: {exc}", file=sys.stderr, flush=True)
        return False
    coord = outcome.coord
    if dist.rank != 0:
        if coord is None:
            return False
        try:
            d = coord.get("decision", time.monotonic() + spec.preflight.timeout_s + GATHER_GRACE_S)
            coord.put(f"ack/{dist.rank}", 1)  # rank 0 keeps the store up until everyone has the decision
        except CoordinationError:
            d = None
        return bool(d and d.get("proceed"))

    decision = decide(outcome.results, spec.preflight.on_failure, dist.nodes, mode)
    if decision.action == "exclude" and getattr(dist, "executor", "slurm") != "slurm":
        decision = Decision("abort", False, reason=f"on_failure = 'exclude' needs Slurm (this is the {dist.executor} executor): {decision.reason}")
    meta = {
        "job_id": dist.job_id, "mode": mode, "on_failure": spec.preflight.on_failure,
        "restart_count": getattr(dist, "restart_count", 0), "executor": getattr(dist, "executor", ""),
        **outcome.meta, "wall_s": round(time.monotonic() - t0, 2),
    }
    report = build_report(outcome.results, decision, meta)
    write_report(output_dir, report)
    _print(report)
    if coord is not None:
        coord.put("decision", decision.to_json())
        coord.gather("ack", list(range(1, dist.world_size)), time.monotonic() + ACK_WAIT_S)
    if decision.action == "exclude":
        from .. import slurm
        from ..errors import SwiftSlurmError

        import signal

        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # requeuehold signals this job's own steps
        try:
            merged = slurm.exclude_and_requeue(dist.requeue_id, list(decision.exclude))
            print(f"swiftslurm preflight: job {dist.requeue_id} requeued with ExcNodeList={merged}", file=sys.stderr, flush=True)
        except SwiftSlurmError as exc:
            signal.signal(signal.SIGTERM, previous)
            report["decision"] = Decision("abort", False, reason=f"could not exclude and requeue: {exc.message()}").to_json()
            write_report(output_dir, report)
            print(f"swiftslurm preflight: {report['decision']['reason']}", file=sys.stderr, flush=True)
    elif decision.action == "warn":
        print(f"swiftslurm preflight WARNING: {decision.reason}", file=sys.stderr, flush=True)
    return decision.proceed


def _print(report: dict) -> None:
    from rich.console import Console

    print_report(Console(width=160, highlight=False), report)
