"""The preflight under real Slurm (tests/cluster/up.sh: node1..node4 on 127.0.0.1-4): srun starts one
rank per node, real nc/iperf3/fio/gloo; and on_failure = "exclude" requeues the job without the bad node.
All checks passing on 4 Slurm nodes is test_preflight_cmd.py::test_slurm_four_nodes (through the CLI).
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


# ---------------------------------------------------------------- exclude, the way the rendered script runs it

EXCLUDE_SPEC = """
[job]
name = "pf-exclude-tpl"
output_dir = "{out}"
[slurm]
partition = "debug"
nodes = 3
time = "00:04:00"
[train]
command = ["true"]
[preflight]
checks = ["ports"]
timeout_s = 30
on_failure = "exclude"
"""

# inserted before the rendered srun line: on the first run only, the second node fails its port check
FIRST_RUN_FAULT = """if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then
  export SWIFTSLURM_PREFLIGHT_FAULT="no-listener@$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 2p)"
fi
echo "attempt ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST fault=${SWIFTSLURM_PREFLIGHT_FAULT:-none}"
"""


def _state(job_id: str) -> tuple[str, str]:
    show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    fields = dict(w.split("=", 1) for w in show.split() if "=" in w)
    return fields.get("JobState", "?"), fields.get("Reason", "?")


@pytest.mark.slow
def test_exclude_under_the_rendered_script_kill_on_bad_exit(tmp_path):
    """The rendered script runs `srun --kill-on-bad-exit=1`: the other ranks' exit (or their death by the
    requeue's SIGTERM) must not kill rank 0 between its Slurm calls; the job reruns without the bad node.
    scontrol answers slowly here (as a busy slurmctld does: a real scontrol behind a 1 s delay), so a
    rank that exits without waiting for rank 0 is caught in the act."""
    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.slurm.render import render_sbatch
    from swiftslurm.spec import parse_spec, parse_toml

    out = tmp_path / "out"
    text = EXCLUDE_SPEC.format(out=out)
    plan = make_plan(parse_spec(text), parse_toml(text), base_dir=str(tmp_path), source="test.toml")
    script = render_sbatch(plan)
    write_plan(plan, script)
    assert "srun --kill-on-bad-exit=1" in script
    script = script.replace("srun --kill-on-bad-exit=1", FIRST_RUN_FAULT + "srun --kill-on-bad-exit=1", 1)
    (tmp_path / "job.sh").write_text(script)
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "scontrol").write_text(f'#!/bin/sh\nsleep 1\nexec {shutil.which("scontrol")} "$@"\n')
    (slow / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{slow}:{os.environ['PATH']}"}  # sbatch exports it to the job
    job_id = subprocess.run(["sbatch", "--parsable", str(tmp_path / "job.sh")], capture_output=True, text=True, check=True, env=env).stdout.strip()
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            state, reason = _state(job_id)
            assert "held" not in reason.lower(), f"job {job_id} left held: {state} {reason}"
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
                break
            time.sleep(1)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    text = "".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert state == "COMPLETED", f"{state} {reason}\n{text[-4000:]}"
    bad = re.search(r"attempt 0 on (\S+) fault=no-listener@(\S+)", text).group(2)
    assert f"requeued with ExcNodeList={bad}" in text and "attempt 1" in text, text[-4000:]
    report = json.loads((out / "preflight" / "report.json").read_text())
    assert report["restart_count"] == 1 and bad not in report["nodes"] and report["ok"]


def _running_sleeper(tmp_path: Path, name: str, *opts: str) -> str:
    """A real `sleep 60` batch job, once it runs."""
    job_id = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-N1", "-t", "2", "-J", name, "--requeue", *opts,
                             "-o", str(tmp_path / f"{name}.out"), "--wrap", "sleep 60"], capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 90
    while _state(job_id)[0] != "RUNNING":
        assert time.monotonic() < deadline and "held" not in _state(job_id)[1].lower(), _state(job_id)
        time.sleep(0.5)
    return job_id


def test_exclusion_never_leaves_the_job_held(tmp_path):
    """exclude_and_requeue against a real job: an update Slurm refuses leaves the job requeued (never held:
    it runs again); a node the job requires by name is not excluded at all (the job would pend forever)."""
    from swiftslurm import slurm
    from swiftslurm.errors import SwiftSlurmError

    job_id = _running_sleeper(tmp_path, "pf-held")
    try:
        with pytest.raises(SwiftSlurmError, match="requeued, but Slurm refused ExcNodeList"):
            slurm.exclude_and_requeue(job_id, ["no-such-node"])
        deadline = time.monotonic() + 60
        while _state(job_id)[0] != "RUNNING":
            assert time.monotonic() < deadline and "held" not in _state(job_id)[1].lower(), _state(job_id)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    pinned = _running_sleeper(tmp_path, "pf-pinned", "-w", "node3")
    try:
        with pytest.raises(SwiftSlurmError, match="requires it by name"):
            slurm.exclude_and_requeue(pinned, ["node3"])
        assert _state(pinned)[0] == "RUNNING"  # not requeued
    finally:
        subprocess.run(["scancel", pinned], capture_output=True)
