"""Pure parsers of sbatch/sacct/squeue output, on output captured from the real test cluster
(tests/data/slurm/, slurm-wlm 22.05.8; sacct -X -D -P -n --format=JobID,State,ExitCode,NodeList,Elapsed,Start,End,JobName;
squeue -h -r -o '%i|%T|%N|%M|%r|%j'; the array is named 'arr|odd name')."""

import os
from pathlib import Path

import pytest

from swiftslurm import slurm
from swiftslurm.errors import SubmissionError, SwiftSlurmError
from swiftslurm.plan import ArrayLimits

DATA = Path(__file__).parent / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_sbatch_parsable():
    assert slurm.parse_sbatch_parsable(read("sbatch_parsable.txt")) == "141"
    assert slurm.parse_sbatch_parsable("123;cluster2\n") == "123"
    with pytest.raises(SwiftSlurmError, match="job id"):
        slurm.parse_sbatch_parsable("Submitted batch job 12")


def test_sacct_pending_array_range_is_expanded():
    recs = slurm.parse_sacct(read("sacct_array_pending.txt"))
    assert sorted(recs) == [f"141_{i}" for i in range(6)]
    assert recs["141_0"].state == "RUNNING" and recs["141_0"].nodes == "node1"
    assert recs["141_4"].state == "PENDING" and recs["141_4"].nodes == ""
    assert {r.name for r in recs.values()} == {"arr|odd name"}  # '|' in a name stays in the name


def test_sacct_requeue_counts_and_latest_run_wins():
    recs = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert recs["141_0"].state == "COMPLETED" and recs["141_0"].restarts == 1 and recs["141_0"].elapsed == "00:00:09"
    assert recs["141_1"].restarts == 0
    assert recs["145"].state == "FAILED" and recs["145"].exit_code == "3:0" and recs["145"].name == "fail3"
    assert recs["146"].state == "CANCELLED" and recs["146"].nodes == "node[2-3]"
    assert all(slurm.is_final(r.state) for r in recs.values())


def test_squeue_live_records():
    recs = slurm.parse_squeue(read("squeue_array.txt"))
    assert recs["141_0"].state == "RUNNING" and recs["141_0"].nodes == "node1" and recs["141_0"].elapsed == "0:03"
    assert recs["141_5"].state == "PENDING" and not slurm.is_final(recs["141_5"].state)
    assert recs["141_5"].name == "arr|odd name"


def test_merge_prefers_squeue_for_live_and_sacct_for_finished():
    acc = slurm.parse_sacct(read("sacct_array_pending.txt"))
    live = {"141_0": slurm.JobRecord("141_0", "COMPLETING", "", "node1", "0:08")}
    merged = slurm.merge_records(acc, live)
    assert merged["141_0"].state == "COMPLETING" and merged["141_2"].state == "PENDING"
    done = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert slurm.merge_records(done, {"145": slurm.JobRecord("145", "RUNNING")})["145"].state == "FAILED"


@pytest.mark.parametrize("raw,state", [("CANCELLED by 0", "CANCELLED"), ("CANCELLED+", "CANCELLED"), ("", "UNKNOWN"), ("REQUEUED", "REQUEUED")])
def test_normalize_state(raw, state):
    assert slurm.normalize_state(raw) == state


def test_expand_job_ids():
    assert slurm.expand_job_ids("7") == ["7"]
    assert slurm.expand_job_ids("7_3") == ["7_3"]
    assert slurm.expand_job_ids("7_[1-3,9%2]") == ["7_1", "7_2", "7_3", "7_9"]


def test_refusal_keeps_slurms_reason():
    err = slurm.refusal(read("sbatch_refused_partition.txt"))
    assert isinstance(err, SubmissionError) and err.exit_code == 3
    assert err.found.startswith("invalid partition specified: nope")


