"""`swiftslurm doctor` (issue 14): findings from what real runs left, and from realistically written files.

Real local-executor runs whose ``train.command`` fails the way training fails (rank 1 raising a captured GPU
error text, ranks waiting in a real gloo all-reduce for a rank that sleeps, spins or dies) are read by the
real CLI; the metrics, requeue and preflight rules run on files written as the trainer, the runtime and the
preflight write them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from swiftslurm.doctor import diagnose, diagnose_task
from swiftslurm.doctor.evidence import TaskRun, read_task
from swiftslurm.doctor.hang import culprits, stack_dumps
from swiftslurm.doctor.target import runs_of
from swiftslurm.plan import make_plan
from swiftslurm.spec import parse_toml, validate_spec
from swiftslurm.submit import submit_plan

HEALTHY_RUN = Path(__file__).parent / "data" / "watch_run"  # the quickstart model, 12 steps, 2 ranks (local)
WAIT_S = 180

# Captured from GPU runs (torch 2.x on H100s / A100s): the texts the rules must recognise. Marked as captured:
# this machine has no GPU to make them.
CAPTURED_CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                     "of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory "
                     "in use. Of the allocated memory 75.61 GiB is allocated by PyTorch, and 1.71 GiB is reserved by PyTorch "
                     "but unallocated.")
CAPTURED_DEVICE_MISMATCH = ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
                            "cuda:1 and cpu! (when checking argument for argument mat2 in method wrapper_CUDA_mm)")
CAPTURED_MISSING_KEYS = ("RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM:\n\tMissing key(s) in "
                         "state_dict: \"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight\".")

# train.command: every rank starts; ``fail``: rank BAD fails with the text in file ARG; ``sleep``/``spin``/``die``: every rank joins a
# gloo all-reduce, then rank BAD sleeps, spins or SIGKILLs itself before the second one, which the others wait in.
WORKER = textwrap.dedent(r"""
    import datetime, os, signal, sys, time
    mode, bad, arg = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    print(f"worker rank {rank} up", flush=True)
    if mode == "fail":  # the traceback a failing trainer prints, ending with the text captured in file ARG
        if rank == bad:
            text = open(arg).read()
            sys.stderr.write('Traceback (most recent call last):\n  File "train.py", line 12, in <module>\n    step()\n' + text + "\n")
            sys.exit(1)
        sys.exit(0)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(arg)))
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"rank {rank} joined the first all-reduce", flush=True)
    if rank == bad:
        if mode == "sleep":
            time.sleep(4 * float(arg))
        elif mode == "spin":
            end = time.time() + 4 * float(arg)
            while time.time() < end:
                pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
""")


def run_local(tmp_path: Path, args: list[str], ranks: int, spec_extra: str = "") -> Path:
    out = tmp_path / "out"
    text = f"""
[job]
name = "doctor"
output_dir = {json.dumps(str(out))}
[slurm]
nodes = 1
tasks_per_node = {ranks}
time = "00:05:00"
[train]
command = {json.dumps([sys.executable, "-c", WORKER, *args])}
per_device_train_batch_size = 4
{spec_extra}
[preflight]
checks = []
"""
    raw = parse_toml(text)
    plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="doctor.toml")
    sub = submit_plan(plan, executor="local")
    sub.wait(timeout_s=WAIT_S, poll_s=0.5)
    return out


def cli(*args):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def doctor_json(target: Path) -> list[dict]:
    proc = cli("doctor", str(target), "--json")
    assert proc.returncode == 6, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- a healthy run


def test_a_healthy_quickstart_run_has_nothing_wrong():
    proc = cli("doctor", str(HEALTHY_RUN))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing wrong found" in proc.stdout
    assert json.loads(cli("doctor", str(HEALTHY_RUN), "--json").stdout) == []


# ---------------------------------------------------------------- errors from real runs (captured texts raised)


@pytest.mark.parametrize("code,text,keys", [
    ("cuda_oom", CAPTURED_CUDA_OOM, "train.per_device_train_batch_size"),
    ("device_mismatch", CAPTURED_DEVICE_MISMATCH, "train.deepspeed"),
    ("ckpt_missing_keys", CAPTURED_MISSING_KEYS, "train.resume_weights_only"),
])
def test_a_failing_rank_is_named_with_file_line_and_fix(tmp_path, code, text, keys):
    (tmp_path / "captured.txt").write_text(text)
    out = run_local(tmp_path, ["fail", "1", str(tmp_path / "captured.txt")], ranks=2, spec_extra='deepspeed = "zero3_offload"')
    findings = doctor_json(out)
    mine = [f for f in findings if f["code"] == code]
    assert mine, findings
    f = mine[0]
    assert f["ranks"] == [1] and keys in f["keys"]
    ev = f["evidence"][0]
    assert ev["rank"] == 1 and ev["node"] and ev["file"] == "logs/rank-1.log" and ev["line"] >= 1
    lines = (out / ev["file"]).read_text().splitlines()
    assert lines[ev["line"] - 1].strip() == ev["text"] and ev["text"] in text  # the line the evidence points at
    if code == "device_mismatch":
        assert "optimizer on cpu" in f["cause"]  # offload on, from the task's spec
    assert [x["code"] for x in findings].count(code) == 1
    human = cli("doctor", str(out))
    assert human.returncode == 6 and code in human.stdout and "fix" in human.stdout


# ---------------------------------------------------------------- hangs from real gloo collectives


@pytest.mark.parametrize("mode", ["sleep", "die", "spin"])
def test_hang_names_the_rank_the_others_wait_for(tmp_path, mode):
    out = run_local(tmp_path, [mode, "2", "6"], ranks=4)
    findings = doctor_json(out)
    assert findings[0]["code"] == "hang", findings
    hang = findings[0]
    assert hang["ranks"] == [2] and hang["nodes"] == ["localhost"], hang
    assert "rank 2 (localhost)" in hang["what"] and "never joined" in hang["what"]
    if mode == "die":
        assert any(f["code"] == "node_failure" and f["ranks"] == [2] for f in findings), findings
    assert any(f["code"] == "nccl_timeout" for f in findings)
