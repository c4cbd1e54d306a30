"""Resume refuses a checkpoint trained with another training spec (issue 21.3), naming what changed.

Real plans (make_plan + write_plan + read_plan_task, as a node reads them), real verified checkpoints
(checkpoint.commit with the fingerprint in the manifest meta, as the trainer writes them), the runtime's
own resume step.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tomllib

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint.fingerprint import META_KEY, check_spec_drift, fingerprint_changes, training_fingerprint
from swiftslurm.errors import RuntimeEnvError
from swiftslurm.plan import make_plan, read_plan_task, write_plan
from swiftslurm.spec import parse_spec


def _resume_point(out, log, spec, ds_config):
    """The trainer's resume step on one rank: the newest verified checkpoint, then the drift check."""
    found = ck.newest_verified(out)
    if found is not None:
        check_spec_drift(found, spec, ds_config, log)
    return str(found) if found is not None else None

SPEC = """
[job]
name = "drift"
output_dir = "{out}"
[slurm]
nodes = {nodes}
tasks_per_node = {tpn}
[train]
model = "tiny-llama"
dataset = ["{data}"]
deepspeed = "zero2"
learning_rate = {lr}
max_steps = 10
logging_steps = {logging}
[checkpoint]
allow_spec_change = {allow}
{sweep}
"""


def tasks(tmp: Path, lr="1e-4", sweep="", nodes=1, tpn=1, logging=10, allow="false", data=None):
    """(spec, ds_config, output_dir) of every task of the plan, read back as a node reads it."""
    data = data or tmp / "data.jsonl"
    if not Path(data).exists():
        Path(data).write_text('{"instruction": "hi", "output": "there"}\n')
    text = SPEC.format(out=tmp / "out", nodes=nodes, tpn=tpn, data=data, lr=lr, sweep=sweep, logging=logging, allow=allow)
    plan = make_plan(parse_spec(text), tomllib.loads(text), base_dir=str(tmp), source="test.toml")
    path = write_plan(plan)
    out = []
    for i in range(len(plan.tasks)):
        _, task, ds = read_plan_task(path, i)
        out.append((task.spec, ds, task.output_dir))
    return out


def save_checkpoint(spec, ds, out_dir: str, step: int = 5, fingerprint: bool = True) -> Path:
    """A verified checkpoint with the meta the trainer writes."""
    stage = ck.prepare_staging(out_dir, step)
    (stage / "weights.bin").write_bytes(b"w" * 64)
    meta = {"step": step, "world_size": spec.world_size}
    if fingerprint:
        meta[META_KEY] = training_fingerprint(spec, ds)
    ck.commit(stage, ck.final_dir(out_dir, step), algo="xxh3", meta=meta)
    return ck.final_dir(out_dir, step)


LOG = logging.getLogger("test-drift")


def test_changed_learning_rate_is_refused_naming_the_key(tmp_path):
    [(spec, ds, out)] = tasks(tmp_path, lr="1e-4")
    save_checkpoint(spec, ds, out)
    [(same, ds_same, _)] = tasks(tmp_path, lr="1e-4")
    assert _resume_point(out, LOG, same, ds_same).endswith("checkpoint-5")
    [(changed, ds2, _)] = tasks(tmp_path, lr="3e-4")
    with pytest.raises(RuntimeEnvError) as err:
        _resume_point(out, LOG, changed, ds2)
    assert "train.learning_rate: 0.0001 -> 0.0003" in err.value.found
    assert "checkpoint.allow_spec_change = true" in err.value.hint
    assert err.value.found.count("->") == 1  # only what changed is named


def test_edited_sweep_list_renumbers_tasks_and_is_refused(tmp_path):
    """[sweep] learning_rate = [1e-4, 2e-4] -> [5e-5, 1e-4, 2e-4]: task 0's dir now belongs to 5e-5,
    task 1's to 1e-4; neither may resume the other combination's checkpoint."""
    before = tasks(tmp_path, sweep="[sweep]\nlearning_rate = [1e-4, 2e-4]")
    for spec, ds, out in before:
        save_checkpoint(spec, ds, out)
    after = tasks(tmp_path, sweep="[sweep]\nlearning_rate = [5e-5, 1e-4, 2e-4]")
    assert [o for _, _, o in after[:2]] == [o for _, _, o in before]  # same dirs, other combinations
    for (spec, ds, out), (old, new) in zip(after[:2], [("0.0001", "5e-05"), ("0.0002", "0.0001")], strict=True):
        with pytest.raises(RuntimeEnvError, match="was trained with another spec") as err:
            _resume_point(out, LOG, spec, ds)
        assert f"train.learning_rate: {old} -> {new}" in err.value.found
    spec, ds, out = after[2]
    assert _resume_point(out, LOG, spec, ds) is None  # a new task dir: a fresh start


