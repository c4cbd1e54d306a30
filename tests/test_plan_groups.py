"""A sweep over allocation keys: one sbatch array per distinct allocation (pure: plan, render, submitit params, CLI)."""

import json
import os
import subprocess
import sys

import pytest

from swiftslurm.errors import OneScriptTooFew
from swiftslurm.jobs.send import Submission, slurm_parameters
from swiftslurm.plan import make_plan
from swiftslurm.slurm.render import array_spec, index_ranges, render_all, render_sbatch, sbatch_directives
from swiftslurm.spec import parse_toml, validate_spec

BASE = """
[job]
name = "g1"
output_dir = "out"
[slurm]
partition = "debug"
nodes = 1
tasks_per_node = 1
time = "00:05:00"
signal_grace_s = 30
[train]
command = ["true"]
[preflight]
checks = []
[sweep]
{sweep}
"""


def plan_of(tmp_path, sweep):
    raw = parse_toml(BASE.format(sweep=sweep))
    return make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="g.toml")


def opts(plan, group):
    return dict(sbatch_directives(plan, group))


def test_nodes_sweep_gives_one_group_per_allocation_with_global_indices(tmp_path):
    plan = plan_of(tmp_path, '"slurm.nodes" = [1, 2]\nseed = [1, 2, 3]')
    assert [t.spec.slurm.nodes for t in plan.tasks] == [1, 1, 1, 2, 2, 2]
    assert [g.tasks for g in plan.groups] == [(0, 1, 2), (3, 4, 5)]
    assert [opts(plan, g)["nodes"] for g in plan.groups] == ["1", "2"]
    assert [array_spec(plan, g) for g in plan.groups] == ["0-2%3", "3-5%3"]
    # task dirs stay global: output_dir/<global index>
    assert [t.output_dir for t in plan.tasks] == [str(tmp_path / "out" / str(i)) for i in range(6)]
    # submitit carries each group's own allocation
    assert [slurm_parameters(plan, g)["nodes"] for g in plan.groups] == [1, 2]


def test_interleaved_groups_list_sparse_indices(tmp_path):
    plan = plan_of(tmp_path, 'seed = [1, 2]\n"slurm.time" = ["00:05:00", "00:20:00"]')
    assert [g.tasks for g in plan.groups] == [(0, 2), (1, 3)]
    assert [opts(plan, g)["time"] for g in plan.groups] == ["00:05:00", "00:20:00"]
    scripts = render_all(plan)
    assert "#SBATCH --array=0,2%2" in scripts[0] and "#SBATCH --array=1,3%2" in scripts[1]
    assert "#SBATCH --time=00:20:00" in scripts[1] and "#SBATCH --time=00:20:00" not in scripts[0]
    for script in scripts:
        path = tmp_path / "s.sh"
        path.write_text(script)
        subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.parametrize(
    "sweep, option, values",
    [
        ('"slurm.tasks_per_node" = [1, 2]', "ntasks-per-node", ["1", "2"]),
        ('"slurm.cpus_per_task" = [1, 2]', "cpus-per-task", ["1", "2"]),
        ('"slurm.mem" = ["1G", "2G"]', "mem", ["1G", "2G"]),
        ('"slurm.partition" = ["debug", "other"]', "partition", ["debug", "other"]),
        ('"slurm.signal_grace_s" = [30, 60]', "signal", ["USR2@30", "USR2@60"]),
        ('"slurm.extra_sbatch" = [["--comment=a"], ["--comment=b"]]', "comment", ["a", "b"]),
    ],
)
def test_every_allocation_key_splits_the_array(tmp_path, sweep, option, values):
    plan = plan_of(tmp_path, sweep)
    assert len(plan.groups) == 2
    assert [opts(plan, g)[option] for g in plan.groups] == values


def test_max_requeues_sweep_splits_too(tmp_path):
    """submitit's requeue count is per executor: a different max_requeues is another submission."""
    plan = plan_of(tmp_path, '"slurm.max_requeues" = [0, 3]')
    assert [g.slurm.max_requeues for g in plan.groups] == [0, 3]


def test_training_sweep_stays_one_array(tmp_path):
    plan = plan_of(tmp_path, "learning_rate = [1e-4, 2e-4]\nseed = [1, 2]")
    assert len(plan.groups) == 1 and plan.groups[0].tasks == (0, 1, 2, 3)
    assert array_spec(plan) == "0-3%4"
    assert render_sbatch(plan) == render_all(plan)[0]


def test_one_script_cannot_hold_two_allocations(tmp_path):
    plan = plan_of(tmp_path, '"slurm.nodes" = [1, 2]')
    with pytest.raises(OneScriptTooFew, match="2 different allocations") as err:
        render_sbatch(plan)
    assert "render SPEC -o FILE" in err.value.hint


def test_plan_json_lists_groups_with_their_scripts(tmp_path):
    plan = plan_of(tmp_path, '"slurm.nodes" = [1, 2]\nseed = [7, 8]')
    doc = plan.to_json(render_all(plan))
    assert [(g["tasks"], g["nodes"], g["world_size"]) for g in doc["groups"]] == [([0, 1], 1, 1), ([2, 3], 2, 2)]
    assert "#SBATCH --nodes=2" in doc["groups"][1]["sbatch"] and doc["sbatch"] is None
    single = plan_of(tmp_path, "seed = [7, 8]")
    assert single.to_json(render_all(single))["sbatch"].startswith("#!/bin/bash")


def test_index_ranges():
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert index_ranges((4,)) == "4"
    assert index_ranges([]) == ""


def test_record_maps_every_array_and_ranks(tmp_path):
    sub = Submission("slurm", ["10_0", "11_0", "10_1", "11_1"], "o", ["a", "b", "c", "d"], "",
                     arrays=[{"job_id": "10", "tasks": [0, 2], "ranks_per_task": 1}, {"job_id": "11", "tasks": [1, 3], "ranks_per_task": 4}])
    assert sub.slurm_job_ids == ["10", "11"]
    assert [sub.ranks_of(i) for i in range(4)] == [1, 4, 1, 4]
    again = Submission.from_json(json.loads(json.dumps(sub.to_json())))
    assert again.arrays == sub.arrays


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def test_cli_plan_shows_groups_and_render_writes_one_script_each(tmp_path):
    (tmp_path / "s.toml").write_text(BASE.format(sweep='"slurm.nodes" = [1, 2]'))
    shown = _cli("plan", "s.toml", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "2 allocation(s)" in shown.stdout and "2 x 1 = 2" in shown.stdout
    doc = json.loads(_cli("plan", "s.toml", "--json", cwd=tmp_path).stdout)
    assert [g["tasks"] for g in doc["groups"]] == [[0], [1]]
    refused = _cli("render", "s.toml", cwd=tmp_path)
    assert refused.returncode == 2 and "2 different allocations" in refused.stderr and "Traceback" not in refused.stderr
    wrote = _cli("render", "s.toml", "-o", "job.sh", cwd=tmp_path)
    assert wrote.returncode == 0, wrote.stderr
    assert "#SBATCH --nodes=1" in (tmp_path / "job.group0.sh").read_text()
    assert "#SBATCH --nodes=2" in (tmp_path / "job.group1.sh").read_text()
    assert "#SBATCH --array=1%1" in (tmp_path / "job.group1.sh").read_text()
    assert not (tmp_path / "job.sh").exists()
