"""Short runs of the built-in trainer in ONE process (world size 1): every shipped DeepSpeed preset for one
optimizer step, and a few spec keys that need training to show their effect (VARIANTS).

    python tests/one_process_runs.py OUT_DIR [PRESET | EXAMPLE.toml | VARIANT ...]

Each preset goes the way a user's spec goes: ``dsconfig.build_for_spec`` (preset + [deepspeed] + the
batch/precision keys) -> ``train.run.train`` (HF Trainer + a real DeepSpeed engine, DS_ACCELERATOR=cpu).
An EXAMPLE.toml brings its own ``train.deepspeed``, ``[deepspeed]`` table, precision and checkpointing onto
the tiny model. A VARIANT is a preset-free spec of its own. Prints one JSON line per run: {"preset", "ok", "steps", "loss",
"learning_rate", "grad_norm", "optimizer", "zero_stage", "ds_config", "error"}. A refusal
(SwiftSlurmError) is reported with its message, never raised: the test decides what may be refused.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _inline(value) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


DATA = ROOT / "examples" / "data"
VARIANTS = {
    # APOLLO on plain DDP (GaLore/APOLLO cannot run under ZeRO) with a linear schedule warmed up over half the steps;
    # the first of tiny-llama's 2 layers recomputes its activations (gradient_checkpointing_layers)
    "apollo": {"train_type": "full", "deepspeed": "none", "optimizer": "apollo_adamw", "galore_rank": 8,
               "galore_update_proj_gap": 2, "max_steps": 4, "lr_scheduler_type": "linear", "warmup_ratio": 0.5,
               "gradient_checkpointing": True, "gradient_checkpointing_layers": 1},
    # the 8-bit GaLore needs bitsandbytes on a GPU: the node refuses it before loading anything
    "galore8bit": {"train_type": "full", "deepspeed": "none", "optimizer": "galore_adamw_8bit", "max_steps": 1},
    # DPO + LoRA on two named modules only (not peft's default for Llama), the reference scored once before training;
    # an eval dataset (files; the split is the cluster run's: test_evaluation.py) evaluated every step, the best
    # checkpoint chosen by TRL's eval reward accuracy
    "dpo": {"task": "dpo", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "lora", "deepspeed": "zero2",
            "lora_target_modules": ["k_proj", "up_proj"], "precompute_ref_log_probs": True, "max_prompt_length": 64,
            "max_steps": 2, "learning_rate": 1e-2, "eval_dataset": [str(DATA / "dpo_demo.jsonl")], "eval_steps": 1,
            "per_device_eval_batch_size": 4, "metric_for_best_model": "eval_rewards/accuracies", "greater_is_better": True},
    # the sources of tests/test_export.py: a LoRA run under ZeRO-2 (fp32, so a merge compares at 1e-4) and a full bf16 run
    # under ZeRO-3 (its fp32 master weights live only in the shards)
    "export_lora": {"train_type": "lora", "deepspeed": "zero2", "max_steps": 1, "learning_rate": 1e-2},
    "export_zero3": {"train_type": "full", "deepspeed": "zero3", "bf16": True, "max_steps": 1, "learning_rate": 1e-2},
    # reward models: their score head is trained whole (under LoRA as peft's modules_to_save), and exported with it
    "export_rm_lora": {"task": "rm", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "lora", "deepspeed": "zero2",
                       "max_steps": 1, "learning_rate": 1e-2},
    "export_rm_full": {"task": "rm", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "full", "deepspeed": "zero2",
                       "max_steps": 1, "learning_rate": 1e-2},
    # a reward model, full fine-tuning under ZeRO-3 in bf16 (the score head sharded with the rest), on the separable DPO pairs
    "rm": {"task": "rm", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "full", "deepspeed": "zero3", "bf16": True,
           "gradient_checkpointing": False, "per_device_train_batch_size": 4, "max_steps": 12, "learning_rate": 1e-3,
           "lr_scheduler_type": "constant"},
    # a mixture of experts (issue 55): the tiny Qwen3-MoE, LoRA "all-linear" (peft adapts the fused expert weights and
    # the routers too, without dropout), its router logging tokens per expert
    # vision-language under ZeRO-3 in bf16 (issue 56): the built-in LLaVA with LoRA, a full fine-tune that trains its
    # projector, and LoRA on a LLaVA directory (from_pretrained partitions it as it builds it, as it does a hub model)
    # DPO on a vision-language model (issue 56): the pairs' images read per micro-batch, LoRA, ZeRO-2
    "vl_dpo": {"model": "tiny-vl", "task": "dpo", "dataset": [str(DATA / "vl_dpo_demo.jsonl")], "train_type": "lora",
               "deepspeed": "zero2", "max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-2,
               "gradient_checkpointing": False},
    "vl_zero3": {"model": "tiny-vl", "dataset": [str(DATA / "vl_demo.jsonl")], "train_type": "lora", "deepspeed": "zero3",
                 "bf16": True, "max_steps": 2, "per_device_train_batch_size": 2, "gradient_checkpointing": False},
    "vl_zero3_full": {"model": "tiny-vl", "dataset": [str(DATA / "vl_demo.jsonl")], "train_type": "full", "deepspeed": "zero3",
                      "bf16": True, "max_steps": 2, "per_device_train_batch_size": 2, "gradient_checkpointing": False,
                      "freeze_projector": False},
    "vl_zero3_dir": {"model": "__OUT__/tiny-vl-dir", "dataset": [str(DATA / "vl_demo.jsonl")], "train_type": "lora",
                     "deepspeed": "zero3", "bf16": True, "max_steps": 2, "per_device_train_batch_size": 2,
                     "gradient_checkpointing": False},
    # every task on the tiny MoE (issue 55), LoRA with the default lora_dropout (the projections get it, the expert
    # weights peft adapts as parameters take none), full fine-tuning under ZeRO-3 in bf16
    "moe_pt": {"model": "tiny-moe", "task": "pt", "dataset": [str(DATA / "pt_demo.jsonl")], "train_type": "full",
               "deepspeed": "zero2", "max_steps": 2},
    "moe_dpo": {"model": "tiny-moe", "task": "dpo", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "lora",
                "deepspeed": "zero2", "max_steps": 2, "max_prompt_length": 64},
    "moe_kto": {"model": "tiny-moe", "task": "kto", "dataset": [str(DATA / "kto_demo.jsonl")], "train_type": "lora",
                "deepspeed": "zero2", "max_steps": 2},
    "moe_rm": {"model": "tiny-moe", "task": "rm", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "full",
               "deepspeed": "zero3", "bf16": True, "max_steps": 2},
    "moe_rm_lora": {"model": "tiny-moe", "task": "rm", "dataset": [str(DATA / "dpo_demo.jsonl")], "train_type": "lora",
                    "deepspeed": "zero2", "max_steps": 2},
    "moe_grpo": {"model": "tiny-moe", "task": "grpo", "dataset": [str(DATA / "grpo_demo.jsonl")], "train_type": "lora",
                 "deepspeed": "zero2", "max_steps": 1, "reward_funcs": ["length"], "reward_length_target": 16,
                 "max_completion_length": 16, "num_generations": 2},
    "moe_zero3_lora": {"model": "tiny-moe", "train_type": "lora", "deepspeed": "zero3", "bf16": True, "max_steps": 2},
    "moe_zero3_full": {"model": "tiny-moe", "train_type": "full", "deepspeed": "zero3", "bf16": True, "max_steps": 2},
    "moe_lora": {"model": "tiny-moe", "train_type": "lora", "lora_dropout": 0.0, "deepspeed": "zero2", "max_steps": 6,
                 "per_device_train_batch_size": 4, "learning_rate": 3e-3, "lr_scheduler_type": "constant"},
    # checkpoint.async_save under ZeRO-3 with LoRA (issue 54): saves at steps 1 and 2 copied off the training's path and
    # written in the background, beside the same run saving synchronously; their checkpoint-2 must hold the same bytes
    "async_zero3": {"train_type": "lora", "deepspeed": "zero3", "max_steps": 3, "save_steps": 1, "learning_rate": 1e-2,
                    "checkpoint": {"async_save": True, "keep": 3}},
    "sync_zero3": {"train_type": "lora", "deepspeed": "zero3", "max_steps": 3, "save_steps": 1, "learning_rate": 1e-2,
                   "checkpoint": {"async_save": False, "keep": 3}},
    # train.fp8 (issue 53) in torchao's fp32 emulation of the FP8 casts and GEMMs (the CPU has no FP8 tensor cores;
    # SWIFTSLURM_TEST_FP8_EMULATE): a full bf16 fine-tune under ZeRO-2 beside the same run in bf16, and its resume from
    # checkpoint-2 (step 3 again, bitwise); LoRA under ZeRO-3, the frozen base in FP8
    "fp8_full": {"train_type": "full", "deepspeed": "zero2", "bf16": True, "fp8": True, "max_steps": 3, "save_steps": 2,
                 "gradient_checkpointing": False, "lr_scheduler_type": "constant"},
    "bf16_full": {"train_type": "full", "deepspeed": "zero2", "bf16": True, "fp8": False, "max_steps": 3, "save_steps": 2,
                  "gradient_checkpointing": False, "lr_scheduler_type": "constant"},
    "fp8_resume": {"train_type": "full", "deepspeed": "zero2", "bf16": True, "fp8": True, "max_steps": 3, "save_steps": 2,
                   "gradient_checkpointing": False, "lr_scheduler_type": "constant",
                   "resume_from": "__OUT__/fp8_full/checkpoint-2", "checkpoint": {"allow_spec_change": True}},
    "fp8_lora_zero3": {"train_type": "lora", "deepspeed": "zero3", "bf16": True, "fp8": True, "max_steps": 3, "save_steps": 2,
                       "gradient_checkpointing": False, "learning_rate": 1e-2},
    # a vision-language model (issue 56): the tiny LLaVA on the demo's colour squares, LoRA on its language model under
    # ZeRO-2, and every weight but the frozen vision tower (the projector trained: freeze_projector = false), both with
    # packing on as by default (turned off for a VLM, with the reason)
    "vl_lora": {"model": "tiny-vl", "dataset": [str(DATA / "vl_demo.jsonl")], "train_type": "lora", "deepspeed": "zero2",
                "image_max_pixels": 3136, "per_device_train_batch_size": 4, "max_steps": 6, "save_steps": 6,
                "learning_rate": 1e-2, "lr_scheduler_type": "constant", "gradient_checkpointing": False},
    "vl_full": {"model": "tiny-vl", "dataset": [str(DATA / "vl_demo.jsonl")], "train_type": "full", "deepspeed": "zero2",
                "image_max_pixels": 3136, "freeze_projector": False, "per_device_train_batch_size": 4, "max_steps": 4,
                "save_steps": 4, "learning_rate": 3e-3, "lr_scheduler_type": "constant"},
    # ... and under ZeRO-2, where rank 0 writes the adapter itself: in the background too, the same bytes
    "async_zero2": {"train_type": "lora", "deepspeed": "zero2", "max_steps": 3, "save_steps": 1, "learning_rate": 1e-2,
                    "checkpoint": {"async_save": True, "keep": 3}},
    "sync_zero2": {"train_type": "lora", "deepspeed": "zero2", "max_steps": 3, "save_steps": 1, "learning_rate": 1e-2,
                   "checkpoint": {"async_save": False, "keep": 3}},
    # zero2's checkpoint resumed under ZeRO-3: a conversion (DeepSpeed's ds_to_universal), here made slower (30 s)
    # than checkpoint.convert_timeout_s (10 s) by SLOW_CONVERTER; run it after zero2
    "convert": {"train_type": "full", "deepspeed": "zero3", "resume_from": "__OUT__/zero2/checkpoint-1", "max_steps": 2,
                "bf16": True, "gradient_checkpointing": False,
                "checkpoint": {"convert_timeout_s": 10, "allow_spec_change": True}},
}
SLOW_CONVERTER = """import os, sys, time
if "--input_folder" in sys.argv and os.environ.get("SWIFTSLURM_TEST_SLOW_CONVERT_S"):
    time.sleep(float(os.environ["SWIFTSLURM_TEST_SLOW_CONVERT_S"]))  # a slow ds_to_universal
