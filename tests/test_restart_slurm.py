"""In-job restart on the real Slurm cluster (slurm.max_restarts, slurm.spare_nodes), both submit paths.

1. submitit path (`swiftslurm submit`), 2 nodes, no spare, max_restarts = 2, beside an uninterrupted reference run
   of the same training: rank 1 stops stepping on the first attempt (the watchdog's test hook
   SWIFTSLURM_TEST_STALL); the watchdog (a 5 s floor) ends the step and it is restarted in place long before the
   collective timeout (ddp_timeout = 600 s). Then rank 1 of the restarted step is SIGKILLed from outside; it is
   restarted again. The same job id ends COMPLETED at max_steps, restarts.json names both causes, `status` says
   so, and every logged loss (the steps logged twice around each restart too) equals the reference's, bitwise.
2. rendered script (`swiftslurm render` + sbatch), 2 nodes + 1 spare, max_restarts = 2, shrink_on_failure: a node
   of the step is set DOWN mid-run and the spare takes its place; then a node of the restarted step is set DOWN and,
   with no spare left, the run shrinks to the one node that remains. The same job ends COMPLETED at max_steps, both
   downed nodes are in the node-health ledger. (After the first down, Slurm resized the job and went on counting the
   failed step's CPUs on the surviving node: slurm/steps.py's ``--immediate`` / ``--overlap`` answer to that is what
   this test caught.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sacct_rows, wait_for_job
from runs import TINY_TRAIN, explain, last_step, losses, restarts, submit

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"
STEPS = 40
STALL_STEP = 12
MIN_STEP_S = 0.3  # every step takes at least this long (the watchdog's test hook): time to act between two saves

SPEC = """
[job]
name = "{name}"
output_dir = "{out}"
[slurm]
partition = "debug"
nodes = 2
tasks_per_node = 1
cpus_per_task = 1
time = "00:15:00"
{slurm}
[train]
""" + TINY_TRAIN + """learning_rate = 1e-3
max_steps = {steps}
max_length = 128
save_steps = 8
logging_steps = 1
ddp_timeout = 600
report_to = ["none"]
[preflight]
checks = []
[env]
OMP_NUM_THREADS = "1"
SWIFTSLURM_TEST_MIN_STEP_S = "{min_step_s}"
SWIFTSLURM_WATCHDOG_FLOOR_S = "5"
{env}
"""


def write_spec(tmp: Path, name: str, slurm: str = "", env: str = "") -> tuple[Path, Path]:
    out = tmp / name
    spec = tmp / f"{name}.toml"
    spec.write_text(SPEC.format(name=f"restart-{name}", out=out, data=DATA, steps=STEPS, slurm=slurm, env=env, min_step_s=MIN_STEP_S))
    return spec, out


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def wait_until(what, timeout_s: float, explain=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what.__name__}\n{explain()}"
        time.sleep(0.5)


def rank_pids(job_id: str, rank: int) -> list[int]:
    """The `swiftslurm run` processes of a job's training step rank (all on this machine: the cluster is local)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = dict(x.split("=", 1) for x in (entry / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in x)
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (environ.get("SLURM_JOB_ID") == job_id and environ.get("SLURM_PROCID") == str(rank) and environ.get("SLURM_STEP_ID", "batch") != "batch"
                and (b"submitit.core._submit" in cmd or b"swiftslurm\0run" in cmd)):
            found.append(int(entry.name))
    return found


