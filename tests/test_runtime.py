"""runtime: `swiftslurm run` on real processes (local) and on the real Slurm cluster."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from runs import tiny_spec

from swiftslurm.node.requeue import NOT_REQUEUED_EXIT, await_other_ranks, decide_requeue, report_stopped
from swiftslurm.plan import make_plan, write_plan
from swiftslurm.records.requeues import read_requeues, stop_reason, walltime_requeues
from swiftslurm.slurm import distenv
from swiftslurm.spec import parse_spec

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]

DUMP_ENV = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "NNODES", "MASTER_ADDR",
        "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_DEBUG", "SLURM_JOB_ID", "SLURMD_NODENAME"]
out = {k: os.environ.get(k) for k in keys}
out["cwd"] = os.getcwd()
with open(os.path.join(sys.argv[1], "env-%s.json" % os.environ["RANK"]), "w") as fh:
    json.dump(out, fh)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""

ALLREDUCE = """
import datetime, json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
out = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_RESTART_COUNT")}
out["sum"] = t.item()
with open(os.path.join(sys.argv[1], "rank-%d.json" % dist.get_rank()), "w") as fh:
    json.dump(out, fh)
dist.destroy_process_group()
"""

SIGNALLED = """
import os, signal, sys, time
out = sys.argv[1]
def got(signum, frame):
    open(os.path.join(out, "got-" + signal.Signals(signum).name), "w").close()
    sys.exit(7 if signum == signal.SIGTERM else 0)
signal.signal(signal.SIGUSR2, got)
signal.signal(signal.SIGTERM, got)
open(os.path.join(out, "ready"), "w").close()
time.sleep(60)
"""


def make_plan_file(tmp: Path, toml: str) -> Path:
    """A plan on disk from a spec's TOML text (base dir = tmp)."""
    raw = tomllib.loads(toml)
    plan = make_plan(parse_spec(toml), raw, base_dir=str(tmp), source="test.toml")
    return write_plan(plan)


def command_spec(tmp: Path, script: str, *args: str, slurm: str = "tasks_per_node = 1", extra: str = "") -> str:
    path = tmp / "script.py"
    path.write_text(script)
    cmd = json.dumps([PY, str(path), *args])
    return f'[job]\nname = "rt"\noutput_dir = "{tmp}/out"\n[slurm]\n{slurm}\n[train]\ncommand = {cmd}\n[preflight]\nchecks = []\n{extra}'


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
           if k == "SWIFTSLURM_LEDGER" or not k.startswith(("SLURM_", "SUBMITIT_", "MASTER_", "SWIFTSLURM_"))}  # the test's own ledger


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "swiftslurm", "run", *args], env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


# ---------------------------------------------------------------- local, real processes


def test_command_gets_derived_env_and_its_exit_code(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), "3", extra='[env]\nNCCL_DEBUG = "WARN"\n'))
    proc = run_cli("--plan", str(plan))
    assert proc.returncode == 3, proc.stderr
    env = json.loads((tmp_path / "env-0.json").read_text())
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert distenv.PORT_BASE <= int(env["MASTER_PORT"]) < 32768  # below Linux's ephemeral range
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and env["NCCL_DEBUG"] == "WARN"
    assert env["cwd"] == str(tmp_path)  # the plan's base_dir
    assert "swiftslurm run" in proc.stderr and "master" in proc.stderr  # rank 0's banner


def test_plan_from_env_var_and_missing_plan(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path)))
    proc = run_cli(env={**clean_env(), "SWIFTSLURM_PLAN": str(plan)})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "env-0.json").exists()
    proc = run_cli("--plan", str(tmp_path / "nope.json"))
    assert proc.returncode == 1 and "plan file does not exist" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli("--plan", str(plan), "--task", "3")
    assert proc.returncode == 1 and "the plan has no task 3" in proc.stderr and "Traceback" not in proc.stderr


def test_usr1_dumps_the_rank_stack(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, SIGNALLED, str(tmp_path)))
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "ready", 30)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "Current thread" in err and "run_command" in err, err[-2000:]
    assert proc.returncode == 7  # still alive after the dump; the TERM ended the command


def test_interrupted_rank_stops_its_command(tmp_path):
    """Ctrl-C on a rank (KeyboardInterrupt while it waits) TERMs the user's command instead of orphaning it."""
    plan = make_plan_file(tmp_path, command_spec(tmp_path, SIGNALLED, str(tmp_path)))
    # a suite started in the background (nohup ... &) inherits SIGINT ignored, and Python then keeps it ignored:
    # give the rank the default disposition, so it gets its KeyboardInterrupt as from a terminal
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(tmp_path / "ready", 30)
        proc.send_signal(signal.SIGINT)  # to the rank only, not to its process group
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (tmp_path / "got-SIGTERM").exists(), err[-2000:]
    assert "stopping train.command" in err


