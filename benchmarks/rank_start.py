"""The CPU a rank spends importing the training stack: what every rank of every job pays at each start and restart.

    python benchmarks/rank_start.py [--runs 5] [--json OUT]

Both sides are a fresh interpreter that ends with transformers, DeepSpeed and peft imported, and DeepSpeed's Muon
optimizer module, which every DeepSpeed engine imports as it starts (ZeRO's optimizer check), on DeepSpeed's CPU
accelerator (what a rank has when its engine starts):

- **before**: ``import transformers, deepspeed, peft`` and the Muon module, as a rank did: DeepSpeed's autotuner
  imports mlflow and peft imports bitsandbytes when they are installed (the ``tracking`` and ``train`` extras
  install them), and the Muon module wraps its kernels with ``torch.compile`` as it imports;
- **now**: ``train.build.prepare_device_env()``, which imports the same with those two kept out and the Muon
  kernels wrapped on their first call (``import_stack``).

Figures: the child's CPU seconds (user + sys, from ``resource.getrusage(RUSAGE_CHILDREN)``) and wall seconds, the
median of ``--runs`` alternating runs each; printed, and with --json written as one object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MUON = "deepspeed.runtime.zero.muon.muon_optimizer"
SIDES = {
    "before": f"import transformers, deepspeed, peft, {MUON}",
    "now": "from swiftslurm.train.build import prepare_device_env; prepare_device_env()",
}
END = f"import sys, {MUON}; assert {{'transformers', 'deepspeed', 'peft', '{MUON}'}} <= set(sys.modules)"


def one(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one fresh interpreter running ``code``."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"{code}; {END}"], check=True, env=env, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    one(SIDES["now"])  # warm the page cache and the .pyc files for both sides
    got: dict[str, list[tuple[float, float]]] = {side: [] for side in SIDES}
    for _ in range(args.runs):
        for side, code in SIDES.items():
            got[side].append(one(code))
    result = {side: {"cpu_s": statistics.median(c for c, _ in runs), "wall_s": statistics.median(w for _, w in runs)}
              for side, runs in got.items()}
    result["cpu_ratio_now_to_before"] = result["now"]["cpu_s"] / result["before"]["cpu_s"]
    result["machine"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    for side in SIDES:
        print(f"{side:7s} CPU {result[side]['cpu_s']:.2f} s  wall {result[side]['wall_s']:.2f} s  (median of {args.runs})")
    print(f"now / before, CPU: {result['cpu_ratio_now_to_before']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
