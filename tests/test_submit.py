"""submit / status / cancel for real: the local executor, and the local Slurm cluster (marker slurm)."""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from swiftslurm import slurm
from swiftslurm.errors import SpecError, SubmissionError, SwiftSlurmError
from swiftslurm.jobs.send import Submission, load_submission, resolve_executor, submit_plan
from swiftslurm.plan import make_plan, write_plan
from swiftslurm.slurm.render import render_sbatch
from swiftslurm.spec import parse_toml, validate_spec

WAIT_S = 180

# Each rank writes what it was given into DIR/<array task or x>-<rank>-<pid>.json.
RECORD = (
    "import json, os, sys; d = sys.argv[1]; os.makedirs(d, exist_ok=True); "
    "keys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURMD_NODENAME', "
    "'SLURM_JOB_NODELIST', 'SLURM_ARRAY_TASK_ID', 'SLURM_RESTART_COUNT', 'SWIFTSLURM_PROBE_A', 'SWIFTSLURM_PROBE_B', 'SWIFTSLURM_PROBE_C']; "
    "name = os.environ.get('SLURM_ARRAY_TASK_ID', 'x') + '-' + os.environ['RANK'] + '-' + str(os.getpid()); "
    "open(os.path.join(d, name + '.json'), 'w').write(json.dumps({k: os.environ.get(k) for k in keys}))"
)


def spec_text(out: str, ranks_dir: str, nodes=1, tasks=1, sweep="", env="", slurm_extra="", name="ssub", command=None) -> str:
    cmd = command or ["python", "-c", RECORD, ranks_dir]
    return f"""
[job]
name = {json.dumps(name)}
output_dir = {json.dumps(out)}
[slurm]
partition = "debug"
nodes = {nodes}
tasks_per_node = {tasks}
time = "00:05:00"
signal_grace_s = 30
{slurm_extra}
[train]
command = {json.dumps(cmd)}
[preflight]
checks = []
{env}
{sweep}
"""


def plan_from(text: str, base: Path):
    raw = parse_toml(text)
    return make_plan(validate_spec(raw), raw, base_dir=str(base), source="test.toml")


def ranks(d: Path, restarts: int = 0) -> list[dict]:
    """What each rank recorded, every run of it (one file per process). Each record must come from run
    `restarts` (SLURM_RESTART_COUNT; 0 under the local executor): none of these jobs is meant to be requeued,
    so a rerun (a requeue) fails the test, naming each task's runs, rather than passing on its last run."""
    got = [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))]
    runs = sorted({(r["SLURM_ARRAY_TASK_ID"] or "-", int(r["SLURM_RESTART_COUNT"] or 0)) for r in got})
    assert all(n == restarts for _, n in runs), f"expected every task's run {restarts} only; (array task, restart count) recorded: {runs}"
    return got


def cli(*args, cwd=None, timeout=WAIT_S + 30):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


# ---------------------------------------------------------------- no cluster needed


def test_auto_picks_local_without_sbatch(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no sbatch on it
    assert resolve_executor("auto") == "local"
    with pytest.raises(Exception, match="sbatch"):
        resolve_executor("slurm")
    with pytest.raises(SubmissionError, match="unknown executor"):
        resolve_executor("kubernetes")


def test_status_of_a_dir_no_job_has_run_in_yet_says_so(tmp_path):
    """A rendered plan whose job has not started: no record, no owner. A plan that names task dirs outside the
    dir, and an owner record whose id is no Slurm job id, are not read as this dir's jobs."""
    plan = plan_from(spec_text("out", str(tmp_path / "r")), tmp_path)
    write_plan(plan, render_sbatch(plan))
    proc = cli("status", str(tmp_path / "out"))
    assert proc.returncode == 1 and "no job has run in this dir yet" in proc.stderr and "Traceback" not in proc.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".swiftslurm-owner.json").write_text(json.dumps({"job_id": "123"}))
    data = json.loads(Path(plan.plan_path).read_text())
    data["tasks"][0]["output_dir"] = str(elsewhere)
    Path(plan.plan_path).write_text(json.dumps(data))
    (tmp_path / "out" / ".swiftslurm-owner.json").write_text(json.dumps({"job_id": "local-4242; rm -rf ~"}))
    proc = cli("status", str(tmp_path / "out"), "--json")
    assert proc.returncode == 1 and "no job has run in this dir yet" in proc.stderr, proc.stdout + proc.stderr


