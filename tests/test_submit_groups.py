"""Submission side on real things: one array per allocation, one live job per output dir, no leaks.

Slurm tests (marker slurm) run on the local cluster; the local-executor ones run anywhere.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from swiftslurm import slurm
from swiftslurm.errors import PreflightFailed, SubmissionError
from swiftslurm.jobs.send import Submission, load_records, load_submission, process_start, submit_plan
from swiftslurm.node import ownership
from swiftslurm.plan import make_plan, write_plan
from swiftslurm.slurm.render import render_sbatch
from swiftslurm.spec import parse_toml, validate_spec

WAIT_S = 180

# Each rank records the allocation it runs in: DIR/<array job>_<array task>-<rank>.json
RECORD = (
    "import json, os, sys; d = sys.argv[1]; os.makedirs(d, exist_ok=True); "
    "keys = ['RANK', 'WORLD_SIZE', 'SLURM_JOB_NUM_NODES', 'SLURM_JOB_NODELIST', 'SLURM_ARRAY_JOB_ID', 'SLURM_ARRAY_TASK_ID', 'SLURM_JOB_ID']; "
    "open(os.path.join(d, os.environ['SLURM_ARRAY_JOB_ID'] + '_' + os.environ['SLURM_ARRAY_TASK_ID'] + '-' + os.environ['RANK'] + '.json'), "
    "'w').write(json.dumps({k: os.environ.get(k) for k in keys}))"
)


def spec_text(out: str, command: list[str], sweep: str = "", nodes: int = 1, extra: str = "", name: str = "sgrp") -> str:
    return f"""
