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
- **one run** (``Supervisor.run``, the whole loop, stand-in ``sinfo``/``scontrol`` too): a node failure while 1% of
  the nodes are drained and slurmctld's first answer is late, then the restart cancelled by TERM: what it decided
  (dropped, ledgered, the drains left alone, the cancel a stop), the restart decision's seconds, the Slurm calls;
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
probe=""
for arg in "$@"; do case "$arg" in --nodelist=*) node="${arg#--nodelist=}";; *swiftslurm.node.batch.probe*) probe=1;; esac; done
echo x >> "$STANDIN_DIR/started"
if [ -z "$probe" ] && [ -n "$STANDIN_STEPS" ]; then  # a training step of the one-run scenario
  date +%s.%N >> "$STANDIN_DIR/steps"  # each training step's start; the first's end in "ended"
  if [ "$(wc -l < "$STANDIN_DIR/steps")" = 1 ]; then  # the first: a node fails under it
    date +%s.%N > "$STANDIN_DIR/ended"
    echo "srun: error: $STANDIN_LOST: task 7: Killed" >&2
    echo "srun: error: Node failure on $STANDIN_LOST" >&2
    exit 1
  fi
  trap 'exit 143' TERM  # the restarted step runs until the cancel reaches it
  while :; do sleep 0.05; done
fi
sleep 0.05
echo "{\\"node\\": \\"$node\\", \\"ok\\": true, \\"observed\\": \\"stand-in\\"}"
"""
# sinfo: its first answer comes too late (a slurmctld under load), the next says: the lost node down, 1% of the
# nodes drained by an admin, the rest allocated. scontrol: the job still holds every node but the lost one.
SINFO = """#!/bin/bash
echo x >> "$STANDIN_DIR/sinfo"
if [ "$(wc -l < "$STANDIN_DIR/sinfo")" = 1 ]; then sleep "$STANDIN_SLOW_S"; fi
cat "$STANDIN_DIR/states"
"""
SCONTROL = """#!/bin/bash
if [ "$2" = hostnames ]; then echo "$3" | tr ',' '\\n'; exit 0; fi  # local, as scontrol's own expansion is
echo x >> "$STANDIN_DIR/scontrol"
echo "JobId=5 JobState=RUNNING NodeList=$(cat "$STANDIN_DIR/held")"
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


def one_run(tmp: Path, nodes: int, env: dict[str, str], slow_s: float) -> dict:
    """One supervised run with what a real cluster throws at it (``Supervisor.run``, the real loop): the first step
    ends with a node failure while 1% of the nodes are being drained by an admin and slurmctld's first answer comes
    later than ``steps.QUERY_TIMEOUT_S``; the restart (the spare in, the lost node out) is then cancelled (TERM to
    the supervisor, as scancel sends it). Returns the decision, what it cost and whether each was taken as it should."""
    import signal

    from swiftslurm.node.restart import read_restarts

    lost = f"node{nodes // 2}"
    drained = {f"node{i}" for i in range(3, nodes + 1, 100)} - {lost}
    states = "".join(f"node{i}|{'down' if f'node{i}' == lost else 'drain' if f'node{i}' in drained else 'alloc'}\n"
                     for i in range(1, nodes + 2))
    run_dir = tmp / f"run{nodes}"
    run_dir.mkdir()
    (run_dir / "states").write_text(states)
    (run_dir / "held").write_text(",".join(f"node{i}" for i in range(1, nodes + 2) if f"node{i}" != lost))
    env = {**env, "STANDIN_DIR": str(run_dir), "STANDIN_STEPS": "1", "STANDIN_LOST": lost, "STANDIN_SLOW_S": str(slow_s),
           "SWIFTSLURM_LEDGER": str(run_dir / "ledger.json")}
    saved_env = dict(os.environ)
    os.environ.update(env)  # the Slurm queries run with this process's environment (PATH: the stand-ins)
    sup = supervisor(run_dir, nodes, env)
    sup.install()
    steps_file = run_dir / "steps"

    def cancel_the_restart() -> None:
        while not steps_file.exists() or len(steps_file.read_text().split()) < 2:
            time.sleep(0.01)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=cancel_the_restart, daemon=True).start()
    try:
        with FdPeak() as fds:
            t0 = time.perf_counter()
            rc = sup.run()
            took = time.perf_counter() - t0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(saved_env)
    (record,) = read_restarts(str(run_dir / "out"))
    from swiftslurm.ledger.store import read as read_ledger

    blamed = sorted({e.node for e in read_ledger(run_dir / "ledger.json")})
    count = {name: len((run_dir / name).read_text().split()) if (run_dir / name).exists() else 0
             for name in ("started", "sinfo", "scontrol")}
    decided = float(steps_file.read_text().split()[1]) - float((run_dir / "ended").read_text())
    return {"seconds_whole_run": round(took, 2), "seconds_restart_decision": round(decided, 2), "rc": rc,
            "restart": record["restarted"], "cause": record["cause"],
            "dropped": record["dropped"], "spare_in": f"node{nodes + 1}" in record["next_nodes"],
            "drained_not_dropped": not (set(record["dropped"]) & drained), "drained": len(drained),
            "ledgered": blamed, "cancel_was_a_stop": rc == 143 and len(read_restarts(str(run_dir / "out"))) == 1,
            "srun_started": count["started"], "sinfo_asked": count["sinfo"], "scontrol_asked": count["scontrol"],
            "peak_fds": fds.peak}


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
    ap.add_argument("--query-timeout-s", type=float, default=2.0,
                    help="steps.QUERY_TIMEOUT_S for the one-run scenario (20 s in production: the slow answer costs that)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "bin").mkdir()
        for name, text in (("srun", STANDIN), ("sinfo", SINFO), ("scontrol", SCONTROL)):
            (tmp / "bin" / name).write_text(text)
            (tmp / "bin" / name).chmod(0o755)
        env = {**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "STANDIN_DIR": str(tmp), "SWIFTSLURM_LEDGER": str(tmp / "ledger.json")}
        result: dict = {"stand_in_srun_answer_s": 0.05, "query_timeout_s": args.query_timeout_s, "nodes": {}}
        from swiftslurm.slurm import steps

        steps.QUERY_TIMEOUT_S = args.query_timeout_s
        for n in args.nodes:
            scenario = tmp / f"scenario{n}"
            scenario.mkdir()
            result.setdefault("one_run", {})[n] = one_run(scenario, n, env, slow_s=args.query_timeout_s + 1)
            print(n, "one run:", json.dumps(result["one_run"][n]), flush=True)
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