def test_the_panel_says_a_local_run_has_no_in_job_restarts(tmp_path):
    from swiftslurm.cli.submit_cmd import local_limits

    plan = plan_from(spec_text("out", "r", slurm_extra="max_restarts = 2\nspare_nodes = 1"), tmp_path)
    (line,) = local_limits("local", plan)
    assert "slurm.max_restarts = 2, slurm.spare_nodes = 1: in-job restarts need Slurm" in line
    assert local_limits("slurm", plan) == [] and local_limits("local", plan_from(spec_text("out", "r"), tmp_path)) == []


def test_local_sweep_two_ranks_each(tmp_path):
    text = spec_text("out", str(tmp_path / "ranks"), tasks=2, sweep="[sweep]\nlearning_rate = [1e-4, 2e-4]",
                     env='[env]\nSWIFTSLURM_PROBE_A = "$(touch pwned) \'x\' `y`"')
    plan = plan_from(text, tmp_path)
    sub = submit_plan(plan, executor="local")
    assert sub.executor == "local" and len(sub.job_ids) == 2
    assert sub.wait(timeout_s=WAIT_S, poll_s=0.5) == {"0": "COMPLETED", "1": "COMPLETED"}
    for i, lr in enumerate((1e-4, 2e-4)):
        spec = json.loads((tmp_path / "out" / str(i) / "spec.json").read_text())
        assert spec["spec"]["train"]["learning_rate"] == lr
    got = ranks(tmp_path / "ranks")
    assert sorted((r["RANK"], r["WORLD_SIZE"]) for r in got) == [("0", "2"), ("0", "2"), ("1", "2"), ("1", "2")]
    assert {r["SWIFTSLURM_PROBE_A"] for r in got} == {"$(touch pwned) 'x' `y`"}
    assert not (tmp_path / "pwned").exists()
    again = load_submission(str(tmp_path / "out"))  # the record alone gives the same answer
    assert again.job_ids == sub.job_ids and again.states() == {"0": "COMPLETED", "1": "COMPLETED"}