[job]
name = "{name}"
output_dir = {json.dumps(out)}
[slurm]
partition = "debug"
nodes = {nodes}
tasks_per_node = 1
time = "00:05:00"
signal_grace_s = 30
{extra}
[train]
command = {json.dumps(command)}
[preflight]
checks = []
{sweep}
"""


def plan_from(text: str, base: Path):
    raw = parse_toml(text)
    return make_plan(validate_spec(raw), raw, base_dir=str(base), source="test.toml")


def cli(*args, cwd, env=None, timeout=WAIT_S + 30):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def _until(pred, timeout_s: float, poll_s: float = 0.3):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(poll_s)


def _running(sub: Submission) -> bool:
    return all(r.state == "RUNNING" for r in sub.statuses())


# ---------------------------------------------------------------- item 1: one array per allocation


@pytest.mark.slurm
def test_nodes_sweep_gets_the_allocation_each_task_asked_for(tmp_path):
    ranks = tmp_path / "ranks"
    cmd = ["python", "-c", RECORD, str(ranks)]
    (tmp_path / "s.toml").write_text(spec_text("out", cmd, sweep='[sweep]\n"slurm.nodes" = [1, 2]\nseed = [1, 2]'))
    proc = cli("submit", "s.toml", "--executor", "slurm", "--wait", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sub = load_submission(str(tmp_path / "out"))
    assert len(sub.arrays) == 2 and len(sub.slurm_job_ids) == 2
    assert [a["tasks"] for a in sub.arrays] == [[0, 1], [2, 3]]
    assert len(list(Path(sub.folder).glob("*_submission.sh"))) == 2  # one sbatch call per allocation
    got = [json.loads(p.read_text()) for p in ranks.glob("*.json")]
    by_job = {}
    for r in got:
        by_job.setdefault(r["SLURM_ARRAY_JOB_ID"], []).append(r)
    want = {a["job_id"]: len(a["tasks"]) for a in sub.arrays}
    nodes_of = {sub.arrays[0]["job_id"]: "1", sub.arrays[1]["job_id"]: "2"}
    for job, rows in by_job.items():
        assert {r["SLURM_JOB_NUM_NODES"] for r in rows} == {nodes_of[job]}, rows
        assert {r["WORLD_SIZE"] for r in rows} == {nodes_of[job]}
        assert len({r["SLURM_ARRAY_TASK_ID"] for r in rows}) == want[job]
    # every task wrote into its own global task dir (spec.json says which combination it is)
    for i, nodes in enumerate([1, 1, 2, 2]):
        assert json.loads((tmp_path / "out" / str(i) / "spec.json").read_text())["spec"]["slurm"]["nodes"] == nodes
    status = json.loads(cli("status", str(tmp_path / "out"), "--json", cwd=tmp_path).stdout)
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED"] * 4
    assert sorted(status["job_ids"]) == sorted(sub.slurm_job_ids)


@pytest.mark.slurm
def test_cancel_dir_stops_every_array(tmp_path):
    (tmp_path / "s.toml").write_text(spec_text("out", ["sleep", "120"], sweep='[sweep]\n"slurm.time" = ["00:05:00", "00:06:00"]'))
    assert cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path).returncode == 0
    sub = load_submission(str(tmp_path / "out"))
    assert len(sub.slurm_job_ids) == 2
    proc = cli("cancel", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert all(j in proc.stdout for j in sub.slurm_job_ids)
    assert sub.wait(timeout_s=60, poll_s=0.5) == {"0": "CANCELLED", "1": "CANCELLED"}


# ---------------------------------------------------------------- item 5: one live job per output dir


@pytest.mark.slurm
def test_second_submit_or_preflight_into_an_active_dir_is_refused(tmp_path):
    (tmp_path / "s.toml").write_text(spec_text("out", ["sleep", "120"]))
    assert cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path).returncode == 0
    first = load_submission(str(tmp_path / "out"))
    plan_file = tmp_path / "out" / "swiftslurm-plan.json"
    before = (plan_file.stat().st_mtime_ns, sorted(p.name for p in (tmp_path / "out" / "logs" / "submitit").iterdir()))
    try:
        for args in (("submit", "s.toml", "--executor", "slurm"), ("preflight", "s.toml", "--executor", "slurm")):
            proc = cli(*args, cwd=tmp_path)
            assert proc.returncode == 3, proc.stdout + proc.stderr
            assert "an active job already owns this output dir" in proc.stderr
            assert first.slurm_job_ids[0] in proc.stderr and "swiftslurm cancel" in proc.stderr
            assert "Traceback" not in proc.stderr
        # nothing was written: same plan file, no new submitit folder, one record
        assert (plan_file.stat().st_mtime_ns, sorted(p.name for p in (tmp_path / "out" / "logs" / "submitit").iterdir())) == before
        assert len(load_records(str(tmp_path / "out"))) == 1
    finally:
        assert cli("cancel", str(tmp_path / "out"), cwd=tmp_path).returncode == 0
    assert first.wait(timeout_s=60, poll_s=0.5) == {"0": "CANCELLED"}
    # a cancelled job's dir may be reused
    again = cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    load_submission(str(tmp_path / "out")).cancel()


@pytest.mark.slurm
def test_a_job_started_by_plain_sbatch_holds_its_dir(tmp_path):
    """No record (a rendered script): the ranks' lock refuses a second writer, and submit sees the lock."""
    plan = plan_from(spec_text("out", ["sleep", "120"]), tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    job = slurm.sbatch(str(tmp_path / "job.sh"))
    try:
        assert _until(lambda: ownership.holder(plan.output_dir), 60), "rank 0 never took the dir's lock"
        (tmp_path / "s.toml").write_text(spec_text("out", ["sleep", "120"]))
        proc = cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path)
        assert proc.returncode == 3 and f"job {job}" in proc.stderr, proc.stderr
        # a rank of another job started on the same dir by hand stops before writing, naming the owner
        ran = subprocess.run([sys.executable, "-m", "swiftslurm", "run", "--plan", plan.plan_path], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
        assert ran.returncode != 0
        assert "another job is running in this output dir" in ran.stderr and f"job {job}" in ran.stderr, ran.stderr
    finally:
        slurm.scancel([job])


def _local_sleeper(tmp_path, seconds=60):
    return spec_text("out", ["python", "-c", f"import time; time.sleep({seconds})"])


def test_local_second_submit_is_refused_while_the_first_runs(tmp_path):
    plan = plan_from(_local_sleeper(tmp_path), tmp_path)
    sub = submit_plan(plan, executor="local")
    try:
        assert _until(lambda: ownership.holder(plan.output_dir), 60)
        with pytest.raises(SubmissionError, match="an active job already owns") as err:
            submit_plan(plan_from(_local_sleeper(tmp_path), tmp_path), executor="local")
        assert sub.job_ids[0] in err.value.found and "swiftslurm cancel" in err.value.hint
    finally:
        sub.cancel()
    assert sub.wait(timeout_s=30, poll_s=0.2) == {"0": "CANCELLED"}
    # finished: the dir is free again
    done = submit_plan(plan_from(spec_text("out", ["true"]), tmp_path), executor="local")
    assert done.wait(timeout_s=60, poll_s=0.2) == {"0": "COMPLETED"}


def test_second_writer_in_one_dir_stops_with_a_clear_message(tmp_path):
    """The lock itself, between two real processes: the second claim fails and names the first."""
    holder_code = (
        "import sys, time; from swiftslurm.node import ownership; "
        f"ownership.claim({str(tmp_path)!r}, 0, '111_0', 'nodeX'); print('held', flush=True); time.sleep(30)"
    )
    proc = subprocess.Popen([sys.executable, "-c", holder_code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert ownership.holder(tmp_path)["job_id"] == "111_0"
        probe = subprocess.run([sys.executable, "-c", f"from swiftslurm.node import ownership; ownership.claim({str(tmp_path)!r}, 0, '222', 'nodeY')"],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "another job is running in this output dir" in probe.stderr and "111_0" in probe.stderr
        # another rank index of the same job is a different writer slot
        other = subprocess.run([sys.executable, "-c", f"from swiftslurm.node import ownership; ownership.claim({str(tmp_path)!r}, 1, '111_0')"],
                               capture_output=True, text=True, timeout=60)
        assert other.returncode == 0, other.stderr
    finally:
        proc.kill()
        proc.wait()
    assert ownership.holder(tmp_path) is None  # the lock goes with the process


# ---------------------------------------------------------------- item 10: leaks


@pytest.mark.slurm
def test_preflight_that_gives_up_cancels_its_job(tmp_path):
    from swiftslurm.cli.preflight_cmd import preflight_command

    plan = plan_from(spec_text("out", ["true"], extra='extra_sbatch = ["--begin=now+1hour"]').replace("checks = []", 'checks = ["ports"]'), tmp_path)
    console = Console(file=open(os.devnull, "w"))
    with pytest.raises(PreflightFailed, match="did not finish") as err:
        preflight_command(console, plan, "slurm", None, timeout_s=3)
    assert "cancelled" in err.value.what
    sub = load_submission(plan.output_dir)
    assert _until(lambda: sub.statuses()[0].state == "CANCELLED", 30), sub.statuses()


def _sleeper_pid() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_local_cancel_never_signals_a_reused_pid(tmp_path):
    """A recorded controller pid now held by another process (here: a sleep we start) is left alone: a reused
    pid (another start time) is a job that ended; a record that cannot prove the process is its own is refused."""
    from swiftslurm.jobs.record import CancelRefused

    other = _sleeper_pid()
    try:
        pid = str(other.pid)
        wrong = Submission("local", [pid], str(tmp_path), [str(tmp_path)], str(tmp_path), pid_starts={pid: process_start(other.pid) - 1})
        assert wrong.statuses()[0].state != "RUNNING"
        wrong.cancel()  # the recorded controller is gone: nothing to stop
        legacy = Submission("local", [pid], str(tmp_path), [str(tmp_path)], str(tmp_path))  # a record without a start time
        copied = Submission("local", [pid], str(tmp_path), [str(tmp_path)], str(tmp_path / "logs"),  # start time copied from /proc
                            pid_starts={pid: process_start(other.pid)}, cwd=os.getcwd())
        for sub, words in ((legacy, "without its start time"), (copied, "runs `sleep 60`, not this submission's submitit controller")):
            with pytest.raises(CancelRefused, match="not a process this submission started") as err:
                sub.cancel()
            assert words in err.value.found and err.value.exit_code == 3
        time.sleep(0.3)
        assert other.poll() is None, "cancel signalled a process that is not the job"
    finally:
        other.kill()
        other.wait()


FAKE_SACCT = """#!/bin/bash
# A stateful stand-in for accounting that is down: counts its calls, answers like a cluster without slurmdbd.
echo "$*" >> "{calls}"
echo "sacct: error: Slurm accounting storage is disabled" >&2
exit 1
"""


@pytest.mark.slurm
def test_wait_ends_on_a_task_slurm_holds_and_says_how_to_go_on(tmp_path):
    """A held task never starts by itself (`--hold` here; on a cluster, "launch failed requeued held"): --wait ends
    and says so instead of waiting for ever, and the job stays queued for the user's release."""
    (tmp_path / "s.toml").write_text(spec_text("out", ["true"], extra='extra_sbatch = ["--hold"]', name="held"))
    proc = cli("submit", "s.toml", "--executor", "slurm", "--wait", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (jid,) = load_submission(str(tmp_path / "out")).job_ids
    try:
        assert "1 of 1 task(s) did not complete: task 0 HELD" in proc.stdout, proc.stdout
        assert (f"task 0: held by Slurm (JobHeldUser: held by its user (`scontrol hold`, or sbatch --hold)); "
                f"`scontrol release {jid}` lets it run, `swiftslurm cancel {tmp_path / 'out'}` ends it") in proc.stdout, proc.stdout
        (task,) = json.loads(cli("status", "out", "--json", cwd=tmp_path).stdout)["tasks"]
        assert task["state"] == "HELD" and task["held"].startswith("held by Slurm (JobHeldUser"), task
        assert task["hold_reason"] == "JobHeldUser", task
        shown = cli("status", "out", cwd=tmp_path).stdout
        assert "HELD" in shown and "task 0: held by Slurm (JobHeldUser" in shown, shown
        doctor = cli("doctor", "out", "--json", cwd=tmp_path)
        assert doctor.returncode == 6 and [f["code"] for f in json.loads(doctor.stdout)] == ["held"], doctor.stdout + doctor.stderr
        again = cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path)  # still queued: the dir is still its
        assert again.returncode != 0 and "active" in again.stdout + again.stderr, again.stdout + again.stderr
        subprocess.run(["scontrol", "release", jid], check=True, capture_output=True, timeout=30)
        followed = cli("status", "out", "--follow", cwd=tmp_path)
        assert followed.returncode == 0 and "all 1 task(s) COMPLETED" in followed.stdout, followed.stdout + followed.stderr
    finally:
        subprocess.run(["scancel", "--name=held", jid], capture_output=True, timeout=30)


@pytest.mark.slurm
def test_follow_ends_on_a_job_slurm_will_not_start_as_submitted_and_says_why(tmp_path):
    """A queued job whose request its partition cannot meet (here: raised past a node's CPUs after validate, as an admin's
    change of the partition would leave it) stays PENDING for ever with reason PartitionConfig: `status --follow` ends
    on it as HELD with the reason and the way on, and doctor names it, instead of following it for ever."""
    (tmp_path / "s.toml").write_text(spec_text("out", ["true"], extra='extra_sbatch = ["--hold"]', name="nostart"))
    assert cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path).returncode == 0
    (jid,) = load_submission(str(tmp_path / "out")).job_ids
    try:
        # slurmctld applies the update and the release, and answers both that the partition cannot run the job (exit 1)
        for change in (["update", f"JobId={jid}", "MinCPUsNode=512"], ["release", jid]):
            subprocess.run(["scontrol", *change], capture_output=True, timeout=30)
        queued = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T|%r"], capture_output=True, text=True, timeout=30).stdout
        assert queued.strip() == "PENDING|PartitionConfig", queued
        followed = cli("status", "out", "--follow", cwd=tmp_path)
        assert followed.returncode == 1 and "task 0 HELD" in followed.stdout, followed.stdout + followed.stderr
        assert (f"task 0: Slurm will not start it as submitted (PartitionConfig: it asks for more than its partition offers "
                f"(a node's CPUs, memory or GPUs, or more nodes)); `swiftslurm cancel {tmp_path / 'out'}` ends it") in followed.stdout, \
            followed.stdout
        doctor = cli("doctor", "out", "--json", cwd=tmp_path)
        [finding] = json.loads(doctor.stdout)
        assert finding["code"] == "held" and "slurm.time" in finding["keys"], finding
        assert cli("cancel", "out", cwd=tmp_path).returncode == 0
        gone = subprocess.run(["squeue", "-h", "-j", jid, "-o", "%T"], capture_output=True, text=True, timeout=30).stdout
        assert gone.strip() in ("", "CANCELLED"), gone
    finally:
        subprocess.run(["scancel", "--name=nostart", jid], capture_output=True, timeout=30)


@pytest.mark.slurm
def test_wait_without_sacct_decides_from_what_the_ranks_left(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "sacct-calls"
    (fake / "sacct").write_text(FAKE_SACCT.format(calls=calls))
    (fake / "sacct").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    assert subprocess.run(["sacct"], env={**os.environ, **env}, capture_output=True).returncode == 1
    (tmp_path / "s.toml").write_text(spec_text("out", ["true"], sweep='[sweep]\n"train.command" = [["true"], ["false"]]'))
    t0 = time.monotonic()
    proc = cli("submit", "s.toml", "--executor", "slurm", "--wait", cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 of 2 task(s) did not complete" in proc.stdout and "task 1 FAILED" in proc.stdout, proc.stdout
    assert time.monotonic() - t0 < 100  # decided from the result files, not after the unseen-job grace
    assert calls.read_text().count("\n") >= 1  # the fake was really asked
    status = json.loads(cli("status", str(tmp_path / "out"), "--json", cwd=tmp_path, env=env).stdout)
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED", "FAILED"]
    # a success alone exits 0
    (tmp_path / "ok.toml").write_text(spec_text("ok", ["true"]))
    ok = cli("submit", "ok.toml", "--executor", "slurm", "--wait", cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
