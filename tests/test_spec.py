"""The job spec: every broken spec is one clear message naming the TOML path, exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from swiftslurm.cli.app import app
from swiftslurm.errors import SpecError
from swiftslurm.plan import make_plan
from swiftslurm.spec import load_raw, load_spec, parse_spec, time_limit_s, validate_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))

GOOD = """
[job]
name = "t"
output_dir = "out"
[train]
model = "tiny-llama"
dataset = ["d.jsonl"]
"""

# (id, TOML text appended to / replacing the good spec, a path or phrase the message must name)
BROKEN = [
    ("typo-key", GOOD + "lernin_rate = 1e-4\n", "train.lernin_rate"),
    ("typo-suggests", GOOD + "lernin_rate = 1e-4\n", "did you mean 'learning_rate'"),
    ("unknown-table", GOOD + "[trian]\nmodel='x'\n", "trian"),
    ("typo-slurm", GOOD + "[slurm]\nnode = 2\n", "slurm.node"),
    ("typo-checkpoint", GOOD + "[checkpoint]\nkeeep = 3\n", "checkpoint.keeep"),
    ("typo-preflight", GOOD + "[preflight]\nchecks=['ports']\nminiperf = 3\n", "preflight.miniperf"),
    ("wrong-type-int", GOOD + "per_device_train_batch_size = 'two'\n", "train.per_device_train_batch_size"),
    ("wrong-type-float", GOOD + "learning_rate = 'fast'\n", "train.learning_rate"),
    ("wrong-type-bool", GOOD + "bf16 = 'yes'\n", "train.bf16"),
    ("wrong-type-list", GOOD + "report_to = 'tensorboard'\n", "train.report_to"),
    ("float-for-int", GOOD + "max_steps = 10.5\n", "train.max_steps"),
    ("negative-lr", GOOD + "learning_rate = -1.0\n", "train.learning_rate"),
    ("zero-batch", GOOD + "per_device_train_batch_size = 0\n", "train.per_device_train_batch_size"),
    ("bad-train-type", GOOD + "train_type = 'qlora'\n", "train.train_type"),
    ("bad-preset", GOOD + "deepspeed = 'zero4'\n", "train.deepspeed"),
    ("preset-typo", GOOD + "deepspeed = 'zreo3'\n", "zero3"),
    ("fp16-and-bf16", GOOD + "bf16 = true\nfp16 = true\n", "bf16 and fp16"),
    ("steps-and-epochs", GOOD + "max_steps = 5\nnum_train_epochs = 1.0\n", "max_steps or num_train_epochs"),
    ("no-model", "[train]\ndataset=['d.jsonl']\n", "train.model"),
    ("zero-nodes", GOOD + "[slurm]\nnodes = 0\n", "slurm.nodes"),
    ("tasks-vs-gpus", GOOD + "[slurm]\ngpus_per_node = 8\ntasks_per_node = 4\n", "tasks_per_node"),
    ("bad-time", GOOD + "[slurm]\ntime = 'one hour'\n", "slurm.time"),
    ("grace-over-time", GOOD + "[slurm]\ntime = '00:01:00'\nsignal_grace_s = 120\n", "signal_grace_s"),
    ("bad-mem", GOOD + "[slurm]\nmem = 'lots'\n", "slurm.mem"),
    ("extra-sbatch-shell", GOOD + "[slurm]\nextra_sbatch = [\"--comment=a\\nb\"]\n", "slurm.extra_sbatch"),
    ("extra-sbatch-not-option", GOOD + "[slurm]\nextra_sbatch = ['rm -rf /']\n", "slurm.extra_sbatch"),
    ("extra-sbatch-owned", GOOD + "[slurm]\nextra_sbatch = ['--time=5']\n", "slurm.time"),
    ("partition-injection", GOOD + "[slurm]\npartition = \"gpu; touch /tmp/pwned\"\n", "slurm.partition"),
    ("bad-job-name", GOOD.replace('name = "t"', "name = \"a'; echo pwned\""), "job.name"),
    ("keep-1", GOOD + "[checkpoint]\nkeep = 1\n", "checkpoint.keep"),
    ("bad-checksum", GOOD + "[checkpoint]\nchecksum = 'crc32'\n", "checkpoint.checksum"),
    ("bad-fraction", GOOD + "[checkpoint]\nforced_save_fractions = [1.5]\n", "checkpoint.forced_save_fractions"),
    ("bad-check", GOOD + "[preflight]\nchecks = ['pings']\n", "preflight.checks"),
    ("bad-on-failure", GOOD + "[preflight]\non_failure = 'ignore'\n", "preflight.on_failure"),
    ("env-bad-name", GOOD + "[env]\n'1BAD' = 'x'\n", "env"),
    ("env-bool", GOOD + "[env]\nNCCL_DEBUG = true\n", "env"),
    ("sweep-unknown-key", GOOD + "[sweep]\nlerning_rate = [1e-4]\n", "sweep.lerning_rate"),
    ("sweep-bad-value", GOOD + "[sweep]\nlearning_rate = ['fast', 1e-4]\n", "train.learning_rate"),
    ("sweep-empty", GOOD + "[sweep]\nlora_rank = []\n", "sweep"),
    ("sweep-not-list", GOOD + "[sweep]\nlora_rank = 8\n", "sweep.lora_rank"),
    ("malformed-toml", GOOD + "[train\n", "line"),
    ("unterminated-string", 'name = "abc\n', "line 1"),
    ("duplicate-key", GOOD + "[job]\nname='x'\n", "line"),
    ("empty-train-table", "[train]\n", "train.model"),  # a [train] table is validated in full; no table at all is not (below)
    ("table-is-scalar", "train = 3\n", "train"),
]


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    p = tmp_path / f"{name}.toml"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return p


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    return tmp_path


@pytest.mark.parametrize("case_id,text,needle", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_spec_is_one_clear_message(in_tmp, case_id, text, needle):
    path = _write(in_tmp, case_id, text)
    result = CliRunner().invoke(app, ["validate", str(path)])
    out = result.output
    assert result.exit_code == 2, out
    assert needle in out, out
    assert "Traceback" not in out
    assert "HINT" in out or "hint" in out.lower() or "did you mean" in out


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("binary", bytes(range(256)) * 8, "not UTF-8"),
        ("garbage", b"\x00\x01\x02 = = [[[", "TOML"),
        ("huge", b"# " + b"x" * (10 * 1024 * 1024) + b"\n", "too large"),
    ],
)
def test_garbage_files_exit_2(in_tmp, name, content, needle):
    path = _write(in_tmp, name, content)
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert needle in result.output
    assert "Traceback" not in result.output


def test_missing_file_and_directory(in_tmp):
    r = CliRunner().invoke(app, ["validate", str(in_tmp / "nope.toml")])
    assert r.exit_code == 2 and "no such spec file" in r.output
    r = CliRunner().invoke(app, ["validate", str(in_tmp)])
    assert r.exit_code == 2 and "directory" in r.output


def test_missing_dataset_is_named(in_tmp):
    path = _write(in_tmp, "s", GOOD.replace("d.jsonl", "missing.jsonl"))
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 2
    assert "train.dataset[0]" in r.output and "missing.jsonl" in r.output


def test_all_problems_reported_together(in_tmp):
    text = GOOD + "lernin_rate = 1\nper_device_train_batch_size = 'x'\n[slurm]\nnodes = 0\n[checkpoint]\nkeep = 1\n"
    with pytest.raises(SpecError) as exc:
        parse_spec(text)
    paths = {p.path for p in exc.value.problems}
    assert {"train.lernin_rate", "train.per_device_train_batch_size", "slurm.nodes", "checkpoint.keep"} <= paths


def test_spec_is_frozen():
    spec = parse_spec(GOOD)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        spec.train.learning_rate = 1.0  # type: ignore[misc]


def test_defaults_follow_spec_md():
    spec = parse_spec(GOOD)
    assert spec.slurm.signal_grace_s == 120 and spec.slurm.max_requeues == 20
    assert spec.checkpoint.keep == 3 and spec.checkpoint.checksum == "xxh3"
    assert spec.preflight.checks == ["ports", "allreduce", "iperf3", "nvme"]
    assert spec.preflight.on_failure == "abort"
    assert spec.train.deepspeed == "zero2" and spec.train.report_to == ["tensorboard"]
    gpu = parse_spec(GOOD + "[slurm]\ngpus_per_node = 8\nnodes = 2\n")
    assert gpu.slurm.ranks_per_node == 8 and gpu.world_size == 16


@pytest.mark.parametrize(
    "value,seconds",
    [("30", 1800), ("01:00:00", 3600), ("10:30", 630), ("1-12", 129600), ("1-00:30", 88200), ("2-01:02:03", 176523)],
)
def test_time_limit_forms(value, seconds):
    assert time_limit_s(value) == seconds


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_every_example_validates_and_plans(example, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(app, ["validate", str(example)])
    assert result.exit_code == 0, result.output
    spec = load_spec(example)
    plan = make_plan(spec, load_raw(example), base_dir=str(ROOT), source=str(example))
    assert len(plan.tasks) >= 1


def test_sweep_plans_four_tasks_with_own_dirs(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, ["plan", "examples/sweep.toml", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert len(data["tasks"]) == 4
    dirs = [t["output_dir"] for t in data["tasks"]]
    assert dirs == [str(ROOT / "output/sweep" / str(i)) for i in range(4)]
    lrs = {(t["spec"]["train"]["learning_rate"], t["spec"]["train"]["lora_rank"]) for t in data["tasks"]}
    assert lrs == {(1e-3, 8), (1e-3, 16), (2e-3, 8), (2e-3, 16)}
    assert len(data["deepspeed"]) == 4 and "sbatch" in data


def test_real_subprocess_no_traceback(tmp_path):
    """The installed console entry point, as a user runs it."""
    bad = _write(tmp_path, "bad", GOOD + "lernin_rate = 1e-4\n")
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(bad)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "train.lernin_rate" in proc.stderr
    ok = subprocess.run([sys.executable, "-m", "swiftslurm", "--version"], capture_output=True, text=True)
    assert ok.returncode == 0 and "swiftslurm" in ok.stdout


# --- property: random TOML documents never crash the validator with anything but a SpecError

_keys = st.sampled_from(
    ["job", "slurm", "train", "checkpoint", "preflight", "env", "sweep", "deepspeed", "name", "nodes", "model",
     "dataset", "learning_rate", "keep", "checks", "time", "bf16", "x"]
)
_scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1), st.floats(allow_nan=False), st.booleans(),
    st.text(max_size=20),
)
_values = st.recursive(
    _scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(_keys, children, max_size=4)),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=6))
def test_random_documents_only_raise_spec_errors(doc):
    try:
        validate_spec(doc)
    except SpecError as exc:
        assert exc.problems and all(p.render() for p in exc.problems)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_random_text_only_raises_spec_errors(text):
    try:
        parse_spec(text)
    except SpecError:
        pass


def test_readme_spec_reference_matches_the_model():
    from swiftslurm.spec.doc import reference_markdown

    readme = (ROOT / "README.md").read_text()
    start = readme.index("<!-- spec-reference")
    body = readme[readme.index("\n", start) + 1 : readme.index("<!-- /spec-reference -->")].rstrip("\n")
    assert body == reference_markdown(), "README spec reference is stale: run python -m swiftslurm.spec.doc"


def test_unknown_executor_is_a_usage_error(monkeypatch):
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(app, ["submit", "examples/quickstart.toml", "--executor", "nope"])
    assert r.exit_code == 2 and "'nope' is not one of" in r.output


# ------------------------------------------------------------------ a spec without [train] (preflight only)

NO_TRAIN = """
[job]
name = "pf"
output_dir = "out"
[slurm]
nodes = 2
[preflight]
checks = ["ports"]
"""


@pytest.mark.parametrize("text", [NO_TRAIN, "[preflight]\n"], ids=["preflight-only", "only-preflight-table"])
def test_spec_without_train_validates_with_a_note_and_plans_no_deepspeed(in_tmp, text):
    """(An empty file is refused: tests/test_validate_nodes.py.)"""
    path = _write(in_tmp, "pf", text)
    r = CliRunner().invoke(app, ["validate", str(path)])
    assert r.exit_code == 0, r.output
    assert "no [train] table" in r.output and "submit" in r.output
    r = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert "train" not in data["spec"] and data["deepspeed"] == [None]
    assert any("no [train] table" in w for w in data["warnings"])


@pytest.mark.parametrize("command", [["submit", "--executor", "local"], ["render"]])
def test_submit_and_render_refuse_a_spec_without_train(in_tmp, command):
    path = _write(in_tmp, "pf", NO_TRAIN)
    r = CliRunner().invoke(app, [*command, str(path)])
    assert r.exit_code == 2, r.output
    assert "no [train] table" in r.output and "swiftslurm preflight" in r.output and "Traceback" not in r.output
    assert not (in_tmp / "out").exists()  # nothing written, nothing sent


def test_spec_without_train_survives_the_plan_file(in_tmp):
    from swiftslurm.plan import read_plan_task, write_plan

    spec = parse_spec(NO_TRAIN)
    assert not spec.has_training and parse_spec(GOOD).has_training
    plan = make_plan(spec, load_raw(_write(in_tmp, "pf", NO_TRAIN)), base_dir=str(in_tmp))
    _, task, ds = read_plan_task(write_plan(plan), 0)
    assert not task.spec.has_training and ds is None and task.spec.preflight.checks == ["ports"]


def test_runtime_refuses_to_train_a_spec_without_train(in_tmp):
    from swiftslurm.errors import RuntimeEnvError
    from swiftslurm.node.runtime import run_task
    from swiftslurm.plan import write_plan

    spec = parse_spec(NO_TRAIN)
    plan = make_plan(spec, load_raw(_write(in_tmp, "pf", NO_TRAIN)), base_dir=str(in_tmp))
    with pytest.raises(RuntimeEnvError, match="no \\[train\\] table"):
        run_task(str(write_plan(plan)), 0, mode="train")
