"""Does the NVML sampler (swiftslurm/train/health/gpuutil.py) read what the GPU does? Three timed phases on one GPU:

    python benchmarks/gpu_util.py                  # one GPU: needs torch with CUDA and nvidia-ml-py (pip install nvidia-ml-py)
    .venv/bin/python benchmarks/gpu_util.py        # CPU: says the sampler is off (no GPU), exits 0

- busy: back-to-back bf16 matmuls (expect ~1.0),
- idle: the process sleeps (expect ~0.0),
- half: matmuls for ~50 ms, then 50 ms of sleep (expect ~0.5).

Each phase runs ``--seconds`` and prints the sampler's mean (``take()``, a fraction) next to the expectation;
``--json FILE`` writes them. With ``CUDA_VISIBLE_DEVICES=3`` it must read GPU 3 (the rank-binding path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def _matmuls_for(seconds: float, a, b) -> None:
    import torch

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--size", type=int, default=8192)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    from swiftslurm.train.health.gpuutil import GpuSampler

    sampler = GpuSampler.for_this_rank(interval_s=0.2)
    if sampler is None:
        print(f"sampler off: cuda available = {torch.cuda.is_available()} (no GPU, no NVML or no nvidia-ml-py): gpu_util stays absent")
        return 0
    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    _matmuls_for(1.0, a, b)  # warm-up
    results = {}
    for phase, expect in (("busy", 1.0), ("idle", 0.0), ("half", 0.5)):
        sampler.take()
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            if phase == "busy":
                _matmuls_for(0.5, a, b)
            elif phase == "idle":
                time.sleep(0.5)
            else:
                _matmuls_for(0.05, a, b)
                time.sleep(0.05)
        got = sampler.take()
        results[phase] = {"gpu_util": got, "expected": expect}
        print(f"{phase:5s} gpu_util {got if got is None else round(got, 3)}  (expected ~{expect})", flush=True)
    sampler.stop()
    print(f"device {torch.cuda.get_device_name()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), **results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
