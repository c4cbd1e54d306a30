"""Jobs found after Slurm forgets them: `submit` appends each Slurm job to this user's index (jobs/index.py), and
`status JOBID` / `doctor JOBID` fall back to it, reading only a dir whose own submission record holds the id; a job
neither sacct nor squeue lists is UNKNOWN there, never COMPLETED. The index is data: a link, a FIFO or a line of
another shape is never followed, blocked on or trusted."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swiftslurm.cli import app
from swiftslurm.jobs import index
from swiftslurm.jobs.record import Submission, update_record

FORGOTTEN = "987654321"  # an id this cluster never handed out: sacct and squeue know nothing of it


def test_the_index_names_the_dirs_of_a_job_newest_first_and_skips_what_is_not_ours(tmp_path):
    path = tmp_path / "jobs.jsonl"
    index.remember(["41", "42_0", "42_1"], "a", str(tmp_path / "a"), path, when=1.0)
    path.open("a").write('not json\n{"job_ids": "42", "output_dir": "/x"}\n{"job_ids": ["42"], "output_dir": "rel"}\n')
    index.remember(["42"], "b", str(tmp_path / "b"), path, when=2.0)
    assert index.output_dirs_of("42", path) == [str(tmp_path / "b"), str(tmp_path / "a")]
    assert index.output_dirs_of("42_1", path) == [str(tmp_path / "b"), str(tmp_path / "a")]
    assert index.output_dirs_of("41", path) == [str(tmp_path / "a")]
    assert index.output_dirs_of("4", path) == [] and index.output_dirs_of("1", tmp_path / "none") == []


def test_the_index_is_never_written_through_a_link_nor_blocked_on(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        index.remember(["1"], "a", "/d", tmp_path / "link")
    assert target.read_text() == ""
    os.mkfifo(tmp_path / "fifo")
    t0 = time.monotonic()
    assert index.output_dirs_of("1", tmp_path / "fifo") == []
    with pytest.raises(OSError):
        index.remember(["1"], "a", "/d", tmp_path / "fifo")
    assert time.monotonic() - t0 < 5


def test_a_long_index_keeps_its_newest_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "KEEP_BYTES", 4000)
    path = tmp_path / "jobs.jsonl"
    for i in range(200):
        index.remember([str(i)], "n", f"/runs/{i}", path)
    assert path.stat().st_size <= 4000 + 200
    assert index.output_dirs_of("199", path) == ["/runs/199"] and index.output_dirs_of("0", path) == []
    assert all(json.loads(line)["job_ids"] for line in path.read_text().splitlines())


def _recorded_run(tmp_path: Path, job_id: str) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    update_record(Submission("slurm", [job_id], str(out), [str(out)], str(out / "logs" / "submitit"),
                             submitted_at=time.time() - 3600, job_name="forgotten"))
    return out


@pytest.mark.slurm
def test_status_and_doctor_find_a_job_slurm_forgot_through_the_index(tmp_path, slurm_cluster):
    out = _recorded_run(tmp_path, FORGOTTEN)
    runner = CliRunner()
    before = runner.invoke(app, ["doctor", FORGOTTEN])
    assert before.exit_code != 0 and "cannot find where job" in before.output  # not indexed: nowhere to look
    index.remember([FORGOTTEN], "forgotten", str(out))
    status = runner.invoke(app, ["status", FORGOTTEN, "--json"])
    assert status.exit_code == 0, status.output
    shown = json.loads(status.output)
    assert shown["output_dir"] == str(out) and [t["state"] for t in shown["tasks"]] == ["UNKNOWN"]
    doctor = runner.invoke(app, ["doctor", FORGOTTEN])
    assert doctor.exit_code == 0 and "in 1 task(s) (UNKNOWN)" in doctor.output, doctor.output  # read, and not COMPLETED


@pytest.mark.slurm
def test_the_index_alone_proves_nothing_the_dirs_record_must_hold_the_id(tmp_path, slurm_cluster):
    out = _recorded_run(tmp_path, "123456789")  # another job's dir: the index line was planted or is stale
    index.remember([FORGOTTEN], "forgotten", str(out))
    result = CliRunner().invoke(app, ["doctor", FORGOTTEN])
    assert result.exit_code != 0 and "cannot find where job" in result.output