@pytest.mark.slurm
@pytest.mark.slow
def test_a_hung_then_killed_rank_restarts_in_place_to_the_same_losses(tmp_path, slurm_cluster):
    ref_spec, ref_out = write_spec(tmp_path, "reference")
    run_spec, run_out = write_spec(tmp_path, "restarted", "max_restarts = 2", f'SWIFTSLURM_TEST_STALL = "1:{STALL_STEP}:3600"')
    ref_job, job = submit(ref_spec, ref_out), submit(run_spec, run_out)
    try:
        # the stall: the watchdog's verdict ends the step and the supervisor restarts it
        wait_until(lambda: len(restarts(run_out)) >= 1, 600, lambda: explain(run_out))
        hang = restarts(run_out)[0]
        assert hang["cause"] == "hang" and hang["restarted"] and "rank 1 on node" in hang["detail"], hang
        # rank 1 sleeps at the end of step STALL_STEP, before its loss is logged: the last row before it is the step before
        stalled_at = next(json.loads(x)["time"] for x in (run_out / "metrics.jsonl").read_text().splitlines()
                          if json.loads(x).get("step") == STALL_STEP - 1 and "loss" in x)
        decided = os.path.getmtime(run_out / "logs" / "hang.json")
        # 5 s floor + at most 20 s gathering the flight records, against the 600 s collective timeout
        assert decided - stalled_at < 120, (stalled_at, decided)
        # the restarted step gets past the stall and saves; then rank 1 is killed from outside
        resumed = hang["resume_step"]
        wait_until(lambda: last_step(run_out) >= STALL_STEP + 4, 600, lambda: explain(run_out))
        pids = rank_pids(job, 1)
        assert pids, f"no process of rank 1 of job {job}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        states = wait_for_job(job, timeout_s=600)
        assert states[job] == "COMPLETED", f"{states}\n{explain(run_out)}"
        ref_state = wait_for_job(ref_job, timeout_s=300)
        assert ref_state[ref_job] == "COMPLETED", f"{ref_state}\n{explain(ref_out)}"
    finally:
        for j, name in ((ref_job, "restart-reference"), (job, "restart-restarted")):
            subprocess.run(["scancel", f"--name={name}", j], capture_output=True, timeout=30)

    records = restarts(run_out)
    assert [(r["cause"], r["restarted"]) for r in records] == [("hang", True), ("rank_killed", True)], records
    assert records[1]["detail"].startswith("task 1 on node") and records[1]["detail"].endswith("Killed"), records[1]
    assert isinstance(resumed, int) and resumed < STALL_STEP
    # the same job ran once: no requeue (sacct -D lists each run of a job id)
    runs = [state for (state,) in sacct_rows(job, "State", runs=True)]
    assert runs == ["COMPLETED"], runs
    ref, got = losses(ref_out), losses(run_out)
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert any(len(v) > 1 for v in got.values())  # steps between a checkpoint and a failure were trained twice
    mismatched = {s: (ref[s][0], v) for s, v in got.items() if any(x != ref[s][0] for x in v)}
    assert not mismatched, f"steps that differ from the uninterrupted run: {sorted(mismatched.items())[:3]}"
    status = cli("status", str(run_out))
    assert "restarted in place 2 time(s); last: rank_killed: task 1 on node" in status.stdout, status.stdout + status.stderr


@pytest.fixture
def down_node():
    """Sets nodes DOWN, and always back (state=resume): other tests share the cluster."""
    downed: list[str] = []

    def down(node: str) -> None:
        downed.append(node)
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=swiftslurm restart test"], check=True, timeout=30)

    def resume() -> None:
        while downed:
            subprocess.run(["scontrol", "update", f"nodename={downed.pop()}", "state=resume"], capture_output=True, timeout=30)

    try:
        yield down, resume
    finally:
        resume()


