"""Benchmark: a 1000-task sweep through `swiftslurm submit` vs a raw `sbatch --array=0-999`, same run.

    .venv/bin/python benchmarks/submit_array.py [--tasks 1000] [--repeat 3] [--partition debug]

Both arrays are submitted held (`--hold`, so they never take nodes from anyone) and cancelled
right after. swiftslurm's time is the whole CLI (`python -m swiftslurm submit SPEC`): interpreter
start, validation, planning 1000 tasks, writing the plan and 1000 task specs, submitit's pickles,
the one sbatch call. The raw side is `sbatch --parsable --array=0-999` of a one-line script.
Prints the median of each over --repeat rounds and their ratio (goal: <= 3x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def spec_text(out: Path, tasks: int, partition: str) -> str:
    return f"""
[job]
name = "bench-array"
output_dir = {json.dumps(str(out))}
[slurm]
partition = {json.dumps(partition)}
time = "00:05:00"
signal_grace_s = 30
extra_sbatch = ["--hold"]
[train]
command = ["true"]
[preflight]
checks = []
[sweep]
seed = {json.dumps(list(range(tasks)))}
"""


def timed(argv: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    return time.perf_counter() - t0, proc


def in_process(spec: Path, base: Path) -> float:
    """submit_plan() alone, on a plan already validated (no interpreter start, no imports)."""
    import os

    from swiftslurm.cli.app import load_plan
    from swiftslurm.jobs.send import submit_plan

    cwd = os.getcwd()
    os.chdir(base)
    try:
        plan = load_plan(spec)
        out = Path(plan.output_dir)
        plan = type(plan)(**{**plan.__dict__, "output_dir": str(out) + "-inproc",
                             "tasks": [type(t)(t.index, t.overrides, t.output_dir.replace(str(out), str(out) + "-inproc", 1), t.spec) for t in plan.tasks]})
        t0 = time.perf_counter()
        sub = submit_plan(plan, executor="slurm")
        took = time.perf_counter() - t0
        sub.cancel()
        return took
    finally:
        os.chdir(cwd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--partition", default="debug")
    args = ap.parse_args()
    ours, raw, inproc = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-submit-", dir=str(Path.cwd())) as tmp:
        base = Path(tmp)
        script = base / "one-line.sh"
        script.write_text("#!/bin/bash\nsrun true\n")
        for i in range(args.repeat):
            spec = base / f"sweep{i}.toml"
            spec.write_text(spec_text(base / f"out{i}", args.tasks, args.partition))
            t_raw, proc = timed(["sbatch", "--parsable", "--hold", f"--array=0-{args.tasks - 1}", "-p", args.partition,
                                 "--time=00:05:00", "-o", "/dev/null", "-J", "bench-raw", str(script)])
            if proc.returncode != 0:
                print(f"raw sbatch failed: {proc.stderr.strip()}", file=sys.stderr)
                return 1
            subprocess.run(["scancel", proc.stdout.strip().split(";")[0]], check=False)
            t_ours, proc = timed([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", "slurm"], cwd=base)
            if proc.returncode != 0:
                print(f"swiftslurm submit failed:\n{proc.stdout}\n{proc.stderr}", file=sys.stderr)
                return 1
            subprocess.run([sys.executable, "-m", "swiftslurm", "cancel", str(base / f"out{i}")], capture_output=True, check=False)
            t_in = in_process(spec, base)
            raw.append(t_raw)
            inproc.append(t_in)
            ours.append(t_ours)
            print(f"round {i + 1}: swiftslurm submit {t_ours:.2f} s (submit_plan in-process {t_in:.2f} s), raw sbatch {t_raw:.3f} s", flush=True)
    m_ours, m_raw = statistics.median(ours), statistics.median(raw)
    m_in = statistics.median(inproc)
    print(f"{args.tasks}-task array, median of {args.repeat}: swiftslurm submit {m_ours:.2f} s, "
          f"raw sbatch --array {m_raw:.3f} s, ratio {m_ours / m_raw:.1f}x (goal <= 3x); "
          f"in-process submit_plan (plan already loaded) {m_in:.2f} s, ratio {m_in / m_raw:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
