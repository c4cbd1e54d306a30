"""validate says what the nodes would say: every refusal a node (or the batch shell) would make after the queue
wait is made by `swiftslurm validate`, `plan`, `render` and `submit`, as one problem (key, found, hint), exit 2, no
traceback, nothing written. Fast: no cluster, no training.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import run_as_another_user
from typer.testing import CliRunner

from swiftslurm.checkpoint import Manifest
from swiftslurm.cli.app import app
from swiftslurm.jobs.prepare import prepare
from swiftslurm.spec import parse_toml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))

COMMAND = """
[job]
name = "n"
output_dir = "{out}"
[slurm]
tasks_per_node = 2
time = "00:10:00"
signal_grace_s = 30
{slurm}
[train]
command = ["true"]
{tail}
"""

TRAINER = """
[job]
name = "n"
output_dir = "out"
[slurm]
tasks_per_node = 2
{slurm}
[train]
model = "{model}"
dataset = ["d.jsonl"]
{train}
{tail}
"""


def files_under(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


@pytest.fixture()
def tmp_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    return tmp_path


def refused(tmp: Path, text: str, key: str, found: str, commands=("validate", "plan", "render", "submit")) -> str:
    """Each command refuses the spec with exit 2 and exactly one problem line naming ``key`` and ``found``; nothing
    is written. Returns validate's output."""
    spec = tmp / "job.toml"
    spec.write_text(text)
    before = files_under(tmp)
    outputs = {}
    for command in commands:
        args = {"validate": ["validate", str(spec)], "plan": ["plan", str(spec)],
                "render": ["render", str(spec), "-o", str(tmp / "job.sh")],
                "submit": ["submit", str(spec), "--executor", "local"]}[command]
        result = CliRunner().invoke(app, args)
        out = result.output
        assert result.exit_code == 2, f"{command}: {out}"
        assert "Traceback" not in out, out
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        problems = [line for line in out.splitlines() if line.startswith("  - ")]
        assert len(problems) == 1, f"{command}: {out}"
        assert problems[0].startswith(f"  - {key}"), f"{command}: {out}"
        assert found in problems[0], f"{command}: {out}"
        assert "HINT" in problems[0], f"{command}: {out}"
        assert files_under(tmp) == before, f"{command} wrote something"
        outputs[command] = out
    return outputs["validate"]


# 1. the batch script must parse and reach its srun line


@pytest.mark.parametrize("setup,index,found,words", [
    (["module load cuda", "echo 'unbalanced"], 1, "echo 'unbalanced", "matching"),
    (["cat <<EOF"], 0, "cat <<EOF", "here-document"),
    (["module load cuda", "cat > x.txt <<EOF", "text"], 1, "cat > x.txt <<EOF", "here-document"),
    (["if [ -f /etc/x ]; then", "module load a"], 0, "if [ -f /etc/x ]; then", "never closed"),
    (["export A=1 \\"], 0, "export A=1", "carries on"),
    (["source env.sh", "exit 0"], 1, "exit 0", "ends the batch script"),
    (["[ -d /opt/x ] || exit"], 0, "|| exit", "ends the batch script"),
    (["exec python other.py"], 0, "exec python other.py", "replaces the batch shell"),
    (["set -n"], 0, "set -n", "noexec"),
    (["srun() { true; }"], 0, "srun()", "function named 'srun'"),
    (["module load a", "kill -9 $$"], 1, "kill -9 $$", "kills the batch shell"),
    (["shopt -s -o noexec"], 0, "shopt -s -o noexec", "noexec"),
], ids=["quote", "heredoc", "heredoc-mid", "open-if", "backslash", "exit", "cond-exit", "exec", "noexec", "srun-fn", "kill-self",
        "shopt-noexec"])
def test_setup_that_breaks_the_batch_script_is_refused_naming_the_line(tmp_cwd, setup, index, found, words):
    text = COMMAND.format(out="out", slurm="setup = " + json.dumps(setup), tail="")
    out = refused(tmp_cwd, text, f"slurm.setup[{index}]", found)
    assert words in out


