"""The preflight on a GPU machine: NCCL all-reduce sweep, nvidia-smi, and tools that are absent there.

The GPU tests skip without CUDA, naming the hardware (CI here has none; the one skip CI=true allows); run on a GPU box with
``PYTHONPATH=. python -m pytest --noconftest -q tests/test_preflight_gpu.py``. Needs only torch:
the checks are called directly, one process per rank, ranks meeting through a TCPStore.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import needs_hardware

from swiftslurm.slurm.distenv import free_port

needs_gpus = needs_hardware("2 CUDA GPUs", torch.cuda.is_available() and torch.cuda.device_count() >= 2)


def _rank_main(rank: int, world: int, port: int) -> None:
    """One rank of the NCCL sweep (run as a subprocess): prints its view as JSON."""
    import torch.distributed as tdist

    from swiftslurm.preflight.checks.allreduce import run_allreduce

    store = tdist.TCPStore("127.0.0.1", port, world, is_master=(rank == 0), wait_for_workers=False)
    view = run_allreduce(rank, world, "nccl", tdist.PrefixStore("ar", store), 120, local_rank=rank)
    print("VIEW " + json.dumps(view), flush=True)
    if rank == 0:
        store.wait(["done/1"])
    else:
        store.set("done/1", "1")


@needs_gpus
def test_nccl_allreduce_sweep_two_gpus():
    from swiftslurm.preflight.checks.allreduce import GPU_SIZES, judge

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(port)], env=env, stdout=subprocess.PIPE, text=True) for r in range(2)]
    views = {}
    for r, p in enumerate(procs):
        out, _ = p.communicate(timeout=300)
        line = next(ln for ln in out.splitlines() if ln.startswith("VIEW "))
        views[r] = json.loads(line[5:])
    assert all(v["ok"] for v in views.values()), views
    assert views[0]["sizes"] == GPU_SIZES and views[0]["backend"] == "nccl"
    (result,) = judge(views, [], ["gpu0", "gpu0"], 50.0, 120)
    print(result.observed)
    print(json.dumps({"sizes": views[0]["sizes"], "busbw_gbps": views[0]["busbw_gbps"]}))
    assert result.ok, result.observed  # NVLink between two H200s: hundreds of GB/s at 1 GiB


@needs_gpus
def test_nvidia_smi_sees_the_gpus():
    from swiftslurm.preflight.checks.local import check_gpu

    (ok,) = check_gpu("gpu-node", torch.cuda.device_count())
    print(ok.observed)
    assert ok.ok or "already uses" in ok.observed, ok
    (missing,) = check_gpu("gpu-node", torch.cuda.device_count() + 1)
    assert not missing.ok and "visible" in missing.observed


def test_tools_absent_on_a_node_are_failed_checks(tmp_path, monkeypatch):
    """A node without fio, iperf3 or nc (the GPU machine had none): each is a failed check with a hint, not a crash.
    Here all three are installed, so PATH is an empty folder: the node has none of them."""
    from swiftslurm.preflight.checks import iperf, local, ports
    from swiftslurm.preflight.results import which

    monkeypatch.setenv("PATH", str(tmp_path))
    for tool, run in (("nc", lambda: ports.check_ports("a", ["a", "b"], 1, "a")),
                      ("iperf3", lambda: [iperf.measure("a", "b", 1, 1.0)]),
                      ("fio", lambda: local.check_nvme("a", "/tmp", 1))):
        assert which(tool) is None, tool
        (r,) = run()
        assert not r.ok and f"'{tool}' not found" in r.observed and "install" in r.hint, (tool, r)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
