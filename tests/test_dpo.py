"""Preference training (train.task = "dpo") and the low-rank optimizers (GaLore) on the plain DDP path.

Fast: the spec refusals and the preference-data checks of `swiftslurm validate` (file and line named).
Slow (2 CPU ranks, the tiny model, real TRL/DeepSpeed/DDP; each run ~30-50 s):
  dpo      the shipped DPO LoRA example: reward accuracy > 0.8, the reward metrics in metrics.jsonl and
           TensorBoard, the summary line; a resume from its step-9 checkpoint that reproduces steps 10-16
  galore   full FT with galore_adamw and deepspeed = "none": loss falls; a resume from the mid checkpoint
           reproduces the uninterrupted losses (the projector state survives the checkpoint)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import losses, quickstart_spec, run, submit_on_two_nodes, tensorboard_scalars

ROOT = Path(__file__).resolve().parents[1]
DPO_EXAMPLE = ROOT / "examples" / "dpo_lora.toml"
REWARDS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"]


def example_spec(tmp: Path, name: str, example: Path = DPO_EXAMPLE, **train) -> tuple[str, Path]:
    return quickstart_spec(tmp, name, example=example, **train)


def validate(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", "validate", spec], capture_output=True, text=True,
                          timeout=120)


# ---------------------------------------------------------------- fast: refusals


@pytest.mark.parametrize("train, expected", [
    ({"task": "sft", "optimizer": "galore_adamw", "deepspeed": "zero2", "train_type": "full"},
     ["2-D gradient", "flattened 1-D", 'train.deepspeed = "none"']),
    ({"task": "sft", "optimizer": "apollo_adamw", "deepspeed": "zero0", "train_type": "full"}, ["every ZeRO stage (0 included)"]),
    ({"task": "sft", "optimizer": "galore_adamw", "deepspeed": "none", "train_type": "lora"}, ["already low-rank"]),
    ({"task": "sft", "galore_rank": 64}, ["galore_rank set with optimizer = 'adamw'"]),
    ({"dpo_loss_type": "sigmod"}, ["did you mean 'sigmoid'"]),
    ({"dpo_loss_type": "exo_pair"}, ["label_smoothing"]),
    ({"max_prompt_length": 128}, ["max_prompt_length (128) must be below max_length (128)"]),
    ({"use_liger_kernel": True}, ["use_liger_kernel = true with task"]),
    ({"task": "sft", "dpo_beta": 0.5}, ["dpo_beta, max_prompt_length set with task = \"sft\""]),
])
def test_spec_refuses_what_cannot_work_with_the_reason(tmp_path, train, expected):
    spec, _ = example_spec(tmp_path, "bad", **train)
    r = validate(spec)
    assert r.returncode == 2, r.stdout + r.stderr
    text = " ".join((r.stdout + r.stderr).split())
    for piece in expected:
        assert " ".join(piece.split()) in text, text
    assert "Traceback" not in r.stderr


def test_deepspeed_table_with_plain_ddp_is_refused(tmp_path):
    spec, _ = example_spec(tmp_path, "ddp", deepspeed="none")
    Path(spec).write_text(Path(spec).read_text() + "[deepspeed]\ngradient_clipping = 1.0\n")
    r = validate(spec)
    assert r.returncode == 2 and "nothing would read it" in r.stdout + r.stderr, r.stdout + r.stderr


def test_galore_on_plain_ddp_validates(tmp_path):
    spec, _ = example_spec(tmp_path, "ok", train_type="full", deepspeed="none", optimizer="galore_adamw", galore_rank=8)
    r = validate(spec)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("records, where, what", [
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": "b"}'], "line 2", "missing 'rejected'"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '', '{"prompt": "a", "chosen": "b", "rejected": "b"}'], "line 3", "identical"),
    (['{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}'], "line 1", "all be strings or all be message lists"),
    (['{"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], '
      '"rejected": [{"role": "assistant", "content": "c"}]}'], "line 1", "assistant messages only"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": [{"role": "user", "content": "a"}], '
      '"chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]}'],
     "line 2", "one dataset holds one form"),
    (['{"prompt": "a", "chosen": 3, "rejected": "c"}'], "line 1", "'chosen' must be a non-empty string"),
    (['{"prompt": "a", "chosen": "b", "rejected": "c"', ], "line 1", "not valid JSON"),
])
def test_malformed_preference_records_are_named_by_file_and_line(tmp_path, records, where, what):
    data = tmp_path / "prefs.jsonl"
    data.write_text("\n".join(records) + "\n")
    spec, _ = example_spec(tmp_path, "bad")
    Path(spec).write_text(Path(spec).read_text().replace(str(ROOT / "examples/data/dpo_demo.jsonl"), str(data)))
    r = validate(spec)
    text = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and f"{data}, {where}: " in text and what in text, text


def test_parquet_preference_rows_are_read_and_named_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from swiftslurm.train.data import preference
    from swiftslurm.train.data.tokens import DataError

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["x", "y"], "rejected": ["z", "w"]}), good)
    assert preference.check_files([str(good)]) == (2, "text")
    assert preference.load([str(good)], tmp_path / "cache")[1] == {"prompt": "b", "chosen": "y", "rejected": "w"}
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["x", "y"], "rejected": ["z", "y"]}), bad)
    with pytest.raises(DataError, match=r"bad.parquet, row index 1: 'chosen' and 'rejected' are identical"):
        preference.check_files([str(good), str(bad)])


# ---------------------------------------------------------------- slow: real training


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    spec, out = example_spec(tmp, "full", max_steps=16, save_steps=9, logging_steps=1)
    whole = run(spec, out)
    resume_spec, resume_out = example_spec(tmp, "resumed", max_steps=16, save_steps=100, logging_steps=1)
    resumed = run(resume_spec, resume_out, resume=str(out / "checkpoint-9"))
    return whole, out, resumed, resume_out




@pytest.mark.slow
def test_dpo_lora_learns_the_preference_and_logs_the_rewards(dpo_runs):
    whole, out, *_ = dpo_runs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r]
    assert len(acc) == 16 and acc[0] <= 0.75, acc  # step 1: policy == reference, no preference yet
    assert whole[0]["reward_accuracy"] == acc[-1] > 0.8, acc
    margins = [r["rewards/margins"] for r in rows if "rewards/margins" in r]
    assert margins[-1] > margins[0] + 0.5, margins
    scalars = tensorboard_scalars(out)
    for name in REWARDS:
        assert len(scalars[f"train/{name}"]) == 16, sorted(scalars)
    assert f"reward accuracy (chosen scored above rejected, last logged step): {acc[-1]:.3f}" in whole[0]["stdout"]
    assert whole[0]["task"] == "dpo" and not whole[0]["packing"]
    from swiftslurm import checkpoint as ck

    assert ck.newest_verified(out) is not None and (ck.newest_verified(out) / "adapter_model.safetensors").exists()
    assert "train.fused_lora: 14 LoRA projections" in whole[0]["stdout"]  # fused after TRL wrapped the model


@pytest.mark.slow
def test_dpo_with_peft_lora_forward_gives_the_fused_losses(tmp_path, dpo_runs):
    """train.fused_lora = false: peft's own forward, the same dropout masks (lora_dropout 0.05 by default), the same
    losses; the reference pass (the adapter disabled) takes peft's forward in both."""
    _, out, *_ = dpo_runs
    spec, peft_out = example_spec(tmp_path, "peft", max_steps=4, save_steps=100, logging_steps=1, fused_lora=False)
    results = run(spec, peft_out)
    assert "train.fused_lora" not in results[0]["stdout"]
    fused, peft = losses(out), losses(peft_out)
    assert set(peft) == {1, 2, 3, 4}
    for step in peft:
        assert peft[step] == pytest.approx(fused[step], rel=1e-4, abs=1e-6), (step, peft[step], fused[step])