@pytest.mark.parametrize("setup", [
    ["module load cuda/12.4", "source /etc/profile.d/x.sh || true", "export HF_HOME=/scratch/hf"],
    ["cat > /tmp/x.txt <<EOF", "text $HOME", "EOF"],
    ["cat <<-'END' > y", "\tz", "\tEND"],
    ["exec > >(tee -a setup.log) 2>&1", "set -euo pipefail"],
    ["if [ -f /etc/x ]; then", "  module load a", "fi", "echo \"exit is a word here\""],
    ["ulimit -n 65536; x=$(exit 3); echo $x"],
    ["module load cuda/12.4 || exit 1", "[ -d /scratch ] || { echo no scratch; exit 3; }"],
], ids=["plain", "heredoc-closed", "heredoc-dash", "exec-redirect", "if-fi", "subshell-exit", "failing-exit"])
def test_setup_that_reaches_srun_validates(tmp_cwd, setup):
    (tmp_cwd / "job.toml").write_text(COMMAND.format(out="out", slurm="setup = " + json.dumps(setup), tail=""))
    result = CliRunner().invoke(app, ["validate", "job.toml"])
    assert result.exit_code == 0, result.output


# 2. containers: the mount list


def test_container_output_dir_with_a_colon_or_comma_is_refused(tmp_cwd):
    tail = '[container]\nruntime = "pyxis"\nimage = "nvcr.io#nvidia/pytorch:24.05-py3"\n'
    refused(tmp_cwd, COMMAND.format(out="out:v2", slurm="", tail=tail), "job.output_dir", str(tmp_cwd / "out:v2"))
    tail = '[container]\nruntime = "apptainer"\nimage = "docker://pytorch/pytorch"\n'
    refused(tmp_cwd, COMMAND.format(out="a,b", slurm="", tail=tail), "job.output_dir", str(tmp_cwd / "a,b"))


def test_read_only_mount_over_the_output_dir_is_refused(tmp_cwd):
    tail = f'[container]\nruntime = "pyxis"\nimage = "nvcr.io#nvidia/pytorch:24.05-py3"\nmounts = ["{tmp_cwd}:{tmp_cwd}:ro"]\n'
    refused(tmp_cwd, COMMAND.format(out="out", slurm="", tail=tail), "container.mounts", f"{tmp_cwd}:{tmp_cwd}:ro")


# 3. slurm.python is an interpreter, never an srun option


@pytest.mark.parametrize("python", ["--export=NONE", "-u", "python3 -u", "~/venv/bin/python", "$HOME/venv/bin/python"])
def test_python_that_is_not_an_interpreter_is_refused(tmp_cwd, python):
    refused(tmp_cwd, COMMAND.format(out="out", slurm=f"python = {json.dumps(python)}", tail=""), "slurm.python", python)


# 4. [env] may not set what the runtime derives


@pytest.mark.parametrize("name", ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "SWIFTSLURM_PLAN",
                                  "SWIFTSLURM_TASK"])
def test_env_setting_a_derived_variable_is_refused(tmp_cwd, name):
    refused(tmp_cwd, COMMAND.format(out="out", slurm="", tail=f'[env]\n{name} = "0"\n'), f"env.{name}", f"{name} = '0'",
            commands=("validate", "plan"))


def test_env_master_port_must_be_a_port_as_on_the_nodes(tmp_cwd):
    refused(tmp_cwd, COMMAND.format(out="out", slurm="", tail='[env]\nMASTER_PORT = "70000"\n'), "env.MASTER_PORT",
            "MASTER_PORT = '70000'", commands=("validate",))


