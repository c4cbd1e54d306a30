"""A walltime requeue that Slurm made is recorded as made, whatever became of `scontrol requeue`'s own answer.

Rank 0 requeues its own job from inside it, and a requeue has slurmd SIGTERM every process of the job's steps:
`scontrol` itself included. The rank survives that (submitit's handler bypasses SIGTERM; a `train.command` rank
has its own), but a `scontrol` still waiting for or writing its answer died of it, and the rank took the death
for a refusal: requeues.json said ``requeued: false`` for a job that then ran again and completed (CI, stop 40,
test_resume). Two stand-ins for `scontrol` (first on the job's PATH, the real one for everything else) make the
race certain instead of rare:

- ``slow``: the real requeue, then a second before exiting 0 (an answer still on its way when the SIGTERM comes);
- ``lost``: the real requeue, then an error, as a reply lost on a loaded controller reads.

Either way the record must say requeued, the job must run again and complete, and the stop's rank must exit 0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sacct_rows, wait_for_job

from swiftslurm.records.requeues import read_requeues

ROOT = Path(__file__).resolve().parents[1]

STANDIN = """#!/bin/sh
echo "$*" >> "{calls}"
if [ "$1" = "requeue" ]; then
    {real} "$@" || exit $?
    {after}
fi
exec {real} "$@"
"""
AFTER = {
    "slow": "sleep 1; exit 0",  # within the test cluster's KillWait (2 s): only the SIGTERM can end it early
    "lost": 'echo "scontrol: error: slurm_requeue error: Socket timed out on send/recv operation" >&2; exit 1',
}

# the job's command: its first run waits for the walltime signal, its rerun (after the requeue) ends at once
COMMAND = """
import os, signal, sys
if int(os.environ.get("SLURM_RESTART_COUNT") or 0) > 0:
    sys.exit(0)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
open(os.path.join(sys.argv[1], "ready"), "w").close()
signal.sigtimedwait({signal.SIGUSR2}, 120)
"""


@pytest.mark.slurm
@pytest.mark.parametrize("answer", sorted(AFTER))
def test_a_requeue_whose_answer_is_lost_is_still_a_requeue(tmp_path, slurm_cluster, answer):
    bin_dir = tmp_path / "site-bin"
    bin_dir.mkdir()
    real = shutil.which("scontrol")
    assert real, "scontrol is not on PATH"
    (bin_dir / "scontrol").write_text(STANDIN.format(calls=tmp_path / "scontrol-calls", real=real, after=AFTER[answer]))
    (bin_dir / "scontrol").chmod(0o755)
    (tmp_path / "cmd.py").write_text(COMMAND)
    out = tmp_path / "out"
    name = f"requeue-answer-{answer}"
    (tmp_path / "job.toml").write_text(
        f'[job]\nname = "{name}"\noutput_dir = "{out}"\n'
        f'[slurm]\npartition = "debug"\ntime = "00:05:00"\nmax_requeues = 3\n'
        f'[train]\ncommand = ["{sys.executable}", "{tmp_path / "cmd.py"}", "{tmp_path}"]\n'
        f'[env]\nPATH = "{bin_dir}:{os.environ["PATH"]}"\nPYTHONPATH = "{ROOT}"\n')
    rendered = subprocess.run([sys.executable, "-m", "swiftslurm", "render", str(tmp_path / "job.toml"), "-o", str(tmp_path / "job.sh")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    from swiftslurm import slurm

    job = slurm.sbatch(str(tmp_path / "job.sh"), extra=[f"--chdir={tmp_path}"])
    try:
        deadline = time.monotonic() + 600
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, f"job {job} did not start its command"
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)  # what --signal=USR2@grace sends
        state = wait_for_job(job, timeout_s=180)
    finally:
        subprocess.run(["scancel", f"--name={name}", job], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix in (".err", ".out"))
    assert state[job] == "COMPLETED", f"{state}\n{logs[-3000:]}"
    assert [s for (s,) in sacct_rows(job, "State", runs=True)] == ["REQUEUED", "COMPLETED"]
    (record,) = read_requeues(str(out))
    assert (record["job_id"], record["restart_count"], record["requeued"], record["outcome"]) == (job, 0, True, "requeued"), json.dumps(record)
    assert ("although scontrol said" in record["message"]) == (answer == "lost"), record["message"]
    assert "requeue refused" not in logs, logs[-3000:]
    assert any(c.startswith("requeue") for c in (tmp_path / "scontrol-calls").read_text().splitlines())
