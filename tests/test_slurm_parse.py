"""Pure parsers of sbatch/sacct/squeue output, on output captured from the real test cluster
(tests/data/slurm/, slurm-wlm 22.05.8; sacct -X -D -P -n --format=JobID,State,ExitCode,NodeList,Elapsed,Start,End,JobName;
squeue -h -r -o '%i|%T|%N|%M|%r|%j'; the array is named 'arr|odd name')."""

from pathlib import Path

import pytest

from swiftslurm import slurm
from swiftslurm.errors import SubmissionError, SwiftSlurmError

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
    from swiftslurm.submit import Submission

    sub = Submission("slurm", ["145"], str(tmp_path), [str(tmp_path)], "", job_name="mine", submitted_at=0.0)
    recs = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert sub._rows_from(recs)[0].state == "UNKNOWN"
    sub.job_name = "fail3"
    assert sub._rows_from(recs)[0].state == "FAILED"