def test_every_variable_child_env_derives_is_refused_in_env():
    """The list validate refuses is the one the nodes refuse: every per-rank variable child_env sets."""
    from swiftslurm.errors import SpecError
    from swiftslurm.slurm import distenv
    from swiftslurm.spec import parse_spec

    dist = distenv.derive({}, pid=1)
    for name in distenv.dist_vars(dist):
        if name in ("MASTER_ADDR", "MASTER_PORT"):
            continue  # documented: [env] may choose them (docs/runtime.md)
        with pytest.raises(SpecError, match=f"env.{name}"):
            parse_spec(f'[job]\nname = "x"\n[env]\n{name} = "1"\n')


# 5. [parallel] needs DeepSpeed


@pytest.mark.parametrize("parallel,key", [("sequence_parallel = 2", "parallel.sequence_parallel"),
                                          ("tensor_parallel = 2", "parallel.tensor_parallel")])
def test_parallel_degrees_with_deepspeed_none_are_refused(tmp_cwd, parallel, key):
    train = 'deepspeed = "none"\npacking = false\ntrain_type = "full"'
    refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train=train, tail=f"[parallel]\n{parallel}\n"), key,
            'train.deepspeed = "none"')


# 6. resume_from is another run's checkpoint


@pytest.mark.parametrize("resume", ["out", "out/checkpoint-5", "./out/../out"])
def test_resume_from_the_runs_own_output_dir_is_refused(tmp_cwd, resume):
    (tmp_cwd / "out" / "checkpoint-5").mkdir(parents=True)
    refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train=f'resume_from = "{resume}"', tail=""),
            "train.resume_from", f"output dir {tmp_cwd / 'out'}")


def test_resume_from_a_sweep_tasks_dir_is_refused(tmp_cwd):
    (tmp_cwd / "out" / "0").mkdir(parents=True)
    out = refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train='resume_from = "out/0"',
                                          tail="[sweep]\nlearning_rate = [1e-4]\n"),
                  "train.resume_from", "resume_from " + str(tmp_cwd / "out" / "0"), commands=("validate",))
    assert "this task's output dir" in out


def _resume_sources(root: Path) -> dict[str, str]:
    """Directories rank 0 would refuse as train.resume_from before reading a tensor -> what validate says."""
    (root / "empty").mkdir(parents=True)
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text("{}")  # no weights beside it: not a model dir
    (root / "fifo-state").mkdir()
    os.mkfifo(root / "fifo-state" / "trainer_state.json")  # an HF Trainer checkpoint whose state would block a reader
    (root / "deep-config").mkdir()
    (root / "deep-config" / "adapter_config.json").write_text("[" * 100 + "]" * 100)
    (root / "hf-out" / "checkpoint-5").mkdir(parents=True)  # an HF Trainer output dir: its checkpoints are not ours
    (root / "hf-out" / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    (root / "edited").mkdir()  # one of ours whose manifest was edited after it was written: rank 0 would not trust it
    (root / "edited" / "manifest.json").write_text(Manifest(step=3, algo="xxh3", files={}).to_json().replace('"step": 3', '"step": 4'))
    (root / "no-checksum").mkdir()
    (root / "no-checksum" / "manifest.json").write_text('{"version": 1}')
    return {"empty": "holds nothing", "model": "holds config.json", "fifo-state": "a FIFO, not a regular file",
            "deep-config": "nested deeper than 64 levels", "hf-out": "hf-out: checkpoint-5",
            "edited": "its body checksum does not match", "no-checksum": "not a swiftslurm manifest"}


@pytest.mark.parametrize("name", ["empty", "model", "fifo-state", "deep-config", "hf-out", "edited", "no-checksum"])
def test_resume_from_what_rank_0_would_refuse_is_refused_at_validate(tmp_cwd, name):
    found = _resume_sources(tmp_cwd / "src")[name]
    refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train=f'resume_from = "src/{name}"', tail=""),
            "train.resume_from", found, commands=("validate", "render"))