BROKEN_IMPORT = """
import sys
class _Broken:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            raise ImportError("simulated broken module " + name, name=name)
sys.meta_path.insert(0, _Broken())
"""


@pytest.mark.parametrize("module,checks", [("swiftslurm.preflight.gate", '["disk"]'), ("swiftslurm.preflight.checks.ports", "[]")])
def test_a_broken_own_import_fails_the_rank_loudly(tmp_path, module, checks):
    """An ImportError from one of our own modules is a bug to see, not "not installed": the rank fails with the
    traceback before the command runs (it once skipped the preflight, or the master port check, silently)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BROKEN_IMPORT.format(module=module))
    spec = command_spec(tmp_path, DUMP_ENV, str(tmp_path)).replace("checks = []", f"checks = {checks}")
    plan = make_plan_file(tmp_path, spec)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT), env.get("PYTHONPATH", "")])
    proc = run_cli("--plan", str(plan), env=env)
    assert proc.returncode != 0 and f"simulated broken module {module}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" in proc.stderr and not (tmp_path / "env-0.json").exists()


@pytest.mark.parametrize("module", ["swiftslurm.train.run", "deepspeed"])
def test_the_trainer_import_fails_loudly_for_our_modules_and_with_a_hint_for_a_missing_extra(tmp_path, module):
    shim = tmp_path / "shim"
    shim.mkdir()
    missing = "import sys; sys.modules[{module!r}] = None  # as if not installed\n"  # import: ModuleNotFoundError
    (shim / "sitecustomize.py").write_text((BROKEN_IMPORT if module.startswith("swiftslurm") else missing).format(module=module))
    plan = make_plan_file(tmp_path, train_spec(tmp_path / "out"))
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT), env.get("PYTHONPATH", "")])
    proc = run_cli("--plan", str(plan), env=env)
    if module.startswith("swiftslurm"):
        assert proc.returncode != 0 and "Traceback" in proc.stderr and f"simulated broken module {module}" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 1 and "not installed" in proc.stderr and "deepspeed" in proc.stderr, proc.stderr[-2000:]
        assert "swiftslurm[train]" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_spec_env_may_not_set_rank(tmp_path):
    """Refused at validate now (tests/test_validate_nodes.py), by the list the node applies too
    (distenv.check_spec_env: tests/test_distenv.py)."""
    from swiftslurm.errors import SpecError

    with pytest.raises(SpecError, match=r"env\.RANK"):
        make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), extra='[env]\nRANK = "0"\n'))
    assert not (tmp_path / "out").exists()


def test_mis_sized_local_run_stops_before_the_command(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), slurm="tasks_per_node = 2"))
    proc = run_cli("--plan", str(plan))
    assert proc.returncode == 1 and "HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "env-0.json").exists()


@pytest.mark.parametrize("sig,code", [(signal.SIGUSR2, NOT_REQUEUED_EXIT), (signal.SIGTERM, 7)])
def test_signals_reach_the_command(tmp_path, sig, code):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, SIGNALLED, str(tmp_path)))
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(tmp_path / "ready", 30)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert (tmp_path / f"got-{sig.name}").exists()
    records = read_requeues(str(tmp_path / "out"))
    if sig == signal.SIGUSR2:  # a walltime stop: recorded; the local executor cannot requeue, so it fails
        assert len(records) == 1 and records[0]["requeued"] is False and records[0]["outcome"] == "cannot_requeue"
        assert "cannot requeue" in err
    else:
        assert records == []


def usr2_held_without_handler(pid: int) -> bool:
    """The process holds SIGUSR2 blocked and has no handler for it yet (/proc's SigBlk and SigCgt masks: signal n
    is bit n-1): a USR2 now lands in the start-up window, before the runtime's handler exists."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return False
    masks = {ln.split(":")[0]: int(ln.split()[1], 16) for ln in lines if ln.startswith(("SigBlk:", "SigCgt:"))}
    bit = 1 << (signal.SIGUSR2 - 1)
    return bool(masks.get("SigBlk", 0) & bit) and not masks.get("SigCgt", 0) & bit


