"""A small local launcher: N processes on this machine, each calling ``sft.train`` (tests, benchmark).

Production runs go through ``swiftslurm run`` (runtime.run_task); this exists so the trainer can be
exercised without Slurm or the runtime:

    python -m swiftslurm.train.launch SPEC.toml --nprocs 2 --out DIR [--resume CKPT]

Each worker gets RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and writes
``DIR/result-rank<r>.json``. ``--stop-at-step N`` makes rank 0 alone report a walltime stop at step N
(the other ranks learn it through the all-reduce), for testing the requeue path.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..slurm.distenv import free_port


def launch(spec_path: str, out: str, nprocs: int = 2, resume: str | None = None, stop_at_step: int | None = None,
           timeout_s: float = 600, extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``nprocs`` ranks to completion; returns their CompletedProcess (stdout+stderr in .stdout).

    Each rank writes to its own temporary file, not a pipe: waiting on rank 0 while rank 1 filled its pipe (64 KiB
    of ZeRO-3's per-call deprecation warnings) blocked rank 1 in a write and rank 0 in the next collective."""
    port = free_port()
    procs, outs = [], []
    for rank in range(nprocs):
        env = {**os.environ, **(extra_env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs),
               "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", "swiftslurm.train.launch", spec_path, "--out", out, "--worker"]
        if resume:
            argv += ["--resume", resume]
        if stop_at_step:
            argv += ["--stop-at-step", str(stop_at_step)]
        outs.append(tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace"))
        procs.append(subprocess.Popen(argv, env=env, stdout=outs[-1], stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    results = []
    for p, f in zip(procs, outs):
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait()
        f.seek(0)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, f.read(), ""))
        f.close()
    return results


def _worker(spec_path: str, out: str, resume: str | None, stop_at_step: int | None) -> int:
    from ..slurm.distenv import DistEnv
    from ..dsconfig import build_for_spec
    from ..errors import SwiftSlurmError
    from ..spec import load_spec
    from .sft import train

    spec = load_spec(spec_path)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0, nnodes=1,
                   nodes=("localhost",), node="localhost", master_addr=os.environ["MASTER_ADDR"],
                   master_port=int(os.environ["MASTER_PORT"]), job_id=f"local-{os.getppid()}",
                   requeue_id=f"local-{os.getppid()}", array_task_id=None, restart_count=0, gpus=(), executor="local")
    ds, _warnings = build_for_spec(spec)
    calls = {"n": 0}

    def should_stop() -> bool:
        calls["n"] += 1
        return bool(stop_at_step) and rank == 0 and calls["n"] >= stop_at_step

    try:
        result = train(spec, dist, ds, out, True if resume == "newest" else resume, should_stop)
    except SwiftSlurmError as exc:  # as `swiftslurm run` does: one message and the SPEC.md exit code, no traceback
        print(f"error: {exc.message()}", file=sys.stderr, flush=True)
        return exc.exit_code
    Path(out, f"result-rank{rank}.json").write_text(json.dumps(dataclasses.asdict(result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swiftslurm.train.launch")
    ap.add_argument("spec")
    ap.add_argument("--out", required=True)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--resume", help="a checkpoint dir, or 'newest': the newest verified one, as swiftslurm run does")
    ap.add_argument("--stop-at-step", type=int)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.spec, a.out, a.resume, a.stop_at_step)
    results = launch(a.spec, a.out, a.nprocs, a.resume, a.stop_at_step)
    for rank, r in enumerate(results):
        if r.returncode != 0 or rank == 0:
            print(f"--- rank {rank} (exit {r.returncode})\n{r.stdout[-4000:]}")
    return max(r.returncode for r in results)


if __name__ == "__main__":
    sys.exit(main())