def test_resume_from_sources_rank_0_takes_validate(tmp_cwd):
    """Its own kinds pass: one HF Trainer checkpoint-N (imported on the node), one of ours, a run's output dir."""
    hf = tmp_cwd / "hf" / "checkpoint-5"
    hf.mkdir(parents=True)
    (hf / "trainer_state.json").write_text('{"global_step": 5}')
    ours = tmp_cwd / "run" / "checkpoint-3"
    ours.mkdir(parents=True)
    (ours / "manifest.json").write_text(Manifest(step=3, algo="xxh3", files={}).to_json())  # its hashes: on the node
    for src in ("hf/checkpoint-5", "run/checkpoint-3", "run"):
        (tmp_cwd / "job.toml").write_text(TRAINER.format(model="tiny-llama", slurm="", train=f'resume_from = "{src}"', tail=""))
        result = CliRunner().invoke(app, ["validate", str(tmp_cwd / "job.toml")])
        assert result.exit_code == 0, (src, result.output)


@pytest.mark.parametrize("out,found", [("job.toml", "job.toml: a file"), ("d.jsonl/run", "d.jsonl: a file"),
                                       ("n" * 300, "File name too long (ENAMETOOLONG)")])
def test_an_output_dir_that_cannot_be_made_is_refused(tmp_cwd, out, found):
    refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train="", tail="").replace('output_dir = "out"', f'output_dir = "{out}"'),
            "job.output_dir", found)


@pytest.mark.parametrize("key,line", [("job.output_dir", 'output_dir = "~/runs/x"'), ("job.output_dir", 'output_dir = "$SCRATCH/x"'),
                                      ("train.dataset", 'dataset = ["${DATA}/d.jsonl"]'), ("train.model", 'model = "~/models/m"')])
def test_a_path_a_shell_would_have_expanded_is_refused(tmp_cwd, key, line):
    text = TRAINER.format(model="tiny-llama", slurm="", train="", tail="")
    text = "\n".join(line if ln.split(" =")[0] == line.split(" =")[0] else ln for ln in text.splitlines()) + "\n"
    out = refused(tmp_cwd, text, key, "'" + line.split("= ")[1].strip('[]"') + "'", commands=("validate",))
    assert "nothing expands a leading '~' or a $VARIABLE" in out


@pytest.mark.parametrize("container,key", [('image = "~/img.sif"', "container.image"),
                                           ('image = "docker://x/y:1"\nmounts = ["$DATA:/data"]', "container.mounts")])
def test_a_container_path_a_shell_would_have_expanded_is_refused(tmp_cwd, container, key):
    text = TRAINER.format(model="tiny-llama", slurm="", train="", tail=f'[container]\nruntime = "pyxis"\n{container}\n')
    assert "nothing expands a leading '~'" in refused(tmp_cwd, text, key, "", commands=("validate",))


def test_an_output_dir_in_a_directory_the_user_cannot_write_is_refused(tmp_path):
    """As another user (nobody): the parent exists, but mkdir there would fail on every node."""
    shared = Path(tempfile.mkdtemp(prefix="swiftslurm-ro-", dir="/tmp"))
    try:
        shared.chmod(0o755)
        (shared / "ro").mkdir(mode=0o755)  # root's: nobody may not create in it
        (shared / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
        (shared / "job.toml").write_text(TRAINER.format(model="tiny-llama", slurm="", train="", tail="")
                                         .replace('output_dir = "out"', 'output_dir = "ro/run"'))
        r = run_as_another_user(["validate", "job.toml"], cwd=str(shared), env={**os.environ, "HOME": str(shared), "SWIFTSLURM_DEBUG": "0"})
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"job.output_dir: the output dir cannot be made there; found {shared / 'ro'} is not writable by you" in r.stderr, r.stderr
    finally:
        shutil.rmtree(shared)


# 7. sequence parallel with packed rows needs flash attention, which a CPU job never has


def test_sequence_parallel_with_packing_on_a_cpu_job_is_refused(tmp_cwd):
    out = refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train="packing = true",
                                          tail="[parallel]\nsequence_parallel = 2\n"),
                  "parallel.sequence_parallel", "slurm.gpus_per_node = 0")
    assert "flash attention" in out