"""


def run_dir(preset: str) -> str:
    """The run's own dir under OUT_DIR (an example is never the preset it names)."""
    return "example-" + Path(preset).stem if preset.endswith(".toml") else preset


def spec_text(preset: str, out: Path) -> str:
    if preset in VARIANTS:
        keys = {"model": "tiny-llama", "dataset": [str(DATA / "alpaca_demo.jsonl")], "per_device_train_batch_size": 2,
                "max_length": 128, "save_steps": 100, "logging_steps": 1, "learning_rate": 1e-3, "report_to": ["none"],
                **VARIANTS[preset]}
        checkpoint = {"forced_save_fractions": [], **keys.pop("checkpoint", {})}
        train = "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items()).replace("__OUT__", str(out.parent))
        tail = "\n".join(f"{k} = {json.dumps(v)}" for k, v in checkpoint.items())
        return f'[job]\nname = "{preset}"\noutput_dir = {json.dumps(str(out))}\n[train]\n{train}\n[checkpoint]\n{tail}\n'
    deepspeed, table, checkpointing = preset, {}, False
    if preset.endswith(".toml"):  # a shipped example: its DeepSpeed choice as written
        import tomllib

        example = tomllib.loads((ROOT / preset).read_text())
        deepspeed, table = example["train"]["deepspeed"], example.get("deepspeed", {})
        checkpointing = example["train"].get("gradient_checkpointing", False)
    overrides = "\n".join(f"{k} = {_inline(v)}" for k, v in table.items())
    return f"""
[job]
name = "preset-{Path(preset).stem}"
output_dir = {json.dumps(str(out))}
[train]
model = "tiny-llama"
dataset = [{json.dumps(str(ROOT / "examples" / "data" / "alpaca_demo.jsonl"))}]
train_type = "full"
deepspeed = "{deepspeed}"
gradient_checkpointing = {json.dumps(checkpointing)}
per_device_train_batch_size = 2
max_steps = 1
max_length = 128
bf16 = true
save_steps = 100
logging_steps = 1
learning_rate = 1e-3
report_to = ["none"]
[checkpoint]
forced_save_fractions = []
[deepspeed]
{overrides}
"""


