"""Bad input ends in one SpecError (exit 2, no traceback), and `validate` refuses what `plan` refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm.errors import SpecError
from swiftslurm.quoting import shell_quote
from swiftslurm.spec import parse_spec

ROOT = Path(__file__).resolve().parents[1]
CMD = '[train]\ncommand = ["true"]\n'


def problems(text: str) -> str:
    with pytest.raises(SpecError) as exc:
        parse_spec(text)
    return "\n".join(p.render() for p in exc.value.problems)


@pytest.mark.parametrize("text,where", [
    ('[job]\nname = "x\\n"\n' + CMD, "job.name"),
    ('[env]\n"A\\n" = "1"\n' + CMD, "env"),
    ('[slurm]\npartition = "gpu\\n"\n' + CMD, "slurm.partition"),
    ('[slurm]\nmem = "64G\\n"\n' + CMD, "slurm.mem"),
    ('[slurm]\ntime = "10\\n"\n' + CMD, "slurm.time"),
    ('[slurm]\ntime = "\u0663\u0660"\n' + CMD, "slurm.time"),  # Arabic-Indic digits: int() takes them, sbatch does not
    ('[slurm]\ntime = "99999999"\n' + CMD, "slurm.time"),
    ('[job]\noutput_dir = "out\\r"\n' + CMD, "job.output_dir"),
    ('[job]\noutput_dir = "a\\tb"\n' + CMD, "job.output_dir"),
    ('[train]\nmodel = "m"\ndataset = ["d\\u001b.jsonl"]\n', "train.dataset"),
    ('[preflight]\nnvme_path = "/tmp\\n"\n' + CMD, "preflight.nvme_path"),
])
def test_trailing_newlines_and_control_characters_are_refused(text, where):
    assert where in problems(text)


@pytest.mark.parametrize("line", ["num_train_epochs = inf", "learning_rate = nan", "weight_decay = inf",
                                  "max_steps = 100000000000000000000", "save_steps = -1", "lora_alpha = 10000000000"])
def test_non_finite_huge_and_negative_numbers_are_refused(line):
    assert "train." in problems(f"[train]\n{line}\ncommand = [\"true\"]\n")


def test_preflight_thresholds_must_be_finite():
    assert "preflight.min_iperf3_gbps" in problems("[preflight]\nmin_iperf3_gbps = inf\n" + CMD)


def test_deepspeed_table_is_plain_finite_shallow_data():
    assert "finite" in problems("[deepspeed]\nx = nan\n" + CMD)
    assert "date" in problems("[deepspeed]\nx = 1979-05-27\n" + CMD)
    assert "nested more than" in problems("[deepspeed]\nx = " + "[" * 40 + "]" * 40 + "\n" + CMD)
    assert "finite" in problems("[sweep]\nlearning_rate = [1e-4, inf]\n" + CMD)


def test_deeply_nested_toml_is_one_spec_error_not_a_recursion_error():
    assert "too deeply" in problems("x = " + "[" * 5000 + "]" * 5000 + "\n")
    assert "too deeply" in problems("x = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n")


def test_user_deepspeed_json_deep_or_non_finite_is_refused(tmp_path):
    from swiftslurm import dsconfig

    deep = tmp_path / "deep.json"
    deep.write_text('{"zero_optimization": {"stage": 2}, "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(SpecError, match="nests more than"):
        dsconfig.load_user_config(deep)
    nan = tmp_path / "nan.json"
    nan.write_text('{"zero_optimization": {"stage": 2}, "x": NaN}')
    with pytest.raises(SpecError, match="NaN"):
        dsconfig.load_user_config(nan)


def test_shell_quote_quotes_a_trailing_newline():
    assert shell_quote("x\n") == "'x\n'"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "SWIFTSLURM_DEBUG": "0"})


def test_rich_markup_in_a_path_is_printed_not_parsed(tmp_path):
    odd = tmp_path / "a[/x]b [bold]"
    odd.mkdir(parents=True)  # "a[" / "x]b [bold]"
    spec = odd / "spec[red].toml"
    spec.write_text('[train]\nmodel = "m"\ndataset = ["missing[/x].jsonl"]\n')
    r = cli("validate", str(spec), cwd=odd)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "a[/x]b [bold]/spec[red].toml" in r.stderr and "missing[/x].jsonl" in r.stderr
    r = cli("validate", str(odd / "nope[/x].toml"), cwd=odd)
    assert r.returncode == 2 and "nope[/x].toml" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------ item: validate runs every check plan runs

REFUSED_BY_DEEPSPEED = """
[train]
model = "tiny-llama"
dataset = ["data.jsonl"]
deepspeed = "zero2"
[deepspeed]
zero_optimization = { offload_param = { device = "nvme", nvme_path = "/tmp" } }
"""

SWEEP_WITH_ONE_BAD_TASK = """
[train]
model = "tiny-llama"
dataset = ["data.jsonl"]
[sweep]
deepspeed = ["zero2", "zero3", "ds.json"]
dataset = [["data.jsonl"], ["missing.jsonl"]]
"""


@pytest.mark.parametrize("text,expected", [
    (REFUSED_BY_DEEPSPEED, ["parameter offload needs ZeRO stage 3", "NVMe offload needs bf16"]),
    (SWEEP_WITH_ONE_BAD_TASK, ["sweep task 1", "missing.jsonl", "sweep task 4", "ds.json", "stage to 2 or 3"]),
    ('[train]\ncommand = ["true"]\n[job]\noutput_dir = "out%j"\n', ["'%' in the output dir"]),
])
def test_validate_refuses_exactly_what_plan_refuses(tmp_path, text, expected):
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}}')
    spec = tmp_path / "job.toml"
    spec.write_text(text)
    results = {cmd: cli(cmd, str(spec), cwd=tmp_path) for cmd in ("validate", "plan", "render")}
    for cmd, r in results.items():
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        for text_ in expected:
            assert text_ in r.stderr, (cmd, text_, r.stderr)
    assert results["validate"].stderr == results["plan"].stderr


def test_validate_ok_means_plan_ok(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    spec = tmp_path / "job.toml"
    spec.write_text('[train]\nmodel = "tiny-llama"\ndataset = ["data.jsonl"]\n[sweep]\ndeepspeed = ["zero2", "zero3"]\n')
    r = cli("validate", str(spec), cwd=tmp_path)
    assert r.returncode == 0 and "2 task(s)" in r.stdout, r.stderr
    assert cli("plan", str(spec), "--json", cwd=tmp_path).returncode == 0