def test_a_walltime_signal_during_the_ranks_imports_is_held_and_stops_it_before_the_command(tmp_path):
    """A USR2 that lands while `swiftslurm run` still imports (before any handler exists; USR2's default action
    kills) is held pending, then taken as a walltime stop: the command never starts, the stop is recorded."""
    plan = make_plan_file(tmp_path, command_spec(tmp_path, SIGNALLED, str(tmp_path)))
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not usr2_held_without_handler(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        held = usr2_held_without_handler(proc.pid)
        proc.send_signal(signal.SIGUSR2)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert held, "the rank never held USR2 blocked while it started"
    assert proc.returncode == NOT_REQUEUED_EXIT, (proc.returncode, err[-3000:])  # not -12: killed by the signal
    assert "before train.command started" in err and "Traceback" not in err
    assert not (tmp_path / "ready").exists()  # the command never ran
    records = read_requeues(str(tmp_path / "out"))
    assert len(records) == 1 and records[0]["global_step"] is None and records[0]["outcome"] == "cannot_requeue"


def test_hold_runs_the_module_as_python_u_m_would_with_usr2_held(tmp_path):
    """submitit's rank command with node/hold.py in front: the module runs as __main__ with its own argv, USR2 is
    blocked from the start, and -u still holds: a line written without a newline is out before the process ends."""
    (tmp_path / "probe_mod.py").write_text(
        "import signal, sys, time\n"
        "if __name__ == '__main__':\n"
        "    sys.stdout.write(repr([sys.argv[1:], signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, [])]))\n"
        "    time.sleep(30)\n")
    proc = subprocess.Popen([PY, "-m", "swiftslurm.node.hold", "-u", "-m", "probe_mod", "FOLDER", "x y"], cwd=tmp_path,
                            stdout=subprocess.PIPE, env={**clean_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    try:
        first = os.read(proc.stdout.fileno(), 4096).decode()  # before the module's sleep ends: nothing buffered
    finally:
        proc.kill()
        proc.wait()
    assert first == "[['FOLDER', 'x y'], True]"


def wait_local_job(job, timeout_s: float) -> list:
    """The results of a submitit local job's ranks. Fails the test as soon as one rank has failed, with that
    rank's error (its peers may wait out their rendezvous timeout for it: submitit stops no one), and on the
    deadline with every rank's output; the job is cancelled either way."""
    from submitit.core.utils import pickle_load

    deadline = time.monotonic() + timeout_s
    try:
        while not job.done():
            for task in range(job.num_tasks):
                paths = job.task(task).paths
                if paths.result_pickle.exists() and paths.result_pickle.stat().st_size:
                    outcome, value = pickle_load(paths.result_pickle)
                    if outcome == "error":
                        pytest.fail(f"rank {task} failed:\n{str(value)[-3000:]}")
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- rank {t}:\n{(job.task(t).stdout() or '')[-1500:]}{(job.task(t).stderr() or '')[-1500:]}"
                                  for t in range(job.num_tasks))
                pytest.fail(f"local job did not finish in {timeout_s:.0f} s\n{tails}")
            time.sleep(0.5)
        return job.results()
    finally:
        if not job.done():
            job.cancel()  # SIGINT to submitit's controller, which stops the ranks
            try:
                job._process.wait(timeout=20)  # within this test (its traceback in this test's captured output)
            except subprocess.TimeoutExpired:  # a controller still waiting on a rank: end it, the test's verdict stands
                job._process.kill()
                job._process.wait(timeout=10)


def submit_local(tmp: Path, plan: Path):
    import submitit

    from swiftslurm.node.runtime import run_task

    executor = submitit.LocalExecutor(folder=str(tmp / "submitit"))
    executor.update_parameters(tasks_per_node=2, nodes=1, timeout_min=2)
    return executor.submit(run_task, str(plan), 0)


def test_submitit_local_executor_two_ranks_allreduce(tmp_path):
    plan = make_plan_file(tmp_path, command_spec(tmp_path, ALLREDUCE, str(tmp_path), slurm="tasks_per_node = 2"))
    assert wait_local_job(submit_local(tmp_path, plan), 90) == [0, 0]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    port = int(ranks[0]["MASTER_PORT"])
    assert ranks[1]["MASTER_PORT"] == str(port) and not 32768 <= port <= 60999  # derived, outside the ephemeral range
    assert (tmp_path / "out" / "logs" / "rank-1.log").exists()


def test_submitit_local_rank0_error_is_seen_at_once(tmp_path):
    """A busy MASTER_PORT: rank 0 refuses before its rendezvous, and the test sees rank 0's error within seconds
    (rank 1, waiting for that rendezvous, is cancelled), not a timeout that names no one."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        extra = f'[env]\nMASTER_ADDR = "127.0.0.1"\nMASTER_PORT = "{port}"\n'
        plan = make_plan_file(tmp_path, command_spec(tmp_path, ALLREDUCE, str(tmp_path), slurm="tasks_per_node = 2", extra=extra))
        job = submit_local(tmp_path, plan)
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="rank 0 failed:(.|\n)*MASTER_PORT is busy"):
            wait_local_job(job, 90)
    assert time.monotonic() - started < 45
    assert not (tmp_path / "rank-1.json").exists()


@pytest.mark.parametrize(
    "done,limit,executor,requeue,count,outcome",
    [(0, 20, "slurm", True, 1, "requeueing"), (2, 3, "slurm", True, 3, "requeueing"), (3, 3, "slurm", False, 3, "max_requeues"),
     (0, 0, "slurm", False, 0, "max_requeues"), (0, 20, "local", False, 0, "cannot_requeue")],
)
def test_decide_requeue(done, limit, executor, requeue, count, outcome):
    d = decide_requeue(done, limit, executor)
    assert (d.requeue, d.count, d.outcome) == (requeue, count, outcome)
    if outcome == "max_requeues":
        assert f"stopped at walltime after {done} requeue(s): max_requeues reached" in d.message


def test_rank_0_ends_a_walltime_stop_only_after_the_other_ranks_report_theirs(tmp_path, caplog):
    """Slurm's USR2 reaches the ranks at different moments; rank 0's exit (or requeue) ends the step, so it
    waits for every rank's report (a rank still saving would be killed), and names those that never report."""
    import logging
    import threading
    from types import SimpleNamespace

    ranks = [SimpleNamespace(rank=r, world_size=4, requeue_id="12_3", restart_count=1) for r in range(4)]
    log = logging.getLogger("test-stops")
    report_stopped(str(tmp_path), ranks[1])
    late = threading.Timer(0.6, report_stopped, (str(tmp_path), ranks[2]))
    late.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, "test-stops"):
        await_other_ranks(ranks[0], str(tmp_path), 2.0, log)  # rank 3 never reports
    waited = time.monotonic() - t0
    late.join()
    assert 2.0 <= waited < 10, waited
    assert "rank(s) 3 did not report" in caplog.text and "rank(s) 2" not in caplog.text
    assert not (tmp_path / ".swiftslurm-stops").exists()  # nothing left in the task dir

    for r in ranks[1:]:
        report_stopped(str(tmp_path), r)
    caplog.clear()
    t0 = time.monotonic()
    await_other_ranks(ranks[0], str(tmp_path), 30.0, log)
    assert time.monotonic() - t0 < 5 and "did not report" not in caplog.text
    # a report of another run of the job (restart count 0) does not count for this one
    report_stopped(str(tmp_path), SimpleNamespace(rank=1, world_size=2, requeue_id="12_3", restart_count=0))
    with caplog.at_level(logging.WARNING, "test-stops"):
        await_other_ranks(SimpleNamespace(rank=0, world_size=2, requeue_id="12_3", restart_count=1), str(tmp_path), 0.5, log)
    assert "rank(s) 1 did not report" in caplog.text


def test_stale_stop_reports_do_not_count(tmp_path, caplog, monkeypatch):
    """A report left by an earlier run (a job whose id the cluster reused, a rank 0 that died before clearing the
    folder) or by another in-job restart attempt is not taken for a rank that has stopped: rank 0 waits for this run's."""
    import logging
    from types import SimpleNamespace

    import swiftslurm.node.requeue as rq
    from swiftslurm.train.health.watchdog import ATTEMPT_ENV

    ranks = [SimpleNamespace(rank=r, world_size=3, requeue_id="77", restart_count=0) for r in range(3)]
    log = logging.getLogger("test-stale-stops")
    monkeypatch.delenv(ATTEMPT_ENV, raising=False)
    report_stopped(str(tmp_path), ranks[1])
    report_stopped(str(tmp_path), ranks[2])
    (stale,) = (tmp_path / ".swiftslurm-stops").glob("77.0*/rank-1")
    old = rq.STARTED - rq.STALE_SLACK_S - 3600  # an hour before this process started
    os.utime(stale, (old, old))
    with caplog.at_level(logging.WARNING, "test-stale-stops"):
        await_other_ranks(ranks[0], str(tmp_path), 0.5, log)
    assert "rank(s) 1 did not report" in caplog.text  # rank 2's report is this run's

    report_stopped(str(tmp_path), ranks[1])  # attempt 0 reported; the step is restarted in the job (attempt 1)
    report_stopped(str(tmp_path), ranks[2])
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, "test-stale-stops"):
        await_other_ranks(ranks[0], str(tmp_path), 0.5, log)
    assert "rank(s) 1, 2 did not report" in caplog.text
    # not a report either, however fresh: a link (here to this run's own report of rank 2) or a folder of rank 1's name
    for fake in ("link", "folder"):
        report_stopped(str(tmp_path), ranks[2])
        (where,) = (tmp_path / ".swiftslurm-stops").glob("77.0.1")
        if fake == "link":
            (where / "rank-1").symlink_to(where / "rank-2")
        else:
            (where / "rank-1").mkdir()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "test-stale-stops"):
            await_other_ranks(ranks[0], str(tmp_path), 0.5, log)
        assert "rank(s) 1 did not report" in caplog.text, fake
    report_stopped(str(tmp_path), ranks[1])
    report_stopped(str(tmp_path), ranks[2])
    caplog.clear()
    await_other_ranks(ranks[0], str(tmp_path), 5.0, log)
    assert "did not report" not in caplog.text


