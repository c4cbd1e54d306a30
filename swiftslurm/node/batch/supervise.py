"""The training step's supervisor in the batch script: run it, and restart it in place when it fails.

``python -m swiftslurm.node.batch.supervise --plan PLAN [--tasks 3,5] -- srun ARGS...`` stands where the batch script
would run ``srun ARGS...`` (the rendered script puts it in front of its srun line; the submitit script calls it
from a shell function named ``srun``, ``slurm/launch.py``'s ``supervisor_setup``). Only jobs with
``slurm.max_restarts > 0`` have one; they are submitted with ``--no-kill``, so a failed node does not end the
allocation.

It runs the step (with ``--kill-on-bad-exit=1``: one dead rank ends the step instead of hanging the others), and
when the step ends non-zero and was not a walltime stop, a refused start or a cancel, it finds the cause, decides
(``node/restart.py``), records the decision in ``restarts.json``, drops lost nodes into the node-health ledger,
probes the nodes of the next step (one task each: can the node run a step, is MASTER_PORT free on the master)
and starts the step again; every start resumes from the newest verified checkpoint (requeue = rerun). The batch
script ends with the last step's exit code: COMPLETED only when training finished.

USR2 and TERM that reach the supervisor (the batch shell's trap, a cancel) are passed on to the running step.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...fsutil import Unreadable, read_json
from ...records import failures as failure
from ...records.requeues import job_records, read_requeues
from ...slurm import distenv, steps
from ...taskdir import HANG_FILE
from ...train.health.watchdog import ATTEMPT_ENV, HANG_RESTART_ENV
from .. import restart
from ..requeue import NO_PROGRESS_EXIT

POLL_S = 0.2
PREFLIGHT_REFUSED = 4  # PreflightFailed.exit_code: the rank's own preflight stopped it, nothing to restart

log = logging.getLogger("swiftslurm.supervise")


def task_index(tasks: str | None, environ: dict[str, str]) -> int:
    """This job's task: the ``SLURM_ARRAY_TASK_ID``-th of ``tasks`` (submitit numbers a part's array 0..n-1), else
    what ``swiftslurm run`` would take ($SWIFTSLURM_TASK, $SLURM_ARRAY_TASK_ID, 0) (pure)."""
    if tasks:
        listed = [int(t) for t in tasks.split(",")]
        return listed[int(environ.get("SLURM_ARRAY_TASK_ID") or 0)]
    return int(environ.get("SWIFTSLURM_TASK") or environ.get("SLURM_ARRAY_TASK_ID") or 0)


def job_id_of(environ: dict[str, str]) -> str:
    """The id the ranks record (``DistEnv.requeue_id``): ``<array job>_<task>`` or the job id (pure)."""
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID", "")


class Supervisor:
    def __init__(self, plan_path: str, index: int, srun_argv: list[str], environ: dict[str, str]) -> None:
        from ...plan import read_plan_task

        _, task, _ = read_plan_task(plan_path, index)
        self.plan_path, self.index, self.spec, self.out = plan_path, index, task.spec, task.output_dir
        self.srun_argv, self.environ = srun_argv, environ
        self.job_id = job_id_of(environ)
        self.allocation = distenv.expand_nodelist(environ.get("SLURM_JOB_NODELIST", ""))
        self.need = self.spec.slurm.nodes
        self.excluded: set[str] = set()
        self.stopping = False
        self.received: list[int] = []
        self.srun_errors: list[restart.SrunError] = []
        self.refused_busy = False

    # ---------------------------------------------------------------- signals: a flag, acted on in the loop

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)  # passed on to the step by the wait loop
        if signum != signal.SIGUSR2:  # a cancel or preemption: decided here, so a TERM that lands as srun ends
            self.stopping = True  # (after the loop's last look) still reads as one, never as a crash to restart

    def install(self) -> None:
        for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    # ---------------------------------------------------------------- one step

    def _argv(self, nodes: tuple[str, ...], attempt: int, refused_for: float | None) -> list[str]:
        options = ["--kill-on-bad-exit=1"] + (steps.after_failure(refused_for) if attempt else [])  # asked again while busy
        if len(self.allocation) > self.need or set(nodes) != set(self.allocation):  # spares: say where
            options += steps.placement(nodes, self.spec.slurm.ranks_per_node)
        return steps.with_options(self.srun_argv, options)

    def _tee(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            if steps.busy(line):
                self.refused_busy = True
            found = restart.parse_srun_error(line)
            if found is not None:
                self.srun_errors.append(found)

    def run_step(self, nodes: tuple[str, ...], attempt: int) -> int:
        """Run the training step to its end; a restart that Slurm refuses only because the nodes are still busy (the
        failed step ending) is started again, for at most ``steps.PROBE_TIMEOUT_S``."""
        start = time.monotonic()
        refused = False
        while True:
            rc = self._run_once(nodes, attempt, time.monotonic() - start if refused else None)
            if not (rc and self.refused_busy and not self.stopping and time.monotonic() < start + steps.PROBE_TIMEOUT_S):
                return rc
            refused = True
            log.info("Slurm did not start the restarted step yet (its nodes are still busy): asking again")
            time.sleep(steps.RETRY_PAUSE_S)

    def _run_once(self, nodes: tuple[str, ...], attempt: int, refused_for: float | None) -> int:
        env = {**self.environ, ATTEMPT_ENV: str(attempt), HANG_RESTART_ENV: "1"}
        if len(nodes) != self.spec.slurm.nodes:  # shrunk (slurm.shrink_on_failure): the ranks check against this
            env[restart.STEP_NODES_ENV] = str(len(nodes))
        self.srun_errors, self.refused_busy = [], False
        proc = steps.start_step(self._argv(nodes, attempt, refused_for), env)
        reader = threading.Thread(target=self._tee, args=(proc.stderr,), daemon=True)
        reader.start()
        while proc.poll() is None:
            while self.received:
                signum = self.received.pop(0)
                if signum != signal.SIGUSR2:
                    self.stopping = True
                log.warning("%s received: passing it on to the training step", signal.Signals(signum).name)
                proc.send_signal(signum)
            time.sleep(POLL_S)
        reader.join(timeout=10)
        return proc.returncode

    # ---------------------------------------------------------------- what ended it

    def _hang(self, since: float) -> dict[str, Any] | None:
        path = Path(self.out, HANG_FILE)
        try:
            if path.stat().st_mtime < since:
                return None
            return read_json(path)
        except (OSError, Unreadable):
            return None

    def step_end(self, rc: int, nodes: tuple[str, ...], since: float) -> restart.StepEnd:
        records = failure.read_failures(self.out, since=since)
        states = steps.node_states(nodes)
        held = steps.job_nodes(self.environ.get("SLURM_JOB_ID", ""))  # a node Slurm lost under --no-kill leaves the job
        down = tuple(n for n in nodes if steps.lost(states.get(n, "")) or (held is not None and n not in held))
        draining = [n for n in nodes if n not in down and steps.unusable(states.get(n, ""))]
        if draining:  # an admin's drain or maintenance: not this run's failure, and not the node's (never ledgered)
            log.warning("node(s) %s %s by Slurm (%s): not counted as failed", restart.listed(draining),
                        "is drained" if len(draining) == 1 else "are drained", ", ".join(sorted({states[n] for n in draining})))
        return restart.StepEnd(
            rc, nodes, tuple(self.srun_errors), tuple((f.rank, f.node, f.what) for f in records if f.kind != "preflight"),
            self._hang(since), down,
        )

    def _not_to_restart(self, rc: int, since: float, requeues_before: int) -> str | None:
        if rc == 0:
            return "finished"
        if self.stopping:
            return "cancelled or signalled: the step was asked to stop"
        if len(job_records(read_requeues(self.out), self.job_id)) > requeues_before:
            return "a walltime stop (requeues.json decides)"
        if rc == PREFLIGHT_REFUSED or any(f.kind == "preflight" for f in failure.read_failures(self.out, since=since)):
            return "the preflight stopped training (preflight/report.json)"
        return None

    # ---------------------------------------------------------------- the loop

    def run(self) -> int:
        nodes = self.allocation[: self.need] if len(self.allocation) > self.need else self.allocation
        attempt = 0
        while True:
            since = time.time() - 1.0
            requeues_before = len(job_records(read_requeues(self.out), self.job_id))
            start_step = self._resume_step()
            rc = self.run_step(nodes, attempt)
            why_not = self._not_to_restart(rc, since, requeues_before)
            if why_not is not None:
                if rc:
                    log.info("training step ended with %d: not restarted (%s)", rc, why_not)
                return rc
            end = self.step_end(rc, nodes, since)
            cause = restart.cause_of(end)
            committed = self._resume_step()
            guard = None
            if not self.spec.train.command:  # our checkpoints tell progress; a command's own saves are not ours
                streak = restart.no_progress_streak(restart.job_restarts(restart.read_restarts(self.out), self.job_id), start_step, committed)
                guard = restart.progress_guard(streak, self.spec.slurm.no_progress_attempts, cause, committed)
            decision = guard or restart.decide_restart(attempt, self.spec.slurm.max_restarts, cause, nodes, self.allocation, self.excluded,
                                                       self.need, self.spec.slurm.shrink_on_failure)
            if decision.restart:
                decision = self._probe(decision, cause, attempt, nodes)
            self._remember(decision.dropped, cause)
            self.excluded |= set(decision.dropped)
            restart.record_restart(self.out, restart.RestartRecord(
                self.job_id, attempt, cause.kind, cause.detail, list(nodes), decision.restart, list(decision.nodes),
                list(decision.dropped), committed, decision.message, rc, start_step=start_step))
            if not decision.restart:
                log.error("training step ended with %d: %s", rc, decision.message)
                return NO_PROGRESS_EXIT if guard is not None else rc or 1
            log.warning("training step ended with %d: %s", rc, decision.message)
            nodes, attempt = decision.nodes, attempt + 1
            self.need = min(self.need, len(nodes))  # after a shrink: the smaller world is the one to keep

    def _probe(self, decision: restart.RestartDecision, cause: restart.Cause, attempt: int,
               ran: tuple[str, ...] = ()) -> restart.RestartDecision:
        """The next step's new nodes (a spare, a node not in the step that failed) and its master (whose MASTER_PORT must
        be free), each running one short check; a node that fails it is dropped and replaced. Every probed node failing
        at once is the probe's own failure (a systematic cause), never that many bad nodes: nothing is ledgered."""
        dropped = list(decision.dropped)
        for _ in range(len(self.allocation)):
            probed = tuple(dict.fromkeys([decision.nodes[0], *(n for n in decision.nodes if n not in ran)]))
            bad = self._probe_nodes(probed)
            if not bad:
                return restart.RestartDecision(True, decision.nodes, tuple(dropped), decision.message)
            if len(probed) > 1 and len(bad) == len(probed):
                why = "; ".join(f"{n}: {w}" for n, w in list(bad.items())[:4])
                log.warning("restart probe failed on every node it ran on (%s): a probe error, not %d bad nodes", why, len(bad))
                return restart.RestartDecision(False, (), tuple(dropped), f"not restarted: the restart probe failed on every node "
                                               f"it ran on ({why}): a probe error, no node is blamed (first: {cause.detail})")
            log.warning("restart probe: %s", "; ".join(f"{n}: {why}" for n, why in bad.items()))
            probe_cause = restart.Cause(restart.PROBE, "restart probe failed on " + "; ".join(f"{n}: {why}" for n, why in bad.items()),
                                        tuple(bad), tuple(bad))
            self._remember(tuple(bad), probe_cause)
            gone = self.excluded | set(dropped)
            decision = restart.decide_restart(attempt, self.spec.slurm.max_restarts, probe_cause, decision.nodes, self.allocation, gone, self.need,
                                              self.spec.slurm.shrink_on_failure)
            dropped += list(decision.dropped)
            if not decision.restart:
                return restart.RestartDecision(False, (), tuple(dropped), f"{decision.message} (first: {cause.detail})")
        return restart.RestartDecision(False, (), tuple(dropped), "not restarted: every node failed the restart probe")

    def _probe_nodes(self, nodes: tuple[str, ...]) -> dict[str, str]:
        # through node.hold, as the ranks start: the walltime USR2 arriving during the probe is held, never its death
        command = [sys.executable, "-m", "swiftslurm.node.hold", "-m", "swiftslurm.node.batch.probe", "--plan", self.plan_path, "--task", str(self.index)]
        env = {**self.environ, restart.PROBE_MASTER_ENV: nodes[0]}  # the next step's master: its MASTER_PORT is checked
        bad: dict[str, str] = {}
        for node, proc in steps.probe(nodes, command, env).items():
            row: Any = None
            for line in proc.stdout.splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
            if isinstance(row, dict) and row.get("node") == node:
                if not row.get("ok"):
                    bad[node] = str(row.get("observed", "failed"))[:200]
            elif proc.returncode == 124:
                bad[node] = "no answer from the probe step in time"
            else:
                bad[node] = (proc.stderr.strip().splitlines() or [f"the probe step exited with {proc.returncode}"])[-1][:200]
        return bad

    def _remember(self, nodes: tuple[str, ...], cause: restart.Cause) -> None:
        """Dropped nodes go into the node-health ledger (later submissions avoid them)."""
        if not nodes:
            return
        from ... import ledger

        reason = {restart.HANG: "hang", restart.PROBE: "preflight"}.get(cause.kind, "node_failure")
        try:
            ledger.record([ledger.Entry(n, reason, cause.detail[:300], self.job_id, 0.0, self.out) for n in nodes])
        except Exception as exc:  # noqa: BLE001 -- the ledger is advice for later jobs: never the reason this one stops
            log.warning("could not record %s in the node-health ledger: %s", ", ".join(nodes), exc)

    def _resume_step(self) -> int | None:
        from ...checkpoint import list_checkpoints, step_of

        listed = list_checkpoints(self.out)
        return step_of(listed[0]) if listed else None


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print("usage: python -m swiftslurm.node.batch.supervise --plan PLAN [--tasks LIST] -- srun ARGS...", file=sys.stderr)
        return 2
    cut = args.index("--")
    ap = argparse.ArgumentParser(prog="python -m swiftslurm.node.batch.supervise")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--tasks")
    opts = ap.parse_args(args[:cut])
    logging.basicConfig(level=logging.INFO, format="swiftslurm supervisor: %(message)s", stream=sys.stderr)
    sup = Supervisor(opts.plan, task_index(opts.tasks, dict(os.environ)), args[cut + 1:], dict(os.environ))
    sup.install()
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