def test_a_reused_job_id_is_not_our_job(tmp_path):
    """After a cluster reset job ids restart at 1: a record under our id with another name is not ours."""
    from swiftslurm.jobs.send import Submission

    sub = Submission("slurm", ["145"], str(tmp_path), [str(tmp_path)], "", job_name="mine", submitted_at=0.0)
    recs = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert sub._rows_from(recs)[0].state == "UNKNOWN"
    sub.job_name = "fail3"
    assert sub._rows_from(recs)[0].state == "FAILED"


def test_a_task_of_another_array_under_the_same_raw_id_is_not_the_job():
    """`sacct -j 4947` lists array task 4928_0 whose raw id was 4947 (captured): it is not job 4947, nor a task of it."""
    recs = slurm.parse_sacct(read("sacct_reused_raw_id.txt"))
    assert sorted(recs) == ["4928_0", "4947"]
    assert list(slurm.records_of(recs, ["4947"])) == ["4947"] and slurm.records_of(recs, ["4947"])["4947"].state == "CANCELLED"
    assert list(slurm.records_of(recs, ["4928"])) == ["4928_0"]
    assert slurm.records_of(recs, ["4928_1"]) == {}
    pairs = (("4947", "4947"), ("4947_3", "4947"), ("4947_3", "4947_3"), ("4947_3", "4947_4"), ("4928_0", "4947"), ("49470", "4947"),
             ("4947", "4947_3"))
    assert [slurm.is_of(j, asked) for j, asked in pairs] == [True, True, True, False, False, False, False]
    # scontrol shows an array task's raw id as JobId: the id to compare is ArrayJobId_ArrayTaskId
    task, single = slurm.parse_scontrol_job("JobId=4947 ArrayJobId=4928 ArrayTaskId=0 JobName=site\nJobId=4951 JobName=x\n")
    assert (slurm.shown_id(task), slurm.shown_id(single)) == ("4928_0", "4951")


FAKE_DOOR = {
    # the captured sacct rows of the reused id (WorkDir asked alone: each row's JobID first), scontrol's record of the
    # array task that held it while slurmctld still remembered it, and an empty queue
    "sacct": """#!/bin/bash
case "$*" in
  *WorkDir*) printf '4928_0|/home/someone/else\\n4947|/runs/mine\\n' ;;
  *) cat "{data}/sacct_reused_raw_id.txt" ;;
esac
""",
    "scontrol": """#!/bin/bash
echo "JobId=4947 ArrayJobId=4928 ArrayTaskId=0 JobName=site WorkDir=/home/someone/else StdErr=/home/someone/else/4928_0.err"
""",
    "squeue": "#!/bin/bash\nexit 0\n",
}


def test_the_door_answers_for_the_asked_job_only(tmp_path, monkeypatch):
    """job_records, status by job id and the paths `cancel DIR` proves ownership with: the other array's task under the
    same raw id is none of them (Slurm's accounting is faked: an id reuse cannot be made to order on the test cluster)."""
    from swiftslurm.jobs.target import bare_job

    for name, text in FAKE_DOOR.items():
        (tmp_path / name).write_text(text.format(data=DATA))
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert list(slurm.job_records(["4947"])) == ["4947"]
    assert bare_job("4947").job_ids == ["4947"]
    assert slurm.job_paths("4947") == ["/runs/mine"]  # scontrol's record is 4928_0's: sacct's row of 4947 answers
    assert slurm.job_paths("4928_0") == ["/home/someone/else/4928_0.err", "/home/someone/else"]



def test_submit_line_paths_are_the_absolute_words_and_option_values():
    # captured from the test cluster's sacct (22.05): a submitit job, and a hand-sent rendered script
    submitit = "sbatch /runs/a/logs/submitit/20261204-060115-813577/.submission_file_826a.sh"
    rendered = "sbatch --parsable --time=00:01:00 -J x --output=/runs/b/requeue.out /runs/b/requeue.sh"
    assert slurm.submit_line_paths(submitit) == ["/runs/a/logs/submitit/20261204-060115-813577/.submission_file_826a.sh"]
    assert slurm.submit_line_paths(rendered) == ["/runs/b/requeue.out", "/runs/b/requeue.sh"]
    assert slurm.submit_line_paths("sbatch job.sh --wrap=x|y") == []