def test_requeues_are_counted_per_job_not_per_directory():
    """A new submission (new job id) starts a new count; an older job that had the same id (a cluster whose
    ids restarted) is told apart by SLURM_RESTART_COUNT, which only grows within one job."""
    records = [
        {"job_id": "7", "restart_count": 0, "requeued": True},  # last week's job 7: requeued 3 times, then done
        {"job_id": "7", "restart_count": 1, "requeued": True, "outcome": "requeued"},
        {"job_id": "7", "restart_count": 2, "requeued": False, "outcome": "max_requeues",
         "message": "stopped at walltime after 2 requeue(s): max_requeues reached"},
        {"job_id": "40_3", "restart_count": 0, "requeued": True, "outcome": "requeued"},  # another submission
        {"job_id": "41", "restart_count": 0, "requeued": True, "outcome": "requeueing"},  # killed by its own requeue
    ]
    assert walltime_requeues(records, "41", restart_count=1) == 1
    assert walltime_requeues(records, "99", restart_count=0) == 0  # a new submit starts at 0
    assert walltime_requeues(records, "40_3", restart_count=1) == 1 and walltime_requeues(records, "40", restart_count=1) == 0
    assert walltime_requeues(records, "7", restart_count=2) == 2
    assert walltime_requeues(records, "7", restart_count=0) == 0  # the id came back after a cluster reset: a new job
    assert stop_reason(records, "7").endswith("max_requeues reached") and stop_reason(records, "41") is None
    assert stop_reason([{"job_id": "local-5", "restart_count": 0, "requeued": False, "message": "m"}], "5") == "m"



