"""Spec keys and CLI options that had no test (issue 36), each by the smallest thing that shows it takes effect:
slurm.bad_node_ttl_h, checkpoint.deadline_save (the end time read from the real squeue), `logs --node`,
`logs --follow`, `--debug`, the watchdog's pause during a save, and the preflight's fatal path (a rank that
cannot leave the preflight's process group). The training keys are in test_one_process_runs.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from swiftslurm.ledger import Entry, avoid_in_plan
from swiftslurm.plan import make_plan
from swiftslurm.spec import parse_spec, parse_toml, validate_spec

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "data" / "watch_run"
HOUR = 3600.0


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, **kw)


# ---------------------------------------------------------------- slurm.bad_node_ttl_h


def test_bad_node_ttl_h_decides_how_long_a_failure_excludes_its_node(tmp_path):
    def excluded(ttl_h: float | None, age_h: float) -> str | None:
        ttl = f"bad_node_ttl_h = {ttl_h}\n" if ttl_h is not None else ""
        raw = parse_toml(f'[job]\nname = "t"\noutput_dir = "{tmp_path}/out"\n[slurm]\nnodes = 2\n{ttl}[train]\ncommand = ["true"]\n')
        plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path))
        entries = [Entry("node3", "hang", "rank 2 never joined", "9", time.time() - age_h * HOUR)]
        new, _ = avoid_in_plan(plan, entries, lambda partition: ["node1", "node2", "node3", "node4"])
        return new.groups[0].slurm.exclude

    assert excluded(None, 3) == "node3"  # the default 24 h
    assert excluded(2, 3) is None  # 3 h old, ttl 2 h: forgotten
    assert excluded(48, 30) == "node3" and excluded(None, 30) is None  # 30 h old: only a 48 h ttl keeps it


# ---------------------------------------------------------------- checkpoint.deadline_save


@pytest.mark.slurm
def test_deadline_save_reads_the_jobs_end_time_from_slurm_only_when_on(tmp_path):
    from swiftslurm.slurm.distenv import DistEnv
    from swiftslurm.train.health.deadline import watch_for

    job = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-t", "5", "-o", "/dev/null", "--wrap", "sleep 120"],
                         capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip() != "RUNNING":
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.3)
        dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1, nodes=("node1",),
                       node="node1", master_addr="127.0.0.1", master_port=29500, job_id=job, requeue_id=job,
                       array_task_id=None, restart_count=0, gpus=(), executor="slurm")
        base = '[train]\nmodel = "tiny-llama"\ndataset = ["d.jsonl"]\n'
        on = watch_for(parse_spec(base), dist, str(tmp_path), lambda: None)
        assert on.end_time is not None and 200 < on.end_time - time.time() <= 300  # -t 5: five minutes from the start
        off = watch_for(parse_spec(base + "[checkpoint]\ndeadline_save = false\n"), dist, str(tmp_path), lambda: None)
        assert off.end_time is None and off.due(saving=False) is False
    finally:
        subprocess.run(["scancel", job], check=False)


# ---------------------------------------------------------------- logs --node, logs --follow, --debug


def _run_copy(tmp_path: Path) -> Path:
    """The captured run (ranks 0 and 1 on localhost) plus a rank 2 that ran on node7."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    (run / "logs" / "rank-2.log").write_text(
        "2026-12-01 05:04:29,000 [rank 2 node7] INFO rank 2/3 on node7\n2026-12-01 05:07:41,600 [rank 2 node7] INFO node7 done\n")
    return run


def test_logs_node_shows_only_the_ranks_of_that_node(tmp_path):
    run = _run_copy(tmp_path)
    on7 = cli("logs", str(run), "--node", "node7")
    assert on7.returncode == 0, on7.stderr
    lines = on7.stdout.splitlines()
    assert len(lines) == 2 and all(ln.startswith("[rank 2 node7]") for ln in lines), on7.stdout
    assert "rank 2/3 on node7" in lines[0] and "node7 done" in lines[1]
    local = cli("logs", str(run), "--node", "localhost")
    ranks = {ln.split()[1] for ln in local.stdout.splitlines()}
    assert "1" in ranks and ranks <= {"0", "1"} and "node7" not in local.stdout
    both = cli("logs", str(run), "--node", "node7", "--rank", "2")
    assert both.returncode != 0 and "do not go together" in both.stderr
    for flag, value, held in (("--node", "node9", "nodes localhost, node7"), ("--rank", "12", "ranks 1, 2")):
        none = cli("logs", str(run), flag, value)  # a filter that matches nothing says so, and what there is
        assert none.returncode == 0 and none.stdout == "", none.stdout
        assert f"no log lines of {flag[2:]} {value} here; the logs hold {held}" in none.stderr, none.stderr