def test_local_failure_is_reported_and_exits_1(tmp_path):
    (tmp_path / "s.toml").write_text(spec_text("out", "", command=["python", "-c", "raise SystemExit('boom: disk full')"]))
    proc = cli("submit", "s.toml", "--executor", "local", "--wait", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout
    assert "task 0: boom: disk full" in proc.stdout  # the command's last words, from rank 0's log
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert [t["state"] for t in status["tasks"]] == ["FAILED"]


SLOW_SAVE = (
    "import sys; from swiftslurm.checkpoint import savetime; "
    "savetime.record_save(sys.argv[1], 40, 95.0, {'write': 60.0, 'fsync': 5.0, 'hash': 25.0, 'commit': 4.0, 'prune': 1.0}, 9.0, 30)"
)


def test_status_warns_when_the_last_save_outgrew_the_grace_period(tmp_path):
    """The trainer records each save (checkpoint-save.json, here written by the command as rank 0 would);
    status shows the advice under the table and the whole record in --json."""
    out = tmp_path / "out"
    (tmp_path / "s.toml").write_text(spec_text("out", "", command=["python", "-c", SLOW_SAVE, str(out)]))
    assert cli("submit", "s.toml", "--executor", "local", "--wait", cwd=tmp_path).returncode == 0
    shown = cli("status", str(out))
    assert shown.returncode == 0, shown.stderr
    flat = " ".join(shown.stdout.split())
    assert "warning: the last checkpoint save took 95.0 s" in flat and "HINT: set slurm.signal_grace_s = 130" in flat, shown.stdout
    status = json.loads(cli("status", str(out), "--json").stdout)
    last = status["tasks"][0]["last_save"]
    assert last["step"] == 40 and last["hash_s"] == 25.0 and last["fits_grace"] is False


def test_local_cancel_stops_the_ranks_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    sleeper = ["python", "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"]
    plan = plan_from(spec_text("out", "", command=sleeper, env='[env]\nSWIFTSLURM_PROBE_A = "x y"'), tmp_path)
    sub = submit_plan(plan, executor="local")
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    child = int(pid_file.read_text())
    load_submission(str(tmp_path / "out")).cancel()  # from the record, as `swiftslurm cancel DIR` does
    assert sub.wait(timeout_s=30, poll_s=0.2) == {"0": "CANCELLED"}
    deadline = time.monotonic() + 15
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists(), "the user's command outlived the cancel"


# ---------------------------------------------------------------- on the local Slurm cluster


def _sbatch_calls(sub: Submission) -> int:
    """submitit writes one submission script per sbatch call into the submission's folder."""
    return len(list(Path(sub.folder).glob("*_submission.sh")))


@pytest.mark.slurm
def test_sweep_is_one_sbatch_array_cli(tmp_path):
    (tmp_path / "s.toml").write_text(spec_text("out", str(tmp_path / "ranks"), sweep="[sweep]\nlearning_rate = [1e-4, 2e-4]\nseed = [1, 2]"))
    proc = cli("submit", "s.toml", "--executor", "auto", "--wait", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "executor: slurm (auto" in proc.stdout
    sub = load_submission(str(tmp_path / "out"))
    assert sub.executor == "slurm" and len(sub.slurm_job_ids) == 1 and _sbatch_calls(sub) == 1
    assert sub.job_ids == [f"{sub.slurm_job_ids[0]}_{i}" for i in range(4)]
    from swiftslurm.jobs import index

    assert index.output_dirs_of(sub.job_ids[2]) == [str((tmp_path / "out").resolve())]  # found after Slurm forgets it
    seen = set()
    for i in range(4):
        spec = json.loads((tmp_path / "out" / str(i) / "spec.json").read_text())["spec"]
        seen.add((spec["train"]["learning_rate"], spec["train"]["seed"]))
    assert seen == {(1e-4, 1), (1e-4, 2), (2e-4, 1), (2e-4, 2)}
    assert sorted(r["SLURM_ARRAY_TASK_ID"] for r in ranks(tmp_path / "ranks")) == ["0", "1", "2", "3"]
    from conftest import wait_for_job

    # --wait may end on submitit's result files while slurmdbd still records the tasks' ends: status names
    # the nodes from sacct, so give accounting its moment (what a user's later `status` sees)
    wait_for_job(sub.slurm_job_ids[0], timeout_s=60, min_rows=4)
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED"] * 4
    assert all(t["nodes"] for t in status["tasks"])
    by_id = json.loads(cli("status", sub.slurm_job_ids[0], "--json").stdout)
    assert [t["state"] for t in by_id["tasks"]] == ["COMPLETED"] * 4


@pytest.mark.slurm
def test_two_nodes_two_tasks_ranks(tmp_path):
    probe = f"$(touch {tmp_path}/pwned) 'x' `y`\nz"
    env = f"[env]\nSWIFTSLURM_PROBE_B = {json.dumps(probe)}"
    plan = plan_from(spec_text("out", str(tmp_path / "ranks"), nodes=2, tasks=2, env=env), tmp_path)
    sub = submit_plan(plan, executor="slurm")
    assert sub.wait(timeout_s=WAIT_S) == {"0": "COMPLETED"}
    got = ranks(tmp_path / "ranks")
    assert sorted(int(r["RANK"]) for r in got) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in got} == {"4"}
    by_node = {}
    for r in got:
        by_node.setdefault(r["SLURMD_NODENAME"], []).append(r)
    assert len(by_node) == 2
    assert sorted(r["NODE_RANK"] for r in got) == ["0", "0", "1", "1"]
    assert all(sorted(r["LOCAL_RANK"] for r in rs) == ["0", "1"] for rs in by_node.values())
    first = slurm.show_hostnames(got[0]["SLURM_JOB_NODELIST"])[0]
    assert len({r["MASTER_ADDR"] for r in got}) == 1
    master = got[0]["MASTER_ADDR"]
    assert master in (first, _addr_of(first))
    rank0 = next(r for r in got if r["RANK"] == "0")
    assert rank0["SLURMD_NODENAME"] == first
    assert {r["SWIFTSLURM_PROBE_B"] for r in got} == {probe}  # [env] via submitit setup lines, on both nodes
    assert not (tmp_path / "pwned").exists()


def _addr_of(host: str) -> str:
    import socket

    return socket.gethostbyname(host)


@pytest.mark.slurm
def test_rendered_script_runs_under_plain_sbatch(tmp_path):
    plan = plan_from(spec_text("out", str(tmp_path / "ranks"), tasks=2, sweep="[sweep]\nseed = [1, 2]"), tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)
    job = slurm.sbatch(str(tmp_path / "job.sh"))
    sub = Submission("slurm", [f"{job}_0", f"{job}_1"], plan.output_dir, [t.output_dir for t in plan.tasks], "")
    assert sub.wait(timeout_s=WAIT_S) == {"0": "COMPLETED", "1": "COMPLETED"}
    assert sorted((r["SLURM_ARRAY_TASK_ID"], r["RANK"]) for r in ranks(tmp_path / "ranks")) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert len(list((tmp_path / "out").glob("slurm-*_*.out"))) == 2


@pytest.mark.slurm
def test_status_and_cancel_of_a_hand_submitted_sweep_by_its_dir(tmp_path):
    """`swiftslurm render` + plain sbatch leaves no submission record: `status DIR` finds each task's job through
    what its rank 0 recorded; `cancel DIR` stops them after Slurm confirms they ran there, and refuses a dir that
    merely names a job in a planted owner record. Neither writes a record."""
    plan = plan_from(spec_text("out", "", sweep="[sweep]\nseed = [1, 2]", command=["sleep", "120"]), tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    job = slurm.sbatch(str(tmp_path / "job.sh"))
    owners = [Path(t.output_dir, ".swiftslurm-owner.json") for t in plan.tasks]
    deadline = time.monotonic() + 90
    while not all(o.exists() for o in owners) and time.monotonic() < deadline:
        time.sleep(0.5)
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert [(t["job_id"], t["state"]) for t in status["tasks"]] == [(f"{job}_0", "RUNNING"), (f"{job}_1", "RUNNING")], status
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / ".swiftslurm-owner.json").write_text(json.dumps({"job_id": f"{job}_0"}))
    refused = cli("cancel", str(planted))
    assert refused.returncode == 3 and "not provably this dir's job" in refused.stderr and "Traceback" not in refused.stderr
    assert slurm.job_records([job])[f"{job}_0"].state == "RUNNING"  # nothing was signalled
    proc = cli("cancel", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    sub = Submission("slurm", [f"{job}_0", f"{job}_1"], plan.output_dir, [t.output_dir for t in plan.tasks], "")
    assert sub.wait(timeout_s=60, poll_s=0.5) == {"0": "CANCELLED", "1": "CANCELLED"}
    assert not (tmp_path / "out" / "submission.json").exists() and not (planted / "submission.json").exists()


@pytest.mark.slurm
def test_injection_through_render_and_real_sbatch(tmp_path):
    pwned = Path(f"/tmp/pwned-{uuid.uuid4().hex}")
    bare_pwned_existed = Path("/tmp/pwned").exists()
    nasty = [f"'; touch {pwned} #", f"$(touch {pwned})", f"`touch {pwned}`", "two\nlines", "sp  aces"]
    # job name: refused by the spec with a clear error
    for bad in nasty:
        with pytest.raises(SpecError, match="job.name"):
            plan_from(spec_text("o", str(tmp_path / "r"), name=bad), tmp_path)
    # extra options: a line break is refused; the rest reach sbatch quoted
    with pytest.raises(SpecError, match="extra_sbatch"):
        plan_from(spec_text("o", str(tmp_path / "r"), slurm_extra=f"extra_sbatch = {json.dumps(['--comment=' + nasty[3]])}"), tmp_path)
    comment = f"--comment={nasty[0]} {nasty[1]} {nasty[2]}"
    # env values and the output path: arrive literally
    values = (nasty[0] + nasty[3], nasty[1] + nasty[4], nasty[2])
    env = "[env]\n" + "\n".join(f"SWIFTSLURM_PROBE_{k} = {json.dumps(v)}" for k, v in zip("ABC", values, strict=True))
    out = tmp_path / f"out {nasty[0]} {nasty[1]} {nasty[2]}".replace("/", "_")
    text = spec_text(str(out), str(tmp_path / "ranks"), env=env, slurm_extra=f"extra_sbatch = {json.dumps([comment])}")
    plan = plan_from(text, tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    job = slurm.sbatch(str(tmp_path / "job.sh"))
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert f"Comment={comment.removeprefix('--comment=')} " in shown  # sbatch read the quoted option literally
    sub = Submission("slurm", [job], plan.output_dir, [plan.output_dir], "")
    assert sub.wait(timeout_s=WAIT_S) == {"0": "COMPLETED"}
    (got,) = ranks(tmp_path / "ranks")
    assert got["SWIFTSLURM_PROBE_A"] == nasty[0] + nasty[3]
    assert got["SWIFTSLURM_PROBE_B"] == nasty[1] + nasty[4]
    assert got["SWIFTSLURM_PROBE_C"] == nasty[2]
    assert list(out.glob("slurm-*.out")), "the log went to the literal output dir"
    assert not pwned.exists()
    assert Path("/tmp/pwned").exists() == bare_pwned_existed


@pytest.mark.slurm
def test_refused_submission_exits_3_with_slurms_reason(tmp_path):
    plan = plan_from(spec_text("out", str(tmp_path / "r")).replace('partition = "debug"', 'partition = "nope"'), tmp_path)
    with pytest.raises(SubmissionError) as err:
        submit_plan(plan, executor="slurm")
    assert "invalid partition" in err.value.found.lower()
    (tmp_path / "s.toml").write_text(spec_text("out2", str(tmp_path / "r")).replace('partition = "debug"', 'partition = "nope"'))
    proc = cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path)
    assert proc.returncode == 3 and "invalid partition" in proc.stderr.lower() and "Traceback" not in proc.stderr


def _until(sub: Submission, pred, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        rows = sub.statuses()
        if pred(rows[0]) or time.monotonic() > deadline:
            return rows[0]
        time.sleep(0.5)


@pytest.mark.slurm
def test_status_counts_a_requeue_then_cancel_from_output_dir(tmp_path):
    (tmp_path / "s.toml").write_text(spec_text("out", str(tmp_path / "r"), command=["sleep", "120"]))
    assert cli("submit", "s.toml", "--executor", "slurm", cwd=tmp_path).returncode == 0
    sub = load_submission(str(tmp_path / "out"))
    assert _until(sub, lambda r: r.state == "RUNNING", 60).state == "RUNNING"
    slurm.requeue(sub.job_ids[0])
    row = _until(sub, lambda r: r.state == "RUNNING" and r.restarts == 1, 90)
    assert (row.state, row.restarts) == ("RUNNING", 1)
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    assert status["tasks"][0]["restarts"] == 1 and status["tasks"][0]["nodes"]
    proc = cli("cancel", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert sub.wait(timeout_s=60, poll_s=0.5) == {"0": "CANCELLED"}


@pytest.mark.slurm
def test_cancel_leaves_a_job_that_took_the_recorded_id_over(tmp_path):
    """Slurm hands a job id out again once it forgot the job (a cluster reset, an array task's raw id): a record whose
    id is now another job of the same user must not stop that job. The record here names a live job of another name."""
    script = tmp_path / "other.sh"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=someone-elses\n#SBATCH --partition=debug\n#SBATCH --time=00:02:00\n"
                      f"#SBATCH --output={tmp_path}/other.out\nsleep 100\n")
    job = slurm.sbatch(str(script))
    try:
        sub = Submission("slurm", [job], str(tmp_path / "out"), [str(tmp_path / "out")], "", job_name="mine", submitted_at=time.time())
        sub.cancel()
        # slurmctld's own state, at once (scancel returns after slurmctld acted; accounting may lag behind it)
        live = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30).stdout.split()
        assert live in (["PENDING"], ["RUNNING"]), f"cancel stopped a job of another name: {live}"
        sub.job_name = "someone-elses"  # the same id under the recorded name is ours: it is stopped
        sub.cancel()
        from conftest import wait_for_job

        assert wait_for_job(job, timeout_s=60) == {job: "CANCELLED"}
        sub.cancel()  # a job that already ended: nothing to stop, no error (scancel --name exits 1 for it)
        with pytest.raises(SwiftSlurmError, match="scancel"):
            Submission("slurm", ["12x"], "", [""], "", job_name="mine", submitted_at=0.0).cancel()  # Slurm's other errors stay errors
    finally:
        subprocess.run(["scancel", "--name=someone-elses", job], capture_output=True, timeout=30)


# Waits for USR2 (up to 80 s), records which rank got it, exits 0.
ON_USR2 = (
    "import os, signal, sys, time; d = sys.argv[1]; os.makedirs(d, exist_ok=True); got = []; "
    "signal.signal(signal.SIGUSR2, lambda *a: got.append(1)); t = time.time(); "
    "open(os.path.join(d, 'ready-' + os.environ['RANK']), 'w').close(); "
    "exec('while not got and time.time() - t < 80: time.sleep(0.2)'); "
    "time.sleep(2 * int(os.environ['RANK'])); "
    "open(os.path.join(d, 'usr2-' + os.environ['RANK']), 'w').write(str(bool(got)))"
)
# Rank 1 takes 2 s longer over its stop (a bigger shard to save): rank 0's exit must not kill it meanwhile.


def _usr2_spec(tmp_path, out: str, nodes: int, tasks: int) -> str:
    return spec_text(out, "", nodes=nodes, tasks=tasks, command=["python", "-c", ON_USR2, str(tmp_path / out / "got")]).replace(
        'time = "00:05:00"\nsignal_grace_s = 30', 'time = "00:01:50"\nsignal_grace_s = 60\nmax_requeues = 0'
    )


@pytest.mark.slurm
@pytest.mark.slow
def test_walltime_usr2_reaches_every_rank(tmp_path):
    """--signal=USR2@grace (not B:) reaches every rank, on both submit paths (run side by side):
    submitit with 2 nodes x 1 rank, the rendered script with 1 node x 2 ranks.

    slurmctld checks limits every 30 s, so USR2 comes 20-50 s after the start here (not before
    the ranks have installed their handlers: an unhandled USR2 kills a process).
    """
    via_submitit = submit_plan(plan_from(_usr2_spec(tmp_path, "a", nodes=2, tasks=1), tmp_path), executor="slurm")
    plan = plan_from(_usr2_spec(tmp_path, "b", nodes=1, tasks=2), tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    via_render = Submission("slurm", [slurm.sbatch(str(tmp_path / "job.sh"))], plan.output_dir, [plan.output_dir], "")
    for sub, out in ((via_submitit, "a"), (via_render, "b")):
        # max_requeues = 0: the walltime stop is not requeued, so the run failed partway (never COMPLETED)
        assert sub.wait(timeout_s=WAIT_S) == {"0": "FAILED"}, out
        got = {p.name: p.read_text() for p in (tmp_path / out / "got").glob("usr2-*")}
        assert got == {"usr2-0": "True", "usr2-1": "True"}, out
        assert "max_requeues reached" in (sub.statuses()[0].stop_reason or ""), out
    status = json.loads(cli("status", str(tmp_path / "a"), "--json").stdout)["tasks"][0]
    assert status["state"] == "FAILED" and "stopped at walltime after 0 requeue(s): max_requeues reached" in status["stop_reason"]
    shown = cli("status", str(tmp_path / "a")).stdout
    assert "task 0: stopped at walltime after 0 requeue(s): max_requeues reached" in shown


@pytest.mark.slurm
def test_rendered_trap_forwards_a_batch_usr2_to_the_ranks(tmp_path):
    """`scancel --batch --signal=USR2` reaches only the batch shell: its trap must pass it to srun's ranks."""
    spec = _usr2_spec(tmp_path, "out", nodes=1, tasks=2).replace('time = "00:01:50"', 'time = "00:05:00"')
    plan = plan_from(spec, tmp_path)
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    job = slurm.sbatch(str(tmp_path / "job.sh"))
    got = tmp_path / "out" / "got"
    deadline = time.monotonic() + 90
    while len(list(got.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert len(list(got.glob("ready-*"))) == 2, "the ranks never started"
    subprocess.run(["scancel", "--batch", "--signal=USR2", job], check=True)
    sub = Submission("slurm", [job], plan.output_dir, [plan.output_dir], "")
    assert sub.wait(timeout_s=WAIT_S) == {"0": "FAILED"}  # max_requeues = 0: a stop that is not requeued fails
    assert {p.name: p.read_text() for p in got.glob("usr2-*")} == {"usr2-0": "True", "usr2-1": "True"}
    log = next((tmp_path / "out").glob("slurm-*.out")).read_text()
    assert "forwarding to the srun step" in log and "max_requeues reached" in log
