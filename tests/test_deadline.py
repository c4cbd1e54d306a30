"""Deadline-aware saving: the pure decision, the end-time parser, the watch with a fake clock, and a real job on
the Slurm cluster whose slow save would not fit the grace period.

Cluster job: 2 minutes, ``signal_grace_s = 10``, a save every 10 steps, every commit slowed by 3 x 10 s (the
save-delay hook), so a save takes ~30 s; steps take ~0.1 s. Slurm's USR2 comes 10-40 s before the end
(slurmctld checks time limits every ~30 s); a save made on it would not fit. The first save (nothing known yet)
ends ~50 s before the end; at the next save point the watch sees that after that save one more step and a save
(+25%) + 5 s would not fit, decides before the signal came, and stops after that save. The job must requeue,
and the stopping save must end before the job's end time (``deadline_margin_s >= 0``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runs import ONE_RANK_A_NODE, tiny_spec

from swiftslurm.slurm.commands import parse_end_time
from swiftslurm.train.health import deadline

ROOT = Path(__file__).resolve().parents[1]


def test_decide_saves_when_one_more_step_and_a_save_would_not_fit():
    end = 1000.0
    # 100 s left; step 2 s, save 40 s (x1.25 = 50), reserve 5: 43 s to spare -> keep training
    keep = deadline.decide(900.0, end, 2.0, 40.0)
    assert not keep.stop and keep.margin_s == pytest.approx(43.0)
    # 56 s left: 2 + 50 + 5 = 57 > 56 -> save now
    now = deadline.decide(944.0, end, 2.0, 40.0)
    assert now.stop and now.margin_s == pytest.approx(-1.0) and "would not fit" in now.reason
    assert deadline.decide(944.0, end, 2.0, 40.0, reserve_s=0.0).stop is False  # the reserve counts
    # a save point: after its own save (50 s) one more step and a save must fit too -> this save is the last
    last = deadline.decide(900.0, end, 2.0, 40.0, saving=True)
    assert last.stop and last.margin_s == pytest.approx(-7.0) and "after this save" in last.reason
    assert not deadline.decide(880.0, end, 2.0, 40.0, saving=True).stop  # 120 s left: 13 s to spare
    # past the end already (a requeue that started late): save at once
    assert deadline.decide(1010.0, end, 2.0, 40.0).stop
    # nothing known: never a deadline save (the signal still works)
    for args in ((900.0, None, 2.0, 40.0), (900.0, end, None, 40.0), (900.0, end, 2.0, None)):
        verdict = deadline.decide(*args)
        assert not verdict.stop and verdict.margin_s is None and verdict.reason


def test_watch_uses_the_slowest_recent_step_fires_once_and_reports_the_margin():
    clock = {"t": 0.0}
    steps = iter([1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    watch = deadline.DeadlineWatch(100.0, lambda: next(steps), save_s=None, clock=lambda: clock["t"])
    assert not watch.due()  # no save measured yet
    watch.saved(60.0)  # 60 x 1.25 + 5 = 80 s
    clock["t"] = 12.0  # 88 s left: 9 (slowest of the last 5 steps) + 80 = 89 > 88
    assert watch.due() and watch.fired
    assert not watch.due()  # once: the stop is already under way
    assert watch.margin_s() == 88.0
    assert deadline.DeadlineWatch(None, lambda: 1.0, 5.0).due() is False
    assert deadline.DeadlineWatch(None, lambda: 1.0, 5.0).margin_s() is None


def test_the_trackers_close_within_the_deadlines_reserve_at_a_walltime_stop(tmp_path):
    """W&B or MLflow flushing online at a walltime stop: every tracker is closed at once, within PAUSE_CLOSE_S in all,
    and the deadline keeps that much more before the end (before: 30 s per tracker, after a 5 s reserve)."""
    from swiftslurm.slurm.distenv import derive
    from swiftslurm.spec import parse_spec
    from swiftslurm.train.tracking import session
    from swiftslurm.train.tracking.identity import PAUSE_CLOSE_S

    class SlowSink:  # an online tracker whose close hangs on the network
        def __init__(self, name: str) -> None:
            self.name, self.closed = name, []

        def close(self, how: str) -> None:
            self.closed.append(how)
            time.sleep(60)

    sinks = [SlowSink("wandb"), SlowSink("mlflow")]
    t0 = time.monotonic()
    session._close(sinks, None, failed=False)  # no finished callback: the run paused (a walltime stop)
    assert time.monotonic() - t0 < PAUSE_CLOSE_S + 2 and all(s.closed == ["paused"] for s in sinks)
    dist = derive({"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "1"})
    text = '[job]\nname = "t"\n[train]\nmodel = "tiny-llama"\ndataset = ["d.jsonl"]\n'
    plain = deadline.watch_for(parse_spec(text), dist, str(tmp_path), lambda: None)
    tracked = deadline.watch_for(parse_spec(text + 'report_to = ["wandb"]\n'), dist, str(tmp_path), lambda: None)
    assert (plain.reserve_s, tracked.reserve_s) == (deadline.RESERVE_S, deadline.RESERVE_S + PAUSE_CLOSE_S)


def test_parse_end_time_reads_squeue_local_time_and_no_end():
    got = parse_end_time("2026-12-01T10:45:03\n")
    assert time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(got)) == "2026-12-01T10:45:03"
    for text in ("N/A\n", "Unknown", "NONE", "", "  \n", "garbage"):
        assert parse_end_time(text) is None, text


def deadline_spec(name: str, out: Path) -> str:
    return tiny_spec(name, out, data=ROOT / "examples" / "data" / "alpaca_demo.jsonl",
                     slurm={**ONE_RANK_A_NODE, "time": "00:02:00", "signal_grace_s": 10, "max_requeues": 3},
                     train={"learning_rate": 1e-3, "max_steps": 100000, "max_length": 128, "save_steps": 10,
                            "logging_steps": 10, "report_to": ["none"]},
                     checkpoint={"keep": 2, "forced_save_fractions": []}, preflight={"checks": []},
                     env={"OMP_NUM_THREADS": "1", "SWIFTSLURM_CKPT_TEST_DELAY_S": "10"})


@pytest.mark.slurm
@pytest.mark.slow
def test_a_slow_save_is_made_before_the_signal_and_the_job_requeues(tmp_path, slurm_cluster):
    name = f"deadline-{tmp_path.name}"[:40]
    out = tmp_path / "run"
    spec = tmp_path / "deadline.toml"
    spec.write_text(deadline_spec(name, out))
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", str(spec), "--executor", "slurm"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"][0]
    requeues: list = []
    try:
        until = time.monotonic() + 300
        while time.monotonic() < until and not any(r.get("requeued") for r in requeues):
            time.sleep(2)
            try:
                requeues = json.loads((out / "requeues.json").read_text())
            except (OSError, ValueError):
                requeues = []
    finally:  # the job would go on requeueing: one requeue is what this test needs
        subprocess.run(["scancel", f"--name={name}", job], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((out / "logs").rglob("*")) if p.is_file())
    assert any(r.get("requeued") for r in requeues), f"no requeue: {requeues}\n{logs[-5000:]}"
    assert "deadline: the job ends at" in logs, logs[-5000:]
    assert "before the walltime signal, then stopping for requeue" in logs, logs[-5000:]  # decided before USR2 came
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    margins = [r["deadline_margin_s"] for r in rows if "deadline_margin_s" in r]
    stop = requeues[0]["global_step"]
    saves = [r for r in rows if "deadline_margin_s" in r and r["step"] == stop]
    assert saves and saves[-1]["deadline_margin_s"] >= 0, (stop, margins)
    assert saves[-1]["checkpoint_save_s"] >= 30  # the slow save really was slow: it could not have fit the grace
    print(f"deadline save at step {stop}: {saves[-1]['checkpoint_save_s']:.1f} s, margin {saves[-1]['deadline_margin_s']:.1f} s; "
          f"all margins {margins}")