FORGOTTEN = {
    # slurmctld has forgotten the job (MinJobAge after its end); accounting has its WorkDir (where submit ran, not the
    # output dir) and its SubmitLine (submitit's script, inside the output dir), as the test cluster's sacct prints them
    "scontrol": "#!/bin/bash\necho 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n",
    "sacct": "#!/bin/bash\ncase \"$*\" in\n  *SubmitLine*) echo '5012|{cwd}|sbatch {run}/logs/submitit/20261204-0601/.submission_file_826a.sh' ;;\nesac\n",
    "squeue": "#!/bin/bash\nexit 0\n",
}


def test_a_job_slurmctld_forgot_is_found_through_its_submit_line(tmp_path, monkeypatch):
    """`status JOBID` / `doctor JOBID` after MinJobAge: sacct's WorkDir is the submit dir, so the output dir is found
    from the submitit script in the SubmitLine (Slurm's forgetting cannot be made to order on the test cluster)."""
    from swiftslurm.jobs.record import Submission, _write_records
    from swiftslurm.jobs.target import resolve

    run, bin_dir = tmp_path / "run", tmp_path / "bin"
    run.mkdir()
    bin_dir.mkdir()
    _write_records(str(run), [Submission("slurm", ["5012"], str(run), [str(run)], str(run / "logs" / "submitit")).to_json()])
    for name, text in FORGOTTEN.items():
        (bin_dir / name).write_text(text.format(cwd=tmp_path, run=run))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    sub, tasks = resolve("5012")
    assert sub is not None and sub.output_dir == str(run) and [t.task_dir for t in tasks] == [str(run)]
    with pytest.raises(SwiftSlurmError, match="cannot find where job 5013 wrote"):
        resolve("5013")  # sacct has no row of it

# ---------------------------------------------------------------- 22.05 (captured), 23.11 and 24.11 (reconstructed):
# tests/data/slurm/README.md says where each file comes from.


def test_sbatch_parsable_with_cluster_and_warning_lines():
    assert slurm.parse_sbatch_parsable(read("23.11/sbatch_parsable_cluster.txt")) == "4242"
    assert slurm.parse_sbatch_parsable(read("24.11/sbatch_parsable_warning.txt")) == "90210"
    assert slurm.parse_sbatch_parsable("  77  \r\n") == "77"
    for bad in ("", "\n", "Submitted batch job 12\n", "12a\n", "\u0661\u0662\n", "12;\n"):
        with pytest.raises(SwiftSlurmError, match="job id"):
            slurm.parse_sbatch_parsable(bad)