@pytest.mark.slow
def test_dpo_resumed_from_its_step_9_checkpoint_reproduces_the_uninterrupted_run(dpo_runs):
    """DPO's own state (the policy adapter, its optimizer, the data order and dropout rng; the reference pass is the
    adapter disabled) survives a checkpoint: steps 10-16 of a resumed run are those of the run that never stopped.
    (The walltime stop that makes such a checkpoint is task-neutral: test_train, test_resume.)"""
    _, out, resumed, resume_out = dpo_runs
    assert resumed[0]["global_step"] == 16 and not resumed[0]["stopped_for_requeue"]
    full, again = losses(out), losses(resume_out)
    assert sorted(again) == list(range(10, 17)), sorted(again)
    for step in range(10, 17):
        assert again[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), (step, again[step], full[step])


@pytest.mark.slow
def test_galore_trains_on_plain_ddp_and_resumes_exactly(tmp_path):
    quick = ROOT / "examples" / "quickstart.toml"
    spec, out = example_spec(tmp_path, "galore", example=quick, deepspeed="none", optimizer="galore_adamw",
                             galore_rank=8, galore_update_proj_gap=4, max_steps=12, save_steps=6, logging_steps=1)
    whole = run(spec, out)
    assert whole[0]["optimizer"] == "galore_torch.AdamW", whole[0]["optimizer"]
    full = losses(out)
    assert full[12] < 0.7 * full[1], full
    spec2, out2 = example_spec(tmp_path, "galore-resumed", example=quick, deepspeed="none", optimizer="galore_adamw",
                               galore_rank=8, galore_update_proj_gap=4, max_steps=12, save_steps=6, logging_steps=1)
    run(spec2, out2, resume=str(out / "checkpoint-6"))
    again = losses(out2)
    for step in range(7, 13):
        assert again[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), (step, again[step], full[step])


