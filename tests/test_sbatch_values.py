"""What reaches Slurm is what the spec said: #SBATCH values through sbatch's own tokenizer, and each
rank's CPUs (srun of 22.05-23.02 does not inherit --cpus-per-task)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm import slurm
from swiftslurm.plan import make_plan
from swiftslurm.slurm.render import render_sbatch
from swiftslurm.spec import parse_spec, parse_toml

# backslashes, both quotes, '#' (a comment to sbatch), '$' and spaces: sbatch's tokenizer eats or cuts each unless quoted right
ODD_COMMENT = "a\\b c\\\\d 'e' \"f\" #g $h %i"


def plan_of(toml: str, base: Path):
    return make_plan(parse_spec(toml), parse_toml(toml), str(base))


def odd_plan(tmp_path: Path):
    entry = json.dumps(f"--comment={ODD_COMMENT}")  # a TOML basic string is JSON-compatible here
    return plan_of(f'[job]\noutput_dir = "out"\n[slurm]\ntime = "5"\nextra_sbatch = [{entry}]\n[train]\ncommand = ["true"]\n', tmp_path)


def submitit_script(plan, folder: Path) -> str:
    from submitit.slurm.slurm import _make_sbatch_string

    from swiftslurm.jobs.send import slurm_parameters

    params = slurm_parameters(plan)
    return _make_sbatch_string(command="true", folder=str(folder), **params)


def test_the_submitit_script_gives_srun_the_cpus_per_task(tmp_path):
    toml = '[slurm]\ncpus_per_task = 3\n[train]\ncommand = ["true"]\n'
    script = submitit_script(plan_of(toml, tmp_path), tmp_path)
    srun = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert srun and "--cpus-per-task=3" in srun[0]
    assert "export SRUN_CPUS_PER_TASK=3\n" in render_sbatch(plan_of(toml, tmp_path))


def held_comment(script: Path) -> str:
    """Submit held, read back the job's Comment as slurmctld stored it, cancel."""
    proc = subprocess.run(["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    job_id = slurm.parse_sbatch_parsable(proc.stdout)
    try:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
        (job,) = slurm.parse_scontrol_job(shown)
        return job["Comment"]
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


@pytest.mark.slurm
def test_sbatch_reads_back_odd_values_from_the_rendered_script(slurm_cluster, tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(odd_plan(tmp_path)))
    assert held_comment(script) == ODD_COMMENT


@pytest.mark.slurm
def test_sbatch_reads_back_odd_values_from_the_submitit_script(slurm_cluster, tmp_path):
    script = tmp_path / "submitit.sh"
    script.write_text(submitit_script(odd_plan(tmp_path), tmp_path))
    assert held_comment(script) == ODD_COMMENT


PROBE = (
    "import json, os, sys; from pathlib import Path; rank = os.environ.get('RANK', os.environ.get('SLURM_PROCID'));"
    "Path(sys.argv[1], f'cpus-{rank}.json').write_text(json.dumps("
    "{'affinity': len(os.sched_getaffinity(0)), **{k: os.environ.get(k) for k in ('SRUN_CPUS_PER_TASK', 'SLURM_CPUS_PER_TASK',"
    " 'SLURM_JOB_ID', 'SLURM_STEP_ID', 'SLURM_STEP_NUM_TASKS')}}))"
)


@pytest.mark.slurm
def test_every_rank_gets_cpus_per_task_cpus(slurm_cluster, tmp_path):
    """Both submit paths hand cpus_per_task to the steps: SRUN_CPUS_PER_TASK (rendered) and srun -c (submitit).

    Slurm allocates each rank's step cpus_per_task CPUs per task, on every cluster: the step's AllocCPUS in
    sacct is tasks x cpus_per_task and each rank sees SLURM_CPUS_PER_TASK. On a cluster that binds
    (task/affinity, task/cgroup) each rank also sees only those CPUs. The test cluster cannot bind: it
    advertises 4 CPUs per node on a 2-core machine, and with task/affinity slurmd cannot even lay out
    `srun -c4` ("Unable to layout tasks on given cpus"), so it runs task/none; the affinity check runs where
    the cluster binds.
    """
    toml = f"""
[job]
output_dir = "out"
[slurm]
nodes = 1
tasks_per_node = 2
cpus_per_task = 2
time = "3"
signal_grace_s = 10
[preflight]
checks = []
[train]
command = ["{sys.executable}", "-c", "{PROBE}", "{tmp_path / 'probe'}"]
"""
    (tmp_path / "probe").mkdir()
    spec_file = tmp_path / "job.toml"
    spec_file.write_text(toml)
    cli = [sys.executable, "-m", "swiftslurm"]
    r = subprocess.run([*cli, "submit", str(spec_file), "--executor", "slurm", "--wait"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    submitit_runs = sorted((tmp_path / "probe").glob("cpus-*.json"))
    for p in submitit_runs:
        p.rename(p.with_name("submitit-" + p.name))
    r = subprocess.run([*cli, "render", str(spec_file), "-o", str(tmp_path / "job.sh")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    from conftest import wait_for_job

    job_id = slurm.parse_sbatch_parsable(subprocess.run(["sbatch", "--parsable", str(tmp_path / "job.sh")], cwd=tmp_path,
                                                        capture_output=True, text=True, timeout=30).stdout)
    wait_for_job(job_id, timeout_s=180)
    rendered_runs = sorted((tmp_path / "probe").glob("cpus-*.json"))
    assert len(submitit_runs) == 2 and len(rendered_runs) == 2, (submitit_runs, rendered_runs)
    seen = {p.name: json.loads(p.read_text()) for p in (tmp_path / "probe").glob("*.json")}
    assert all(v["SRUN_CPUS_PER_TASK"] == "2" for k, v in seen.items() if not k.startswith("submitit-")), seen
    # what Slurm allocated: each rank's step holds 2 tasks x 2 CPUs, and says so to the rank
    assert {k: v["SLURM_CPUS_PER_TASK"] for k, v in seen.items()} == {k: "2" for k in seen}, seen
    steps = {(v["SLURM_JOB_ID"], v["SLURM_STEP_ID"]) for v in seen.values()}
    assert len(steps) == 2 and all(v["SLURM_STEP_NUM_TASKS"] == "2" for v in seen.values()), seen  # one step per path
    for job, step in steps:
        alloc = subprocess.run(["sacct", "-n", "-P", "-j", f"{job}.{step}", "-o", "JobID,AllocCPUS"], capture_output=True, text=True, timeout=30)
        # only this step's row: another array's task may have had the same raw id (conftest.sacct_rows)
        mine = [row.split("|")[1] for row in alloc.stdout.splitlines() if row.split("|")[0] == f"{job}.{step}"]
        assert mine == ["4"], (job, step, alloc.stdout, alloc.stderr)
    # submitit's path: -c on the srun line of the batch script it wrote
    scripts = sorted((tmp_path / "out").rglob("*_submission.sh"))
    assert scripts, "submitit's batch script not found"
    for script in scripts:
        srun_lines = [ln for ln in script.read_text().splitlines() if ln.lstrip().startswith("srun ")]
        assert srun_lines and all("--cpus-per-task=2" in ln for ln in srun_lines), script.read_text()
    task_plugin = slurm.show_config().get("TaskPlugin", "")
    if "affinity" in task_plugin or "cgroup" in task_plugin:  # a cluster that binds: each rank sees its CPUs
        assert {k: v["affinity"] for k, v in seen.items()} == {k: 2 for k in seen}, seen
