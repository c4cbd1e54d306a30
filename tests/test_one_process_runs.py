"""Short trainer runs in ONE process (tests/one_process_runs.py: world size 1, the tiny model, real DeepSpeed on
the CPU), through swiftslurm's own config building (dsconfig.build_for_spec) and trainer (train.run.train):

- every shipped DeepSpeed preset starts a real engine and takes one optimizer step; a preset the CPU cannot
  run is refused by the node with its reason (NVMe offload without DeepSpeed's async_io op / libaio);
  examples/zero3_offload.toml runs with its own [deepspeed] table;
- spec keys that only training shows: train.optimizer = "apollo_adamw" (trains) and "galore_adamw_8bit"
  (refused on a CPU node, with the reason), warmup_ratio (the learning rate of each step), gradient_checkpointing_layers
  (the layers that recompute, as the model ran), DPO's
  precompute_ref_log_probs (the reference is scored before training) and lora_target_modules (the adapter),
  checkpoint.convert_timeout_s (zero2's checkpoint resumed under ZeRO-3 through a converter slower than it);
- task = "rm": a reward model learns the separable demo pairs (accuracy above 0.8) under ZeRO-3 in bf16;
- checkpoint.async_save under ZeRO-3 with LoRA (issue 54): the background saves write a synchronous save's bytes;
- train.fp8 (issue 53), in torchao's emulation on the CPU: a full fine-tune's losses stay with bf16's, its checkpoint holds
  bf16's tensors key for key (no FP8 leftovers) and resumes bitwise; LoRA under ZeRO-3 trains with the frozen base in FP8;
- vision-language models under ZeRO-3 in bf16 (issue 56): tiny-vl with LoRA and with its projector trained, and a
  LLaVA directory loaded by from_pretrained;
- model = "tiny-moe" (issue 55): LoRA adapts attention, the fused expert weights and the routers, the loss carries the
  router's load-balancing term, and every logged step its tokens per expert.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from one_process_runs import VARIANTS as VARIANTS_OF
from one_process_runs import run_dir

from swiftslurm import dsconfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "examples/zero3_offload.toml"
VARIANT_RUNS = ("apollo", "galore8bit", "convert", "dpo", "rm", "moe_lora", "async_zero3", "sync_zero3", "async_zero2", "sync_zero2",
                "fp8_full", "bf16_full", "fp8_resume", "fp8_lora_zero3", "vl_zero3", "vl_zero3_full", "vl_zero3_dir", "vl_dpo")
MOE_RUNS = ("moe_pt", "moe_dpo", "moe_kto", "moe_rm", "moe_rm_lora", "moe_grpo", "moe_zero3_lora", "moe_zero3_full")
VARIANT_RUNS += MOE_RUNS
SHIPPED = {"zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme", "zero2_fast"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[bool, dict[str, dict], Path, str]:
    out = tmp_path_factory.mktemp("presets")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "one_process_runs.py"), str(out),
                           *VARIANT_RUNS[:2], *dsconfig.preset_names(), EXAMPLE, *VARIANT_RUNS[2:]],  # plain DDP before any DeepSpeed engine
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "SWIFTSLURM_TEST_FP8_EMULATE": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    aio = json.loads(next(ln for ln in lines if ln.startswith("AIO "))[4:])
    rows = [json.loads(ln[len("PRESET "):]) for ln in lines if ln.startswith("PRESET ")]
    return aio, {r["preset"]: r for r in rows}, out, proc.stdout + proc.stderr


def test_every_shipped_preset_takes_one_step_on_a_real_engine(runs):
    aio, rows, out, _log = runs
    assert set(dsconfig.preset_names()) == SHIPPED and set(rows) == SHIPPED | {EXAMPLE, *VARIANT_RUNS}
    for name, row in rows.items():
        if name not in SHIPPED | {EXAMPLE}:
            continue
        if name == "zero3_nvme" and not aio:
            continue
        assert row["ok"], f"{name}: {row.get('error')}\n{row.get('trace', '')}"
        assert row["steps"] == 1 and len(row["loss"]) == 1 and math.isfinite(row["loss"][0]), row
        # what the spec decided is what the model on the node ran with (the example turns it on, the presets off)
        assert row["gradient_checkpointing"] is (name == EXAMPLE), (name, row["gradient_checkpointing"])
        # DeepSpeed's norm, held as the engine's tensor through the step (test_overflow.py), logged as a number
        assert type(row["grad_norm"][0]) is float and 0 < row["grad_norm"][0] < math.inf, (name, row["grad_norm"])
        shards = out / run_dir(name) / "checkpoint-1" / "global_step1"  # the engine's own checkpoint
        files = sorted(p.name for p in shards.iterdir())
        assert any(f.endswith("model_states.pt") for f in files), (name, files)
        assert row["zero_stage"] == 0 or any(f.endswith("optim_states.pt") for f in files), (name, files)


def test_presets_reach_the_engine_as_shipped(runs):
    """What each engine got is the preset (its stage and offloads), not a default."""
    _aio, rows, _out, _log = runs
    for name in SHIPPED:
        preset = dsconfig.load_preset(name)["zero_optimization"]
        got = rows[name]["ds_config"]["zero_optimization"]
        assert got["stage"] == preset["stage"] == rows[name]["zero_stage"], name
        for key in ("offload_optimizer", "offload_param"):
            assert (got.get(key) or {}).get("device") == (preset.get(key) or {}).get("device"), (name, key)
    example = tomllib.loads((ROOT / EXAMPLE).read_text())
    got = rows[EXAMPLE]["ds_config"]["zero_optimization"]
    assert rows[EXAMPLE]["zero_stage"] == 3 and got["offload_optimizer"]["device"] == "cpu"
    for key, value in example["deepspeed"]["zero_optimization"].items():  # the example's own [deepspeed] table
        assert got[key] == value, key


def test_nvme_offload_is_refused_with_its_reason_where_the_cpu_cannot_run_it(runs):
    aio, rows, _out, _log = runs
    row = rows["zero3_nvme"]
    if aio:  # libaio present: the preset must run like the others (checked above)
        assert row["ok"], row
        return
    assert not row["ok"] and row.get("refused"), row
    assert "NVMe offload needs DeepSpeed's async_io op" in row["error"] and "libaio" in row["error"], row["error"]
    assert "zero3_offload" in row["error"]  # the way out


# ---------------------------------------------------------------- keys only training shows


def test_apollo_trains_and_warmup_ratio_shapes_the_learning_rate(runs):
    _aio, rows, _out, _log = runs
    row = rows["apollo"]
    assert row["ok"], f"{row.get('error')}\n{row.get('trace', '')}"
    assert row["optimizer"] == "apollo_torch.AdamW" and row["steps"] == 4
    assert row["gradient_checkpointing"] and row["checkpointed_layers"] == [1, 2]  # gradient_checkpointing_layers = 1
    assert all(math.isfinite(x) for x in row["loss"]) and row["loss"][-1] < row["loss"][0]
    # linear schedule, lr 1e-3, 4 steps, warmup_ratio 0.5: 2 warm-up steps (without it: 1e-3, 7.5e-4, 5e-4, 2.5e-4)
    assert row["learning_rate"] == pytest.approx([0.0, 5e-4, 1e-3, 5e-4])


def test_galore_8bit_is_refused_by_a_cpu_node_with_the_reason(runs):
    row = runs[1]["galore8bit"]
    assert not row["ok"] and row.get("refused"), row
    assert "needs a GPU" in row["error"] and "galore_adamw on CPU" in row["error"]


def test_dpo_precomputes_the_reference_and_lora_targets_the_named_modules(runs):
    _aio, rows, out, log = runs
    row = rows["dpo"]
    assert row["ok"], f"{row.get('error')}\n{row.get('trace', '')}"
    assert row["steps"] == 2 and row["loss"][0] == pytest.approx(0.6931, abs=1e-3)  # policy == reference at the start
    assert "Computing reference log probs for train dataset" in log  # TRL scored the reference before training
    adapter = json.loads((out / "dpo" / "checkpoint-2" / "adapter_config.json").read_text())
    assert sorted(adapter["target_modules"]) == ["k_proj", "up_proj"]  # not peft's Llama default (q_proj, v_proj)
    # train.eval_dataset: TRL's own eval metrics at every step, and the best checkpoint by one of them
    evals = [r for r in map(json.loads, (out / "dpo" / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all("eval_rewards/accuracies" in r and "eval_rewards/margins" in r for r in evals)
    assert (out / "dpo" / "latest_best").read_text().strip() in ("checkpoint-1", "checkpoint-2")


def test_convert_timeout_s_bounds_the_universal_conversion(runs):
    """zero2's checkpoint resumed under ZeRO-3 must be converted; the converter takes 30 s, the key allows 10."""
    row = runs[1]["convert"]
    assert not row["ok"] and row.get("refused"), row
    assert "converting checkpoint-1 to a universal checkpoint took longer than 10 s" in row["error"], row["error"]
    assert "raise checkpoint.convert_timeout_s" in row["error"] and row["wall_s"] < 28  # killed at 10 s, not waited out


