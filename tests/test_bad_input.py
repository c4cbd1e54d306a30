"""Bad input ends in one SpecError (exit 2, no traceback), and `validate` refuses what `plan` refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_as_another_user

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


def test_a_spec_saved_with_a_byte_order_mark_validates(tmp_path):
    """An editor's "UTF-8 with BOM": the mark is read past, not a TOML error on line 1 ("check the quoting")."""
    from swiftslurm.spec import load_spec

    spec = tmp_path / "job.toml"
    spec.write_bytes(b"\xef\xbb\xbf" + ('[job]\nname = "bom"\n' + CMD).encode())
    assert load_spec(spec).job.name == "bom"
    r = cli("validate", str(spec), cwd=tmp_path)
    assert r.returncode == 0 and "not valid TOML" not in r.stdout + r.stderr, r.stdout + r.stderr


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


# ------------------------------------------------------------ item: a path that cannot be looked at is one message

LONG = "n" * 300  # one name over NAME_MAX: stat fails with ENAMETOOLONG, which Path.is_dir/exists do not swallow


def test_path_kind_names_what_is_there_and_never_raises(tmp_path):
    from swiftslurm.fsutil import DIRECTORY, FILE, MISSING, path_kind

    (tmp_path / "f").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    kinds = {name: path_kind(tmp_path / name) for name in ("f", "fifo", "loop", "dangling", "absent", "f/under", LONG)}
    assert kinds == {"f": FILE, "fifo": "a FIFO", "loop": "unreachable: Too many levels of symbolic links (ELOOP)",
                     "dangling": f"unreachable: dangling symlink to {tmp_path / 'gone'}", "absent": MISSING,
                     "f/under": MISSING, LONG: "unreachable: File name too long (ENAMETOOLONG)"}
    assert path_kind(tmp_path) == DIRECTORY and path_kind("/dev/null") == "a character device"
    assert path_kind("a\0b") == "unreachable: the name holds a NUL byte"


@pytest.mark.parametrize("args,code", [
    (["validate", LONG], 2), (["plan", LONG], 2), (["render", LONG], 2), (["submit", LONG], 2), (["preflight", LONG], 2),
    (["status", LONG], 1), (["logs", LONG], 1), (["plot", LONG], 1), (["doctor", LONG], 1), (["cancel", LONG], 1),
    (["verify", LONG], 1), (["import", LONG, "--into", "out"], 2), (["export", LONG, "--to", "out"], 2),
    (["verify", f"{LONG}/checkpoint-1"], 1), (["status", f"ok/{LONG}"], 1),
])
def test_every_command_given_a_path_it_cannot_look_at_says_so_in_one_message(tmp_path, monkeypatch, args, code):
    from typer.testing import CliRunner

    from swiftslurm.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok").mkdir()
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert result.exit_code == code and "error:" in result.output and "Traceback" not in result.output, result.output
    assert "File name too long" in result.output, result.output


@pytest.mark.parametrize("key,line", [
    ("train.model", f'model = "./{LONG}"'), ("train.model", f'model = "{LONG}"'),
    ("train.dataset[0]", f'dataset = ["{LONG}.jsonl"]'), ("train.eval_dataset[0]", f'eval_dataset = ["./{LONG}/d"]'),
    ("train.resume_from", f'resume_from = "{LONG}"'),
])
def test_a_spec_path_too_long_to_look_at_is_a_problem_of_its_key(tmp_path, key, line):
    (tmp_path / "data.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    spec = tmp_path / "job.toml"
    spec.write_text('[train]\nmodel = "tiny-llama"\ndataset = ["data.jsonl"]\n'.replace(line.split(" =")[0] + " =", "#") + line + "\n")
    r = cli("validate", str(spec), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{key}: " in r.stderr and "File name too long (ENAMETOOLONG)" in r.stderr, r.stderr


def test_a_spec_in_a_directory_the_user_may_not_search_is_refused_with_why(tmp_path):
    """Another user's directory on a shared filesystem: stat fails with EACCES, which Path.is_dir raises."""
    private = tmp_path / "private"
    private.mkdir()
    (private / "job.toml").write_text(CMD)
    private.chmod(0o700 if os.geteuid() == 0 else 0o000)
    env = {**os.environ, "SWIFTSLURM_DEBUG": "0", "HOME": "/tmp"}
    try:
        if os.geteuid() == 0:
            r = run_as_another_user(["validate", str(private / "job.toml")], cwd="/", env=env)
        else:
            r = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(private / "job.toml")],
                               capture_output=True, text=True, cwd="/", timeout=120, env=env)
    finally:
        private.chmod(0o700)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "cannot read the spec file" in r.stderr and "Permission denied (EACCES)" in r.stderr, r.stderr


