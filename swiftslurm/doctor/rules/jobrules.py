"""Findings from what Slurm, the preflight and the requeue records say: lost nodes and killed ranks,
failed preflight checks, and walltime requeues that never move the run forward (pure over a ``TaskRun``)."""

from __future__ import annotations

from ... import slurm
from ...preflight.results import CheckResult, blamed_nodes
from ...taskdir import PREFLIGHT_REPORT as PREFLIGHT_FILE
from ..evidence import TaskRun
from ..findings import Evidence, Finding
from .logrules import evidence_of, killed_ranks

WALLTIME_STOPS = 2  # this many walltime stops in a row without a new step is a loop


def node_failure(run: TaskRun) -> list[Finding]:
    out: list[Finding] = []
    killed = killed_ranks(run)
    if killed or run.state in ("NODE_FAIL", "BOOT_FAIL"):
        nodes = sorted({node for _, _, node, _ in killed if node})
        ranks = sorted({r for _, r, _, _ in killed if r is not None})
        hows = sorted({how for _, _, _, how in killed})
        ev = evidence_of(run, [ln for ln, _, _, _ in killed])
        ev = tuple(Evidence(e.file, e.line, next((r for ln, r, _, _ in killed if ln.file == e.file and ln.number == e.line), e.rank),
                            next((n for ln, _, n, _ in killed if ln.file == e.file and ln.number == e.line and n), e.node), e.step, e.text)
                   for e in ev)
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else "the job") + (f" on {', '.join(nodes)}" if nodes else "")
        what = f"{who} ended by {', '.join(hows) or run.state}" if killed else f"Slurm lost a node of the job (state {run.state})"
        out.append(Finding(
            "node_failure", what,
            "a node failed or a process was killed from outside (the OOM killer, a segfault in a native library, the node "
            "going down); the other ranks then lose their peers",
            "resubmit without the node (slurm.exclude, or preflight.on_failure = \"exclude\" to requeue without failing "
            "nodes automatically); keep preflight.checks on so a bad node is caught before training",
            ("slurm.exclude", "preflight.on_failure", "preflight.checks"), ev, run.task, tuple(ranks), tuple(nodes)))
    out += preflight_failures(run)
    return out


def preflight_failures(run: TaskRun) -> list[Finding]:
    report = run.preflight or {}
    results = []
    for item in report.get("results") or []:
        try:
            results.append(CheckResult.from_json(item))
        except (KeyError, TypeError, AttributeError):
            continue
    bad = [r for r in results if not r.ok]
    if not bad:
        return []
    blamed = blamed_nodes(bad)
    decision = found if isinstance(found := report.get("decision"), dict) else {}
    ev = tuple(Evidence(PREFLIGHT_FILE, None, None, r.node, None, f"{r.check} {r.node}: {r.observed}"
                        + (f" (expected {r.expected})" if r.expected else "") + (f"; HINT: {r.hint}" if r.hint else "")) for r in bad[:4])
    action = str(decision.get("action") or "")
    return [Finding(
        "node_failure", f"{len(bad)} preflight check(s) failed" + (f", blaming {', '.join(blamed)}" if blamed else "")
        + (f"; the gate decided to {action}" if action else ""),
        "; ".join(sorted({r.check for r in bad})) + " failed on the nodes named in the evidence (each result's hint says why)",
        "fix or avoid the node: slurm.exclude, or preflight.on_failure = \"exclude\" (requeue without it); "
        "thresholds: preflight.min_allreduce_busbw_gbps, preflight.min_iperf3_gbps, preflight.min_nvme_iops",
        ("slurm.exclude", "preflight.on_failure"), ev, run.task, (), tuple(blamed))]


LAUNCH_FAILED = (
    "its start failed on a node (the node's slurmd or prolog, or slurmctld reconfigured while it launched), and Slurm "
    "requeued it held so that it does not fail again at once",
    "`scontrol release` the job id named to let it run, or cancel it; if one node keeps failing launches, leave it out "
    "(slurm.exclude) and tell the admins", ("slurm.exclude",))
