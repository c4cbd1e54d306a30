"""In-job restart (slurm.max_restarts, slurm.spare_nodes): the pure decisions, the scripts of both submit paths.

The end-to-end runs on the Slurm cluster are in tests/test_restart_slurm.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from swiftslurm.jobs.send import slurm_parameters
from swiftslurm.node import restart
from swiftslurm.node.batch.supervise import job_id_of, task_index
from swiftslurm.plan import make_plan
from swiftslurm.records import restarts
from swiftslurm.slurm import steps
from swiftslurm.slurm.render import render_sbatch
from swiftslurm.spec.load import validate_spec

SPEC = """
[job]
name = "r"
output_dir = "{out}"
[slurm]
nodes = 2
tasks_per_node = 1
{slurm}
[train]
model = "tiny-llama"
dataset = ["x.jsonl"]
max_steps = 5
"""


def plan_of(tmp_path, slurm: str = ""):
    import tomllib

    raw = tomllib.loads(SPEC.format(out=tmp_path / "out", slurm=slurm))
    return make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="test.toml")


# ---------------------------------------------------------------- srun's error lines (as Slurm 22.05 prints them)


def test_srun_error_lines():
    e = restart.parse_srun_error("srun: error: node2: task 1: Killed\n")
    assert e == restart.SrunError("node2", "1", "Killed")
    assert restart.parse_srun_error("srun: error: node1: tasks 0-1: Exited with exit code 86") == restart.SrunError("node1", "0-1", "Exited with exit code 86")
    assert restart.parse_srun_error("srun: Job step aborted: Waiting up to 32 seconds for job step to finish.") is None
    assert restart.parse_srun_error("some rank's own line: srun: error: node2: task 1: Killed") is None
    # a node set DOWN under the step (seen on the test cluster): the node is lost, whatever the killed tasks say after it
    lines = ["srun: error: Node failure on node3", "srun: error: node3: task 1: Killed", "srun: error: node2: task 0: Killed"]
    errors = tuple(e for e in map(restart.parse_srun_error, lines) if e is not None)
    assert errors[0] == restart.SrunError("node3", "-", "Node failure")
    lost = restart.cause_of(restart.StepEnd(137, ("node2", "node3"), errors))
    assert (lost.kind, lost.gone) == ("node_failure", ("node3",))


# ---------------------------------------------------------------- what happened


def test_cause_a_killed_rank_a_down_node_a_hang_and_hardware():
    nodes = ("node1", "node2")
    killed = restart.StepEnd(137, nodes, (restart.SrunError("node2", "1", "Killed"),))
    assert restart.cause_of(killed) == restart.Cause("rank_killed", "task 1 on node2: Killed")
    # what the cluster showed: rank 1 SIGKILLed, then rank 0 raised "connection reset by peer" and srun terminated it
    collateral = restart.StepEnd(143, nodes, (restart.SrunError("node2", "1", "Killed"), restart.SrunError("node1", "0", "Terminated")),
                                 failures=((0, "node1", "RuntimeError: [gloo] Read error: Connection reset by peer"),))
    assert restart.cause_of(collateral) == restart.Cause("rank_killed", "task 1 on node2: Killed")
    down = restart.StepEnd(1, nodes, (restart.SrunError("node2", "1", "Killed"),), down=("node2",))
    assert restart.cause_of(down).kind == "node_failure" and restart.cause_of(down).gone == ("node2",)
    hang = restart.StepEnd(86, nodes, (), hang={"rank": 1, "node": "node2", "limit_s": 5, "detail": "hang: rank 1 (node2) never joined"})
    c = restart.cause_of(hang)
    assert (c.kind, c.suspects, c.gone) == ("hang", ("node2",), ()) and "rank 1 on node2" in c.detail
    ecc = restart.StepEnd(1, nodes, (), failures=((1, "node2", "RuntimeError: CUDA error: uncorrectable ECC error encountered"),))
    assert restart.cause_of(ecc).kind == "hardware" and restart.cause_of(ecc).suspects == ("node2",)
    bug = restart.StepEnd(1, nodes, (), failures=((0, "node1", "ValueError: bad shape"),))
    assert restart.cause_of(bug) == restart.Cause("rank_failed", "rank 0 on node1: ValueError: bad shape")
    # not a hardware verdict: SIGBUS from a full /dev/shm, a CUDA error inside NCCL (the node is not blamed)
    for what in ("Fatal Python error: Bus error", "NCCL error: unhandled cuda error (ncclUnhandledCudaError)"):
        shm = restart.StepEnd(1, nodes, (), failures=((1, "node2", what),))
        assert restart.cause_of(shm).kind == "rank_failed" and restart.cause_of(shm).suspects == (), what


# ---------------------------------------------------------------- what to do


def test_decide_restarts_until_max_then_stops():
    cause = restart.Cause("rank_killed", "task 1 on node2: Killed")
    d = restart.decide_restart(0, 2, cause, ("node1", "node2"), ("node1", "node2"), (), 2)
    assert d.restart and d.nodes == ("node1", "node2") and d.dropped == () and d.message.startswith("restart 1 of at most 2")
    d = restart.decide_restart(2, 2, cause, ("node1", "node2"), ("node1", "node2"), (), 2)
    assert not d.restart and "max_restarts reached (slurm.max_restarts = 2" in d.message and "task 1 on node2: Killed" in d.message


def test_a_restart_at_4096_nodes_says_its_nodes_as_slurm_does_in_one_short_line():
    allocation = tuple(f"gpu{i:04d}" for i in range(1, 4098))  # 4096 nodes and a spare
    end = restart.StepEnd(1, allocation[:4096], down=("gpu2048",))
    d = restart.decide_restart(0, 3, restart.cause_of(end), allocation[:4096], allocation, (), 4096)
    assert d.restart and len(d.nodes) == 4096 and d.dropped == ("gpu2048",)
    assert d.message == ("restart 1 of at most 3 on gpu[0001-2047,2049-4097] (dropped gpu2048) after: node(s) gpu2048 failed "
                         "or went down (Slurm)")


def test_a_spare_takes_a_lost_nodes_place_and_without_one_the_run_stops():
    lost = restart.Cause("node_failure", "node(s) node2 failed", ("node2",), ("node2",))
    d = restart.decide_restart(0, 3, lost, ("node1", "node2"), ("node1", "node2", "node3"), (), 2)
    assert d.restart and d.nodes == ("node1", "node3") and d.dropped == ("node2",)
    # the spare is used up: the next lost node stops the run, with the reason and the fix
    d = restart.decide_restart(1, 3, restart.Cause("node_failure", "node(s) node3 failed", ("node3",), ("node3",)),
                               ("node1", "node3"), ("node1", "node2", "node3"), ("node2",), 2)
    assert not d.restart and d.dropped == ("node3",) and "no spare left" in d.message and "slurm.spare_nodes" in d.message


def test_a_hang_culprit_is_replaced_only_when_a_spare_is_free():
    hang = restart.Cause("hang", "no step", ("node2",))
    with_spare = restart.decide_restart(0, 1, hang, ("node1", "node2"), ("node1", "node2", "node3"), (), 2)
    assert with_spare.nodes == ("node1", "node3") and with_spare.dropped == ("node2",)
    without = restart.decide_restart(0, 1, hang, ("node1", "node2"), ("node1", "node2"), (), 2)
    assert without.restart and without.nodes == ("node1", "node2") and without.dropped == ()


def test_restart_records_and_status_summary(tmp_path):
    assert restarts.read_restarts(tmp_path) == [] and restarts.summary([], "7") == (0, None)
    rec = restarts.RestartRecord("7", 0, "rank_killed", "task 1 on node2: Killed", ["node1", "node2"], True,
                                ["node1", "node2"], [], 20, "restart 1 of at most 2", 137)
    restarts.record_restart(tmp_path, rec)
    records = restarts.read_restarts(tmp_path)
    assert [r["cause"] for r in records] == ["rank_killed"]
    made, line = restarts.summary(records, "7")
    assert made == 1 and "restarted in place 1 time(s)" in line and "Killed" in line and "resumed from step 20" in line
    assert restarts.summary(records, "8") == (0, None)  # another job's record
    stop = restarts.RestartRecord("7", 1, "rank_killed", "x", [], False, [], [], 20, "not restarted: max_restarts reached", 137)
    restarts.record_restart(tmp_path, stop)
    assert restarts.summary(restarts.read_restarts(tmp_path), "7") == (1, "not restarted: max_restarts reached")
    (tmp_path / "restarts.json").write_text("{not json")
    assert restarts.read_restarts(tmp_path) == []


# ---------------------------------------------------------------- where the step runs


def test_placement_and_task_of_the_supervisor():
    assert steps.placement(("node1", "node3"), 2) == ["--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=node1,node3"]
    assert steps.with_options(["srun", "--unbuffered", "python"], ["-k"]) == ["srun", "-k", "--unbuffered", "python"]
    with pytest.raises(ValueError):
        steps.with_options(["python", "x"], ["-k"])
    # after a failure: asked with --immediate, and sharing the CPUs once Slurm has refused it as busy for SETTLE_S
    assert steps.after_failure(None) == [f"--immediate={steps.STEP_START_S}"]
    assert steps.after_failure(steps.SETTLE_S - 1) == [f"--immediate={steps.STEP_START_S}"]
    assert steps.after_failure(steps.SETTLE_S) == [f"--immediate={steps.STEP_START_S}", "--overlap"]
    assert steps.busy("srun: error: Unable to create step for job 3036: Requested nodes are busy\n")
    assert steps.busy("srun: Job 3033 step creation temporarily disabled, retrying (Requested nodes are busy)") is False
    assert not steps.busy("srun: error: Unable to create step for job 7: Requested node configuration is not available")
    assert steps.unusable("down*") and steps.unusable("drain") and steps.unusable("idle*") and not steps.unusable("mix")
    assert steps.parse_node_states("node1|mix\nnode2|down*\n") == {"node1": "mix", "node2": "down*"}
    assert task_index("3,5", {"SLURM_ARRAY_TASK_ID": "1"}) == 5
    assert task_index(None, {"SWIFTSLURM_TASK": "4", "SLURM_ARRAY_TASK_ID": "1"}) == 4
    assert job_id_of({"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}) == "10_2"
    assert job_id_of({"SLURM_JOB_ID": "12"}) == "12"


# ---------------------------------------------------------------- the spec and both scripts


def test_spare_nodes_without_restarts_is_refused():
    with pytest.raises(Exception) as exc:
        validate_spec({"slurm": {"spare_nodes": 1}})
    assert "slurm.max_restarts" in str(exc.value)


def test_rendered_script_keeps_the_allocation_and_runs_the_supervisor(tmp_path):
    plain = render_sbatch(plan_of(tmp_path), python="/py")
    assert "--no-kill" not in plain and "supervise" not in plain  # nothing changes unless asked
    text = render_sbatch(plan_of(tmp_path, "max_restarts = 2\nspare_nodes = 1"), python="/py")
    assert "#SBATCH --nodes=3\n" in text and "#SBATCH --no-kill\n" in text
    line = next(ln for ln in text.splitlines() if "-m swiftslurm run" in ln)
    assert line.startswith("/py -m swiftslurm.node.batch.supervise --plan ") and " -- srun --kill-on-bad-exit=1 " in line and line.endswith("&")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def test_submitit_script_hands_its_srun_line_to_the_supervisor(tmp_path):
    params = slurm_parameters(plan_of(tmp_path, "max_restarts = 1"), tasks=(0,))
    assert params["additional_parameters"].get("no-kill") is True and params["nodes"] == 2
    function = params["setup"][-1]
    assert function.startswith("srun() { ") and "-m swiftslurm.node.batch.supervise --plan" in function and '--tasks 0 -- srun "$@"; }' in function
    # the function stands in for submitit's own srun line: bash calls it with that line's arguments
    script = "\n".join([function.replace("-m swiftslurm.node.batch.supervise", "-c 'import sys; print(sys.argv[1:])'"),
                        "srun --unbuffered --output x python -u -m submitit.core._submit f"])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert "'srun', '--unbuffered', '--output', 'x', 'python'" in out.stdout, out.stderr
    assert "no-kill" not in slurm_parameters(plan_of(tmp_path))["additional_parameters"]


def test_doctor_names_the_restarts_and_a_run_it_stopped(tmp_path):
    from swiftslurm.doctor.diagnose import diagnose_task
    from swiftslurm.doctor.evidence import TaskRun

    hang = {"job_id": "7", "attempt": 0, "cause": "hang", "detail": "no training step for 5 s (watchdog; rank 1 on node2)",
            "restarted": True, "dropped": ["node2"], "resume_step": 8, "message": "restart 1 of at most 1"}
    lost = {"job_id": "7", "attempt": 1, "cause": "node_failure", "detail": "node(s) node3 failed", "restarted": False,
            "dropped": ["node3"], "resume_step": 16, "message": "not restarted: ... no spare left. HINT: give the job spares"}
    found = {f.code: f for f in diagnose_task(TaskRun(0, str(tmp_path), in_job=[hang, lost]))}
    assert found["hang"].nodes == ("node2",) and "restarted in place 1 time(s)" in found["hang"].what
    assert found["node_failure"].what.endswith("then the run stopped") and found["node_failure"].fix.startswith("not restarted")
    assert diagnose_task(TaskRun(0, str(tmp_path))) == []


def test_shrink_on_failure_restarts_on_fewer_nodes_only_where_the_spec_allows(tmp_path):
    lost = restart.Cause("node_failure", "node(s) node2 failed", ("node2",), ("node2",))
    args = (0, 2, lost, ("node1", "node2", "node3"), ("node1", "node2", "node3"), (), 3)
    assert not restart.decide_restart(*args).restart
    d = restart.decide_restart(*args, shrink=True)
    assert d.restart and d.nodes == ("node1", "node3") and d.dropped == ("node2",) and "2 of 3 node(s)" in d.message
    # the ranks of the shrunk step check their allocation against the smaller world, and only then
    spec = validate_spec({"slurm": {"nodes": 3, "max_restarts": 2, "shrink_on_failure": True}})
    assert restart.step_spec(spec, {"SWIFTSLURM_STEP_NODES": "2"}).slurm.nodes == 2
    assert restart.step_spec(spec, {}).slurm.nodes == 3 and restart.step_spec(spec, {"SWIFTSLURM_STEP_NODES": "4"}).slurm.nodes == 3
    rigid = validate_spec({"slurm": {"nodes": 3, "max_restarts": 2}})
    assert restart.step_spec(rigid, {"SWIFTSLURM_STEP_NODES": "2"}).slurm.nodes == 3
    # and the DeepSpeed dict's global batch follows the smaller world (HF Trainer refuses a mismatch)
    from swiftslurm.dsconfig import build_for_spec

    trains = validate_spec({"slurm": {"nodes": 3, "max_restarts": 2, "shrink_on_failure": True},
                            "train": {"model": "tiny-llama", "dataset": ["x.jsonl"], "per_device_train_batch_size": 2,
                                      "gradient_accumulation_steps": 3, "dataset_scan": False}})
    ds, _ = build_for_spec(trains)
    assert ds["train_batch_size"] == 2 * 3 * 3
    smaller = restart.step_spec(trains, {"SWIFTSLURM_STEP_NODES": "2"})
    assert restart.step_ds_config(ds, smaller) == {**ds, "train_batch_size": 2 * 3 * 2}
    assert restart.step_ds_config({}, smaller) == {}
    with pytest.raises(Exception) as exc:
        validate_spec({"slurm": {"nodes": 2, "max_restarts": 1, "shrink_on_failure": True}, "parallel": {"tensor_parallel": 2}})
    assert "data parallel" in str(exc.value) and "spare_nodes" in str(exc.value)


WATCHED = """
import sys, time
from swiftslurm.train.health.watchdog import ProgressWatchdog
env = {"SWIFTSLURM_WATCHDOG_FLOOR_S": "0.5", "SWIFTSLURM_WATCHDOG_BACKUP_S": "30", "SWIFTSLURM_HANG_RESTART": sys.argv[2]}
dog = ProgressWatchdog(0, 600.0, environ=env, node="node1", hang_file=sys.argv[1])
for step in range(1, 5):
    dog.step_done(step)
    time.sleep(0.01)