def test_the_node_and_validate_share_the_packing_rule():
    """The node refuses what validate predicts for a CPU rank: "auto" resolves to sdpa there, which the rule refuses."""
    from swiftslurm.sizing.layout import keeps_packed_apart
    from swiftslurm.train.kernels.choose import NodeFacts, resolve_attention

    attn, _ = resolve_attention("auto", True, NodeFacts(cuda=False), 2048)
    assert not keeps_packed_apart(attn)
    assert keeps_packed_apart("flash_attention_2")
    # a bf16 GPU node without flash-attn resolves "auto" to varlen_attn, which keeps samples apart under SP (issue #34)
    attn, _ = resolve_attention("auto", True, NodeFacts(cuda=True, varlen=True), 2048, half=True)
    assert attn == "varlen_attn" and keeps_packed_apart(attn)


# 8. a local model's config.json is bounded like train.model_shape


@pytest.mark.parametrize("key,value", [("num_attention_heads", 0), ("num_attention_heads", 100000000001),
                                       ("hidden_size", -4), ("num_key_value_heads", 0), ("vocab_size", "32000")])
def test_config_json_numbers_out_of_range_are_refused_with_key_and_file(tmp_cwd, key, value):
    model = tmp_cwd / "model"
    model.mkdir()
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 259}
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    import time

    start = time.monotonic()
    out = refused(tmp_cwd, TRAINER.format(model="./model", slurm="", train="packing = false", tail="[parallel]\nsequence_parallel = 2\n"
                                          if key == "num_attention_heads" else ""),
                  "train.model", f"{key} = {value!r}", commands=("validate",))
    assert str(model / "config.json") in out
    assert time.monotonic() - start < 20


def test_config_json_bounds_are_model_shapes_bounds():
    from swiftslurm.sizing.shape import SHAPE_BOUNDS
    from swiftslurm.spec.parallel import ModelShapeTable

    for name, (low, high) in SHAPE_BOUNDS.items():
        meta = {type(m).__name__: m for m in ModelShapeTable.model_fields[name].metadata}
        assert (meta["Ge"].ge, meta["Le"].le) == (low, high), name


# 9. an empty spec is not a preflight-only job


@pytest.mark.parametrize("text,found", [("", "an empty file"), ("  \n\n", "an empty file"),
                                        ("# only a comment\n\n# and another\n", "only blank lines and comments")])
def test_empty_spec_is_refused(tmp_cwd, text, found):
    out = refused(tmp_cwd, text, "(spec): empty spec: nothing to run; a preflight-only spec names [preflight]", found,
                  commands=("validate", "plan", "submit"))
    assert "empty spec" in out


def test_a_spec_naming_only_preflight_still_validates(tmp_cwd):
    (tmp_cwd / "p.toml").write_text("[preflight]\nchecks = []\n")
    assert CliRunner().invoke(app, ["validate", "p.toml"]).exit_code == 0


# bash -n over every rendered script: the examples and the specs the tests write


def _spec_texts_in_tests() -> list[tuple[str, str]]:
    """Every string literal in tests/*.py that is a job spec (a TOML text with [job], [slurm] or [train]), with its
    str.format placeholders filled: a value for a quoted one, nothing for one on a line of its own."""
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            text = node.value
            if not re.search(r"^\[(job|slurm|train)\]\s*$", text, re.M):
                continue
            text = re.sub(r"^\{[a-z_]+\}$", "", text, flags=re.M)
            text = re.sub(r"\{[a-z_]+\}", "x", text).replace("{{", "{").replace("}}", "}")
            try:
                parse_toml(text)
            except Exception:  # noqa: BLE001 -- a fragment, or a test of broken TOML
                continue
            found.append((f"{path.name}:{node.lineno}", text))
    return found


