"""runtime: `swiftslurm run` on real processes (local) and on the real Slurm cluster."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from swiftslurm.plan import make_plan, write_plan
from swiftslurm.runtime import decide_requeue, read_requeues
from swiftslurm.spec import parse_spec

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]

DUMP_ENV = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR",
        "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "SLURM_JOB_ID", "SLURMD_NODENAME"]
out = {k: os.environ.get(k) for k in keys}
out["cwd"] = os.getcwd()
with open(os.path.join(sys.argv[1], "env-%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump(out, fh)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""

ALLREDUCE = """
import datetime, json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")}
out["sum"] = t.item()
with open(os.path.join(sys.argv[1], "rank-%d.json" % dist.get_rank()), "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
"""

SIGNALLED = """
import os, signal, sys, time
out = sys.argv[1]
def got(signum, frame):
    open(os.path.join(out, "got-" + signal.Signals(signum).name), "w").close()
    sys.exit(7 if signum == signal.SIGTERM else 0)
signal.signal(signal.SIGUSR2, got)
signal.signal(signal.SIGTERM, got)
open(os.path.join(out, "ready"), "w").close()
time.sleep(60)
"""


def make_plan_file(tmp: Path, toml: str) -> Path:
    """A plan on disk from a spec's TOML text (base dir = tmp)."""
    raw = tomllib.loads(toml)
    plan = make_plan(parse_spec(toml), raw, base_dir=str(tmp), source="test.toml")
    return write_plan(plan)


def command_spec(tmp: Path, script: str, *args: str, slurm: str = "tasks_per_node = 1", extra: str = "") -> str:
    path = tmp / "script.py"
    path.write_text(script)
    cmd = json.dumps([PY, str(path), *args])
    return f'[job]\nname = "rt"\noutput_dir = "{tmp}/out"\n[slurm]\n{slurm}\n[train]\ncommand = {cmd}\n[preflight]\nchecks = []\n{extra}'


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT_", "MASTER_", "SWIFTSLURM_"))}


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "swiftslurm", "run", *args], env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


# ---------------------------------------------------------------- local, real processes


def test_command_gets_derived_env_and_its_exit_code(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), "3", extra='[env]\nNCCL_DEBUG = "WARN"\n'))
    proc = run_cli("--plan", str(plan))
    assert proc.returncode == 3, proc.stderr
    env = json.loads((tmp_path / "env-0.json").read_text())
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert 20000 <= int(env["MASTER_PORT"]) < 60000
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_DEBUG"] == "WARN"
    assert env["cwd"] == str(tmp_path)  # the plan's base_dir
    assert "swiftslurm run" in proc.stderr and "master" in proc.stderr  # rank 0's banner


def test_plan_from_env_var_and_missing_plan(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path)))
    proc = run_cli(env={**clean_env(), "SWIFTSLURM_PLAN": str(plan)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "env-0.json").exists()
    proc = run_cli("--plan", str(tmp_path / "nope.json"))
    assert proc.returncode == 1 and "plan file does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_spec_env_may_not_set_rank(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), extra='[env]\nRANK = "0"\n'))
    proc = run_cli("--plan", str(plan))
    assert proc.returncode == 1 and "per-rank" in proc.stderr and "HINT" in proc.stderr
    assert not (tmp_path / "env-0.json").exists()


def test_mis_sized_local_run_stops_before_the_command(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), slurm="tasks_per_node = 2"))
    proc = run_cli("--plan", str(plan))
    assert proc.returncode == 1 and "HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "env-0.json").exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGUSR2, 0), (signal.SIGTERM, 7)])
def test_signals_reach_the_command(tmp_path, sig, code):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, SIGNALLED, str(tmp_path)))
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "ready", 30)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert (tmp_path / f"got-{sig.name}").exists()
    records = read_requeues(str(tmp_path / "out"))
    if sig == signal.SIGUSR2:  # a walltime stop: recorded; the local executor cannot requeue
        assert len(records) == 1 and records[0]["requeued"] is False
    else:
        assert records == []


def test_submitit_local_executor_two_ranks_allreduce(tmp_path):
    submitit = pytest.importorskip("submitit")
    from swiftslurm.runtime import run_task

    plan = make_plan_file(tmp_path, command_spec(tmp_path, ALLREDUCE, str(tmp_path), slurm="tasks_per_node = 2"))
    executor = submitit.LocalExecutor(folder=str(tmp_path / "submitit"))
    executor.update_parameters(tasks_per_node=2, nodes=1, timeout_min=2)
    job = executor.submit(run_task, str(plan), 0)
    deadline = time.monotonic() + 90
    while not job.done():
        assert time.monotonic() < deadline, "local job did not finish in 90 s"
        time.sleep(0.5)
    assert job.results() == [0, 0]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]
    assert (tmp_path / "out" / "logs" / "rank-1.log").exists()


@pytest.mark.parametrize(
    "recorded,restarts,limit,requeue,count",
    [(0, 0, 20, True, 1), (2, 0, 3, True, 3), (0, 2, 3, True, 3), (3, 0, 3, False, 3), (1, 5, 5, False, 5), (0, 0, 0, False, 0)],
)
def test_decide_requeue(recorded, restarts, limit, requeue, count):
    d = decide_requeue(recorded, restarts, limit)
    assert (d.requeue, d.count) == (requeue, count)
    if not requeue:
        assert "max_requeues" in d.message