def test_allocation_and_logging_changes_still_resume(tmp_path):
    """Another world size (nodes, ranks per node: train_batch_size changes with it) and a logging change
    are not training drift: resuming on another allocation must keep working."""
    [(spec, ds, out)] = tasks(tmp_path)
    save_checkpoint(spec, ds, out)
    [(moved, ds2, _)] = tasks(tmp_path, nodes=2, tpn=4, logging=1)
    assert ds2["train_batch_size"] != ds["train_batch_size"]
    assert fingerprint_changes(training_fingerprint(spec, ds), training_fingerprint(moved, ds2)) == []
    assert _resume_point(out, LOG, moved, ds2).endswith("checkpoint-5")


def test_dataset_content_and_deepspeed_overrides_are_drift(tmp_path):
    [(spec, ds, out)] = tasks(tmp_path)
    save_checkpoint(spec, ds, out)
    (tmp_path / "data.jsonl").write_text('{"instruction": "other", "output": "data"}\n')
    [(spec2, ds2, _)] = tasks(tmp_path)
    with pytest.raises(RuntimeEnvError) as err:
        _resume_point(out, LOG, spec2, ds2)
    assert "dataset[0]: " in err.value.found and "data.jsonl" in err.value.found
    text = SPEC.format(out=tmp_path / "out", nodes=1, tpn=1, data=tmp_path / "data.jsonl", lr="1e-4", sweep="", logging=10, allow="false")
    text += '[deepspeed]\nzero_optimization = { stage = 3 }\n'
    spec3 = parse_spec(text)
    changes = fingerprint_changes(training_fingerprint(spec2, ds2), training_fingerprint(spec3, {**ds2, "zero_optimization": {"stage": 3}}))
    assert "deepspeed.zero_optimization.stage: (unset) -> 3" in changes and "ds_config.zero_optimization.stage: 2 -> 3" in changes


def test_override_key_and_old_checkpoints_resume_with_a_warning(tmp_path, caplog):
    [(spec, ds, out)] = tasks(tmp_path, lr="1e-4")
    save_checkpoint(spec, ds, out)
    [(changed, ds2, _)] = tasks(tmp_path, lr="3e-4", allow="true")
    with caplog.at_level(logging.WARNING, logger="test-drift"):
        assert _resume_point(out, LOG, changed, ds2).endswith("checkpoint-5")
    assert "allow_spec_change" in caplog.text and "train.learning_rate" in caplog.text
    caplog.clear()
    old = tmp_path / "old"
    old.mkdir()
    [(spec_o, ds_o, out_o)] = tasks(old, lr="1e-4")
    save_checkpoint(spec_o, ds_o, out_o, fingerprint=False)  # written before fingerprints existed
    [(changed_o, ds_co, _)] = tasks(old, lr="3e-4")
    with caplog.at_level(logging.WARNING, logger="test-drift"):
        assert _resume_point(out_o, LOG, changed_o, ds_co).endswith("checkpoint-5")
    assert "no spec fingerprint" in caplog.text


def test_a_key_added_later_at_its_default_is_no_drift(tmp_path):
    """A checkpoint of an older swiftslurm has no train.max_grad_norm in its fingerprint: resuming with the default
    (what HF clipped to then) is the same training; another value is drift. train.ddp_timeout never is."""
    from swiftslurm.checkpoint.fingerprint import train_defaults

    [(spec, ds, out)] = tasks(tmp_path)
    old = {k: v for k, v in training_fingerprint(spec, ds).items() if k not in ("train.max_grad_norm", "train.ddp_timeout")}
    assert fingerprint_changes(old, training_fingerprint(spec, ds), train_defaults()) == []
    clipped = spec.model_copy(update={"train": spec.train.model_copy(update={"max_grad_norm": 0.5, "ddp_timeout": 60})})
    assert fingerprint_changes(old, training_fingerprint(clipped, ds), train_defaults()) == ["train.max_grad_norm: (unset) -> 0.5"]