TEST_SPECS = _spec_texts_in_tests()


def _scripts(spec: Path) -> list[str]:
    from swiftslurm.errors import SpecError

    try:
        return prepare(spec).scripts
    except SpecError as exc:
        if any(p.path.startswith("slurm") and "bash" in p.what for p in exc.problems):
            raise
        return []  # a spec the tests keep invalid on purpose (or whose files live elsewhere): nothing rendered


def _bash_n(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)


def test_every_example_renders_scripts_that_bash_parses(monkeypatch):
    monkeypatch.chdir(ROOT)
    for example in EXAMPLES:
        from swiftslurm.plan import ArrayLimits

        for limits in (None, ArrayLimits(max_array_size=2)):
            scripts = prepare(example, limits=limits).scripts
            assert scripts, example
            for script in scripts:
                proc = _bash_n(script)
                assert proc.returncode == 0 and not proc.stderr, (example, proc.stderr)
                assert re.search(r"^srun .* -m swiftslurm run ", script, re.M), example


def test_every_spec_the_tests_write_renders_scripts_that_bash_parses(tmp_cwd):
    assert len(TEST_SPECS) >= 15, [name for name, _ in TEST_SPECS]
    rendered = 0
    for name, text in TEST_SPECS:
        spec = tmp_cwd / "spec.toml"
        spec.write_text(text)
        for script in _scripts(spec):
            proc = _bash_n(script)
            assert proc.returncode == 0 and not proc.stderr, (name, proc.stderr)
            rendered += 1
    assert rendered >= 10


def test_validate_warns_of_a_secret_in_env_and_of_evaluating_on_the_training_data(tmp_cwd):
    """Both are valid, and neither is what a user means: the secret would sit in the rendered script and the resolved
    spec in the output dir; an eval set that is the training data measures memorisation."""
    text = TRAINER.format(model="tiny-llama", slurm="", train='eval_dataset = ["d.jsonl"]', tail='[env]\nWANDB_API_KEY = "x"\nHF_TOKEN = "y"\n')
    (tmp_cwd / "job.toml").write_text(text)
    result = CliRunner().invoke(app, ["validate", "job.toml"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "[env] HF_TOKEN, WANDB_API_KEY look(s) like a secret" in out and "export it in the shell you submit from" in out
    assert "train.eval_dataset names training data" in out
    (tmp_cwd / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * 20)
    clean = TRAINER.format(model="tiny-llama", slurm="", train="eval_split = 0.2", tail='[env]\nNCCL_DEBUG = "WARN"\n')
    (tmp_cwd / "job.toml").write_text(clean)
    assert "warning" not in CliRunner().invoke(app, ["validate", "job.toml"]).output


@pytest.mark.parametrize("records,split,found", [
    (1, 0.2, "1 record(s) in train.dataset"),
    (10, 0.7, "10 record(s): 7 held out for evaluation by eval_split = 0.7, 3 left to train on; one step takes 4"),
    (10, 0.99, "9 held out"),
])
def test_an_eval_split_that_leaves_less_than_one_step_to_train_on_is_refused(tmp_cwd, records, split, found):
    """The nodes would train on the few records left, repeated within every step (or fail on under 2): 2 ranks x a
    micro-batch of 2 take 4 records a step."""
    (tmp_cwd / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * records)
    refused(tmp_cwd, TRAINER.format(model="tiny-llama", slurm="", train=f"per_device_train_batch_size = 2\neval_split = {split}",
                                    tail=""), "train.eval_split", found)


def test_an_eval_split_that_leaves_one_step_validates(tmp_cwd):
    (tmp_cwd / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * 10)
    (tmp_cwd / "job.toml").write_text(TRAINER.format(model="tiny-llama", slurm="", train="per_device_train_batch_size = 2\neval_split = 0.6",
                                                     tail=""))
    result = CliRunner().invoke(app, ["validate", "job.toml"])
    assert result.exit_code == 0, result.output