def test_reward_model_learns_the_separable_pairs_under_zero3(runs):
    """task = "rm", full fine-tuning under ZeRO-3 in bf16 (the score head partitioned with the backbone): the accuracy
    (chosen scored above rejected) of the last logged steps is above 0.8 within 12 steps, and the saved classifier
    has the 1-output head in place of the LM head."""
    _aio, rows, out, _log = runs
    row = rows["rm"]
    assert row["ok"] and row["steps"] == 12, f"{row.get('error')}\n{row.get('trace', '')}"
    logged = [json.loads(line) for line in (out / "rm" / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["accuracy"] for r in logged if "accuracy" in r]
    assert len(accuracy) == 12 and min(accuracy[-3:]) > 0.8, accuracy
    from safetensors import safe_open

    with safe_open(str(out / "rm" / "checkpoint-12" / "model.safetensors"), "pt") as f:
        assert list(f.get_slice("score.weight").get_shape()) == [1, 64] and "lm_head.weight" not in f.keys()


def test_vision_language_models_train_under_zero3_in_bf16_built_in_code_or_loaded_from_a_directory(runs):
    _aio, rows, _out, _log = runs
    for name in ("vl_zero3", "vl_zero3_full", "vl_zero3_dir"):
        row = rows[name]
        assert row["ok"] and row["zero_stage"] == 3 and row["steps"] == 2, (name, row.get("error"), row.get("trace"))
        assert all(math.isfinite(x) for x in row["loss"]) and row["loss"][1] < row["loss"][0], (name, row["loss"])
    # the same seeded weights, whichever way they reached the engine: the first loss is one number
    assert rows["vl_zero3"]["loss"][0] == rows["vl_zero3_dir"]["loss"][0] == rows["vl_zero3_full"]["loss"][0]


def test_a_tiny_moe_trains_with_lora_on_its_experts_and_logs_how_its_router_spreads_tokens(runs):
    _aio, rows, out, log = runs
    row = rows["moe_lora"]
    assert row["ok"], f"{row.get('error')}\n{row.get('trace', '')}"
    assert row["steps"] == 6 and row["loss"][-1] < row["loss"][0], row["loss"]
    # 4 experts, top-2: max/mean tokens per expert between even (1) and collapsed (4 / 2)
    assert all(1.0 <= v <= 2.0 for v in row["router_load_max"]) and set(row["router_load_limit"]) == {2.0}, row
    adapter = json.loads((out / "moe_lora" / "checkpoint-6" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) >= {"gate_up_proj", "down_proj"}, adapter  # the experts, adapted
    assert "mixture of experts: 4 experts, top-2, 2 routed layers; router auxiliary loss x 0.001" in log
    assert "experts: grouped_mm (transformers' default: one grouped GEMM per layer over every expert)" in log
    assert "mixture of experts, LoRA: projections k_proj, o_proj, q_proj, v_proj and the expert/router weights" in log


def test_dpo_trains_a_vision_language_model_on_pairs_whose_prompts_hold_images(runs):
    _aio, rows, _out, _log = runs
    row = rows["vl_dpo"]
    assert row["ok"] and row["steps"] == 3, (row.get("error"), row.get("trace"))
    # step 1: the policy is the reference (LoRA's B is 0, the reference is the adapter disabled), both scored on the
    # same images: the loss is -log sigmoid(0) = ln 2; after an update it is not
    assert abs(row["loss"][0] - math.log(2)) < 1e-6 and row["loss"][1] != row["loss"][0], row["loss"]


def test_every_task_trains_a_tiny_moe_with_lora_and_in_full_under_zero3_and_logs_its_router(runs):
    _aio, rows, _out, log = runs
    for name in MOE_RUNS:
        row = rows[name]
        assert row["ok"], (name, row.get("error"), row.get("trace"))
        assert row["loss"] and all(math.isfinite(x) for x in row["loss"]), (name, row["loss"])
        assert all(1.0 <= v <= 2.0 for v in row["router_load_max"]), (name, row["router_load_max"])  # 4 experts, top-2
    lora = [n for n in MOE_RUNS if VARIANTS_OF[n].get("train_type") == "lora"]
    said = "lora_dropout 0.05 on the projections, none on the expert/router weights"
    assert len(lora) == 5 and log.count(said) == len(lora), log.count(said)  # the default dropout, every LoRA task


@pytest.mark.parametrize("stage", ["zero3", "zero2"])
def test_async_saves_with_lora_write_the_bytes_of_a_synchronous_save(runs, stage):
    """ZeRO-3 gathers the adapter through DeepSpeed; under ZeRO-2 rank 0 stages its own adapter for the background."""
    from swiftslurm import checkpoint as ck

    _aio, rows, out, log = runs
    assert "written synchronously" not in log  # every shard staged: ZeRO-3's flat partitions carry a ds_id attribute
    ours_run, theirs_run = f"async_{stage}", f"sync_{stage}"
    assert rows[ours_run]["ok"] and rows[theirs_run]["ok"], (rows[ours_run].get("error"), rows[theirs_run].get("error"))
    assert rows[ours_run]["loss"] == rows[theirs_run]["loss"]
    metrics = [json.loads(line) for line in (out / ours_run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("checkpoint_step") == 2 for r in metrics)  # committed by the background writer
    ours, theirs = (ck.read_manifest(out / run / "checkpoint-2").files for run in (ours_run, theirs_run))
    # trainer_state.json carries wall times, training_args.bin the output dir: every other file the same bytes
    differ = sorted(rel for rel in set(ours) | set(theirs) if ours.get(rel) != theirs.get(rel))
    assert differ == ["trainer_state.json", "training_args.bin"], differ
    assert any(rel.endswith("optim_states.pt") for rel in ours) and "adapter_model.safetensors" in ours


def test_fp8_trains_beside_bf16_and_its_checkpoints_hold_the_same_tensors_and_resume_bitwise(runs):
    _aio, rows, out, log = runs
    for name in ("fp8_full", "bf16_full", "fp8_resume", "fp8_lora_zero3"):
        assert rows[name]["ok"], f"{name}: {rows[name].get('error')}\n{rows[name].get('trace', '')}"
    fp8, bf16 = rows["fp8_full"], rows["bf16_full"]
    # the tiny model's 14 projections (2 layers x 7) run in FP8, its LM head does not; bf16 converts none
    assert fp8["fp8_layers"] == 14 and bf16["fp8_layers"] == 0, (fp8["fp8_layers"], bf16["fp8_layers"])
    assert fp8["loss"] != bf16["loss"]  # the casts are real: the losses differ ...
    assert all(abs(a - b) / b < 0.02 for a, b in zip(fp8["loss"], bf16["loss"], strict=True)), (fp8["loss"], bf16["loss"])  # ... a little
    import torch

    def tensors(run: str) -> dict[str, tuple]:
        shard = out / run / "checkpoint-2" / "global_step2" / "mp_rank_00_model_states.pt"
        module = torch.load(shard, map_location="cpu", weights_only=True)["module"]
        return {k: (v.dtype, tuple(v.shape)) for k, v in module.items()}

    assert tensors("fp8_full") == tensors("bf16_full")  # key for key, dtype for dtype: nothing of FP8 is saved
    assert rows["fp8_resume"]["loss"] == fp8["loss"][2:], (rows["fp8_resume"]["loss"], fp8["loss"])  # step 3, bitwise
    lora = rows["fp8_lora_zero3"]
    assert lora["fp8_layers"] == 14 and lora["zero_stage"] == 3 and lora["loss"][-1] < lora["loss"][0], lora
    assert "train.fp8: 14 linear layers run their matmuls in FP8 (torchao tensorwise scaling" in log
