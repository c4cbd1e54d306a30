"""The trainer owns what it starts: when a phase of ``sft.train`` fails, everything it started is undone.

A rank runs ``sft.train`` in a child process with a config the Trainer's constructor refuses (bf16 in the spec,
fp16 enabled in the DeepSpeed config: accelerate raises while the Trainer builds its Accelerator). The GPU
sampler is the real class with its real thread, reading a constant (no NVML here); the ``deepspeed.comm``
patch is the real one. After the failure neither may be left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

RANK = """
import json, os, sys, threading
from swiftslurm.dsconfig import build_for_spec
from swiftslurm.slurm.distenv import DistEnv, free_port
from swiftslurm.spec import load_spec
from swiftslurm.train.health import gpuutil
from swiftslurm.train.run import train

port = free_port()
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def sampler(cls, interval_s=0.5):  # the real sampler and thread; NVML is the one thing this machine lacks
    started = cls(lambda: 50.0, 0.05)
    started._thread.start()
    return started


gpuutil.GpuSampler.for_this_rank = classmethod(sampler)
spec = load_spec(sys.argv[1])
ds, _ = build_for_spec(spec)
ds["fp16"] = {"enabled": True}  # with the spec's bf16: the Trainer's Accelerator refuses it
dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1, nodes=("localhost",),
               node="localhost", master_addr="127.0.0.1", master_port=port, job_id="local-1", requeue_id="local-1",
               array_task_id=None, restart_count=0, gpus=(), executor="local")
try:
    train(spec, dist, ds, sys.argv[2], None, lambda: False)
    error = None
except Exception as exc:
    import traceback
    error = f"{type(exc).__name__}: {exc}"
    where = traceback.extract_tb(exc.__traceback__)
import deepspeed.comm as dscomm
import deepspeed.comm.comm as impl
print("RESULT " + json.dumps({
    "error": error,
    "in_trainer_init": any(f.name == "__init__" and f.filename.endswith("transformers/trainer.py") for f in where) if error else False,
    "threads": [t.name for t in threading.enumerate()],
    "patched": sorted(n for mod in (dscomm, impl) for n in dir(mod) if hasattr(getattr(mod, n), "__wrapped__")),
}))
"""


def test_a_trainer_that_fails_to_build_leaves_no_sampler_thread_and_no_comm_patch(tmp_path):
    data = tomllib.loads((ROOT / "examples" / "quickstart.toml").read_text())
    data.pop("preflight")
    data["job"]["output_dir"] = str(tmp_path / "out")
    data["slurm"]["tasks_per_node"] = 1
    data["train"].update(dataset=[str(ROOT / d) for d in data["train"]["dataset"]], bf16=True)
    lines = []
    for table, body in data.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in body.items()]
    (tmp_path / "spec.toml").write_text("\n".join(lines) + "\n")
    (tmp_path / "rank.py").write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(tmp_path / "rank.py"), str(tmp_path / "spec.toml"), str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert "mixed_precision" in (result["error"] or "") and result["in_trainer_init"], result
    assert "swiftslurm-gpu-util" not in result["threads"], result["threads"]
    assert result["patched"] == [], result["patched"]
