"""The in-job restart supervisor at scale, simulated: what one restart decision costs at 1024 and 4096 nodes.

    python benchmarks/supervisor_scale.py [--nodes 1024 4096] [--json OUT]

Slurm is a stand-in here (this machine has 4 nodes): an ``srun`` script on PATH that answers the restart probe as
the real probe step does (one JSON line for the node its ``--nodelist`` names), after 50 ms. What is measured is the
supervisor's own side, with the real code (``Supervisor._probe``, ``slurm.steps.probe``):

- **probe, now**: a node lost, a spare in its place: the probe runs on the new node and the master only, at most
  ``PROBE_CONCURRENCY`` steps at once;
- **every node probed**, ``PROBE_CONCURRENCY`` at a time (now) and all at once (before this change), under a 1024
  soft limit of open files (the common default): seconds, the peak of the supervisor's open file descriptors, and
  whether it ran out;
- **straggler window**: rank 0's ratio of each rank to the median of the others (``train.health.straggler.ratios``)
  at 8192 ranks, against the per-rank median it replaced (timed at 4096 ranks, where it still ends).

Figures: seconds per decision, srun processes started, peak open fds of the supervisor; printed, and with --json
written as one object. The machine and the stand-in's 50 ms answer are the same on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STANDIN = """#!/bin/bash
node=""
for arg in "$@"; do case "$arg" in --nodelist=*) node="${arg#--nodelist=}";; esac; done
echo x >> "$STANDIN_DIR/started"
sleep 0.05
echo "{\\"node\\": \\"$node\\", \\"ok\\": true, \\"observed\\": \\"stand-in\\"}"
"""

SPEC = """
[job]
name = "scale"
output_dir = "{out}"
[slurm]
nodes = {nodes}
tasks_per_node = 1
max_restarts = 3
spare_nodes = 1
[train]
model = "tiny-llama"
dataset = ["x.jsonl"]
max_steps = 5
"""


class FdPeak:
    """The most file descriptors this process held at once, sampled every millisecond."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, len(os.listdir("/proc/self/fd")))
            except OSError:
                pass
            time.sleep(0.001)

    def __enter__(self) -> FdPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def supervisor(tmp: Path, nodes: int, env: dict[str, str]):
    import tomllib

    from swiftslurm.node.batch.supervise import Supervisor
    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.spec.load import validate_spec

    raw = tomllib.loads(SPEC.format(out=tmp / "out", nodes=nodes))
    plan_path = write_plan(make_plan(validate_spec(raw), raw, base_dir=str(tmp), source="scale.toml"))
    return Supervisor(str(plan_path), 0, ["srun", "true"], {**env, "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": f"node[1-{nodes + 1}]"})


def probe_now(tmp: Path, nodes: int, env: dict[str, str]) -> dict:
    from swiftslurm.node import restart

    sup = supervisor(tmp, nodes, env)
    ran = tuple(f"node{i}" for i in range(1, nodes + 1))
    lost = ran[nodes // 2]
    nxt = tuple(n for n in ran if n != lost) + (f"node{nodes + 1}",)
    started = Path(env["STANDIN_DIR"], "started")
    started.unlink(missing_ok=True)
    with FdPeak() as fds:
        t0 = time.perf_counter()
        decision = sup._probe(restart.RestartDecision(True, nxt, (lost,), "restart 1"), restart.Cause("node_failure", f"{lost} lost", (), (lost,)), 0,
                              ran=ran)
        took = time.perf_counter() - t0
    assert decision.restart, decision
    return {"seconds": round(took, 3), "srun_started": len(started.read_text().split()), "peak_fds": fds.peak}


def probe_all(nodes: int, env: dict[str, str], at_once: int | None) -> dict:
    """Every node of the step probed, ``at_once`` steps at a time (None: all at once, as before), under a 1024 soft
    limit of open files."""
    from swiftslurm.slurm import steps

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    saved = steps.PROBE_CONCURRENCY
    steps.PROBE_CONCURRENCY = at_once or nodes
    error = ""
    try:
        with FdPeak() as fds:
            t0 = time.perf_counter()
            try:
                steps.probe(tuple(f"node{i}" for i in range(1, nodes + 1)), ["true"], env, timeout_s=300)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc.strerror}"
            took = time.perf_counter() - t0
    finally:
        steps.PROBE_CONCURRENCY = saved
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {"seconds": round(took, 3), "peak_fds": fds.peak, "error": error or None}


def steps_at_once() -> int:
    from swiftslurm.slurm import steps

    return steps.PROBE_CONCURRENCY


def straggler(ranks_now: int = 8192, ranks_before: int = 4096) -> dict:
    from swiftslurm.train.health.straggler import ratios

    times = [random.random() for _ in range(ranks_now)]
    t0 = time.perf_counter()
    ratios(times)
    now = time.perf_counter() - t0
    before_times = times[:ranks_before]
    t0 = time.perf_counter()
    for rank in range(ranks_before):  # the replaced code: a median of the others per rank
        statistics.median(before_times[:rank] + before_times[rank + 1:])
    before = time.perf_counter() - t0
    return {f"one_sort_s_at_{ranks_now}": round(now, 4), f"per_rank_median_s_at_{ranks_before}": round(before, 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "bin").mkdir()
        (tmp / "bin" / "srun").write_text(STANDIN)
        (tmp / "bin" / "srun").chmod(0o755)
        env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "STANDIN_DIR": str(tmp), "SWIFTSLURM_LEDGER": str(tmp / "ledger.json")}
        result: dict = {"stand_in_srun_answer_s": 0.05, "nodes": {}}
        for n in args.nodes:
            result["nodes"][n] = {"restart_probe_now": probe_now(tmp / f"now{n}", n, env),
                                  "every_node_bounded": probe_all(n, env, steps_at_once())}
        for n in args.nodes:  # last: a run out of file descriptors leaves processes and pipes behind
            result["nodes"][n]["every_node_at_once_before"] = probe_all(n, env, None)
            print(n, json.dumps(result["nodes"][n]), flush=True)
        result["straggler"] = straggler()
        print(json.dumps(result["straggler"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
