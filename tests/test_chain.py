"""Where `scontrol requeue` is refused: the singleton chain (issue 35, slurm.continue_with = "singleton").

A stand-in `scontrol`, first on the job's PATH (the spec's [env]), refuses `requeue` as such a site does and passes
everything else to the real one. A walltime stop (Slurm's USR2, sent with `scancel --signal=USR2` as the
time limit's --signal would, only sooner) then continues as a new job with --dependency=singleton:

- a submitit job of the built-in trainer: the training goes on in the next link and finishes (COMPLETED), and
  `status` of the output dir shows one task, the newest link, with the continuation counted;
- a rendered script sent with plain sbatch: the next link is the same script file, found through `scontrol show job`.

The bound (max_requeues counts the chain's links) is checked on the runtime's own decision, without a cluster.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import sacct_rows, wait_for_job
from runs import ONE_RANK_A_NODE, QUIET, last_step, tiny_spec

from swiftslurm.node import chain
from swiftslurm.node.requeue import NOT_REQUEUED_EXIT, after_walltime_stop
from swiftslurm.records.requeues import read_requeues
from swiftslurm.slurm import parse_batch_script
from swiftslurm.slurm.distenv import derive
from swiftslurm.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"

STANDIN = """#!/bin/sh
# a site that does not let users requeue: `scontrol requeue` is refused, everything else is the real scontrol
echo "$*" >> "{calls}"
if [ "$1" = "requeue" ]; then
    echo "scontrol: error: Requeue of job is not permitted for users on this cluster" >&2
    exit 1
fi
exec {real} "$@"
"""


def standin_path(tmp: Path) -> str:
    """A dir holding the refusing `scontrol`, then the PATH the test runs with."""
    import shutil

    where = tmp / "site-bin"
    where.mkdir()
    real = shutil.which("scontrol")
    assert real, "scontrol is not on PATH"
    (where / "scontrol").write_text(STANDIN.format(calls=tmp / "scontrol-calls", real=real))
    (where / "scontrol").chmod(0o755)
    return f"{where}:{os.environ['PATH']}"


# ---------------------------------------------------------------- pure parts


def test_chain_record_follows_to_the_newest_link():
    chains = chain.with_link([], "10", "14")
    chains = chain.with_link(chains, "14", "19")
    chains = chain.with_link(chains, "30", "31")  # another submission into the same dir: its own chain
    assert chains == [["10", "14", "19"], ["30", "31"]]
    assert chain.newest(chains, "10") == ["10", "14", "19"] and chain.newest(chains, "12") == ["12"]
    assert [chain.links_before(chains, j) for j in ("10", "14", "19", "31", "99")] == [0, 1, 2, 1, 0]


def test_the_next_link_gets_no_variable_of_this_job():
    env = {"PATH": "/bin", "HOME": "/h", "SLURM_RESTART_COUNT": "2", "SLURM_ARRAY_TASK_ID": "3", "SBATCH_PARTITION": "x",
           "SUBMITIT_FOLDER": "/f", "RANK": "0", "MASTER_PORT": "1234", "SWIFTSLURM_TASK": "3", "OMP_NUM_THREADS": "1"}
    assert chain.submit_env(env) == {"PATH": "/bin", "HOME": "/h", "OMP_NUM_THREADS": "1"}


def test_batch_script_is_read_from_scontrol_show_job():
    shown = ("JobId=41 JobName=my run UserId=root(0) Command=/runs/my run/job.sh WorkDir=/runs/my run "
             "StdErr=/runs/my run/slurm-41.out")
    assert parse_batch_script(shown) == "/runs/my run/job.sh"
    assert parse_batch_script("JobId=42 Command=(null) WorkDir=/x") == ""


def test_submitit_work_is_its_script_and_pickle(tmp_path):
    (tmp_path / "7_submission.sh").write_text("#!/bin/bash\n")
    (tmp_path / "7_3_submitted.pkl").write_bytes(b"x")
    how = chain.how_to_resubmit("7_3", {"SUBMITIT_FOLDER": str(tmp_path)}, lambda job: pytest.fail("not asked"))
    assert how.script == str(tmp_path / "7_submission.sh") and how.extra == ("--array=3",)
    assert how.pickle == str(tmp_path / "7_3_submitted.pkl")
    with pytest.raises(ValueError, match="submitit's files of job 8"):
        chain.how_to_resubmit("8", {"SUBMITIT_FOLDER": str(tmp_path)}, lambda job: "")
    with pytest.raises(ValueError, match="names no batch script"):
        chain.how_to_resubmit("9", {}, lambda job: "")


def test_max_requeues_bounds_the_chain(tmp_path):
    """The third link of a chain whose spec allows 2 continuations stops at walltime with exit 75: the runtime's own
    decision, before any Slurm call (none could be made here: there is no job 19)."""
    spec = parse_spec('[job]\nname = "c"\n[slurm]\nmax_requeues = 2\ncontinue_with = "singleton"\n')
    out = str(tmp_path)
    chain.write_chains(out, [["10", "14", "19"]], "c")
    dist = derive({"SLURM_JOB_ID": "19", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODEID": "0",
                   "SLURM_JOB_NODELIST": "node1", "SLURMD_NODENAME": "node1", "SLURM_TASKS_PER_NODE": "1"})
    code = after_walltime_stop(dist, spec, out, logging.getLogger("test"), step=30)
    (record,) = read_requeues(out)
    assert code == NOT_REQUEUED_EXIT and record["outcome"] == "max_requeues" and "after 2 requeue(s)" in record["message"]


# ---------------------------------------------------------------- on the cluster

def chain_spec(out: Path, path: str) -> str:
    return tiny_spec("chain-train", out, data=DATA,
                     slurm={**ONE_RANK_A_NODE, "time": "00:10:00", "signal_grace_s": 10, "max_requeues": 1,
                            "continue_with": "singleton"},
                     train={"max_steps": 120, "max_length": 128, "save_steps": 1000, "logging_steps": 1,
                            "straggler_window": 0, "report_to": ["none"]},
                     **QUIET, env={"OMP_NUM_THREADS": "1", "PATH": path, "SWIFTSLURM_TEST_MIN_STEP_S": "0.1"})


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, **kw)


def wait_until(what, timeout_s: float, why: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = what()
        if found:
            return found
        time.sleep(0.5)
    raise TimeoutError(why)


@pytest.mark.slurm
def test_refused_requeue_continues_as_a_singleton_chain_to_the_end(tmp_path, slurm_cluster):
    out = tmp_path / "run"
    spec = tmp_path / "chain.toml"
    spec.write_text(chain_spec(out, standin_path(tmp_path)))
    sent = cli("submit", str(spec), "--executor", "slurm")
    assert sent.returncode == 0, sent.stdout + sent.stderr
    first = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"][0]
    try:
        wait_until(lambda: last_step(out) >= 3, 900, f"job {first} logged no step")
        subprocess.run(["scancel", "--signal=USR2", first], check=True, timeout=30)  # what --signal=USR2@grace sends
        assert wait_for_job(first, timeout_s=600)[first] == "COMPLETED"
        links = chain.read_chains(str(out))
        assert len(links) == 1 and links[0][0] == first and len(links[0]) == 2, links
        second = links[0][1]
        state = wait_for_job(second, timeout_s=1500)
    finally:
        subprocess.run(["scancel", "--name=chain-train"], capture_output=True, timeout=30)
    logs = "\n".join(p.read_text(errors="replace") for p in (out / "logs").rglob("*") if p.suffix in (".err", ".out"))
    assert state[second] == "COMPLETED", f"{state}\n{logs[-3000:]}"

    (record,) = read_requeues(str(out))
    assert record["job_id"] == first and record["outcome"] == "chained" and record["next_job"] == second
    assert 3 <= record["global_step"] < 120
    assert f"continued as job {second}" in logs and "training finished at step 120" in logs
    assert last_step(out) == 120
    # the new job ran after the first ended: singleton, the same name
    assert sacct_rows(second, "JobName") == [["chain-train"]]

    status = cli("status", str(out), "--json")
    task = json.loads(status.stdout)["tasks"]
    assert [(t["job_id"], t["state"], t["restarts"]) for t in task] == [(second, "COMPLETED", 1)], status.stdout


RENDERED_COMMAND = """
import os, signal, sys, time
marker = os.path.join(sys.argv[1], "first-link-done")
if os.path.exists(marker):
    sys.exit(0)  # the continuation: the work is done