def loss_rows(out: Path) -> int:
    try:
        return sum('"loss"' in x for x in (out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.alone  # a node set down kills every job on it, another test's too
def test_a_node_set_down_is_replaced_by_the_spare_then_the_run_shrinks(tmp_path, slurm_cluster, down_node):
    down, resume = down_node
    ledger = tmp_path / "ledger.json"
    spec, out = write_spec(tmp_path, "spare", "max_restarts = 2\nspare_nodes = 1\nshrink_on_failure = true")
    script = tmp_path / "job.sh"
    rendered = cli("render", str(spec), "-o", str(script))
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    env = {**os.environ, "SWIFTSLURM_LEDGER": str(ledger)}  # sbatch exports it to the job
    sent = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert sent.returncode == 0, sent.stderr
    job = sent.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: last_step(out) >= 10, 600, lambda: explain(out))
        first = re.search(r"node 1/2 (\S+)\)", (out / "logs" / "rank-1.log").read_text())[1]
        down(first)
        wait_until(lambda: len(restarts(out)) >= 1, 150, lambda: explain(out))
        replaced = restarts(out)[0]
        assert replaced["restarted"] and replaced["dropped"] == [first] and first not in replaced["next_nodes"], replaced
        trained = loss_rows(out)
        wait_until(lambda: loss_rows(out) >= trained + 4, 300, lambda: explain(out))  # the restarted step trains
        second = replaced["next_nodes"][1]
        down(second)
        wait_until(lambda: len(restarts(out)) >= 2, 150, lambda: explain(out))
        states = wait_for_job(job, timeout_s=600)
    finally:
        resume()
        subprocess.run(["scancel", "--name=restart-spare", job], capture_output=True, timeout=30)
    assert states[job] == "COMPLETED", f"{states}\n{explain(out)}"
    shrunk = restarts(out)[1]
    assert shrunk["cause"] == "node_failure" and shrunk["restarted"] and shrunk["dropped"] == [second], shrunk
    assert shrunk["next_nodes"] == [replaced["next_nodes"][0]] and "shrink_on_failure" in shrunk["message"], shrunk
    assert last_step(out) == STEPS
    entries = json.loads(ledger.read_text())
    for node in (first, second):
        assert any(e["node"] == node and e["reason"] == "node_failure" and e["job"] == job for e in entries), entries
    doctor = cli("doctor", str(out))
    assert "restart" in doctor.stdout, doctor.stdout + doctor.stderr


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("slurm, exit_code, said", [
    # the progress guard: max_restarts = 5 would allow six attempts; the second that commits nothing newer ends the job
    ("max_restarts = 5", "79:0", "no progress in 2 attempt(s) in a row (no checkpoint committed yet)"),
    # without the guard, max_restarts is the bound: exhausted end to end, with the step's own exit code (srun's)
    ("max_restarts = 1\nno_progress_attempts = 0", None, "not restarted: max_restarts reached (slurm.max_restarts = 1"),
])
def test_a_run_that_hangs_before_its_first_save_on_every_attempt_stops_after_two_attempts(tmp_path, slurm_cluster, slurm, exit_code, said):
    """A step that hangs at step 5 every time (before its first save at 8; the watchdog arms after 3 steps of each
    attempt) is tried twice, then the job ends with the reason in restarts.json and `status`."""
    spec, out = write_spec(tmp_path, "loop", slurm, 'SWIFTSLURM_TEST_STALL = "1:5:3600:every"')
    spec.write_text(spec.read_text() + "[checkpoint]\nforced_save_fractions = []\n")  # no save before step 8
    job = submit(spec, out)
    try:
        states = wait_for_job(job, timeout_s=600)
    finally:
        subprocess.run(["scancel", "--name=restart-loop", job], capture_output=True, timeout=30)
    records = restarts(out)
    assert [(r["cause"], r["restarted"]) for r in records] == [("hang", True), ("hang", False)], f"{records}\n{explain(out)}"
    assert said in records[-1]["message"], records
    (code,) = sacct_rows(job, "ExitCode")
    assert states[job] == "FAILED" and (code == [exit_code] if exit_code else code[0] not in ("0:0", "79:0")), (states, code)
    status = cli("status", str(out))
    assert said.split(" (")[0] in " ".join(status.stdout.split()), status.stdout + status.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_and_a_walltime_stop_under_the_supervisor_are_never_restarts(tmp_path, slurm_cluster):
    """The supervisor's "do not restart" rows, end to end: a job cancelled mid-run (scancel) ends CANCELLED, and a
    walltime USR2 (a 1-minute job, max_requeues = 0) is the requeue path's to decide (requeues.json, exit 75); neither
    leaves a restart record, although max_restarts = 3 would allow one."""
    cancelled_spec, cancelled = write_spec(tmp_path, "cancel", "max_restarts = 3")
    walltime_spec, walltime = write_spec(tmp_path, "wall", "max_restarts = 3\nmax_requeues = 0\nsignal_grace_s = 10")
    walltime_spec.write_text(walltime_spec.read_text().replace('time = "00:15:00"', 'time = "00:01:00"')
                             .replace(f'SWIFTSLURM_TEST_MIN_STEP_S = "{MIN_STEP_S}"', 'SWIFTSLURM_TEST_MIN_STEP_S = "3"'))
    job, wall_job = submit(cancelled_spec, cancelled), submit(walltime_spec, walltime)
    try:
        wait_until(lambda: last_step(cancelled) >= 3, 600, lambda: explain(cancelled))
        subprocess.run(["scancel", job], check=True, timeout=30)
        states = wait_for_job(job, timeout_s=300)
        wall_states = wait_for_job(wall_job, timeout_s=300)
    finally:
        for j, name in ((job, "restart-cancel"), (wall_job, "restart-wall")):
            subprocess.run(["scancel", f"--name={name}", j], capture_output=True, timeout=30)
    assert states[job] == "CANCELLED" and restarts(cancelled) == [], f"{states} {restarts(cancelled)}\n{explain(cancelled)}"
    assert wall_states[wall_job] == "FAILED" and restarts(walltime) == [], f"{wall_states} {restarts(walltime)}\n{explain(walltime)}"
    (stop,) = json.loads((walltime / "requeues.json").read_text())
    assert stop["outcome"] == "max_requeues" and not stop["requeued"], stop


@pytest.mark.slurm
@pytest.mark.slow
def test_a_failed_rank_preflight_under_the_supervisor_is_never_a_restart(tmp_path, slurm_cluster):
    """The preflight stopped training (a disk floor no node meets): the preflight's decision, not a crash the
    supervisor restarts, although max_restarts = 3 would allow it."""
    spec, out = write_spec(tmp_path, "preflight", "max_restarts = 3")
    spec.write_text(spec.read_text().replace("[preflight]\nchecks = []", '[preflight]\nchecks = ["disk"]\nmin_disk_free_gb = 1000000'))
    job = submit(spec, out)
    try:
        states = wait_for_job(job, timeout_s=300)
    finally:
        subprocess.run(["scancel", "--name=restart-preflight", job], capture_output=True, timeout=30)
    assert states[job] == "FAILED" and restarts(out) == [], f"{states} {restarts(out)}\n{explain(out)}"
    said = "".join(p.read_text(errors="replace") for p in (out / "logs").rglob("*") if p.is_file() and p.suffix in (".out", ".err"))
    assert "not restarted (the preflight stopped training" in said, explain(out)
