"""Watching a run (issue 20): progress rows, the follow view, sweep results, logs by rank, plots.

Pure readers are tested on the files of a real tiny run (tests/data/watch_run: the quickstart model, 12
steps, 2 ranks, local executor) and on written rows; the commands on real local-executor jobs whose
``train.command`` is a fake trainer that writes metrics.jsonl like the built-in one (seconds, not minutes).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from swiftslurm import slurm
from swiftslurm.cli.watch_cmd import PlainFollower, plain_line, progress_table
from swiftslurm.jobs.send import submit_plan
from swiftslurm.plan import make_plan
from swiftslurm.spec import parse_toml, validate_spec
from swiftslurm.watch import logs as L
from swiftslurm.watch.progress import Progress, TaskFiles, Watcher, progress_of, rank_sweep, restart_steps, segments, total_of

RUN = Path(__file__).parent / "data" / "watch_run"
WAIT_S = 180

# A trainer as train.command: reads its task's spec.json, logs one metrics.jsonl row per step on rank 0
# (loss falls faster with a larger learning rate); with argv[1] == its rank it raises instead.
FAKE_TRAINER = r"""
import json, os, sys, time
from pathlib import Path
task_dir = Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"]).parent.parent
train = json.loads((task_dir / "spec.json").read_text())["spec"]["train"]
rank = int(os.environ["RANK"])
print(f"fake trainer rank {rank} starting", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == str(rank):
    time.sleep(1.0)
    raise ValueError(f"planted failure on rank {rank}")
step_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
gate = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None  # the test opens it: <gate>/go, <gate>/last
def wait_for(name):
    deadline = time.time() + 120  # bounded: a test that never opens the gate fails on its asserts, not a hang
    while gate is not None and not (gate / name).exists() and time.time() < deadline:
        time.sleep(0.05)
for step in range(1, train["max_steps"] + 1):
    wait_for("go" if step == 1 else "last" if step == train["max_steps"] else "")
    time.sleep(step_s)
    if rank == 0:
        with open(task_dir / "metrics.jsonl", "a") as fh:
            row = {"step": step, "time": time.time(), "loss": 1.0 / (step * train["learning_rate"] * 1e4), "tokens_per_s": 1000.0 + step}
            fh.write(json.dumps(row) + "\n")
"""


def spec_text(out: str, max_steps: int = 6, tasks: int = 1, fail_rank: str = "-", step_s: float = 0.2, sweep: str = "",
              gate: str = "") -> str:
    command = [sys.executable, "-c", FAKE_TRAINER, fail_rank, str(step_s)] + ([gate] if gate else [])
    return f"""
[job]
name = "watch"
output_dir = {json.dumps(out)}
[slurm]
nodes = 1
tasks_per_node = {tasks}
time = "00:05:00"
[train]
command = {json.dumps(command)}
max_steps = {max_steps}
learning_rate = 1e-4
[preflight]
checks = []
{sweep}
"""


def submit_local(tmp_path: Path, text: str):
    raw = parse_toml(text)
    plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="watch.toml")
    return plan, submit_plan(plan, executor="local")


def cli(*args, timeout=WAIT_S):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


# ---------------------------------------------------------------- progress, on the real run's files


@pytest.mark.parametrize("state", sorted(slurm.FINAL_STATES - {"COMPLETED"}) + ["UNKNOWN"])
def test_total_counts_every_final_state_but_completed_as_failed(state):
    """Slurm's final states have one list (slurm.FINAL_STATES): a REVOKED task (a federated sibling) failed too."""
    rows = [Progress(task=0, state="COMPLETED"), Progress(task=1, state=state), Progress(task=2, state="RUNNING")]
    total = total_of(rows)
    assert (total.done, total.failed, total.running) == (1, 1, 1)


def test_progress_of_a_real_finished_run():
    files = TaskFiles(str(RUN))
    p = progress_of(0, "COMPLETED", files.metrics(), max_steps=12, summary=files.summary())
    assert (p.step, p.max_steps, p.fraction) == (12, 12, 1.0)
    assert p.loss == pytest.approx(2.9705, abs=1e-4) and p.final_loss == pytest.approx(2.9705, abs=1e-4)
    assert p.best_loss == p.final_loss and p.tokens_kind == "tokens_per_s" and p.tokens_per_s > 0 and p.eta_s == 0.0
    assert len(segments(files.metrics())) == 1  # the checkpoint-save rows at steps 6 and 12 are not restarts


def test_progress_running_eta_counts_down_and_prefers_useful_tokens():
    rows = [{"step": s, "time": 1000.0 + s, "loss": 10.0 / s, "tokens_per_s": 900.0, "useful_tokens_per_s": 600.0 + s} for s in range(2, 12, 2)]
    p = progress_of(0, "RUNNING", rows, max_steps=100, now=rows[-1]["time"])
    assert p.step == 10 and p.eta_s == pytest.approx(90.0)  # one step per second
    assert p.tokens_kind == "useful_tokens_per_s" and p.tokens_per_s == 610.0
    later = progress_of(0, "RUNNING", rows, max_steps=100, now=rows[-1]["time"] + 30)
    assert later.eta_s == pytest.approx(60.0)
    assert progress_of(0, "PENDING", [], max_steps=100).step is None


def test_requeue_continues_the_bar_and_paces_after_the_resume():
    first = [{"step": s, "time": 100.0 + s, "loss": 5.0 - s / 10} for s in (2, 4, 6, 8)]
    # requeued at step 8, resumed from checkpoint-6 an hour later; twice as fast now
    second = [{"step": s, "time": 3700.0 + (s - 6) / 2, "loss": 4.5 - s / 10} for s in (8, 10, 12)]
    rows = first + second
    assert [len(s) for s in segments(rows)] == [4, 3] and restart_steps(rows) == [8]
    assert restart_steps(rows, [{"global_step": 8}, {"global_step": 3}]) == [3, 8]
    p = progress_of(0, "RUNNING", rows, max_steps=20, restarts=1, resumed_at=3600.0, now=rows[-1]["time"],
                    checkpoint="/x/checkpoint-10")
    assert p.step == 12 and p.restarts == 1 and p.eta_s == pytest.approx(4.0)  # 8 steps at 2 steps/s, the queue wait not counted
    assert p.best_loss == pytest.approx(3.3)


def test_torn_nan_and_absent_files_are_tolerated(tmp_path):
    assert TaskFiles(str(tmp_path)).metrics() == [] and TaskFiles(str(tmp_path)).summary() is None
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": 3.0}\n{"step": 3, "lo')
    files = TaskFiles(str(tmp_path))
    assert [r["step"] for r in files.metrics()] == [1, 2]
    with path.open("a") as fh:
        fh.write('ss": 2.5}\n')
    assert [r["step"] for r in files.metrics()] == [1, 2, 3]  # the torn line, once complete
    p = progress_of(0, "COMPLETED", files.metrics())
    assert p.best_loss == 2.5 and json.loads(json.dumps(Progress(0, "X", loss=float("nan")).to_json()))["loss"] is None
    (tmp_path / "requeues.json").write_text("{not json")
    row = Watcher("", [str(tmp_path)]).rows([SimpleNamespace(task=0, job_id="1", state="RUNNING", nodes="", restarts=0, elapsed="1-02:03:04",
                                                             output_dir=str(tmp_path))])[0]
    assert row.elapsed_s == 93784 and row.restarts == 0 and row.step == 3


def test_sweep_ranking_marks_the_best_completed():
    rows = [Progress(0, "COMPLETED", loss=2.0, final_loss=2.0), Progress(1, "RUNNING", loss=0.5),
            Progress(2, "COMPLETED", loss=float("nan"), final_loss=float("nan")), Progress(3, "COMPLETED", loss=1.0, final_loss=1.0),
            Progress(4, "FAILED", loss=0.1)]
    ranked = rank_sweep(rows)
    assert [p.task for p in ranked] == [3, 0, 4, 1, 2] and [p.best for p in ranked] == [True, False, False, False, False]
    assert not any(p.best for p in rank_sweep([Progress(0, "RUNNING", loss=1.0)]))


# ---------------------------------------------------------------- rendering


def test_terminal_table_and_plain_lines():
    rows = [Progress(0, "RUNNING", step=6, max_steps=12, loss=1.25, tokens_per_s=1500.0, tokens_kind="useful_tokens_per_s", eta_s=75,
                     elapsed_s=3725, checkpoint="/o/checkpoint-6", overrides={"learning_rate": 2e-4}),
            Progress(1, "COMPLETED", step=12, max_steps=12, loss=0.5, final_loss=0.5, elapsed_s=10, overrides={"learning_rate": 3e-4})]
    buf = io.StringIO()
    Console(file=buf, force_terminal=True, width=200).print(progress_table(rows, "job 7"))
    screen = buf.getvalue()
    assert "\x1b[" in screen and "6/12" in screen and "learning_rate=0.0002" in screen and "1:02:05" in screen
    assert "1 best" in re.sub(r"\x1b\[[0-9;]*m", "", screen) and "total" in screen and "1/2 done" in re.sub(r"\x1b\[[0-9;]*m", "", screen)
    line = plain_line(rows[0])
    assert "step 6/12 (50%)" in line and "useful tokens/s 1500" in line and "eta 0:01:15" in line and "checkpoint checkpoint-6" in line
    out = io.StringIO()
    follower = PlainFollower(Console(file=out, force_terminal=False, width=80), interval_s=0)
    follower.update(rows)
    follower.update(rows)  # nothing moved: nothing printed again
    follower.finish(rows)
    text = out.getvalue()
    assert "\x1b" not in text and text.count("task 0 ") == 1 and "BEST" in text and "total" in text


# ---------------------------------------------------------------- logs


def _run_reader(root: Path) -> L.Reader:
    return L.Reader([(0, str(root), str(root / "logs" / "submitit"), "5556")])


def test_logs_of_a_real_run_by_rank_and_interleaved():
    per_source = _run_reader(RUN).new_lines()
    lines = L.interleave(per_source)
    assert {ln.rank for ln in lines} == {0, 1} and {ln.node for ln in lines} == {"localhost"}
    times = [ln.time for ln in lines]
    assert times == sorted(times)
    assert "Starting with JobEnvironment" in lines[0].text  # submitit's first line, the earliest stamp
    one = L.select(lines, rank=1)
    assert one and all(ln.rank == 1 for ln in one) and any("rank 1/2" in ln.text for ln in one)
    assert L.find_errors(per_source) == []  # FutureWarnings are not errors


def test_errors_name_the_rank_that_printed_first(tmp_path):
    logs = tmp_path / "logs"
    shutil.copytree(RUN / "logs", logs)
    with (logs / "rank-1.log").open("a") as fh:
        fh.write("2026-12-01 05:07:42,000 [rank 1 node7] INFO started train.command\n"
                 "Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n    boom()\n"
                 "ValueError: planted on a rank\n"
                 "2026-12-01 05:07:43,000 [rank 1 node7] INFO train.command exited with 1\n")
    with (logs / "submitit" / "5556_0_log.err").open("a") as fh:
        fh.write("2026-12-01 05:07:50,000 [rank 0 localhost] INFO other\n[rank0]: Traceback (most recent call last):\n"
                 "[rank0]:   File \"t.py\", line 3, in <module>\n[rank0]: ValueError: planted on a rank\n"
                 "2026-12-01 05:07:51,000 [rank 0 localhost] ERROR NCCL watchdog timeout\n")
    reports = L.find_errors(_run_reader(tmp_path).new_lines())
    assert [(r.rank, r.headline) for r in reports] == [(1, "ValueError: planted on a rank"),
                                                       (0, "2026-12-01 05:07:51,000 [rank 0 localhost] ERROR NCCL watchdog timeout")]
    assert reports[0].also == [0] and reports[0].lines[0] == "Traceback (most recent call last):" and len(reports[0].lines) == 4
    assert reports[0].node == "node7"


def test_logs_of_one_attempt(tmp_path, monkeypatch):
    """Each start of a rank opens with its attempt header (taskdir.attempt_header): a requeue appends to the same files,
    and `logs --attempt N` shows the N-th start alone; an N the logs do not hold is one message listing those they do."""
    from swiftslurm.cli.watch_cmd import logs_command
    from swiftslurm.errors import SwiftSlurmError
    from swiftslurm.taskdir import attempt_header

    logs = tmp_path / "logs"
    (logs / "submitit").mkdir(parents=True)
    for rank, where in ((0, logs / "submitit" / "5556_0_log.err"), (1, logs / "rank-1.log")):
        where.write_text("submitit INFO (2026-12-01 05:00:00,000) - Starting with JobEnvironment\n"
                         f"2026-12-01 05:00:01,000 [rank {rank} node1] INFO {attempt_header('5556', 0, 0, 'node1,node2')}\n"
                         f"2026-12-01 05:00:02,000 [rank {rank} node1] INFO first start, rank {rank}\n"
                         f"2026-12-01 05:09:01,000 [rank {rank} node3] INFO {attempt_header('5556', 1, 0, 'node3,node4')}\n"
                         f"2026-12-01 05:09:02,000 [rank {rank} node3] INFO after the requeue, rank {rank}\n")
    read = _run_reader(tmp_path).new_lines()
    assert L.attempts(ln for lines in read for ln in lines) == ["5556.0.0", "5556.1.0"]
    monkeypatch.setattr("swiftslurm.jobs.target.resolve", lambda target, **kw: (None, [SimpleNamespace(
        task=0, task_dir=str(tmp_path), folder=str(logs / "submitit"), job_id="5556")]))
    out = io.StringIO()
    assert logs_command(Console(file=out, width=200), str(tmp_path), None, None, None, False, None, False, attempt=2) == 0
    shown = out.getvalue()
    assert "after the requeue, rank 0" in shown and "after the requeue, rank 1" in shown and "first start" not in shown
    assert "[rank 1 node3]" in shown
    with pytest.raises(SwiftSlurmError) as refused:
        logs_command(Console(file=io.StringIO()), str(tmp_path), None, None, None, False, None, False, attempt=3)
    assert "1 = 5556.0.0, 2 = 5556.1.0" in refused.value.found


# ---------------------------------------------------------------- real local jobs


def test_status_follow_in_a_pipe_prints_step_lines_and_ends(tmp_path):
    """The trainer steps only once the follower is watching, and takes its last step only once the follower has
    printed a running step: no race between the CLI's start-up and the job on a loaded machine."""
    gate = tmp_path / "gate"
    gate.mkdir()
    _, sub = submit_local(tmp_path, spec_text("out", max_steps=8, step_s=0.05, gate=str(gate)))
    proc = subprocess.Popen([sys.executable, "-m", "swiftslurm", "status", str(tmp_path / "out"), "--follow", "--interval", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        lines = [proc.stdout.readline()]  # "following ...": the follower is up
        (gate / "go").touch()
        while lines[-1] and not re.search(r"RUNNING  step [1-7]/8", lines[-1]):
            lines.append(proc.stdout.readline())
        (gate / "last").touch()
        rest, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    stdout = "".join(lines) + rest
    assert proc.returncode == 0, stdout + err
    assert "\x1b" not in stdout
    steps = [int(m) for m in re.findall(r"RUNNING  step (\d+)/8", stdout)]
    assert steps and all(1 <= s < 8 for s in steps), stdout
    last = [ln for ln in stdout.splitlines() if "COMPLETED" in ln and "step" in ln][-1]
    assert "step 8/8 (100%)" in last and re.search(r"elapsed \d+:\d\d:\d\d", last), stdout
    status = json.loads(cli("status", str(tmp_path / "out"), "--json").stdout)
    task = status["tasks"][0]
    assert (task["step"], task["max_steps"], task["eta_s"]) == (8, 8, 0.0) and task["elapsed_s"] > 0 and task["loss"] > 0


def test_logs_rank_and_errors_of_a_failed_rank(tmp_path):
    _, sub = submit_local(tmp_path, spec_text("out", max_steps=2, tasks=2, fail_rank="1"))
    assert sub.wait(timeout_s=WAIT_S, poll_s=0.5) == {"0": "FAILED"}
    out = str(tmp_path / "out")
    only = cli("logs", out, "--rank", "1")
    assert only.returncode == 0 and "fake trainer rank 1 starting" in only.stdout
    assert all(ln.startswith("[rank 1 ") for ln in only.stdout.splitlines()) and "rank 0 starting" not in only.stdout
    errors = cli("logs", out, "--errors")
    assert errors.returncode == 0, errors.stderr
    head = errors.stdout.splitlines()[0]
    assert "first printed by rank 1" in head, errors.stdout
    assert "ValueError: planted failure on rank 1" in errors.stdout and "Traceback (most recent call last):" in errors.stdout
    tail = cli("logs", out, "--tail", "3")
    assert len(tail.stdout.splitlines()) == 3 and all(re.match(r"\[rank \d ", ln) for ln in tail.stdout.splitlines())


def test_sweep_status_sorted_by_final_loss_and_plot(tmp_path):
    sweep = "[sweep]\nlearning_rate = [1e-4, 3e-4, 2e-4]"
    _, sub = submit_local(tmp_path, spec_text("out", max_steps=3, sweep=sweep, step_s=0.05))
    assert sub.wait(timeout_s=WAIT_S, poll_s=0.5) == {"0": "COMPLETED", "1": "COMPLETED", "2": "COMPLETED"}
    out = str(tmp_path / "out")
    status = json.loads(cli("status", out, "--json").stdout)
    tasks = status["tasks"]
    assert [t["overrides"] for t in tasks] == [{"learning_rate": 3e-4}, {"learning_rate": 2e-4}, {"learning_rate": 1e-4}]
    finals = [t["final_loss"] for t in tasks]
    assert finals == sorted(finals) and [t["best"] for t in tasks] == [True, False, False]
    assert [t["task"] for t in tasks] == [1, 2, 0] and all(t["best_loss"] == t["final_loss"] for t in tasks)
    table = cli("status", out).stdout.splitlines()
    assert "learning_rate=0.0003" in table[1] and "BEST" in table[1] and "BEST" not in "".join(table[2:])

    plot = cli("plot", out)
    assert plot.returncode == 0, plot.stderr
    png = Path(out) / "metrics.png"
    assert str(png) in plot.stdout and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from swiftslurm.watch.plot import Series, figure

    fig = figure([Series(f"task {i}", TaskFiles(d).metrics()) for i, d in enumerate(sub.task_dirs)])
    assert len(fig.axes[0].get_lines()) == 3 and len(fig.axes[1].get_lines()) == 3


def test_submit_wait_on_a_terminal_shows_the_step_and_a_real_elapsed(tmp_path):
    (tmp_path / "w.toml").write_text(spec_text(str(tmp_path / "out"), max_steps=12, step_s=0.5))
    cmd = f"{sys.executable} -m swiftslurm submit {tmp_path / 'w.toml'} --executor local --wait"
    proc = subprocess.run(["script", "-qec", cmd, "/dev/null"], capture_output=True, text=True, timeout=WAIT_S,
                          env={**os.environ, "COLUMNS": "160", "TERM": "xterm"})
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", proc.stdout)
    assert proc.returncode == 0, screen
    assert "\x1b[" in proc.stdout  # a live display, not plain lines
    seen = [int(m) for m in re.findall(r"\b(\d+)/12\b", screen)]
    assert any(1 <= s < 12 for s in seen), screen
    final = [ln for ln in screen.splitlines() if "COMPLETED" in ln and "12/12" in ln][-1]
    assert re.search(r"\b\d+:\d\d:\d\d\b", final), final


def test_plot_marks_each_requeue_on_the_loss_line_before_it():
    from swiftslurm.watch.plot import Series, figure

    rows = [{"step": s, "loss": 5.0 - s / 10, "tokens_per_s": 10.0} for s in (2, 4, 6, 8)] + [{"step": s, "loss": 4.0} for s in (8, 10)]
    fig = figure([Series("task 0", rows, [{"global_step": 7}])])
    (marks,) = fig.axes[0].collections
    assert sorted(map(tuple, marks.get_offsets().tolist())) == [(6.0, 4.4), (8.0, 4.2)]
