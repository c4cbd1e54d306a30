"""Driver for test_preflight_bounded.py: the gate on this rank, then what a trainer does next: init its own
process group (on its own port) and all-reduce across every rank. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as tdist

from swiftslurm.preflight import gate
from swiftslurm.slurm import distenv
from swiftslurm.spec import load_spec


def main() -> None:
    spec_path, out_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[-1])
    spec = load_spec(spec_path)
    dist = distenv.derive(os.environ, pid=os.getpid(), explicit=spec.env)
    proceed = gate(dist, spec, out_dir, mode="train")
    left = tdist.is_initialized()
    store = tdist.TCPStore("127.0.0.1", port, dist.world_size, is_master=dist.rank == 0, timeout=timedelta(seconds=60))
    tdist.init_process_group("gloo", store=store, rank=dist.rank, world_size=dist.world_size, timeout=timedelta(seconds=60))
    x = torch.ones(1)
    tdist.all_reduce(x)
    tdist.barrier()
    print(json.dumps({"proceed": proceed, "left": left, "sum": x.item()}), flush=True)
    os._exit(0)  # the hung sweep thread of the faulty rank must not keep it alive


if __name__ == "__main__":
    main()