def test_logs_follow_prints_lines_written_after_it_started(tmp_path):
    run = _run_copy(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "swiftslurm", "logs", str(run), "--follow", "--node", "node7"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"})
    killer = threading.Timer(60, proc.kill)  # a follow that never prints must not hang the suite: readline sees EOF
    killer.start()
    try:
        seen = [proc.stdout.readline(), proc.stdout.readline()]  # what was there
        assert all("node7" in ln for ln in seen), seen
        with (run / "logs" / "rank-2.log").open("a") as fh:
            fh.write("2026-12-01 05:08:00,000 [rank 2 node7] INFO written while following\n")
        late = proc.stdout.readline()  # blocks until `--follow` prints it (the timeout below ends a broken follow)
        assert "written while following" in late, late
    finally:
        killer.cancel()
        proc.kill()
        proc.wait(timeout=30)


def test_debug_shows_the_traceback_a_user_error_otherwise_hides(tmp_path):
    missing = str(tmp_path / "missing")
    plain = cli("logs", missing)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and "read from an output dir" in plain.stderr, plain.stderr
    debug = cli("--debug", "logs", missing)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr, debug.stderr
    assert "swiftslurm.errors.SwiftSlurmError: logs and plots are read from an output dir" in debug.stderr
    env = cli("logs", missing, env={"SWIFTSLURM_DEBUG": "1"})
    assert "Traceback (most recent call last)" in env.stderr


# ---------------------------------------------------------------- the watchdog pauses during a save


def test_the_watchdog_is_paused_for_a_save_or_an_evaluation_and_rearmed_by_the_next_step(tmp_path):
    from transformers import TrainerControl, TrainerState

    from swiftslurm.train.health.watchdog import FLOOR_ENV, ProgressWatchdog
    from swiftslurm.train.trainer import ScheduleCallback

    class Meter:  # the step meter is not what is tested here
        def end_step(self):
            pass

    log = (tmp_path / "stderr").open("w+")
    watchdog = ProgressWatchdog(0, 1800, target=log, environ={FLOOR_ENV: "0.3"})
    schedule = ScheduleCallback(lambda: False, [], Meter(), watchdog)
    args, state = type("Args", (), {"device": "cpu", "world_size": 1})(), TrainerState(max_steps=100)
    try:
        for step in range(1, 6):  # past the warm-up: armed with the 0.3 s floor
            state.global_step = step
            schedule.on_step_end(args, state, TrainerControl())
        assert watchdog.armed_s == pytest.approx(0.3)
        state.global_step = 6
        schedule.on_step_end(args, state, TrainerControl(should_save=True))  # a save follows this step
        assert watchdog.armed_s is None
        time.sleep(1.0)  # a save three times the limit: no dump
        log.flush()
        assert "watchdog: no step" not in Path(log.name).read_text()
        state.global_step = 7
        schedule.on_step_end(args, state, TrainerControl())  # the next step end re-arms it
        assert watchdog.armed_s == pytest.approx(0.3)
        # an evaluation follows this step (eval_steps != save_steps): paused through it and the saves it asks for
        schedule.on_step_end(args, state, TrainerControl(should_evaluate=True))
        assert watchdog.armed_s is None
        schedule.on_step_end(args, state, TrainerControl())
        schedule.on_epoch_end(args, state, TrainerControl(should_evaluate=True))  # an epoch's evaluation
        assert watchdog.armed_s is None
        schedule.on_step_end(args, state, TrainerControl())
        assert watchdog.armed_s == pytest.approx(0.3)
        time.sleep(1.0)  # and a real stall is still caught
        log.flush()
        assert "watchdog: no step for 0 s: stacks of rank 0" in Path(log.name).read_text()
    finally:
        watchdog.stop()
        log.close()


# ---------------------------------------------------------------- the preflight's fatal path


def test_a_rank_that_cannot_leave_the_preflight_group_stops_training_whatever_on_failure_says(monkeypatch, capsys):
    import importlib

    from swiftslurm.preflight.checks import allreduce
    from swiftslurm.preflight.results import decide

    views = {0: {"ok": True, "released": True}, 1: {"ok": True, "released": False}}
    bad = allreduce.unreleased(views, ["node1", "node2"])
    assert [(r.check, r.node, r.ok) for r in bad] == [("process-group", "node2", False)]
    assert "rank 1 on node2 could not destroy the preflight's process group" in bad[0].observed
    for on_failure in ("warn", "exclude", "abort"):
        d = decide(bad, on_failure, ["node1", "node2"])
        assert (d.action, d.proceed) == ("abort", False), (on_failure, d)
        assert "no on_failure trains past" in d.reason
    gate = importlib.import_module("swiftslurm.preflight.gate")  # the module (the package exports its gate function)
    # the gate's last word on a rank: a group it cannot release is no group to train on
    dist = type("Dist", (), {"rank": 1, "node": "node2"})()
    monkeypatch.setattr(allreduce, "release_process_group", lambda: False)
    assert gate._fresh_group_for_training(True, dist) is False
    assert "could not be released" in capsys.readouterr().err
    monkeypatch.setattr(allreduce, "release_process_group", lambda: True)
    assert gate._fresh_group_for_training(True, dist) is True