@pytest.mark.slurm
@pytest.mark.slow
def test_dpo_runs_under_slurm_across_two_nodes(tmp_path, slurm_cluster):
    """The DPO example as full fine-tuning under ZeRO-3 in bf16 (the reference model: TRL's sharded copy),
    2 nodes x 1 rank (gloo over 127.0.0.N), through `swiftslurm submit`: the reward accuracy is all-reduced over
    both nodes' pairs and still rises. (The LoRA / ZeRO-2 / fp32 example is the module's fixture above.)"""
    from swiftslurm import checkpoint as ck

    spec, out = example_spec(tmp_path, "dpo2", max_steps=12, save_steps=6, logging_steps=1, train_type="full",
                             deepspeed="zero3", bf16=True)
    hosts = submit_on_two_nodes(spec, out, "dpo-2node-test")
    assert len(set(hosts)) == 2, hosts
    for name in ("checkpoint-6", "checkpoint-12"):
        assert ck.verify(out / name).ok
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = [r["rewards/accuracies"] for r in rows if "rewards/accuracies" in r]
    assert len(acc) == 12 and acc[-1] > 0.8, acc
    assert "reward accuracy" in json.loads((out / "train-summary.json").read_text())["text"]
    plan = json.loads((out / "swiftslurm-plan.json").read_text())
    assert plan["deepspeed"][0]["zero_optimization"]["stage"] == 3 and plan["deepspeed"][0]["bf16"]["enabled"]
    assert (out / "checkpoint-12" / "model.safetensors").exists()  # full weights, gathered from the ZeRO-3 shards


def test_galore_8bit_without_a_gpu_is_one_clear_error():
    from swiftslurm.train.build import OptimizerUnavailable, check_optimizer

    check_optimizer("galore_adamw", cuda=False)
    with pytest.raises(OptimizerUnavailable, match="needs a GPU") as err:
        check_optimizer("galore_adamw_8bit", cuda=False)
    assert err.value.exit_code == 2 and "galore_adamw on CPU" in err.value.hint
