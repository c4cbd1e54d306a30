"""Exact resume across walltime requeues, on the real Slurm cluster.

Two jobs of the same spec (2 nodes x 1 CPU rank, ZeRO-2, tiny-llama, full fine-tuning, no dropout):

- reference: a 10-minute time limit, runs uninterrupted;
- requeued: `time = "00:01:00"`, `signal_grace_s = 10`. Slurm's USR2 arrives 20-50 s into each allocation
  (slurmctld checks every 30 s) and a start costs 5-35 s of imports here, so one allocation trains at most
  ~45 s. Every step of this run takes at least 0.18 s (the watchdog's test hook), so 600 steps need 108 s of
  training and cannot finish with fewer than 2 requeues, on any machine. At each stop the ranks agree, save a
  verified checkpoint, rank 0 requeues, and every start resumes from the newest verified checkpoint.
  (SWIFTSLURM_RESUME_TEST_STEPS=2500 gives the ~3-minute run of issue 7; the floor keeps the slots' count.)

The requeued job must finish after >= 2 walltime requeues (how many depends on this machine's speed), each
recorded in requeues.json, and Slurm must have run it exactly once more than that many times (sacct -D: no
requeue of another cause). Every loss it logged (metrics.jsonl, each
step, including steps logged twice around a stop) must equal the reference's loss at that step, bitwise.
Then the same run is resubmitted on 1 node for 10 more steps: its 2-rank checkpoint is converted to a
universal one and the run continues at the next step (the losses of a world-size change: test_worldsize.py).
Bitwise is expected: on the CPU the same ops on the same data in the same order give the same bits,
and the checkpoint restores weights, optimizer and scheduler state, every rank's RNG state and the
data position.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import sacct_rows, wait_for_job
from runs import ONE_RANK_A_NODE, explain, losses, tiny_spec
from runs import submit as submit_spec

from swiftslurm import checkpoint as ck

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"
MAX_STEPS = int(os.environ.get("SWIFTSLURM_RESUME_TEST_STEPS", "600"))
MIN_STEP_S = 108 / MAX_STEPS  # 108 s of training at least: more than two 1-minute slots hold

def submit(tmp: Path, name: str, time_limit: str, nodes: int = 2, steps: int = MAX_STEPS, min_step_s: float = 0.0,
           data: Path = DATA, train: dict | None = None, checkpoint: dict | None = None) -> tuple[str, Path]:
    """Submit the spec of job ``resume-<name>`` (2 nodes x 1 rank, ZeRO-2, full fine-tuning) into ``tmp/<name>``;
    ``train``, ``checkpoint``: keys added to its [train] and [checkpoint] tables."""
    out = tmp / name
    spec = tmp / f"{name}.toml"
    spec.write_text(resume_spec(f"resume-{name}", out, time_limit, nodes, steps, min_step_s, data, train or {}, checkpoint or {}))
    return submit_spec(spec, out), out


def requeued_beside_reference(tmp: Path, name: str, steps: int, stop_at: int, data: Path = DATA, train: dict | None = None) -> Path:
    """``submit``'s spec twice side by side, ``<name>-reference`` uninterrupted and ``<name>-requeued`` sent the walltime
    signal (USR2 to every rank, as ``--signal=USR2@grace`` does) once it logged step ``stop_at``: the signalled run
    saves, requeues once, resumes on both nodes and must log every step's loss bitwise as the uninterrupted run did.
    Returns the requeued run's output dir."""
    from test_pt import _signal_at_step

    ref_job, ref_out = submit(tmp, f"{name}-reference", "00:10:00", steps=steps, data=data, train=train)
    req_job, req_out = submit(tmp, f"{name}-requeued", "00:10:00", steps=steps, min_step_s=0.2, data=data, train=train)
    try:
        _signal_at_step(req_job, req_out, stop_at, timeout_s=600)
        for job, out in ((ref_job, ref_out), (req_job, req_out)):
            state = wait_for_job(job, timeout_s=600)
            assert state[job] == "COMPLETED", f"{state}\n{explain(out)}"
    finally:  # never leave this test's jobs behind on the shared cluster (the name guards against reused ids)
        for job, run in ((ref_job, "reference"), (req_job, "requeued")):
            subprocess.run(["scancel", f"--name=resume-{name}-{run}", job], capture_output=True, timeout=30)

    (stop,) = json.loads((req_out / "requeues.json").read_text())
    assert stop["requeued"] and stop_at <= stop["global_step"] < steps, stop
    ref, req = losses(ref_out), losses(req_out)
    assert sorted(ref) == sorted(req) == list(range(1, steps + 1))
    mismatched = {s: (ref[s][0], got) for s, got in req.items() if any(x != ref[s][0] for x in got)}
    assert not mismatched, f"{len(mismatched)} steps differ from the uninterrupted run, first: {sorted(mismatched.items())[:3]}"
    return req_out