time.sleep(3)  # no step: the watchdog fires after 0.5 s
print("still here")
"""


def test_a_stalled_rank_ends_its_step_only_under_the_supervisor(tmp_path):
    import sys

    hang = tmp_path / "hang.json"
    ended = subprocess.run([sys.executable, "-c", WATCHED, str(hang), "1"], capture_output=True, text=True, timeout=60)
    assert ended.returncode == 86 and "still here" not in ended.stdout, ended.stderr[-2000:]
    record = json.loads(hang.read_text())
    assert (record["rank"], record["node"]) == (0, "node1") and "no rank named" in record["detail"]  # one rank: itself
    hang.unlink()
    dumped = subprocess.run([sys.executable, "-c", WATCHED, str(hang), "0"], capture_output=True, text=True, timeout=60)
    assert dumped.returncode == 0 and "still here" in dumped.stdout and not hang.exists()  # today's behaviour: stacks only
    assert "watchdog: no step for" in dumped.stderr


# ---------------------------------------------------------------- real cluster conditions (issue 52)


def test_only_a_lost_node_counts_as_failed_never_a_drained_one():
    assert all(steps.lost(s) for s in ("down", "down*", "idle*", "fail", "failg", "alloc*", "down~"))
    assert not any(steps.lost(s) for s in ("drain", "drng", "drained", "maint", "reboot", "mix", "alloc", "idle"))
    assert all(steps.unusable(s) for s in ("drain", "drng", "maint"))  # still not given to later jobs (the ledger's side)


def test_a_cancel_that_lands_as_the_step_ends_is_a_cancel_not_a_crash(tmp_path):
    """The handler decides: a TERM after the wait loop's last look (srun already exiting) is still a stop."""
    import signal

    from swiftslurm.node.batch.supervise import Supervisor
    from swiftslurm.plan import write_plan

    plan = plan_of(tmp_path, "max_restarts = 2")
    plan_path = write_plan(plan)
    sup = Supervisor(str(plan_path), 0, ["srun", "true"], {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-2]"})
    assert sup._not_to_restart(137, 0.0, 0) is None  # a rank killed, nothing asked: restart it
    sup._on_signal(signal.SIGUSR2, None)
    assert sup._not_to_restart(137, 0.0, 0) is None  # the walltime signal: requeues.json decides, not the handler
    sup._on_signal(signal.SIGTERM, None)
    assert sup._not_to_restart(143, 0.0, 0) == "cancelled or signalled: the step was asked to stop"


def test_the_next_chain_link_gets_nothing_the_supervisor_set_for_this_step():
    from swiftslurm.node import chain

    env = chain.submit_env({"PATH": "/bin", "SWIFTSLURM_STEP_NODES": "1", "SWIFTSLURM_RESTART_ATTEMPT": "2",
                            "SWIFTSLURM_HANG_RESTART": "1", "SWIFTSLURM_PROBE_MASTER": "node3", "SWIFTSLURM_LEDGER": "/l"})
    assert env == {"PATH": "/bin", "SWIFTSLURM_LEDGER": "/l"}


def test_a_slurmctld_that_does_not_answer_is_unknown_not_a_crash(tmp_path, monkeypatch):
    """Stand-in sinfo and scontrol that hang past the query time-out: the step-end checks answer 'unknown'."""
    for tool in ("sinfo", "scontrol"):
        (tmp_path / tool).write_text("#!/bin/sh\nsleep 30\n")
        (tmp_path / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr(steps, "QUERY_TIMEOUT_S", 0.5)
    assert steps.node_states(("node1", "node2")) == {}
    assert steps.job_nodes("5") is None


STANDIN_SRUN = """#!/bin/bash
# a stand-in srun for the restart probe: one step on the node --nodelist names, answering as the probe does
node=""
for arg in "$@"; do case "$arg" in --nodelist=*) node="${arg#--nodelist=}";; esac; done
mark="$STANDIN_DIR/running.$$"; touch "$mark"
ls "$STANDIN_DIR" | grep -c '^running\\.' >> "$STANDIN_DIR/concurrency"
echo "$node" >> "$STANDIN_DIR/probed"
sleep 0.3
case " $STANDIN_FAIL " in *" $node "*) ok=false;; *) ok=true;; esac
echo "{\\"node\\": \\"$node\\", \\"ok\\": $ok, \\"observed\\": \\"stand-in\\"}"
rm -f "$mark"
"""


@pytest.fixture
def standin_srun(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "srun").write_text(STANDIN_SRUN)
    (bindir / "srun").chmod(0o755)
    return {"PATH": f"{bindir}:{__import__('os').environ['PATH']}", "STANDIN_DIR": str(tmp_path)}


def test_the_probe_runs_a_bounded_number_of_steps_at_once(tmp_path, monkeypatch, standin_srun):
    monkeypatch.setattr(steps, "PROBE_CONCURRENCY", 3)
    nodes = tuple(f"node{i}" for i in range(1, 9))
    done = steps.probe(nodes, ["true"], {**__import__("os").environ, **standin_srun, "STANDIN_FAIL": ""}, timeout_s=60)
    assert sorted(done) == sorted(nodes) and all(p.returncode == 0 for p in done.values())
    assert max(int(x) for x in (tmp_path / "concurrency").read_text().split()) <= 3


def _supervisor(tmp_path, standin_srun, fail: str):
    from swiftslurm.node.batch.supervise import Supervisor
    from swiftslurm.plan import write_plan

    plan_path = write_plan(plan_of(tmp_path, "max_restarts = 2\nspare_nodes = 2"))
    return Supervisor(str(plan_path), 0, ["srun", "true"], {**__import__("os").environ, **standin_srun, "STANDIN_FAIL": fail,
                                                         "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "node[1-4]"})


def test_the_restart_probe_runs_on_the_new_nodes_and_the_master_only(tmp_path, standin_srun):
    from swiftslurm import ledger

    sup = _supervisor(tmp_path, standin_srun, fail="node3")
    cause = restart.Cause("node_failure", "node2 lost", (), ("node2",))
    first = restart.RestartDecision(True, ("node1", "node3"), ("node2",), "restart 1")
    decision = sup._probe(first, cause, 0, ran=("node1", "node2"))
    assert decision.restart and decision.nodes == ("node1", "node4") and "node3" in decision.dropped, decision
    probed = (tmp_path / "probed").read_text().split()
    assert sorted(probed) == ["node1", "node1", "node3", "node4"]  # never node2 (gone), the master each time
    assert [e.node for e in ledger.read()] == ["node3"]


def test_a_probe_that_fails_on_every_node_is_a_probe_error_not_bad_nodes(tmp_path, standin_srun):
    from swiftslurm import ledger

    sup = _supervisor(tmp_path, standin_srun, fail="node1 node3 node4")
    cause = restart.Cause("node_failure", "node2 lost", (), ("node2",))
    decision = sup._probe(restart.RestartDecision(True, ("node1", "node3"), ("node2",), "restart 1"), cause, 0, ran=("node1", "node2"))
    assert not decision.restart and "a probe error, no node is blamed" in decision.message
    assert ledger.read() == []
