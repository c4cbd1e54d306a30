"""The progress guard: a walltime attempt that commits no checkpoint newer than the one it started from counts as no
progress, and after `slurm.no_progress_attempts` of them in a row (default 2) the job stops for good (exit 79, the
reason recorded) instead of requeueing until max_requeues; a run that progresses between attempts is never stopped.
The runtime's own decision (node/requeue.py) on real task dirs, before any Slurm call (job ids no cluster hands out:
a requeue is refused by Slurm, a stop needs no call)."""

from __future__ import annotations

import logging

import pytest

from swiftslurm.node.requeue import NO_PROGRESS_EXIT, NOT_REQUEUED_EXIT, after_walltime_stop
from swiftslurm.records.requeues import NO_PROGRESS, made_progress, no_progress_streak, read_requeues, stop_reason
from swiftslurm.slurm.distenv import derive
from swiftslurm.spec import parse_spec

LOG = logging.getLogger("test")


def _dist(job: str, restart_count: int = 0):
    return derive({"SLURM_JOB_ID": job, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node1",
                   "SLURMD_NODENAME": "node1", "SLURM_TASKS_PER_NODE": "1", "SLURM_RESTART_COUNT": str(restart_count)})


def _spec(extra: str = "", train: str = 'model = "tiny-llama"\ndataset = ["d.jsonl"]\n'):
    return parse_spec(f'[job]\nname = "g"\n[slurm]\nmax_requeues = 20\n{extra}[train]\n{train}')


def _committed(out, step: int) -> None:
    (out / f"checkpoint-{step}").mkdir()


@pytest.mark.parametrize("record,progress", [
    ({"start_step": 10, "committed_step": 20}, True), ({"start_step": None, "committed_step": 5}, True),
    ({"start_step": 10, "committed_step": 10}, False), ({"start_step": None, "committed_step": None}, False),
    ({"global_step": 3}, None), ({"committed_step": "x"}, None), ({"committed_step": True}, None)])
def test_an_attempt_made_progress_when_it_committed_past_its_start(record, progress):
    assert made_progress(record) is progress


def test_the_streak_counts_only_the_last_attempts_in_a_row():
    none, some, old = {"start_step": 4, "committed_step": 4}, {"start_step": 4, "committed_step": 8}, {"global_step": 1}
    assert no_progress_streak([none, none, some, none]) == 1
    assert no_progress_streak([some, none, none]) == 2
    assert no_progress_streak([none, old, none]) == 1  # a record from before the guard says nothing: the streak ends there
    assert no_progress_streak([]) == 0


def test_two_attempts_that_commit_nothing_newer_stop_the_job_for_good(tmp_path):
    _committed(tmp_path, 40)
    first = after_walltime_stop(_dist("99000007", 0), _spec(), str(tmp_path), LOG, step=40, start_step=40)
    assert first == NOT_REQUEUED_EXIT  # no such Slurm job: the requeue itself is refused, but it was tried
    assert read_requeues(str(tmp_path))[-1]["outcome"] != NO_PROGRESS
    second = after_walltime_stop(_dist("99000007", 1), _spec(), str(tmp_path), LOG, step=40, start_step=40)
    record = read_requeues(str(tmp_path))[-1]
    assert second == NO_PROGRESS_EXIT and record["outcome"] == NO_PROGRESS and not record["requeued"]
    assert "no progress in 2 attempt(s) in a row (newest committed step 40)" in record["message"]
    assert stop_reason(read_requeues(str(tmp_path)), "99000007") == record["message"]  # what `status` shows


def test_a_run_that_progresses_between_attempts_is_never_stopped_by_the_guard(tmp_path):
    for attempt in range(5):
        _committed(tmp_path, 10 * (attempt + 1))  # each attempt's walltime save committed a newer step
        after_walltime_stop(_dist("99000008", attempt), _spec(), str(tmp_path), LOG, step=10 * (attempt + 1), start_step=10 * attempt or None)
        assert read_requeues(str(tmp_path))[-1]["outcome"] != NO_PROGRESS


def test_the_guard_counts_the_chains_links_and_can_be_turned_off(tmp_path):
    from swiftslurm.records import chains

    chains.write_chains(str(tmp_path), [["990000010", "990000014"]], "g")
    singleton = 'continue_with = "singleton"\n'
    after_walltime_stop(_dist("990000010"), _spec(singleton), str(tmp_path), LOG, step=None, start_step=None)
    code = after_walltime_stop(_dist("990000014"), _spec(singleton), str(tmp_path), LOG, step=None, start_step=None)
    assert code == NO_PROGRESS_EXIT and "no checkpoint committed yet" in read_requeues(str(tmp_path))[-1]["message"]
    off = tmp_path / "off"
    off.mkdir()
    for restart in range(3):
        code = after_walltime_stop(_dist("99000009", restart), _spec("no_progress_attempts = 0\n"), str(off), LOG, step=None, start_step=None)
        assert read_requeues(str(off))[-1]["outcome"] != NO_PROGRESS


def test_a_train_command_is_not_judged_by_our_checkpoints(tmp_path):
    """A user's script saves its own way: no committed checkpoint of ours is no evidence of a loop."""
    command = 'command = ["python", "train.py"]\n'
    for restart in range(3):
        after_walltime_stop(_dist("990000011", restart), _spec(train=command), str(tmp_path), LOG, step=None, start_step=None)
        assert read_requeues(str(tmp_path))[-1]["outcome"] != NO_PROGRESS


def test_the_supervisor_counts_attempts_without_progress_in_a_row():
    from swiftslurm.node import restart

    hang = restart.Cause(restart.HANG, "no training step for 5 s", (), ())
    old = {"resume_step": 8}  # a record from before the guard: says nothing
    stuck = {"start_step": 8, "resume_step": 8}
    assert restart.no_progress_streak([], None, None) == 1
    assert restart.no_progress_streak([stuck], 8, 8) == 2 and restart.no_progress_streak([old, stuck], 8, 8) == 2
    assert restart.no_progress_streak([stuck, stuck], 8, 16) == 0  # this attempt saved step 16: progress
    assert restart.progress_guard(1, 2, hang, 8) is None and restart.progress_guard(5, 0, hang, 8) is None
    stop = restart.progress_guard(2, 2, hang, 8)
    assert stop is not None and not stop.restart and "no progress in 2 attempt(s) in a row (newest committed step 8)" in stop.message
    assert "no training step for 5 s" in stop.message
