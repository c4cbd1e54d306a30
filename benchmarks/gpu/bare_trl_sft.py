"""The TRL baseline: TRL's ``SFTTrainer`` with its own best packing (``packing=True``: BFD, padding-free rows, so
no token is padding) on the same alpaca-like records, model dir and DeepSpeed dict as the other arms.

torchrun --nproc_per_node=1 bare_trl_sft.py --model DIR --data JSONL --ds DS.json --steps 30 --out DIR [--lora] [--seq 4096] [--micro 2]
Writes OUT/steps.jsonl (step, time, loss, useful = the step's tokens; with padding-free packing every one is a
sample's) and OUT/summary.json (peak memory), the same rows as bare_trainer.py.
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepLog(TrainerCallback):
    def __init__(self, path):
        self.path, self.trainer, self.seen = path, None, 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            useful = self.trainer.useful - self.seen
            self.seen = self.trainer.useful
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": state.global_step, "time": time.time(), "loss": logs["loss"], "useful": useful}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--lora-targets", default=",".join(LORA_TARGETS), help="comma-separated module names")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    os.makedirs(a.out, exist_ok=True)
    with open(a.ds) as fh:
        ds_config = json.load(fh)
    tok = AutoTokenizer.from_pretrained(a.model)
    records = [json.loads(line) for line in open(a.data)]
    data = Dataset.from_list([{"prompt": r["instruction"] + ("\n" + r["input"] if r.get("input") else ""), "completion": r["output"]}
                              for r in records])
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation=a.attn,
                                                 use_kernels=False)
    peft_config = None
    if a.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=1, learning_rate=a.lr,
        lr_scheduler_type="constant", max_steps=a.steps, logging_steps=a.logging_steps, save_strategy="no", seed=42,
        data_seed=42, bf16=True, deepspeed=ds_config, report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        packing=True, max_length=a.seq, gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(),
    )

    class CountingSFT(SFTTrainer):
        useful = 0

        def training_step(self, model, inputs, *rest, **kw):
            mask = inputs.get("attention_mask")
            self.useful += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *rest, **kw)

    log = StepLog(os.path.join(a.out, "steps.jsonl"))
    trainer = CountingSFT(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=peft_config, callbacks=[log])
    log.trainer = trainer
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "summary.json"), "w") as fh:
            json.dump({"gpu_mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
                       "packing": "bfd, padding-free", "attn": a.attn}, fh)


if __name__ == "__main__":
    main()
