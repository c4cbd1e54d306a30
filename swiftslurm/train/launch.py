"""A small local launcher: N processes on this machine, each calling ``run.train`` (tests, benchmark).

Production runs go through ``swiftslurm run`` (runtime.run_task); this exists so the trainer can be
exercised without Slurm or the runtime:

    python -m swiftslurm.train.launch SPEC.toml --nprocs 2 --out DIR [--resume CKPT]

It goes through the production wiring: the spec is planned (``make_plan``, the plan file written to DIR as
``submit`` writes it), each worker gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID) and, as ``swiftslurm run`` does,
reads its task from the plan file, derives its rank environment (``distenv.derive``), checks the allocation
and exports ``distenv.child_env`` before training. Each writes ``DIR/result-rank<r>.json``. ``--stop-at-step N`` makes
rank 0 alone report a walltime stop at step N
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

from ..errors import SwiftSlurmError
from ..fsutil import atomic_write_text
from ..slurm.distenv import free_port


def launch(spec_path: str, out: str, nprocs: int = 2, resume: str | None = None, stop_at_step: int | None = None,
           timeout_s: float = 600, extra_env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``nprocs`` ranks to completion; returns their CompletedProcess (stdout+stderr in .stdout).

    Each rank writes to its own temporary file, not a pipe: waiting on rank 0 while rank 1 filled its pipe (64 KiB
    of ZeRO-3's per-call deprecation warnings) blocked rank 1 in a write and rank 0 in the next collective."""
    plan_file = _write_plan(spec_path, out)
    port = free_port()
    procs, outs = [], []
    for rank in range(nprocs):
        env = {**os.environ, **(extra_env or {}), **torchrun_vars(rank, nprocs, port),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", "swiftslurm.train.launch", str(plan_file), "--out", out, "--worker"]
        if resume:
            argv += ["--resume", resume]
        if stop_at_step:
            argv += ["--stop-at-step", str(stop_at_step)]
        outs.append(tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace"))
        procs.append(subprocess.Popen(argv, env=env, stdout=outs[-1], stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout_s
    results = []
    for p, f in zip(procs, outs, strict=True):
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


def torchrun_vars(rank: int, nprocs: int, port: int) -> dict[str, str]:
    """What ``torchrun --standalone --nproc-per-node=<nprocs>`` gives its worker ``rank`` (one node)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": f"local-{os.getpid()}", "TORCHELASTIC_RESTART_COUNT": "0"}


def _write_plan(spec_path: str, out: str) -> Path:
    """The spec planned as ``submit`` plans it (every check of ``make_plan``; paths against the working directory),
    its plan file written into ``out``, where the ranks train."""
    from ..plan import make_plan, write_plan
    from ..spec import load_raw, load_spec

    spec = load_spec(spec_path)
    plan = make_plan(spec, load_raw(spec_path), base_dir=os.getcwd(), source=spec_path)
    return write_plan(dataclasses.replace(plan, output_dir=str(Path(out).resolve())))


def _worker(plan_file: str, out: str, resume: str | None, stop_at_step: int | None) -> int:
    from ..plan import read_plan_task
    from ..slurm import distenv
    from .run import train

    def should_stop() -> bool:  # asked once at train begin, then at every step's end: true from step stop_at_step on
        calls["n"] += 1
        return bool(stop_at_step and dist.rank == 0 and calls["n"] > stop_at_step)

    calls = {"n": 0}
    try:  # the runtime's steps (node/runtime.py), without its preflight, signals and requeue
        _data, task, ds = read_plan_task(plan_file, 0)
        spec = task.spec
        if ds is None:  # the plan has none for a spec without training or with train.command: not this launcher's
            raise SwiftSlurmError("the test launcher runs the built-in trainer", "the plan holds no DeepSpeed config for task 0",
                                  "give the spec a [train] model and dataset, without train.command")
        distenv.check_spec_env(spec.env)
        dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
        distenv.check_allocation(dist, spec)
        logs = Path(out, "logs")
        logs.mkdir(parents=True, exist_ok=True)
        the_env = distenv.child_env(os.environ, dist, spec.env, log_dir=str(logs), pg_timeout_s=spec.train.ddp_timeout)
        os.environ.clear()
        os.environ.update(the_env)  # the one export step, as for the runtime's in-process trainer
        result = train(spec, dist, ds, out, True if resume == "newest" else resume, should_stop)
    except SwiftSlurmError as exc:  # as `swiftslurm run` does: one message and the SPEC.md exit code, no traceback
        print(f"error: {exc.message()}", file=sys.stderr, flush=True)
        return exc.exit_code
    atomic_write_text(Path(out, f"result-rank{dist.rank}.json"), json.dumps(dataclasses.asdict(result)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m swiftslurm.train.launch")
    ap.add_argument("spec", help="the spec TOML (the worker: the plan file the launcher wrote)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--resume", help="a checkpoint dir, or 'newest': the newest verified one, as swiftslurm run does")
    ap.add_argument("--stop-at-step", type=int)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return _worker(a.spec, a.out, a.resume, a.stop_at_step)
    try:
        results = launch(a.spec, a.out, a.nprocs, a.resume, a.stop_at_step)
    except SwiftSlurmError as exc:  # the spec did not plan
        print(f"error: {exc.message()}", file=sys.stderr, flush=True)
        return exc.exit_code
    for rank, r in enumerate(results):
        if r.returncode != 0 or rank == 0:
            print(f"--- rank {rank} (exit {r.returncode})\n{r.stdout[-4000:]}")
    return max(r.returncode for r in results)


if __name__ == "__main__":
    sys.exit(main())
