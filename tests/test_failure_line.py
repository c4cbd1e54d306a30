"""The failure line is the failure (issue 30): `submit --wait`, `status`, `logs --errors` and the rank's own last line
say why a task failed (a failed preflight check with its fix, an exception's message), never a table border.

The readers are pure or read files written here as the runtime writes them; one real local-executor job, a
preflight on a PATH without `nc` (the quickstart's failure in the issue), is read by every command.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table

from swiftslurm.errors import PreflightFailed
from swiftslurm.preflight.report import build_report, failure_of
from swiftslurm.preflight.results import INSTALL_HINTS, CheckResult, decide, missing_tool
from swiftslurm.records import failures as failure
from swiftslurm.watch.failure import task_failure
from swiftslurm.watch.logs import is_decoration, last_words

WAIT_S = 180
NC_HINT = INSTALL_HINTS["nc"]


def rendered(*things) -> list[str]:
    """What rich prints for ``things`` on a colour terminal (ANSI codes included), line by line."""
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="truecolor", width=100)
    for thing in things:
        console.print(thing)
    return buf.getvalue().splitlines()


def banner_and_report() -> list:
    banner = Table(title="swiftslurm run", box=box.SQUARE, show_header=False)
    banner.add_row("job", "quickstart local-29628 [local]")
    banner.add_row("nodes", "localhost (1)")
    report = Table(title="preflight: localhost", box=box.HEAVY_HEAD)
    for col in ("check", "node", "", "observed"):
        report.add_column(col)
    report.add_row("ports", "localhost", "[bold red]FAIL[/]", "'nc' not found on PATH")
    return [banner, report, Panel("submitted via local: job 7", title="swiftslurm submit"), Rule("preflight"), Rule()]


def progress_bars() -> list[str]:
    from tqdm import tqdm

    buf = io.StringIO()
    for unicode in (True, False):  # blocks (a terminal) and # (ASCII)
        with tqdm(total=50, file=buf, ncols=90, desc="Map", ascii=not unicode, mininterval=0, miniters=1) as bar:
            for _ in range(3):
                bar.update(10)
    return [part for part in buf.getvalue().split("\r") if part.strip()]


REAL_LINES = ["ValueError: boom", "preflight: ports localhost: 'nc' not found on PATH", "error: 3/4 ranks failed",
              "RuntimeError: shape '[2, 3]' is invalid for input of size 4", "--- Logging error ---", "x = a / b"]


def test_tables_panels_rules_and_progress_bars_are_decoration_real_errors_are_not():
    lines = [ln for ln in rendered(*banner_and_report()) if ln.strip()]
    assert any("\x1b[" in ln for ln in lines) and any("└" in ln for ln in lines) and any("━" in ln for ln in lines)
    ascii_table = ["+-------+-----------+", "| check | node      |", "+=======+===========+"]
    bars = progress_bars()
    assert len(bars) >= 6 and any("█" in b for b in bars) and any("#" in b for b in bars) and all("it/s" in b for b in bars)
    decoration = lines + ascii_table + bars + ["", "   ", "[rank0]: └──────┴──────┘", "=" * 40]
    assert [ln for ln in decoration if not is_decoration(ln)] == []
    assert [ln for ln in REAL_LINES if is_decoration(ln)] == []


SUBMITIT_TRACEBACK = [
    "submitit ERROR (2026-12-03 06:47:37,949) - Submitted job triggered an exception",
    "[rank0]: Traceback (most recent call last):",
    '[rank0]:   File "/x/submitit/core/submission.py", line 55, in process_job',
    "[rank0]:     result = delayed.result()",
    '[rank0]:   File "/x/swiftslurm/node/entry.py", line 42, in run_rank',
    "[rank0]:     raise TaskFailed(...)",
]


def test_last_words_skip_the_banner_the_runtime_info_lines_and_the_launchers():
    head = ["2026-12-03 06:47:23,965 [rank 0 localhost] INFO rank 0/2 (local 0/2, node 0/1 localhost)"]
    banner = rendered(*banner_and_report()[:1])
    # the stderr: the banner, then submitit's traceback around TaskFailed (no reason in it then)
    before = head + banner + SUBMITIT_TRACEBACK + ["[rank0]: swiftslurm.node.entry.TaskFailed: task 0 (train) exited with code 4 on this rank"]
    assert last_words(before) == "task 0 (train) exited with code 4 on this rank"
    # now: the runtime says why as its last log line, and TaskFailed carries it
    reason = f"preflight: ports localhost: 'nc' not found on PATH. HINT: {NC_HINT}"
    now = head + banner + [f"2026-12-03 06:52:19,035 [rank 0 localhost] ERROR not training: {reason}"] + SUBMITIT_TRACEBACK
    assert last_words(now + ["[rank0]: swiftslurm.node.entry.TaskFailed: task 0 (train) exited with code 4 on this rank"]) == \
        f"not training: {reason} (task 0 (train) exited with code 4 on this rank)"
    assert last_words(now + [f"[rank0]: swiftslurm.node.entry.TaskFailed: task 0 (train) exited with code 4 on this rank: {reason}"]) == \
        f"task 0 (train) exited with code 4 on this rank: {reason}"
    # a train.command's own last words before the wrapper; an exception in colour followed by a progress bar
    command = ["boom: disk full", *SUBMITIT_TRACEBACK, "swiftslurm.node.entry.TaskFailed: task 0 (train) exited with code 1 on this rank"]
    assert last_words(command) == "boom: disk full (task 0 (train) exited with code 1 on this rank)"
    assert last_words(["\x1b[31mRuntimeError: CUDA error: an illegal memory access\x1b[0m", *progress_bars(), ""]) == \
        "RuntimeError: CUDA error: an illegal memory access"
    assert last_words(banner + ["", "srun: error: node1: task 0: Exited"]) is None


def record(rank: int, when: float, what: str = "ValueError: x", **extra) -> dict:
    return {"rank": rank, "node": f"node{rank}", "job_id": "41", "time": when, "kind": "exception", "what": what, "hint": "", **extra}


def test_records_first_the_earliest_of_this_submission_and_hostile_ones_skipped(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    now = time.time()
    (logs / "failure-rank-0.json").write_text(json.dumps(record(0, now + 2, "RuntimeError: peer rank 1 gone")))
    (logs / "failure-rank-1.json").write_text(json.dumps(record(1, now + 1, "ValueError: planted on rank 1")))
    (logs / "failure-rank-2.json").write_text(json.dumps(record(2, now - 3600, "an earlier submission's")))
    (logs / "failure-rank-3.json").write_text(json.dumps(record(4, now, "claims another rank")))
    (logs / "failure-rank-4.json").write_text("[" * 100_000)
    (logs / "failure-rank-5.json").write_text(json.dumps(record(5, now, ["not", "text"])))
    os.mkfifo(logs / "failure-rank-6.json")  # would block a plain open() forever
    got = failure.read_failures(tmp_path, since=now - 60)
    assert [(f.rank, f.what) for f in got] == [(1, "ValueError: planted on rank 1"), (0, "RuntimeError: peer rank 1 gone")]
    found = task_failure(str(tmp_path), since=now)
    assert found is not None and found.source == "record" and found.text == "ValueError: planted on rank 1 (rank 1)"
    failure.clear_failure(tmp_path, 1)
    assert task_failure(str(tmp_path), since=now).text == "RuntimeError: peer rank 1 gone"
    for rank in (0, 2, 3, 4, 5):
        failure.clear_failure(tmp_path, rank)
    # no record: rank 0's stderr, its banner skipped
    folder = tmp_path / "submitit"
    folder.mkdir()
    (folder / "41_0_log.err").write_text("\n".join(rendered(*banner_and_report()) + ["OSError: [Errno 28] No space left on device", *rendered(Rule())]) + "\n")
    found = task_failure(str(tmp_path), str(folder), "41", now)
    assert found is not None and found.source == "log" and found.text == "OSError: [Errno 28] No space left on device"


def test_an_exception_becomes_one_line_with_its_hint():
    ours = failure.from_exception(PreflightFailed("MASTER_PORT is busy", "port 29500 held by pid 7", "set [env] MASTER_PORT"), 0, "n1", "9")
    assert (ours.what, ours.hint, ours.kind) == ("MASTER_PORT is busy (found: port 29500 held by pid 7)", "set [env] MASTER_PORT", "exception")
    theirs = failure.from_exception(ValueError("line one\n  line two\n" + "x" * 5000), 1, "n2", "9")
    assert theirs.what.startswith("ValueError: line one line two x") and len(theirs.what) == failure.WHAT_CHARS and "\n" not in theirs.what
    assert failure.from_exception(KeyError(), 0, "", "").what == "KeyError"


def test_a_failed_preflight_report_says_its_first_failed_check_and_fix():
    results = [CheckResult("disk", "n1", True, "83 GB free"), missing_tool("ports", "n1", "nc"),
               CheckResult("allreduce", "all", False, "rank 1 timed out", hint="check the firewall")]
    report = build_report(results, decide(results, "abort", ["n1"]), {"job_id": "7"})
    assert failure_of(report) == ("preflight: ports n1: 'nc' not found on PATH (and 1 more failed check(s): preflight/report.json)", NC_HINT)
    assert failure_of(build_report(results[:1], decide(results[:1], "abort", ["n1"]), {})) is None
    excluded = build_report(results[:2], decide(results[:2], "exclude", ["n1", "n2"]), {})
    assert failure_of(excluded) == ("preflight: excluding n1 and requeueing: ports n1: 'nc' not found on PATH", "")


# ---------------------------------------------------------------- one real job: the quickstart without nc


def path_without_nc(root: Path) -> str:
    """A PATH of one folder: a link to every program on this PATH but nc (netcat's names)."""
    root.mkdir()
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name in ("nc", "ncat", "netcat", "nc.openbsd", "nc.traditional") or (root / name).exists():
                continue
            (root / name).symlink_to(Path(folder) / name)
    return str(root)


SPEC = """
[job]
name = "nonc"
output_dir = "out"
[slurm]
nodes = 1
tasks_per_node = 2
time = "00:05:00"
[train]
command = ["{python}", "-c", "print('never runs')"]
[preflight]
checks = ["ports"]
"""


def test_a_preflight_without_nc_is_the_line_every_command_shows(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC.format(python=sys.executable))
    env = {**os.environ, "COLUMNS": "200", "PATH": path_without_nc(tmp_path / "bin")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path, env=env)

    reason = f"preflight: ports localhost: 'nc' not found on PATH. HINT: {NC_HINT}"
    sub = cli("submit", "s.toml", "--executor", "local", "--wait")
    assert sub.returncode == 1, sub.stdout + sub.stderr
    assert f"  task 0: {reason}\n" in sub.stdout, sub.stdout
    out = tmp_path / "out"
    assert f"  task 0: {reason}\n" in cli("status", str(out)).stdout
    assert json.loads(cli("status", str(out), "--json").stdout)["tasks"][0]["failure"] == reason
    unsorted = cli("status", str(out), "--json", "--sort", "eval_loss")  # no task logged it: the order says nothing
    assert "note: no task has logged 'eval_loss' (yet), so the order is the tasks' own" in unsorted.stderr, unsorted.stderr
    errors = cli("logs", str(out), "--errors").stdout
    assert errors.startswith(f"failed: {reason}  (recorded by rank 0 localhost, logs/failure-rank-0.json)"), errors
    saved = json.loads((out / "logs" / "failure-rank-0.json").read_text())
    assert (saved["kind"], saved["what"], saved["hint"]) == ("preflight", "preflight: ports localhost: 'nc' not found on PATH", NC_HINT)
    # the rank's own last line: submitit's TaskFailed, carrying the reason
    err = next((out / "logs" / "submitit").rglob("*_0_log.err")).read_text().splitlines()
    assert err[-1].endswith(f"TaskFailed: task 0 (train) exited with code 4 on this rank: {reason}"), err[-5:]


def test_a_rank_records_its_exception_and_a_rerun_clears_it(tmp_path):
    """`swiftslurm run` (one local rank, no Slurm): a train.command that cannot start is a RuntimeEnvError, recorded
    with its hint; the next run of the task removes that record, whatever it then does."""
    import tomllib

    from swiftslurm.plan import make_plan, write_plan
    from swiftslurm.spec import parse_spec

    def run(command: list[str]) -> subprocess.CompletedProcess:
        toml = (f'[job]\nname = "rec"\noutput_dir = "{tmp_path}/out"\n[slurm]\ntasks_per_node = 1\n[train]\n'
                f"command = {json.dumps(command)}\n[preflight]\nchecks = []\n")
        plan = write_plan(make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source="t.toml"))
        env = {k: v for k, v in os.environ.items()
           if k == "SWIFTSLURM_LEDGER" or not k.startswith(("SLURM_", "SUBMITIT_", "MASTER_", "SWIFTSLURM_"))}  # the test's own ledger
        return subprocess.run([sys.executable, "-m", "swiftslurm", "run", "--plan", str(plan)], env=env, capture_output=True, text=True, timeout=120)

    started = time.time()
    proc = run([str(tmp_path / "no-such-trainer")])
    assert proc.returncode == 1 and "cannot start train.command" in proc.stderr, proc.stderr
    [rec] = failure.read_failures(tmp_path / "out", since=started - 1)
    assert (rec.rank, rec.kind) == (0, "exception") and rec.what.startswith("cannot start train.command (No such file or directory)")
    assert rec.hint == "check the program name and that it is on PATH on every node"
    assert task_failure(str(tmp_path / "out"), since=started).text == rec.line()
    assert run([sys.executable, "-c", "raise SystemExit(3)"]).returncode == 3
    assert failure.read_failures(tmp_path / "out") == []  # the rerun's rank 0 removed its earlier reason; an exit code is no record
