"""The preflight under real Slurm (tests/cluster/up.sh: node1..node4 on 127.0.0.1-4): srun starts one
rank per node, real nc/iperf3/fio/gloo; and on_failure = "exclude" requeues the job without the bad node.
All checks passing on 4 Slurm nodes is test_preflight_cmd.py::test_slurm_four_nodes (through the CLI).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

SPEC = """
[job]
name = "preflight-slurm"
output_dir = "{out}"
[slurm]
nodes = {n}
partition = "debug"
[train]
command = ["true"]
[preflight]
checks = ["ports", "allreduce", "iperf3", "nvme", "disk", "sharedfs"]
min_iperf3_gbps = 0.1
min_nvme_iops = 100
nvme_path = "{out}"
timeout_s = 45
on_failure = "{on_failure}"
"""


def write_spec(tmp_path: Path, n: int, on_failure: str = "abort") -> tuple[Path, Path]:
    out = tmp_path / "out"
    out.mkdir()
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out=out, n=n, on_failure=on_failure))
    return spec, out


def srun(spec: Path, out: Path, n: int, env_extra: str = "", timeout_s: int = 150) -> tuple[int, str, float]:
    argv = ["srun", "-N", str(n), "--ntasks-per-node=1", "-p", "debug", "-t", "3", "-J", "preflight-test", "--kill-on-bad-exit=0"]
    if env_extra:
        argv.append(f"--export=ALL,{env_extra}")
    argv += [sys.executable, "-m", "swiftslurm.preflight", str(spec), str(out), "--mode", "train"]
    t0 = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.slow
def test_srun_rank_killed_in_allreduce(tmp_path):
    spec, out = write_spec(tmp_path, 4)
    code, log, wall = srun(spec, out, 4, env_extra="SWIFTSLURM_PREFLIGHT_FAULT=kill-allreduce@rank1")
    assert code != 0
    report = json.loads((out / "preflight" / "report.json").read_text())
    dead = [r for r in report["results"] if r["check"] == "allreduce" and not r["ok"] and "rank 1 on" in r["observed"]]
    assert len(dead) == 1 and dead[0]["node"] == report["nodes"][1] and dead[0]["hint"]
    assert wall < 120  # bounded by timeout_s (45) and the gather grace: no hang


JOB = """#!/bin/bash
#SBATCH -J preflight-exclude
#SBATCH -N 3
#SBATCH --ntasks-per-node=1
#SBATCH -p debug
#SBATCH -t 5
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -o {log}
# the test hook: on the first attempt only, make the second node of the allocation fail its port check
if [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then
  export SWIFTSLURM_PREFLIGHT_FAULT="no-listener@$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 2p)"
fi
echo "attempt ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST fault=${{SWIFTSLURM_PREFLIGHT_FAULT:-none}}"
srun {python} -m swiftslurm.preflight {spec} {out} --mode train
echo "preflight exit $?"
"""


@pytest.mark.slow
def test_exclude_requeues_without_the_failing_node(tmp_path):
    spec, out = write_spec(tmp_path, 3, on_failure="exclude")
    log = tmp_path / "job.log"
    script = tmp_path / "job.sh"
    script.write_text(JOB.format(log=log, python=sys.executable, spec=spec, out=out))
    job_id = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True).stdout.strip()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            text = log.read_text() if log.exists() else ""
            if "attempt 1" in text and "preflight exit" in text.split("attempt 1", 1)[1]:
                break
            time.sleep(2)
        text = log.read_text()
        assert "attempt 1" in text, text[-4000:]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    first = re.search(r"attempt 0 on (\S+) fault=no-listener@(\S+)", text)
    bad = first.group(2)
    assert f"excluding {bad} and requeueing" in text and "ExcNodeList=" in text
    second = text.split("attempt 1", 1)[1]
    report = json.loads((out / "preflight" / "report.json").read_text())
    assert report["restart_count"] == 1 and bad not in report["nodes"] and len(report["nodes"]) == 3
    assert report["ok"] and "preflight exit 0" in second