def train_spec(out: Path) -> str:
    return tiny_spec("rt-train", out, data=ROOT / "examples" / "data" / "alpaca_demo.jsonl",
                     slurm={"tasks_per_node": 1, "max_requeues": 2},
                     train={"max_steps": 500, "max_length": 128, "save_steps": 1000, "logging_steps": 1,
                            "report_to": ["none"]},
                     checkpoint={"keep": 2, "forced_save_fractions": []}, preflight={"checks": []})


@pytest.mark.slow
def test_walltime_signal_stops_the_in_process_trainer_and_records_the_requeue(tmp_path):
    """USR2 during built-in training: the trainer saves a verified checkpoint at the next step and
    stops; the run records the walltime stop and exits 0; a rerun resumes from that checkpoint."""
    from swiftslurm import checkpoint as ck

    out = tmp_path / "out"
    plan = make_plan_file(tmp_path, train_spec(out))
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists():  # training has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)[0][-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR2)
        text, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == NOT_REQUEUED_EXIT, text  # stopped partway, and nobody will continue it
    records = read_requeues(str(out))
    assert len(records) == 1 and records[0]["requeued"] is False, records  # the local run cannot requeue
    step = records[0]["global_step"]
    assert 1 <= step < 500
    newest = ck.newest_verified(out)
    assert newest is not None and newest.name == f"checkpoint-{step}"
    # the manifest records what it was trained with, so a resume under another spec can be refused
    from swiftslurm.checkpoint.fingerprint import training_fingerprint
    from swiftslurm.plan import read_plan_task

    _, task, ds = read_plan_task(plan, 0)
    assert ck.read_manifest(newest).meta["spec_fingerprint"] == training_fingerprint(task.spec, ds)
    # requeue = rerun: the next start reports the checkpoint as its resume point (its banner, before anything loads);
    # a walltime signal now, while it loads, stops it before its first step: no step trained, nothing new saved
    proc = subprocess.Popen([PY, "-m", "swiftslurm", "run", "--plan", str(plan)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(out / "logs", 5)
        deadline = time.monotonic() + 120
        seen = ""
        while f"checkpoint-{step}" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
        assert f"checkpoint-{step}" in seen, seen[-3000:]
        proc.send_signal(signal.SIGUSR2)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == NOT_REQUEUED_EXIT, rest[-3000:]
    assert "walltime stop before the first step of this run" in rest and "Traceback" not in rest, rest[-3000:]
    records = read_requeues(str(out))
    assert len(records) == 2 and records[1]["global_step"] == step, records
    assert ck.newest_verified(out).name == f"checkpoint-{step}" and not (out / f"checkpoint-{step + 1}").exists()


# ---------------------------------------------------------------- on the real cluster

HOLD_ALLREDUCE = """
import datetime, json, os, signal, sys, time
import torch, torch.distributed as dist
out, hold_until = sys.argv[1], sys.argv[2]  # hold: "usr2" (until USR2 on the first run) or a file to wait for
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=90))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
info = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_JOB_ID")}
info["sum"] = t.item()
with open(os.path.join(out, "rank-%d-restart%s.json" % (dist.get_rank(), restart)), "w") as fh:
    json.dump(info, fh)
deadline = time.monotonic() + 150  # the process group (and its store on MASTER_PORT) stays up while holding
if hold_until == "usr2":
    while restart == "0" and not got and time.monotonic() < deadline:
        time.sleep(0.1)
else:
    while not os.path.exists(hold_until) and time.monotonic() < deadline:
        time.sleep(0.1)
dist.destroy_process_group()
"""


def sbatch_script(tmp: Path, name: str, plan: Path, directives: str) -> Path:
    """A minimal batch script: one Slurm task per rank, each `swiftslurm run` (as render's script does)."""
    script = tmp / f"{name}.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name=rt-{name} --partition=debug --time=00:04:00 --cpus-per-task=1 {directives}\n"
        f"#SBATCH --output={tmp}/{name}-%j.out\n"
        f"cd {shlex.quote(str(ROOT))}\n"
        f"srun --unbuffered {shlex.quote(PY)} -m swiftslurm run --plan {shlex.quote(str(plan))}\n"
    )
    return script


def wait_state(job_id: str, states: set[str], timeout_s: float):
    from swiftslurm import slurm

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rec = slurm.job_records([job_id]).get(job_id)
        if rec and rec.state in states:
            return rec
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} not in {states} within {timeout_s} s: {slurm.job_records([job_id])}")