got = []
signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))
open(os.path.join(sys.argv[1], "ready"), "w").close()
t = time.monotonic()
while not got and time.monotonic() - t < 120:
    time.sleep(0.1)
open(marker, "w").close()
"""


@pytest.mark.slurm
def test_a_rendered_script_continues_as_the_same_script(tmp_path, slurm_cluster):
    script = tmp_path / "cmd.py"
    script.write_text(RENDERED_COMMAND)
    out = tmp_path / "out"
    spec = tmp_path / "rendered.toml"
    spec.write_text(f'[job]\nname = "chain-rendered"\noutput_dir = "{out}"\n'
                    f'[slurm]\npartition = "debug"\ntime = "00:05:00"\nmax_requeues = 3\ncontinue_with = "singleton"\n'
                    f'[train]\ncommand = ["{sys.executable}", "{script}", "{tmp_path}"]\n'
                    f'[env]\nPATH = "{standin_path(tmp_path)}"\nPYTHONPATH = "{ROOT}"\n')
    rendered = cli("render", str(spec), "-o", str(tmp_path / "job.sh"))
    assert rendered.returncode == 0, rendered.stdout + rendered.stderr
    from swiftslurm import slurm

    first = slurm.sbatch(str(tmp_path / "job.sh"), extra=[f"--chdir={tmp_path}"])
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), 600, f"job {first} did not start its command")
        subprocess.run(["scancel", "--signal=USR2", first], check=True, timeout=30)
        assert wait_for_job(first, timeout_s=120)[first] == "COMPLETED"
        links = chain.read_chains(str(out))
        assert len(links) == 1 and links[0][0] == first and len(links[0]) == 2, links
        state = wait_for_job(links[0][1], timeout_s=120)
    finally:
        subprocess.run(["scancel", "--name=chain-rendered"], capture_output=True, timeout=30)
    assert state[links[0][1]] == "COMPLETED"
    calls = (tmp_path / "scontrol-calls").read_text().splitlines()
    assert f"show job -o {first}" in calls and not any(c.startswith("requeue") for c in calls), calls
    assert sacct_rows(links[0][1], "JobName", "WorkDir")[0] == ["chain-rendered", str(tmp_path)]