def test_an_os_error_no_check_foresaw_is_one_message_and_debug_shows_the_traceback(tmp_path, monkeypatch):
    """The CLI's last net: any OSError a command meets is what/found/hint, exit 1 (--debug: the traceback)."""
    from typer.testing import CliRunner

    import swiftslurm.checkpoint as ck
    from swiftslurm.cli import app

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device", str(tmp_path / "x"))

    (tmp_path / "checkpoint-1").mkdir()
    monkeypatch.setattr(ck, "verify", full_disk)  # what `verify` calls per checkpoint
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "checkpoint-1")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "error: a file or directory could not be used" in result.output and "No space left on device (ENOSPC)" in result.output
    result = CliRunner().invoke(app, ["--debug", "verify", str(tmp_path / "checkpoint-1")])
    assert isinstance(result.exception, OSError) and result.exception.errno == 28


def test_a_reader_that_leaves_early_is_no_error(tmp_path):
    """`swiftslurm plan --json SPEC | head -1`: the pipe closed before the write is exit 1 and nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([sys.executable, "-m", "swiftslurm", "plan", "--json", str(ROOT / "examples/quickstart.toml")],
                           stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 1 and not [line for line in r.stderr.splitlines() if "WARNING" not in line], r.stderr


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("100KB", 10**5), (" 2 gb", 2 * 10**9), ("1.5MB", 1_500_000),
                                       ("garbage", None), ("0", None), ("0.5KB", None), ("1e400GB", None), ("5", None),
                                       ("2000TB", None), ("nanGB", None), ("-1GB", None)])
def test_max_shard_size_is_a_size_transformers_reads_or_one_message(text, size):
    from swiftslurm.export.source import ExportRefused, shard_bytes

    if size is not None:
        assert shard_bytes(text) == size
        return
    with pytest.raises(ExportRefused, match="--max-shard-size must be a size"):
        shard_bytes(text)


@pytest.mark.parametrize("executor", ["local", "slurm"])
def test_a_bad_shard_size_is_refused_before_anything_is_loaded_or_sent(tmp_path, monkeypatch, executor):
    from typer.testing import CliRunner

    from swiftslurm import slurm
    from swiftslurm.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(slurm, "sbatch", lambda *a, **k: pytest.fail("sent"))
    (tmp_path / "checkpoint-1").mkdir()
    result = CliRunner().invoke(app, ["export", "checkpoint-1", "--to", "model", "--max-shard-size", "1e400GB", "--executor", executor])
    assert result.exit_code == 2 and "--max-shard-size must be a size" in result.output and "Traceback" not in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_preflight_refuses_its_json_path_before_the_job_runs(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from swiftslurm.cli import app, preflight_cmd

    monkeypatch.setattr(preflight_cmd, "preflight_command", lambda *a, **k: pytest.fail("the preflight ran"))
    (tmp_path / "report.json").symlink_to(tmp_path / "elsewhere.json")
    spec = tmp_path / "job.toml"
    spec.write_text('[slurm]\nnodes = 1\n')
    result = CliRunner().invoke(app, ["preflight", str(spec), "--json", str(tmp_path / "report.json"), "--executor", "local"])
    assert result.exit_code == 2 and "will not write there" in result.output and "a symlink" in result.output, result.output
    assert not (tmp_path / "elsewhere.json").exists()