def wait_files(paths: list[Path], timeout_s: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            missing = [str(p) for p in paths if not p.exists()]
            logs = "".join(f.read_text()[-3000:] for f in sorted(log.glob("*.out"))) if log else ""
            raise AssertionError(f"missing after {timeout_s} s: {missing}\n{logs}")
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.slow
def test_cluster_allreduce_ports_and_requeue(tmp_path):
    """2 nodes x 2 tasks: gloo all-reduce from the derived env; a second job on the same nodes at the
    same time gets another MASTER_PORT; a walltime USR2 makes rank 0 requeue, and the rerun keeps the port."""
    from swiftslurm import slurm

    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir(), b_dir.mkdir()
    release = tmp_path / "release-b"
    plan_a = make_plan_file(a_dir, command_spec(a_dir, HOLD_ALLREDUCE, str(a_dir), "usr2", slurm="nodes = 2\ntasks_per_node = 2\nmax_requeues = 3"))
    plan_b = make_plan_file(b_dir, command_spec(b_dir, HOLD_ALLREDUCE, str(b_dir), str(release), slurm="nodes = 2\ntasks_per_node = 1"))
    job_a = slurm.sbatch(str(sbatch_script(tmp_path, "a", plan_a, "--nodes=2 --ntasks-per-node=2")))
    try:
        nodes = wait_state(job_a, {"RUNNING"}, 120).nodes
        job_b = slurm.sbatch(str(sbatch_script(tmp_path, "b", plan_b, f"--nodes=2 --ntasks-per-node=1 --nodelist={nodes}")))
        try:
            wait_files([a_dir / f"rank-{r}-restart0.json" for r in range(4)] + [b_dir / f"rank-{r}-restart0.json" for r in range(2)], 150, tmp_path)
            a0 = [json.loads((a_dir / f"rank-{r}-restart0.json").read_text()) for r in range(4)]
            b0 = [json.loads((b_dir / f"rank-{r}-restart0.json").read_text()) for r in range(2)]
            # the all-reduce: 1+2+3+4 on every rank, ranks spread 2 per node
            assert [r["sum"] for r in a0] == [10.0] * 4
            assert [r["WORLD_SIZE"] for r in a0] == ["4"] * 4
            assert sorted((r["SLURMD_NODENAME"], r["LOCAL_RANK"]) for r in a0) == sorted((n, str(i)) for n in slurm.show_hostnames(nodes) for i in range(2))
            assert {r["MASTER_ADDR"] for r in a0} == {slurm.show_hostnames(nodes)[0]}
            # both jobs hold their process group (store on MASTER_PORT) at this moment, on the same nodes
            assert {r["SLURMD_NODENAME"] for r in b0} == {r["SLURMD_NODENAME"] for r in a0}
            assert [r["sum"] for r in b0] == [3.0, 3.0]
            port_a, port_b = {r["MASTER_PORT"] for r in a0}, {r["MASTER_PORT"] for r in b0}
            assert len(port_a) == len(port_b) == 1 and port_a != port_b
            release.touch()
            # the walltime signal, as Slurm's --signal=USR2@grace sends it: to every task of the step
            subprocess.run(["scancel", "--signal=USR2", job_a], check=True, timeout=30)
            wait_files([a_dir / f"rank-{r}-restart1.json" for r in range(4)], 150, tmp_path)
            a1 = [json.loads((a_dir / f"rank-{r}-restart1.json").read_text()) for r in range(4)]
            assert [r["sum"] for r in a1] == [10.0] * 4
            assert {r["MASTER_PORT"] for r in a1} == port_a  # requeued: same job id, same port
            assert {r["SLURM_JOB_ID"] for r in a1} == {job_a}
            records = read_requeues(str(a_dir / "out"))
            assert len(records) == 1 and records[0]["requeued"] is True and records[0]["job_id"] == job_a
            assert wait_state(job_a, {"COMPLETED"}, 60).restarts >= 1
            assert wait_state(job_b, {"COMPLETED"}, 60)
        finally:
            release.touch()
            slurm.scancel([job_b])
    finally:
        slurm.scancel([job_a])


@pytest.mark.slurm
def test_cluster_mis_sized_allocation_stops_before_training(tmp_path):
    """The spec says 2 tasks per node; the job runs 1 per node: every rank stops with the hint."""
    from swiftslurm import slurm

    plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), slurm="nodes = 2\ntasks_per_node = 2"))
    job = slurm.sbatch(str(sbatch_script(tmp_path, "small", plan, "--nodes=2 --ntasks-per-node=1")))
    try:
        rec = wait_state(job, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, 150)
    finally:
        slurm.scancel([job])
    out = (tmp_path / f"small-{job}.out").read_text()
    assert rec.state == "FAILED", out
    assert "the spec asks for 2 per node" in out and "HINT: set sbatch/srun --ntasks-per-node=2" in out
    assert "Traceback" not in out
    assert not list(tmp_path.glob("env-*.json"))  # the command never started


