"""train/shutdown.py: after a run, no torch.distributed thread may outlive the process groups (issue 21, 15b).

Two real gloo ranks, a few collectives, then ``shut_down_distributed`` and a plain exit; each rank records the
threads still running at exit (tests/exit_threads). A group held past ``destroy_process_group`` keeps its gloo
workers, transport loop and TCPStore server, and such a worker can abort the rank during finalization.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import exit_threads_env, threads_at_exit

from swiftslurm.train.launch import free_port

ROOT = Path(__file__).resolve().parents[1]

# A library function that captured the default group in a default argument, as DeepSpeed's TorchBackend.barrier
# does when deepspeed.comm.torch is imported after init_process_group; and a subgroup, as DeepSpeed makes.
RANK_SCRIPT = """
import datetime, sys
import torch, torch.distributed as dist
from swiftslurm.train.health.shutdown import shut_down_distributed
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
def barrier(group=dist.GroupMember.WORLD, async_op=False):
    return dist.barrier(group=group, async_op=async_op)
async def kw_barrier(*, group=dist.GroupMember.WORLD):
    return dist.barrier(group=group)
sub = dist.new_group([0, 1])
t = torch.ones(1000)
for _ in range(3):
    dist.all_reduce(t)
    dist.all_reduce(t, group=sub)
barrier()
del sub
shut_down_distributed()
"""


def run_ranks(tmp: Path, script: str, world: int = 2, timeout_s: float = 60) -> list[subprocess.CompletedProcess]:
    """``script`` as ``world`` gloo ranks on this machine, recording their threads at exit into ``tmp``."""
    (tmp / "rank.py").write_text(script)
    common = {**os.environ, **exit_threads_env(tmp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
              "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp / "rank.py")], cwd=ROOT, env={**common, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout_s
    try:  # one deadline for all ranks; a rank still running after it is killed
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [subprocess.CompletedProcess(p.args, p.returncode, out, "") for p, out in zip(procs, outputs, strict=True)]


def test_no_process_group_thread_outlives_shut_down_distributed(tmp_path):
    procs = run_ranks(tmp_path, RANK_SCRIPT)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{p.stdout[-3000:]}"
        assert "still running after shutdown" not in p.stdout, p.stdout[-3000:]
    assert threads_at_exit(tmp_path) == {0: [], 1: []}
