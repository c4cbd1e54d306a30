"""The baseline: a plain torch.distributed all_reduce loop (NCCL), same sizes and dtype as the preflight.

torchrun --nproc_per_node=N bare_allreduce.py OUT.json
busbw = algbw x 2(n-1)/n (nccl-tests), GB/s.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

SIZES = [2**k for k in (20, 22, 24, 26, 28, 30, 32)]


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    res = {"sizes": [], "busbw_gbps": []}
    for size in SIZES:
        x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        n = 20 if size <= 2**26 else 10
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / n
        res["sizes"].append(size)
        res["busbw_gbps"].append(round(size / dt / 1e9 * 2 * (world - 1) / world, 2))
        del x
    if rank == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(res, fh)
        print(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