def resume_spec(name: str, out: Path, time_limit: str, nodes: int, steps: int, min_step_s: float, data: Path, train: dict,
                checkpoint: dict | None = None) -> str:
    # min_step_s: every step takes at least this long (the watchdog's test hook): the number of walltime stops no longer
    # depends on how fast this machine is. nodes != 2: a later leg on another world size, and longer (max_steps is part
    # of the spec fingerprint), so the spec may change. no_progress_attempts: a start that meets its signal before step 1
    # is allowed here (see the test), and on a loaded machine two can come in a row; the guard has tests of its own
    return tiny_spec(name, out, data=data,
                     slurm={**ONE_RANK_A_NODE, "nodes": nodes, "time": time_limit, "signal_grace_s": 10, "max_requeues": 25,
                            "no_progress_attempts": 5},
                     train={"learning_rate": 1e-3, "lr_scheduler_type": "cosine", "max_steps": steps, "max_length": 128,
                            "save_steps": 1000, "logging_steps": 1, "report_to": ["none"], **train},
                     checkpoint={"keep": 2, "forced_save_fractions": [0.5], **({"allow_spec_change": True} if nodes != 2 else {}),
                                 **(checkpoint or {})},
                     preflight={"checks": []},
                     env={"OMP_NUM_THREADS": "1", **({"SWIFTSLURM_TEST_MIN_STEP_S": str(min_step_s)} if min_step_s else {})})


@pytest.mark.slurm
@pytest.mark.slow
def test_walltime_requeues_resume_to_the_same_losses(tmp_path, slurm_cluster):
    ref_job, ref_out = submit(tmp_path, "reference", "00:10:00")
    # MAX_STEPS steps of at least MIN_STEP_S: 108 s of training, more than two 1-minute slots can hold (each loses its
    # start-up and the signal's grace), so the run is stopped and requeued at least twice on any machine
    req_job, req_out = submit(tmp_path, "requeued", "00:01:00", min_step_s=MIN_STEP_S)
    t0 = time.monotonic()
    try:
        ref_state = wait_for_job(ref_job, timeout_s=1200)
        assert ref_state[ref_job] == "COMPLETED", f"reference {ref_state}\n{explain(ref_out)}"
        req_state = wait_for_job(req_job, timeout_s=max(60, 1800 - (time.monotonic() - t0)))
        assert req_state[req_job] == "COMPLETED", f"requeued {req_state}\n{explain(req_out)}"
    finally:  # never leave this test's jobs behind on the shared cluster (the name guards against reused ids)
        for job, name in ((ref_job, "resume-reference"), (req_job, "resume-requeued")):
            subprocess.run(["scancel", f"--name={name}", job], capture_output=True, timeout=30)

    requeues = json.loads((req_out / "requeues.json").read_text())
    assert len(requeues) >= 2 and all(r["requeued"] for r in requeues), json.dumps(requeues, indent=1)
    # exactly those: every run Slurm made of the job (sacct -D: one row per run) but the last ended in one of
    # these walltime requeues; a requeue of another cause (a node failure, a stray scontrol requeue) fails here
    runs = [state for (state,) in sacct_rows(req_job, "State", runs=True)]
    assert runs == ["REQUEUED"] * len(requeues) + ["COMPLETED"], (runs, requeues)
    stops = [r["global_step"] for r in requeues]
    # a start slow enough to meet its signal before the first step stops at step 0 (nothing to save): that is
    # allowed; the run must still have stopped mid-run at least once, and resumed from there
    assert stops == sorted(stops) and stops[-1] < MAX_STEPS and any(s > 0 for s in stops), stops

    ref, req = losses(ref_out), losses(req_out)
    assert sorted(ref) == sorted(req) == list(range(1, MAX_STEPS + 1))
    assert all(len(v) == 1 for v in ref.values())
    mismatched = {s: (ref[s][0], got) for s, got in req.items() if any(x != ref[s][0] for x in got)}
    assert not mismatched, f"{len(mismatched)} steps differ from the uninterrupted run, first: {sorted(mismatched.items())[:3]}"

    # each stop left a verified checkpoint at the step it stopped (until retention dropped it), and the
    # final one verifies
    runtime = [json.loads(x)["train_runtime"] for x in (ref_out / "metrics.jsonl").read_text().splitlines() if "train_runtime" in x]
    print(f"{MAX_STEPS} steps, uninterrupted training {runtime[-1]:.0f} s; requeued run: {len(requeues)} walltime "
          f"requeues (stops at steps {stops}), {time.monotonic() - t0:.0f} s wall; all {MAX_STEPS} losses bitwise equal")
    newest = ck.newest_verified(req_out, log=None)
    assert newest is not None and ck.read_manifest(newest).step == MAX_STEPS
    assert ck.read_manifest(newest).meta["world_size"] == 2

    # the queue is short of nodes: resubmit the same run on 1 node for 10 more steps. The 2-rank checkpoint is
    # converted (DeepSpeed's universal checkpoint, in the run's own dir) and the run goes on at step K+1.
    job, _ = submit(tmp_path, "requeued", "00:10:00", nodes=1, steps=MAX_STEPS + 10)
    try:
        state = wait_for_job(job, timeout_s=600)
    finally:
        subprocess.run(["scancel", "--name=resume-requeued", job], capture_output=True, timeout=30)
    assert state[job] == "COMPLETED", f"1-node leg {state}\n{explain(req_out)}"
    said = "\n".join(p.read_text(errors="replace") for p in (req_out / "logs").rglob("*") if p.is_file() and p.suffix in (".out", ".err"))
    assert f"checkpoint-{MAX_STEPS} was written by 2 data-parallel rank(s) at ZeRO-2; this run has 1" in said, explain(req_out)
    after = losses(req_out)
    assert [s for s in sorted(after) if s > MAX_STEPS] == list(range(MAX_STEPS + 1, MAX_STEPS + 11))
    last = ck.read_manifest(ck.newest_verified(req_out, log=None))
    assert (last.step, last.meta["world_size"], last.meta["dp_world_size"]) == (MAX_STEPS + 10, 1, 1)
    assert ck.verify(req_out / "universal" / f"checkpoint-{MAX_STEPS}").ok
