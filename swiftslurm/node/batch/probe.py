"""The restart's short preflight, one task per node: ``python -m swiftslurm.node.batch.probe --plan PLAN --task N``.

The supervisor (``node/batch/supervise.py``) starts it on the nodes of the next training step before a restart. Each
node prints one JSON line ``{"node", "ok", "observed"}``: that it could run a step at all, and on the master
node (the step's first) that MASTER_PORT is free, the preflight's ``ports`` check. A node that prints nothing
failed (srun could not start it there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from ...plan import read_plan_task
    from ...preflight.checks import ports
    from ...slurm import distenv
    from ..restart import PROBE_MASTER_ENV

    ap = argparse.ArgumentParser(prog="python -m swiftslurm.node.batch.probe")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--task", type=int, default=0)
    args = ap.parse_args(argv)
    _, task, _ = read_plan_task(args.plan, args.task)
    dist = distenv.derive(os.environ, pid=os.getpid(), explicit=task.spec.env)
    row = {"node": dist.node, "ok": True, "observed": "runs a step"}
    if dist.node == os.environ.get(PROBE_MASTER_ENV, dist.nodes[0]):
        result = ports.check_master_port(dist.node, dist.master_port)
        row = {"node": dist.node, "ok": result.ok, "observed": result.observed}
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