def test_sacct_states_of_23_11():
    recs = slurm.parse_sacct(read("23.11/sacct_states.txt"))
    states = {jid: r.state for jid, r in recs.items()}
    assert states["7001"] == "COMPLETED" and recs["7001"].elapsed == "1-02:03:04" and recs["7001"].nodes == "gpu[001-002]"
    assert states["7002"] == "CANCELLED"  # "CANCELLED by 1000"
    assert [states[f"700{i}"] for i in range(3, 9)] == ["OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "DEADLINE", "BOOT_FAIL", "TIMEOUT"]
    assert all(slurm.is_final(states[f"700{i}"]) for i in range(1, 9))
    assert recs["7006"].nodes == ""  # "None assigned"
    assert sorted(j for j in recs if j.startswith("7009_")) == ["7009_0", "7009_4", "7009_5", "7009_6", "7009_7"]
    assert states["7009_0"] == "RUNNING" and recs["7009_0"].restarts == 1
    assert states["7010+0"] == "RUNNING" and recs["7010+1"].nodes == "cpu001"  # heterogeneous job components


def test_sacct_without_x_and_with_p_skips_steps_and_the_trailing_separator():
    recs = slurm.parse_sacct(read("24.11/sacct_steps_p.txt"))
    assert sorted(recs) == ["8100", "8101_0", "8101_1", "8101_3", "8101_5", "8101_6"]
    assert recs["8100"].name == "with steps" and recs["8100"].state == "COMPLETED"
    assert recs["8101_0"].state == "CANCELLED" and recs["8101_0"].restarts == 0


def test_squeue_states_of_24_11():
    recs = slurm.parse_squeue(read("24.11/squeue_states.txt"))
    assert recs["9100_0"].elapsed == "1-00:00:05" and recs["9100_0"].name == "qwen|lora"
    assert sorted(j for j in recs if j.startswith("9100_")) == [f"9100_{i}" for i in range(6)]
    for jid in ("9100_1", "9101", "9102", "9103", "9104", "9105", "9106", "9107+0"):
        assert recs[jid].state in slurm.ACTIVE_STATES and not slurm.is_final(recs[jid].state), jid


def test_squeue_with_and_without_r_captured_on_22_05():
    with_r = slurm.parse_squeue(read("22.05/squeue_held.txt"))
    without_r = slurm.parse_squeue(read("22.05/squeue_held_no_r.txt"))
    assert sorted(with_r) == ["32_0", "32_1", "32_2", "32_3", "33"]
    assert sorted(without_r) == ["32_0", "32_1", "32_2", "32_3"]
    assert {r.state for r in without_r.values()} == {"PENDING"}
    recs = slurm.parse_sacct(read("22.05/sacct_cancelled_held.txt"))
    assert sorted(recs) == ["32_0", "32_1", "32_2", "32_3", "33"] and {r.state for r in recs.values()} == {"CANCELLED"}


def test_a_task_slurm_holds_is_told_from_one_that_waits_for_resources():
    recs = slurm.parse_squeue(read("22.05/squeue_launch_failed_held.txt"))
    assert recs["2295_1"].reason == "launch failed requeued held"
    assert slurm.held_reason(recs["2295_1"]) == "launch failed requeued held: its start failed on the node and Slurm held it"
    assert slurm.held_reason(recs["2507"]).startswith("job requeued in held state: ")
    assert slurm.held_reason(recs["2508"]) is None  # PartitionConfig: it will never start either, but no release helps
    assert slurm.never_starts(recs["2508"]).startswith("PartitionConfig: it asks for more than its partition offers")
    assert slurm.never_starts(recs["2295_1"]) is None
    # reasons that other jobs' usage or the nodes' return lift are a wait, not a dead end
    for reason in ("Resources", "Priority", "ReqNodeNotAvail, UnavailableNodes:node3", "AssocGrpGRES", "QOSGrpCpuLimit"):
        assert slurm.never_starts(slurm.JobRecord("1", "PENDING", reason=reason)) is None
    assert slurm.never_starts(slurm.JobRecord("1", "RUNNING", reason="PartitionConfig")) is None
    held_user = slurm.parse_squeue(read("22.05/squeue_held.txt"))["33"]
    assert slurm.held_reason(held_user).startswith("JobHeldUser: ")
    # the reason of a job that already runs (a stale word) holds nothing; sacct's records carry no reason
    assert slurm.held_reason(slurm.JobRecord("1", "RUNNING", reason="JobHeldUser")) is None
    assert slurm.held_reason(slurm.JobRecord("1", "REQUEUE_HOLD")) is not None
    # squeue's live reason survives the merge with sacct's record of the same job
    acc = slurm.parse_sacct("2295_1|PENDING|0:0|None assigned|00:00:00|Unknown|Unknown|sgrp\n")
    assert slurm.merge_records(acc, recs)["2295_1"].reason == "launch failed requeued held"


@pytest.mark.parametrize("name", ["22.05/scontrol_show_job_o.txt", "22.05/scontrol_show_job.txt"])
def test_scontrol_show_job_captured(name):
    (job,) = slurm.parse_scontrol_job(read(name))
    assert job["JobId"] == "32" and job["ArrayTaskId"] == "1" and job["JobState"] == "PENDING"
    assert job["TRES"] == "cpu=1,mem=4000M,node=1,billing=1"
    # the comment says "ExcNodeList=nodeX" after the real field: the first occurrence wins
    assert job["ExcNodeList"] == "node4" and slurm.parse_exc_node_list(read(name)) == "node4"


def test_scontrol_show_job_of_24_11():
    (job,) = slurm.parse_scontrol_job(read("24.11/scontrol_show_job_o.txt"))
    assert job["Command"] == "/home/alice/runs/my run/job.sh" and job["WorkDir"] == "/home/alice/runs/my run"
    assert job["CPUs/Task"] == "8" and job["NtasksPerN:B:S:C"] == "8:0:*:*" and job["TresPerNode"] == "gres/gpu:8"
    assert job["NodeList"] == "" and job["JobName"] == "qwen|lora"
    assert slurm.parse_exc_node_list(read("24.11/scontrol_show_job_o.txt")) == "gpu[003-004],gpu010"
    two = slurm.parse_scontrol_job(read("24.11/scontrol_show_job_o.txt") * 2)
    assert len(two) == 2
    assert slurm.parse_exc_node_list("JobId=1 ExcNodeList=(null) NodeList=n1") == ""


def test_scontrol_show_config_of_22_05_and_24_11():
    old = slurm.parse_scontrol_config(read("22.05/scontrol_show_config.txt"))
    assert old["SLURM_VERSION"] == "22.05.8" and old["TaskPlugin"] == "task/none" and old["MinJobAge"] == "10 sec"
    new = slurm.parse_scontrol_config(read("24.11/scontrol_show_config.txt"))
    assert new["TaskPlugin"] == "task/affinity,task/cgroup" and new["ConstrainCores"] == "yes"
    assert new["SchedulerParameters"] == "bf_continue,bf_max_job_test=500,default_queue_depth=500"
    assert not any(" " in k for k in new)
    # the array caps read through the same parser (one parser of `scontrol show config`)
    assert slurm.parse_array_limits(read("22.05/scontrol_show_config.txt")) == ArrayLimits(1001, None)
    assert slurm.parse_array_limits(read("24.11/scontrol_show_config.txt")) == ArrayLimits(1001, None)


def test_expand_job_ids_edge_cases():
    assert slurm.expand_job_ids("7_[1,3,5-6]") == ["7_1", "7_3", "7_5", "7_6"]
    assert slurm.expand_job_ids("7+0") == ["7+0"]
    assert slurm.expand_job_ids("7_[1-999999999999]") == ["7_[1-999999999999]"]  # not expanded into memory
    assert slurm.expand_job_ids("7_[x-3]") == ["7_[x-3]"]


def test_an_array_cancelled_before_any_task_started_is_cancelled_for_each_task(tmp_path):
    """Captured: arrays cancelled while pending are one sacct row under the bare id (``1259``, no task range); each
    task takes that row, where it had none and was shown PENDING until the unseen grace ran out."""
    from swiftslurm.jobs.send import Submission

    recs = slurm.parse_sacct(read("sacct_array_cancelled_pending.txt"))
    assert sorted(recs) == ["1259", "1260", "1261"]
    tasks = ["1259_0", "1259_1", "1260_0", "1260_1", "1261_0"]
    sub = Submission("slurm", tasks, str(tmp_path), [str(tmp_path / str(i)) for i in range(5)], "", job_name="site")
    assert [r.state for r in sub._rows_from(recs)] == ["CANCELLED"] * 5
    assert slurm.task_record(recs, "1262_0") is None and slurm.task_record(recs, "1259").state == "CANCELLED"
