"""render_sbatch: the standalone script (pure parts here; `sbatch` of it runs in test_submit.py)."""

import os
import subprocess
import sys

import pytest

from swiftslurm.errors import SpecError
from swiftslurm.jobs.send import slurm_parameters
from swiftslurm.plan import make_plan
from swiftslurm.slurm.render import render_sbatch, sbatch_directives
from swiftslurm.spec import parse_toml, validate_spec

BASE = """
[job]
name = "r1"
output_dir = "{out}"
[slurm]
nodes = 2
tasks_per_node = 2
cpus_per_task = 1
time = "00:05:00"
signal_grace_s = 30
{slurm_extra}
[train]
command = ["true"]
[preflight]
checks = []
{tail}
"""


def plan_of(tmp_path, out="out", slurm_extra="", tail=""):
    text = BASE.format(out=out, slurm_extra=slurm_extra, tail=tail)
    raw = parse_toml(text)
    return make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="test.toml")


def directives(script: str) -> list[str]:
    return [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]


def test_single_job_directives_and_srun_line(tmp_path):
    plan = plan_of(tmp_path, slurm_extra='partition = "debug"\nmem = "1G"\nextra_sbatch = ["--exclusive", "--comment=hi there"]')
    script = render_sbatch(plan, python="/opt/py/bin/python")
    assert directives(script) == [
        "#SBATCH --job-name=r1",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=1",
        "#SBATCH --mem=1G",
        "#SBATCH --time=00:05:00",
        "#SBATCH --partition=debug",
        "#SBATCH --signal=USR2@30",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --exclusive",
        "#SBATCH --comment='hi there'",
        f"#SBATCH --output={tmp_path}/out/slurm-%j.out",
    ]
    assert f"/opt/py/bin/python -m swiftslurm run --plan {tmp_path}/out/swiftslurm-plan.json &" in script
    assert "trap forward_usr2 USR2" in script
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)


def test_sweep_is_one_array_with_parallelism(tmp_path):
    plan = plan_of(tmp_path, slurm_extra="array_parallelism = 2", tail="[sweep]\nlearning_rate = [1e-4, 2e-4, 3e-4]\nseed = [1, 2]")
    script = render_sbatch(plan)
    assert "#SBATCH --array=0-5%2" in directives(script)
    assert f"#SBATCH --output={tmp_path}/out/slurm-%A_%a.out" in directives(script)


def test_submitit_sends_the_same_directives(tmp_path):
    """The submitit path carries every render directive (native names or additional_parameters)."""
    plan = plan_of(tmp_path, slurm_extra='partition = "debug"\nmem = "1G"\nreservation = "r"\nextra_sbatch = ["--exclusive"]', tail='[env]\nA = "x y"')
    params = slurm_parameters(plan)
    sent = {**{k: v for k, v in params.items() if k != "additional_parameters"}, **params["additional_parameters"]}
    assert sent["job_name"] == "r1" and sent["nodes"] == 2 and sent["ntasks_per_node"] == 2
    assert sent["time"] == "00:05:00" and sent["mem"] == "1G" and sent["reservation"] == "r"
    assert sent["requeue"] is True and sent["exclusive"] is True and sent["open-mode"] == "append"
    assert params["signal_delay_s"] == 30 and params["setup"] == ["export A='x y'"]
    assert "gpus_per_node" not in sent  # omitted when 0
    assert {k for k, _ in sbatch_directives(plan)} - {"signal"} <= {
        "job-name", "nodes", "ntasks-per-node", "cpus-per-task", "mem", "time", "partition", "reservation", "requeue", "open-mode", "exclusive"
    }


def test_submitit_writes_usr2_without_batch_flag(tmp_path):
    """--signal=USR2@N reaches every rank; B:USR2 would only reach the batch shell."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = slurm_parameters(plan_of(tmp_path))
    text = _make_sbatch_string(command="true", folder=str(tmp_path), **params)
    assert "#SBATCH --signal=USR2@30" in text
    assert "#SBATCH --requeue" in text and "#SBATCH --open-mode=append" in text
    assert "wckey" not in text


def test_env_values_arrive_literally(tmp_path):
    """Run the script's export lines in bash: the values come out byte for byte."""
    pwned = tmp_path / "pwned"
    values = {"A": f"'; touch {pwned} #", "B": f"$(touch {pwned})", "C": f"`touch {pwned}`", "D": "two\nlines", "E": "sp aces"}
    tail = "[env]\n" + "\n".join(f"{k} = {json_str(v)}" for k, v in values.items())
    script = render_sbatch(plan_of(tmp_path, tail=tail))
    exports = script[: script.index("srun_pid=")]  # directives, plan check, exports: everything before srun
    exports = exports.replace('if [ ! -r "$SWIFTSLURM_PLAN" ]', "if false")
    probe = exports + "\n" + "".join(f"printf '%s\\0' \"${k}\"\n" for k in values)
    out = subprocess.run(["bash", "-c", probe], capture_output=True, check=True).stdout.decode().split("\0")[:-1]
    assert out == list(values.values())
    assert not pwned.exists()


def json_str(v: str) -> str:
    import json

    return json.dumps(v)


@pytest.mark.parametrize("opt,field", [("--array=0-3", "[sweep]"), ("--job-name=x", "job.name"), ("--signal=B:USR2@9", "signal_grace_s"),
                                       ("--wrap=id", "swiftslurm")])
def test_extra_sbatch_cannot_override_what_swiftslurm_sets(tmp_path, opt, field):
    """Refused when the spec is validated (so `swiftslurm validate` already says it), not only at render."""
    with pytest.raises(SpecError) as err:
        plan_of(tmp_path, slurm_extra=f"extra_sbatch = [{json_str(opt)}]")
    assert "slurm.extra_sbatch" in err.value.found and field in err.value.found


def test_odd_output_dir_is_quoted_or_refused(tmp_path):
    script = render_sbatch(plan_of(tmp_path, out="my out/$(x)"))
    assert f"#SBATCH --output='{tmp_path}/my out/$(x)/slurm-%j.out'" in directives(script)
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    with pytest.raises(SpecError, match="%"):
        render_sbatch(plan_of(tmp_path, out="o%j"))


def test_cli_render_writes_script_and_plan(tmp_path):
    spec = tmp_path / "s.toml"
    spec.write_text(BASE.format(out="o", slurm_extra="", tail=""))
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "render", str(spec), "-o", str(tmp_path / "job.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "o" / "swiftslurm-plan.json").is_file()
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)
