"""Benchmark: the preflight's coordination at 16, 64, 256 ranks, apart from interpreter start-up.

    .venv/bin/python benchmarks/preflight_scale.py --ranks 16,64,256 [--ranks-per-node 8] [--checks disk,sharedfs]

For each rank count it forks that many processes from one that imported everything the preflight imports
(torch.distributed for the TCPStore, rich): interpreter start-up and imports (~2 s of CPU each, minutes
for hundreds on two cores) are left out, which is the point. Each gets the SLURM_* variables one srun task
of a job of ``ranks / ranks-per-node`` nodes would see (node names ``sim001``...: labels only; MASTER_ADDR
is 127.0.0.1 through the spec's [env]), derives its rank and waits on a pipe. The benchmark then lets all
go at once, and each runs the real ``preflight.gate``:
TCPStore connect, the "ready" barrier, the node checks (cheap ones by default: disk and sharedfs, on each
node's local rank 0), the "network-done" barrier, node results, rank 0's gathers, the report, the
decision broadcast and every rank's acknowledgement. (ports and iperf3 bind per-node ports and need one
address per node: not on one machine. ``--checks allreduce`` adds a gloo all-reduce, heavy at 256 ranks.)

Reported per rank count: start-up (forking the ranks until every one is ready), the slowest rank's
TCPStore client connect (``Coordinator.connect``, timed by the benchmark: torch's own, see docs/benchmarks.md),
coordination (go to the last rank through the gate), and rank 0's ``phase_s`` from report.json. Goal: coordination
under 10 s at 256 ranks, growing no faster than linearly with ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

SPEC = """
[job]
name = "preflight-scale"
output_dir = "{out}"
[slurm]
nodes = {nodes}
tasks_per_node = {per_node}
[preflight]
checks = {checks}
timeout_s = {timeout}
min_disk_free_gb = 0
on_failure = "warn"
[env]
MASTER_ADDR = "127.0.0.1"
"""


def _child(rank_env_: dict[str, str], spec_path: str, out: str, go_fd: int, result_fd: int) -> None:
    """One forked rank: its SLURM_* environment, wait for go, the real gate; its seconds on ``result_fd``."""
    from swiftslurm.preflight import coord as coord_module
    from swiftslurm.preflight.gate import gate
    from swiftslurm.slurm import distenv
    from swiftslurm.spec import load_spec

    real_connect = coord_module.Coordinator.connect.__func__
    connect_s = [0.0]

    def timed_connect(cls, *args, **kwargs):  # instrumentation: the TCPStore client's own connect time
        t = time.monotonic()
        try:
            return real_connect(cls, *args, **kwargs)
        finally:
            connect_s[0] = time.monotonic() - t

    coord_module.Coordinator.connect = classmethod(timed_connect)
    code = 1
    try:
        os.environ.clear()
        os.environ.update(rank_env_)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        spec = load_spec(spec_path)
        dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
        os.write(result_fd, b"ready\n")
        os.read(go_fd, 1)
        t0 = time.monotonic()
        ok = gate(dist, spec, out, mode="preflight")
        os.write(result_fd, f"{dist.rank} {time.monotonic() - t0:.3f} {int(ok)} {connect_s[0]:.3f}\n".encode())
        code = 0
    finally:
        os._exit(code)


def rank_env(rank: int, ranks: int, per_node: int, job_id: str) -> dict[str, str]:
    nnodes = ranks // per_node
    node_id = rank // per_node
    return dict(os.environ, SLURM_JOB_ID=job_id, SLURM_PROCID=str(rank), SLURM_NTASKS=str(ranks),
                SLURM_JOB_NODELIST=f"sim[001-{nnodes:03d}]", SLURMD_NODENAME=f"sim{node_id + 1:03d}",
                SLURM_NODEID=str(node_id), SLURM_LOCALID=str(rank % per_node), SLURM_STEP_ID="0",
                SLURM_TASKS_PER_NODE=f"{per_node}(x{nnodes})", SLURM_JOB_NUM_NODES=str(nnodes))


def run_once(ranks: int, per_node: int, checks: list[str], timeout_s: int, workdir: str) -> dict:
    base = Path(tempfile.mkdtemp(prefix="swiftslurm-preflight-scale-", dir=workdir))
    try:
        out = base / "out"
        out.mkdir()
        spec = base / "spec.toml"
        spec.write_text(SPEC.format(out=out, nodes=ranks // per_node, per_node=per_node, checks=json.dumps(checks), timeout=timeout_s))
        job_id = str(99_000_000 + zlib.crc32(f"{base}".encode()) % 4000)
        go_r, go_w = os.pipe()
        res_r, res_w = os.pipe()
        t_spawn = time.monotonic()
        pids = []
        for r in range(ranks):
            pid = os.fork()
            if pid == 0:
                os.close(go_w)
                os.close(res_r)
                _child(rank_env(r, ranks, per_node, job_id), str(spec), str(out), go_r, res_w)
            pids.append(pid)
        os.close(go_r)
        os.close(res_w)
        rank_s: list[float] = []
        store_s: list[float] = []
        with os.fdopen(res_r) as results:
            for _ in range(ranks):  # every rank forked, its spec loaded, its rank derived
                if results.readline().strip() != "ready":
                    raise SystemExit("a rank died before it was ready")
            startup = time.monotonic() - t_spawn
            t_go = time.monotonic()
            os.write(go_w, b"g" * ranks)  # every rank reads one byte: all start at once
            for line in results:  # until every child closed its end (exited)
                rank_s.append(float(line.split()[1]))
                store_s.append(float(line.split()[3]))
                if len(rank_s) == ranks:
                    break
            coordination = time.monotonic() - t_go  # the last rank through the gate (exits not counted)
        for pid in pids:
            os.waitpid(pid, 0)
        os.close(go_w)
        if len(rank_s) != ranks:
            raise SystemExit(f"only {len(rank_s)} of {ranks} ranks finished the gate")
        report = json.loads((out / "preflight" / "report.json").read_text())
        failed = [r for r in report["results"] if not r["ok"]]
        return {"ranks": ranks, "nodes": ranks // per_node, "startup_s": round(startup, 2), "coordination_s": round(coordination, 2),
                "slowest_rank_s": round(max(rank_s), 2),
                "store_connect_max_s": round(max(store_s), 2), "store_connect_median_s": round(sorted(store_s)[len(store_s) // 2], 3),
                "phase_s": report.get("phase_s", {}), "wall_s_rank0": report.get("wall_s"),
                "failed": [f"{r['check']}@{r['node']}: {r['observed']}" for r in failed][:5]}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    import rich.console  # noqa: F401
    import torch.distributed  # noqa: F401 - imported once, before the ranks fork: start-up is not measured here

    import swiftslurm.preflight.gate  # noqa: F401

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="16,64", help="comma-separated rank counts")
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--checks", default="disk,sharedfs")
    ap.add_argument("--timeout", type=int, default=60, help="preflight.timeout_s")
    ap.add_argument("--dir", default="/tmp")
    args = ap.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    rows = []
    print(f"cpus={os.cpu_count()} ranks/node={args.ranks_per_node} checks={checks}")
    print(f"{'ranks':>6}{'nodes':>6}{'start-up s':>12}{'coordination s':>16}{'store connect max s':>21}  phase_s (rank 0)")
    for ranks in [int(x) for x in args.ranks.split(",")]:
        row = run_once(ranks, min(args.ranks_per_node, ranks), checks, args.timeout, args.dir)
        rows.append(row)
        print(f"{row['ranks']:>6}{row['nodes']:>6}{row['startup_s']:>12.2f}{row['coordination_s']:>16.2f}"
              f"{row['store_connect_max_s']:>21.2f}  {json.dumps(row['phase_s'])}"
              + (f"  FAILED: {row['failed']}" if row["failed"] else ""), flush=True)
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