NOT_AS_SUBMITTED = (
    "the job asks for what its partition, QOS or account does not allow (the reason names which): Slurm keeps it "
    "pending until the request or the limit changes, which `validate` checks against the partition as it was then",
    "cancel it and submit again within the limit (slurm.time, slurm.gpus_per_node, slurm.cpus_per_task, slurm.mem, "
    "slurm.nodes), or ask the admins; `scontrol update` can lower the request of the queued job",
    ("slurm.time", "slurm.gpus_per_node", "slurm.cpus_per_task", "slurm.mem", "slurm.nodes"))
ANY_HOLD = (
    "a hold (an administrator's, the user's `scontrol hold` or sbatch --hold, or too many requeues) keeps it from starting",
    "`scontrol release` the job id named to let it run, or cancel it; ask the admins why, for an administrator's hold", ())
# what keeps a HELD task in the queue, by Slurm's pending reason (TaskStatus.hold_reason) -> (cause, fix, spec keys);
# any other reason is a hold (slurm.HELD_REASONS)
HOLDS = {slurm.LAUNCH_FAILED_HELD: LAUNCH_FAILED, **dict.fromkeys(slurm.NEVER_STARTS, NOT_AS_SUBMITTED)}


def held(run: TaskRun) -> list[Finding]:
    """A task Slurm keeps in the queue until a person acts: a hold (``slurm.held_reason``) or a request it will not
    start as it is (``slurm.never_starts``)."""
    if run.state != "HELD":
        return []
    cause, fix, keys = HOLDS.get(run.hold_reason, ANY_HOLD)
    return [Finding("held", "Slurm keeps the job in the queue: " + (run.held or "held"), cause, fix, keys,
                    (Evidence("squeue", None, None, "", None, run.held or run.state),), run.task)]


def walltime_loop(run: TaskRun) -> list[Finding]:
    stops = [r for r in run.requeues if r.get("outcome") != "requeueing" or r.get("requeued")]
    if len(stops) < WALLTIME_STOPS:
        return []
    tail = [stops[-1]]
    for prev in reversed(stops[:-1]):
        a, b = prev.get("global_step"), tail[0].get("global_step")
        if isinstance(b, int) and isinstance(a, int) and b > a:
            break
        tail.insert(0, prev)
    if len(tail) < WALLTIME_STOPS:
        return []
    step = tail[-1].get("global_step")
    save = run.save or {}
    advice = save.get("advice") if save.get("fits_grace") is False else None
    cause = (str(advice) if advice else
             "each run ends at walltime before it saves a newer checkpoint: the time limit is shorter than startup plus "
             "save_steps steps, or the save after the walltime signal is killed before it commits")
    grace = (run.spec.get("slurm") or {}).get("signal_grace_s")
    ev = tuple(Evidence("requeues.json", None, None, "", r.get("global_step") if isinstance(r.get("global_step"), int) else None,
                        f"job {r.get('job_id')} restart {r.get('restart_count')}: {r.get('outcome')} at step {r.get('global_step')}")
               for r in tail[-3:])
    if save:
        ev += (Evidence("checkpoint-save.json", None, 0, "", save.get("step") if isinstance(save.get("step"), int) else None,
                        f"last save took {save.get('save_s')} s"
                        + (f" (training stalled {save.get('stall_s')} s of it, the rest in the background)"
                           if isinstance(save.get("stall_s"), (int, float)) and save["stall_s"] < (save.get("save_s") or 0) else "")
                        + f", signal_grace_s {save.get('signal_grace_s')}"),)
    return [Finding(
        "walltime_loop", f"stopped at walltime {len(tail)} times in a row "
        + (f"without getting past step {step}" if isinstance(step, int) else "without recording a step (no checkpoint to resume from)"),
        cause,
        "save more often (train.save_steps), give the walltime save more time (slurm.signal_grace_s"
        + (f", now {grace}" if grace is not None else "") + "), or ask for a longer slurm.time",
        ("train.save_steps", "slurm.signal_grace_s", "slurm.time"), ev, run.task)]
