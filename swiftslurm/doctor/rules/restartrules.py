"""In-job restarts (``restarts.json``, node/restart.py): what the supervisor restarted, and a run it had to stop (pure)."""

from __future__ import annotations

from ..evidence import TaskRun
from ..findings import Evidence, Finding

CODE_OF = {"hang": "hang"}  # every other cause (a lost node, a killed or failed rank, a failed probe) is a node_failure


def in_job_restarts(run: TaskRun) -> list[Finding]:
    """One finding per cause the supervisor saw: how often, on which nodes, and whether the run went on."""
    by_cause: dict[str, list[dict]] = {}
    for r in run.in_job:
        by_cause.setdefault(str(r.get("cause") or "rank_failed"), []).append(r)
    out = []
    for cause, records in by_cause.items():
        made = sum(1 for r in records if r.get("restarted"))
        stopped = [r for r in records if not r.get("restarted")]
        dropped = tuple(dict.fromkeys(str(n) for r in records for n in (r.get("dropped") or [])))
        ev = tuple(Evidence("restarts.json", None, None, "", r.get("resume_step") if isinstance(r.get("resume_step"), int) else None,
                            f"job {r.get('job_id')} attempt {r.get('attempt')}: {r.get('message')}") for r in records[-3:])
        what = f"the training step failed {len(records)} time(s) ({cause}); restarted in place {made} time(s)" + (
            f", dropped {', '.join(dropped)}" if dropped else "") + ("; then the run stopped" if stopped else "")
        fix = (str(stopped[-1].get("message")) if stopped else
               "nothing needed: the run went on from its newest verified checkpoint; check the nodes named if it recurs "
               "(swiftslurm nodes)")
        out.append(Finding(CODE_OF.get(cause, "node_failure"), what, str(records[-1].get("detail") or cause), fix,
                           ("slurm.max_restarts", "slurm.spare_nodes"), ev, run.task, (), dropped))
    return out
