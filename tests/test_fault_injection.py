"""Fault injection: a checkpoint writer is SIGKILLed at random moments, >= 30 times, often mid-save.

The writer does what the trainer does on rank 0: write a multi-file checkpoint into the staging dir,
commit it, prune. A test hook (SWIFTSLURM_CKPT_TEST_DELAY_S, plus a sleep between files) widens the
windows so kills land inside file writes, inside commit and inside prune. After every kill:

- every ``checkpoint-N`` dir verifies (a partial save is never visible under a checkpoint name);
- ``newest_verified`` returns one, at least as new as the last commit the writer reported;
- no verified checkpoint that retention must keep was lost;
- the next start resumes from exactly that checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from swiftslurm import checkpoint as ck

KEEP = 3
TRIALS = 36

WRITER = r'''
import os, sys, time
from pathlib import Path
from swiftslurm import checkpoint as ck

out, keep, file_delay = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
log = open(out / "writer.log", "a")

def note(line):
    log.write(line + "\n"); log.flush(); os.fsync(log.fileno())

resume = ck.newest_verified(out, log=lambda msg: note("skip " + msg))
step = ck.read_manifest(resume).step if resume else 0
note(f"resume {step}")
while True:
    step += 1
    stage = ck.prepare_staging(out, step)
    (stage / f"global_step{step}").mkdir()
    for i, size in enumerate((300_000, 200_000, 200_000, 50_000, 4_000, 500)):
        name = f"global_step{step}/shard_{i}.pt" if i < 3 else f"file_{i}.bin"
        with open(stage / name, "wb") as f:
            f.write(f"step={step};file={i};".encode().ljust(size, b"x"))
        time.sleep(file_delay)
    ck.commit(stage, ck.final_dir(out, step), algo="xxh3", meta={"step": step, "world_size": 1, "seed": 0})
    note(f"commit {step}")
    ck.prune(out, keep)
'''


def read_log(out: Path) -> tuple[list[int], list[int]]:
    commits, resumes = [], []
    for line in (out / "writer.log").read_text().splitlines():
        kind, _, value = line.partition(" ")
        if kind == "commit":
            commits.append(int(value))
        elif kind == "resume":
            resumes.append(int(value))
    return commits, resumes


def check_after_kill(out: Path, commits: list[int]) -> int:
    """The invariants after a SIGKILL; returns the step a restart must resume from."""
    for ckpt in ck.list_checkpoints(out):
        result = ck.verify(ckpt)
        assert result.ok, f"a partial or damaged checkpoint is visible after a kill: {ckpt.name}: {result.problems}"
    newest = ck.newest_verified(out, log=None)
    if not commits:
        return ck.step_of(newest) if newest else 0
    assert newest is not None, "a verified checkpoint existed before the kill and none is found after it"
    step = ck.step_of(newest)
    assert step >= commits[-1], f"resume would go back to {step}, but checkpoint-{commits[-1]} was committed"
    assert (newest / f"global_step{step}" / "shard_0.pt").read_bytes().startswith(f"step={step};".encode())
    # At most one commit can be unreported (killed between commit and the log line), and its prune may
    # have removed one more; the newest KEEP-1 reported commits must all still be there and verify.
    for s in sorted(set(commits))[-(KEEP - 1):]:
        assert ck.verify(ck.final_dir(out, s)).ok, f"verified checkpoint-{s} was lost (keep={KEEP})"
    return step


def test_sigkill_at_random_moments_never_loses_or_exposes_a_checkpoint(tmp_path):
    rng = random.Random(int(os.environ.get("SWIFTSLURM_FAULT_SEED", "1234")))
    env = {**os.environ, "SWIFTSLURM_CKPT_TEST_DELAY_S": "0.02"}
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "out"
    out.mkdir()
    expected_resume = 0
    mid_save = 0
    t0 = time.monotonic()
    for trial in range(TRIALS):
        proc = subprocess.Popen([sys.executable, str(script), str(out), str(KEEP), "0.01"], env=env)
        time.sleep(rng.uniform(0.25, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL, f"trial {trial}: the writer exited on its own ({proc.returncode})"
        commits, resumes = read_log(out)
        assert resumes[-1] == expected_resume, f"trial {trial}: resumed from {resumes[-1]}, expected {expected_resume}"
        if any(p.name.startswith((".staging-", ".deleting-")) for p in out.iterdir()):
            mid_save += 1
        expected_resume = check_after_kill(out, commits)
    elapsed = time.monotonic() - t0
    commits, _ = read_log(out)
    print(f"{TRIALS} kills in {elapsed:.1f} s; {mid_save} landed mid-save; {len(commits)} commits; resumed at {expected_resume}")
    assert mid_save >= TRIALS // 4, f"only {mid_save} of {TRIALS} kills hit a save in progress: the test lost its point"
    assert len(commits) >= TRIALS, "the writer barely committed anything; kills came too early"