def main(out_root: str, presets: list[str]) -> int:
    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from swiftslurm import dsconfig
    from swiftslurm.errors import SwiftSlurmError
    from swiftslurm.slurm.distenv import DistEnv, free_port
    from swiftslurm.spec import parse_spec
    from swiftslurm.train.run import train

    print("AIO " + json.dumps(AsyncIOBuilder().is_compatible(verbose=False)), flush=True)
    import accelerate

    copies = []  # every whole-model state dict accelerate was asked for (a copy of every weight to host memory)
    whole = accelerate.Accelerator.get_state_dict
    accelerate.Accelerator.get_state_dict = lambda self, *a, **k: copies.append(1) or whole(self, *a, **k)
    port = free_port()
    os.environ["MASTER_PORT"] = str(port)
    dist = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nnodes=1, nodes=("localhost",),
                   node="localhost", master_addr="127.0.0.1", master_port=port, job_id=f"local-{os.getpid()}",
                   requeue_id=f"local-{os.getpid()}", array_task_id=None, restart_count=0, gpus=(), executor="local")
    from deepspeed.runtime.zero.partition_parameters import Init

    for preset in presets or dsconfig.preset_names():
        Init.param_id = 0  # ZeRO-3 numbers parameters process-wide (ds_id, saved in its shards): as if each run had its own process
        out = Path(out_root, run_dir(preset))
        row: dict = {"preset": preset, "ok": False}
        copies.clear()
        started = time.perf_counter()
        try:
            spec = parse_spec(spec_text(preset, out))
            ds, _warnings = dsconfig.build_for_spec(spec)
            row["zero_stage"] = ds.get("zero_optimization", {}).get("stage")
            row["ds_config"] = ds
            resume = True if "resume_from" in VARIANTS.get(preset, {}) else None  # as `swiftslurm run`: the own newest, else resume_from
            if preset == "vl_zero3_dir":  # tiny-vl saved as a model directory with its processor
                from swiftslurm.train.tinymodel import TINY_VL, build_model, build_processing

                processor = build_processing(TINY_VL)
                build_model(len(processor.tokenizer), 128, 42, name=TINY_VL).save_pretrained(Path(out_root, "tiny-vl-dir"))
                processor.save_pretrained(Path(out_root, "tiny-vl-dir"))
            if preset == "convert":  # the converter runs as a child: a sitecustomize on its PYTHONPATH slows it
                slow = Path(out_root, "slow-converter")
                slow.mkdir(exist_ok=True)
                (slow / "sitecustomize.py").write_text(SLOW_CONVERTER)
                os.environ.update(SWIFTSLURM_TEST_SLOW_CONVERT_S="30", PYTHONPATH=f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            result = train(spec, dist, ds, str(out), resume, lambda: False)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            stepped = [r for r in rows if r.get("loss") is not None]
            row.update(ok=True, steps=result.global_step, optimizer=result.optimizer, loss=[r["loss"] for r in stepped],
                       gradient_checkpointing=result.gradient_checkpointing, state_dict_copies=len(copies),
                       checkpointed_layers=list(result.checkpointed_layers), fp8_layers=result.fp8_layers,
                       learning_rate=[r.get("learning_rate") for r in stepped], grad_norm=[r.get("grad_norm") for r in stepped],
                       router_load_max=[r.get("router_load_max") for r in stepped],
                       router_load_limit=[r.get("router_load_limit") for r in stepped])
        except SwiftSlurmError as exc:
            row.update(refused=True, error=exc.message())
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            row.update(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-3000:])
        row["wall_s"] = round(time.perf_counter() - started, 1)
        print("PRESET " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
