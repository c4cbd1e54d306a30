"""Fault injection: a checkpoint writer is SIGKILLed at random moments, >= 30 times, often mid-save.

The writer does what the trainer does on rank 0: write a multi-file checkpoint into the staging dir,
commit it, prune. A test hook (SWIFTSLURM_CKPT_TEST_DELAY_S, plus a sleep between files) widens the
windows so kills land inside file writes, inside commit and inside prune. After every kill:

- every ``checkpoint-N`` dir verifies (a partial save is never visible under a checkpoint name);
- ``newest_verified`` returns one, at least as new as the last commit the writer reported;
- no verified checkpoint that retention must keep was lost;
- the next start resumes from exactly that checkpoint.

Then the real trainer: killed mid-save at random (synchronous and background saves), and with checkpoint.async_save
killed by its own test hook (SWIFTSLURM_CKPT_TEST_KILL_AT) at each point of a background save in turn.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import tiny_spec

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
    # Retention's contract: a committed checkpoint is removed only once KEEP newer ones are committed, and those stay
    # (every checkpoint-N dir verifies, checked above). A life killed between a commit and its log line leaves that
    # commit unreported, and two lives in a row can: so count the newer ones on disk, not the reported ones.
    on_disk = {ck.step_of(p) for p in ck.list_checkpoints(out)}
    for s in sorted(set(commits)):
        newer = sorted(t for t in on_disk if t > s)
        assert s in on_disk or len(newer) >= KEEP, f"verified checkpoint-{s} was lost (keep={KEEP}) with only {newer} newer"
    return step


def test_sigkill_at_random_moments_never_loses_or_exposes_a_checkpoint(tmp_path):
    rng = random.Random(int(os.environ.get("SWIFTSLURM_FAULT_SEED", "1234")))
    env = {**os.environ, "SWIFTSLURM_CKPT_TEST_DELAY_S": "0.02"}
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    out = tmp_path / "out"
    out.mkdir()
    expected_resume = 0
    mid_save = after_commit = 0
    t0 = time.monotonic()
    for trial in range(TRIALS):
        committed, started = map(len, read_log(out)) if (out / "writer.log").exists() else (0, 0)
        proc = subprocess.Popen([sys.executable, str(script), str(out), str(KEEP), "0.01"], env=env)
        deadline = time.monotonic() + 30
        while not (out / "writer.log").exists() or len(read_log(out)[1]) == started:  # wait for its resume line
            assert proc.poll() is None and time.monotonic() < deadline, f"trial {trial}: the writer did not start"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.8))  # kill at a random moment of its work (python startup excluded)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL, f"trial {trial}: the writer exited on its own ({proc.returncode})"
        commits, resumes = read_log(out)
        after_commit += len(commits) > committed  # this life committed at least once before its kill
        assert resumes[-1] == expected_resume, f"trial {trial}: resumed from {resumes[-1]}, expected {expected_resume}"
        if any(p.name.startswith((".staging-", ".deleting-")) for p in out.iterdir()):
            mid_save += 1
        expected_resume = check_after_kill(out, commits)
    elapsed = time.monotonic() - t0
    commits, _ = read_log(out)
    print(f"{TRIALS} kills in {elapsed:.1f} s; {mid_save} landed with a save in progress; {after_commit} after a commit of "
          f"that life; {len(commits)} commits; resumed at {expected_resume}")
    # both kinds of moment, counted in the writer's own progress (not in commits per second, which a loaded machine halves)
    assert mid_save >= TRIALS // 4, f"only {mid_save} of {TRIALS} kills hit a save in progress: the test lost its point"
    assert after_commit >= TRIALS // 4, f"only {after_commit} of {TRIALS} kills came after a commit (and its prune): kills came too early"


# ---------------------------------------------------------------- the real trainer, killed mid-save

def train_spec(out: Path, data: Path, steps: int, async_save: bool = False) -> str:
    return tiny_spec("fault", out, data=data, slurm={"tasks_per_node": 1},
                     train={"learning_rate": 1e-3, "max_steps": steps, "max_length": 128, "save_steps": 2,
                            "logging_steps": 1, "report_to": ["none"]},
                     checkpoint={"keep": 2, "forced_save_fractions": [], "async_save": async_save}, preflight={"checks": []},
                     env={"OMP_NUM_THREADS": "1"})


def _start_trainer(plan: Path, delay_s: str | None, kill_at: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k == "SWIFTSLURM_LEDGER" or not k.startswith(("SLURM_", "SUBMITIT_", "MASTER_", "SWIFTSLURM_"))}  # the test's own ledger
    if delay_s:
        env["SWIFTSLURM_CKPT_TEST_DELAY_S"] = delay_s
    if kill_at:  # "POINT:STEP": the trainer SIGKILLs itself there (checkpoint.commit.crash_point)
        env["SWIFTSLURM_CKPT_TEST_KILL_AT"] = kill_at
    return subprocess.Popen([sys.executable, "-m", "swiftslurm", "run", "--plan", str(plan)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _wait_for_commit_after(out: Path, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(ck.step_of(p) > step for p in ck.list_checkpoints(out)):
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before committing past step {step}:\n"
                                 + proc.stderr.read().decode(errors="replace")[-3000:])
        assert time.monotonic() < deadline, f"no checkpoint after step {step} within {timeout_s} s"
        time.sleep(0.05)


def _wait_for_a_save_in_progress(out: Path, proc: subprocess.Popen, timeout_s: float) -> Path:
    """The staging dir of a save newer than every committed checkpoint, once the trainer has made it."""
    deadline = time.monotonic() + timeout_s
    while True:
        committed = max((ck.step_of(p) for p in ck.list_checkpoints(out)), default=0)
        staging = [ck.staging_dir(out, step) for step in range(committed + 1, committed + 64)]
        found = next((p for p in staging if p.is_dir()), None)
        if found is not None:
            return found
        if proc.poll() is not None:
            raise AssertionError(f"the trainer exited ({proc.returncode}) before a save after step {committed}:\n"
                                 + proc.stderr.read().decode(errors="replace")[-3000:])
        assert time.monotonic() < deadline, f"no save began after step {committed} within {timeout_s} s"
        time.sleep(0.02)


@pytest.mark.slow
def test_real_trainer_killed_mid_save_resumes_from_a_verified_checkpoint(tmp_path):
    import tomllib

    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.spec import parse_spec

    steps = 16
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    rng = random.Random(7)
    resumed_at = 0
    for trial in range(2):
        # trial 0 saves synchronously; trial 1 (and the last start) with checkpoint.async_save, where the kill lands
        # while the background thread writes, hashes or commits (training goes on meanwhile)
        toml = train_spec(out, root / "examples/data/alpaca_demo.jsonl", steps, async_save=trial == 1)
        plan = write_plan(make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source="fault.toml"))
        # each commit sleeps 3 x 0.4 s, two of them before the staging dir is renamed: a kill within 0.6 s of the
        # staging dir's appearing lands while the save writes or commits it, at a random point of that
        proc = _start_trainer(plan, delay_s="0.4")
        try:
            _wait_for_commit_after(out, resumed_at, proc, timeout_s=180)
            staging = _wait_for_a_save_in_progress(out, proc, timeout_s=120)
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL, f"trial {trial}: the trainer exited on its own ({proc.returncode})"
        half_saved = ck.final_dir(out, ck.step_of(staging.name.removeprefix(".staging-")))
        assert staging.is_dir() and not half_saved.exists(), f"trial {trial}: the kill did not land mid-save ({half_saved.name} was committed)"
        for ckpt in ck.list_checkpoints(out):
            assert ck.verify(ckpt).ok, f"trial {trial}: {ckpt.name} is visible but does not verify"
        newest = ck.newest_verified(out, log=None)
        assert newest is not None and ck.step_of(newest) > resumed_at
        assert ck.step_of(newest) < ck.step_of(half_saved)  # the save the kill cut short is not a checkpoint
        resumed_at = ck.step_of(newest)
    proc = _start_trainer(plan, delay_s=None)
    _, err = proc.communicate(timeout=300)
    text = err.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert f"checkpoint-{resumed_at}" in text, "the last start did not say it resumed from the newest verified checkpoint"
    final = ck.newest_verified(out, log=None)
    assert final == ck.final_dir(out, steps) and ck.read_manifest(final).meta["world_size"] == 1
    print(f"real trainer: 2 kills, both mid-save, resumed from checkpoint-{resumed_at}, finished at {steps}")


# the points of a background save (checkpoint.async_save), in the order it passes them: the state copied to host
# memory; the first file written; every file written; every file hashed and synced; the manifest written; the rename
ASYNC_POINTS = ("snapshot", "writing", "written", "fsynced", "manifest", "renamed")


@pytest.mark.slow
def test_an_async_save_killed_at_each_of_its_points_leaves_a_verified_newest_checkpoint_to_resume_from(tmp_path):
    """The real trainer (one CPU rank, checkpoint.async_save) SIGKILLs itself (the test hook) at one point of a
    background save, point after point, each life resuming from what the last one left. Before the rename the save is
    not a checkpoint: the one before it stays the newest verified; from the rename on it is the newest. After every
    kill every visible checkpoint verifies, and the last start finishes from the newest."""
    import tomllib

    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.spec import parse_spec

    steps = 40
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    toml = train_spec(out, root / "examples/data/alpaca_demo.jsonl", steps, async_save=True)
    plan = write_plan(make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source="fault.toml"))
    resumed_at = 0
    for point in ASYNC_POINTS:
        killed = resumed_at + 4  # this life's second save: its first (resumed_at + 2) commits in the background before it
        proc = _start_trainer(plan, delay_s=None, kill_at=f"{point}:{killed}")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"{point}: the trainer was not killed there ({proc.returncode}):\n" \
            + err.decode(errors="replace")[-3000:]
        for ckpt in ck.list_checkpoints(out):
            assert ck.verify(ckpt).ok, f"{point}: {ckpt.name} is visible but does not verify"
        newest = ck.newest_verified(out, log=None)
        expected = killed if point == "renamed" else killed - 2
        assert newest is not None and ck.step_of(newest) == expected, (point, newest)
        if point != "renamed":  # the save the kill cut short: still under its staging name, never a checkpoint
            assert ck.staging_dir(out, killed).is_dir() and not ck.final_dir(out, killed).exists(), point
        resumed_at = expected
    proc = _start_trainer(plan, delay_s=None)
    _, err = proc.communicate(timeout=300)
    text = err.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert f"checkpoint-{resumed_at}" in text, "the last start did not say it resumed from the newest verified checkpoint"
    assert ck.newest_verified(out, log=None) == ck.final_dir(out, steps)


@pytest.mark.slow
def test_a_walltime_signal_during_a_background_write_commits_it_and_the_stops_own_save_before_exiting(tmp_path):
    """checkpoint.async_save, one CPU rank: the walltime signal (USR2, as Slurm's --signal sends it) lands while a
    background save is being written (each commit held 3 x 1 s by the test hook). The trainer commits that save, then
    its own stop save, and only then ends (75: the local executor cannot requeue; on Slurm it requeues,
    tests/test_pt.py): both verify, and the stop record names the last."""
    import tomllib

    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.spec import parse_spec

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    toml = train_spec(out, root / "examples/data/alpaca_demo.jsonl", 40, async_save=True)
    plan = write_plan(make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source="fault.toml"))
    proc = _start_trainer(plan, delay_s="1.0")
    try:
        _wait_for_commit_after(out, 0, proc, timeout_s=180)
        in_flight = ck.step_of(_wait_for_a_save_in_progress(out, proc, timeout_s=120).name.removeprefix(".staging-"))
        os.kill(proc.pid, signal.SIGUSR2)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = err.decode(errors="replace")
    assert proc.returncode == 75 and "walltime stop: saving at step" in text, text[-3000:]
    (stop,) = json.loads((out / "requeues.json").read_text())
    assert stop["global_step"] >= in_flight, (stop, in_flight)
    for step in sorted({in_flight, stop["global_step"]}):
        assert ck.final_dir(out, step).is_dir() and ck.verify(ck.final_dir(out, step)).ok, step
    assert ck.newest_verified(out, log=None) == ck.final_dir(out, stop["global_step"])
    assert not any(p.name.startswith(".staging-") for p in out.iterdir())  # nothing left half-saved