def test_busy_master_port_stops_rank0_before_the_command(tmp_path):
    """MASTER_PORT already taken on the master node: rank 0 says so, with the fix, before any rendezvous."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        plan = make_plan_file(tmp_path, command_spec(tmp_path, DUMP_ENV, str(tmp_path), extra=f'[env]\nMASTER_PORT = "{port}"\n'))
        proc = run_cli("--plan", str(plan))
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stderr
    assert f"MASTER_PORT {port} is busy" in proc.stderr and "HINT" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "env-0.json").exists()


def _held_rank(job_id: str) -> int | None:
    """The pid of the job's rank process while it holds USR2 without a handler (still importing), else None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        rank = cmd.split(b"\0")[1:3] == [b"-m", b"swiftslurm.node.hold"]  # the rank itself, not the srun that started it
        if rank and f"SLURM_JOB_ID={job_id}\0".encode() in environ and usr2_held_without_handler(int(entry.name)):
            return int(entry.name)
    return None


@pytest.mark.slurm
def test_cluster_walltime_signal_while_a_submitit_rank_imports_is_a_walltime_stop(tmp_path):
    """submitit's path (swiftslurm submit): a USR2 that reaches the rank while it still imports (no handler yet:
    the default action kills; then submitit's handler would fail rank 0 as not checkpointable) is held, then taken as
    swiftslurm's walltime stop: the command never starts, the stop is recorded, max_requeues = 0 fails the job.

    The window lasts a few hundred milliseconds; the test keeps it open by holding back the job's pickle, which the
    rank waits for (submitit polls for it each second) with USR2 held and no handler yet, and gives it back once the
    signal is sent. The job is submitted held (``--hold``) and released once its pickle is away: on an idle cluster
    the rank started and read the pickle before the test could move it (rehearsal of 2026-12-07)."""
    (tmp_path / "s.toml").write_text(command_spec(tmp_path, SIGNALLED, str(tmp_path),
                                                  slurm='partition = "debug"\nnodes = 1\ntasks_per_node = 1\ntime = "00:03:00"\n'
                                                        'max_requeues = 0\nextra_sbatch = ["--hold"]'))
    proc = subprocess.run([PY, "-m", "swiftslurm", "submit", "s.toml", "--executor", "slurm", "--json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = json.loads(proc.stdout)["job_ids"][0]
    pickles = list((tmp_path / "out").rglob(f"{job}_submitted.pkl"))
    assert len(pickles) == 1, "submitit wrote no pickle where the test looks for it"
    for pickle in pickles:
        pickle.rename(pickle.with_name(pickle.name + ".held"))
    subprocess.run(["scontrol", "release", job], check=True, capture_output=True, timeout=30)
    try:
        deadline, pid = time.monotonic() + 120, None
        while pid is None and time.monotonic() < deadline and not (tmp_path / "ready").exists():
            pid = _held_rank(job)
            time.sleep(0.005)
        assert pid is not None, "no rank of the job was seen holding USR2 while it started"
        os.kill(pid, signal.SIGUSR2)
        for pickle in pickles:
            pickle.with_name(pickle.name + ".held").rename(pickle)
        rec = wait_state(job, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, 120)
    finally:
        from swiftslurm import slurm

        slurm.scancel([job])
    records = read_requeues(str(tmp_path / "out"))
    assert rec.state == "FAILED" and not (tmp_path / "ready").exists()
    assert len(records) == 1 and records[0]["global_step"] is None and records[0]["outcome"] == "max_requeues", records


WAIT_USR2 = """
import os, signal, sys, time
out = sys.argv[1]
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
open(os.path.join(out, "ready-" + os.environ["RANK"]), "w").close()
t = time.monotonic()
while not got and time.monotonic() - t < 90:
    time.sleep(0.1)
open(os.path.join(out, "usr2-" + os.environ["RANK"]), "w").write(str(bool(got)))
"""


@pytest.mark.slurm
def test_cluster_walltime_stop_that_slurm_refuses_to_requeue_fails_the_job(tmp_path):
    """The rendered script as it runs (srun --kill-on-bad-exit=1), 2 nodes, a job Slurm may not requeue
    (--no-requeue): the walltime stop ends the job FAILED, not COMPLETED, and the record says Slurm refused."""
    from swiftslurm import slurm
    from swiftslurm.slurm.render import render_sbatch

    toml = command_spec(tmp_path, WAIT_USR2, str(tmp_path), slurm='partition = "debug"\nnodes = 2\ntasks_per_node = 1\ntime = "00:03:00"\nmax_requeues = 5')
    plan = make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source="test.toml")
    script = render_sbatch(plan)
    write_plan(plan, script)
    (tmp_path / "job.sh").write_text(script)
    job = slurm.sbatch(str(tmp_path / "job.sh"), extra=["--no-requeue"])
    try:
        wait_files([tmp_path / "ready-0", tmp_path / "ready-1"], 120, tmp_path / "out")
        subprocess.run(["scancel", "--signal=USR2", job], check=True, timeout=30)
        rec = wait_state(job, {"FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"}, 90)
    finally:
        slurm.scancel([job])
    log = "".join(p.read_text() for p in (tmp_path / "out").glob("slurm-*.out"))
    assert rec.state == "FAILED", log[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.glob("usr2-*")} == {"usr2-0": "True", "usr2-1": "True"}
    records = read_requeues(str(tmp_path / "out"))
    assert len(records) == 1 and records[0]["outcome"] == "refused" and records[0]["job_id"] == job, records
    assert "requeue refused by Slurm" in records[0]["message"] and "requeue refused by Slurm" in log
    assert stop_reason(records, job) == records[0]["message"]
