"""The per-step walltime stop flag (``train/trainer.py``, ``train/collective.py``): every rank stops at the same step when any one saw the
signal. On GPUs the default group is NCCL, whose read of the flag waits for the whole step's kernels; the flag is
reduced on a gloo side group instead (``stop_flag_group``). Two real ranks (gloo on the CPU, in child processes):
the side group is made where the default backend is not gloo, left out where it is (or with one rank), and agrees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from swiftslurm.train.launch import free_port

CHILD = r'''
import json, os, sys
import torch.distributed as tdist
from swiftslurm.train.collective import all_reduce_values, stop_flag_group
tdist.init_process_group("gloo")
rank = tdist.get_rank()
own = stop_flag_group()  # the default group is gloo: none needed
side = stop_flag_group(backend="nccl", timeout_s=60)  # what a GPU job's ranks make
seen = [1.0 if rank == 1 and step == 2 else 0.0 for step in range(4)]  # rank 1 alone saw the signal, at step 2
agreed = [all_reduce_values([flag], tdist.ReduceOp.MAX, "cpu", 2, side)[0] for flag in seen]
print("RESULT " + json.dumps({"own": own is None, "side": type(side).__name__, "agreed": agreed,
                              "backend": str(tdist.get_backend(side))}), flush=True)
tdist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, stdout[-2000:] + stderr[-3000:]
        out.append(json.loads(lines[-1][len("RESULT "):]))
    return out


def test_every_rank_stops_at_the_step_one_rank_saw_the_signal(ranks):
    assert [r["agreed"] for r in ranks] == [[0.0, 0.0, 1.0, 0.0]] * 2


def test_the_flag_goes_over_gloo_only_where_the_default_group_is_not_gloo(ranks):
    assert all(r["own"] for r in ranks)  # a CPU job's default group already reduces on the CPU
    assert {r["backend"] for r in ranks} == {"gloo"} and {r["side"] for r in ranks} == {"ProcessGroup"}


def test_one_rank_has_nothing_to_agree_with():
    from swiftslurm.train.collective import all_reduce_values, stop_flag_group

    assert stop_flag_group(backend="nccl") is None  # no process group at all (one rank, never initialized)
    assert all_reduce_values([1.0], None, "cuda:7", world_size=1) == [1.0]  # no tensor made, no device touched
