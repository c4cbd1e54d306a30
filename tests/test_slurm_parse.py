"""Pure parsers of sbatch/sacct/squeue output, on output captured from the real test cluster
(tests/data/slurm/, slurm-wlm 22.05.8; sacct -X -D -P -n --format=JobID,State,ExitCode,NodeList,Elapsed,Start,End;
squeue -h -r -o '%i|%T|%N|%M|%r')."""

from pathlib import Path

import pytest

from swiftslurm import slurm
from swiftslurm.errors import SubmissionError, SwiftSlurmError

DATA = Path(__file__).parent / "data" / "slurm"


def read(name: str) -> str:
    return (DATA / name).read_text()


def test_sbatch_parsable():
    assert slurm.parse_sbatch_parsable(read("sbatch_parsable.txt")) == "37"
    assert slurm.parse_sbatch_parsable("123;cluster2\n") == "123"
    with pytest.raises(SwiftSlurmError, match="job id"):
        slurm.parse_sbatch_parsable("Submitted batch job 12")


def test_sacct_pending_array_range_is_expanded():
    recs = slurm.parse_sacct(read("sacct_array_pending.txt"))
    assert sorted(recs) == [f"56_{i}" for i in range(6)]
    assert recs["56_0"].state == "RUNNING" and recs["56_0"].nodes == "node2"
    assert recs["56_4"].state == "PENDING" and recs["56_4"].nodes == ""


def test_sacct_requeue_counts_and_latest_run_wins():
    recs = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert recs["37_0"].state == "COMPLETED" and recs["37_0"].restarts == 1 and recs["37_0"].nodes == "node2"
    assert recs["37_1"].restarts == 0
    assert recs["41"].state == "FAILED" and recs["41"].exit_code == "3:0"
    assert recs["42"].state == "CANCELLED" and recs["42"].nodes == "node[2-3]"
    assert all(slurm.is_final(r.state) for r in recs.values())


def test_squeue_live_records():
    recs = slurm.parse_squeue(read("squeue_array.txt"))
    assert recs["37_0"].state == "RUNNING" and recs["37_0"].nodes == "node1" and recs["37_0"].elapsed == "0:02"
    assert recs["37_5"].state == "PENDING" and not slurm.is_final(recs["37_5"].state)


def test_merge_prefers_squeue_for_live_and_sacct_for_finished():
    acc = slurm.parse_sacct(read("sacct_array_pending.txt"))
    live = {"56_0": slurm.JobRecord("56_0", "COMPLETING", "", "node2", "0:06")}
    merged = slurm.merge_records(acc, live)
    assert merged["56_0"].state == "COMPLETING" and merged["56_2"].state == "PENDING"
    done = slurm.parse_sacct(read("sacct_mixed_done.txt"))
    assert slurm.merge_records(done, {"41": slurm.JobRecord("41", "RUNNING")})["41"].state == "FAILED"


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
