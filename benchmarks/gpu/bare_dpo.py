"""The DPO baseline: a bare TRL DPOTrainer + DeepSpeed script (no swiftslurm runtime, callbacks, metrics or
checkpoint commit) on the same model dir, the same preference JSONL and the same DeepSpeed dict.

torchrun --nproc_per_node=N bare_dpo.py --model DIR --data JSONL --ds DS.json --steps 30 --out DIR [--lora]
Writes OUT/steps.jsonl (one row per step: step, time, loss) and OUT/summary.json (peak memory).
"""

import argparse
import json
import os

import torch
from bare_trainer import LORA_TARGETS, StepLog
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with open(a.ds) as fh:
        ds_config = json.load(fh)
    tok = AutoTokenizer.from_pretrained(a.model)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))  # the precision of swiftslurm's run (CPU smoke: fp32)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_kernels=False)
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    data = load_dataset("json", data_files=a.data, split="train")
    args = DPOConfig(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=1, learning_rate=1e-5,
        lr_scheduler_type="constant", max_steps=a.steps, logging_steps=1, save_strategy="no", seed=42, data_seed=42,
        bf16=bf16, deepspeed=ds_config, report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False, max_length=a.seq, beta=0.1, use_cpu=not torch.cuda.is_available(),
    )
    ref = None if a.lora else AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, use_kernels=False)
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tok,
                         peft_config=peft_config, callbacks=[StepLog(os.path.join(a.out, "steps.jsonl"))])
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "summary.json"), "w") as fh:
            json.dump({"gpu_mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}, fh)


if __name__ == "__main__":
    main()
