"""The baseline: a bare HF Trainer + DeepSpeed script (no swiftslurm runtime, callbacks, metrics or
checkpoint commit) on the same model dir, the same encoded samples and the same DeepSpeed dict.

torchrun --nproc_per_node=N bare_trainer.py --model DIR --data JSONL --ds DS.json --steps 30 --out DIR [--lora] [--hf-collator]
Writes OUT/steps.jsonl (one row per step: step, time, loss, useful = this rank's non-padding tokens of
the step) and OUT/summary.json (peak memory). ``--hf-collator``: HF's own dynamic padding
(``DataCollatorForSeq2Seq``, pad to the longest sample of each micro-batch) instead of swiftslurm's.
Data encoding reuses swiftslurm.train.data.tokens (the encoded token ids are then identical); everything
that is timed is plain transformers + DeepSpeed.
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

from swiftslurm.train.data.tokens import Collator, load_dataset  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class CountingTrainer(Trainer):
    """Counts the non-padding tokens of every micro-batch it trains on (nothing else changes)."""

    useful = 0

    def training_step(self, model, inputs, *args, **kwargs):
        mask = inputs.get("attention_mask")
        self.useful += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        return super().training_step(model, inputs, *args, **kwargs)


class StepLog(TrainerCallback):
    def __init__(self, path):
        self.path = path
        self.trainer = None
        self.seen = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            useful = self.trainer.useful - self.seen if self.trainer else None
            self.seen = self.trainer.useful if self.trainer else 0
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": state.global_step, "time": time.time(), "loss": logs["loss"], "useful": useful}) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--lora-targets", default=",".join(LORA_TARGETS), help="comma-separated module names")
    ap.add_argument("--logging-steps", type=int, default=1, help="log (and sync for it) every this many steps")
    ap.add_argument("--out", required=True)
    ap.add_argument("--hf-collator", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    with open(a.ds) as fh:
        ds_config = json.load(fh)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, use_kernels=False)  # no Hub kernels (offline)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=a.lora_targets.split(","), task_type="CAUSAL_LM"))
    data = load_dataset([a.data], tok, a.seq)
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=1, learning_rate=a.lr,
        lr_scheduler_type="constant", max_steps=a.steps, logging_steps=a.logging_steps, save_strategy="no", seed=42, data_seed=42,
        bf16=True, deepspeed=ds_config, report_to="none", remove_unused_columns=False, dataloader_num_workers=0,
        disable_tqdm=True, use_cpu=not torch.cuda.is_available(),  # CPU: a smoke run of this script only
    )
    collator = (DataCollatorForSeq2Seq(tok, padding=True, label_pad_token_id=-100) if a.hf_collator
                else Collator(tok.pad_token_id))
    log = StepLog(os.path.join(a.out, "steps.jsonl"))
    trainer = CountingTrainer(model=model, args=args, train_dataset=data, data_collator=collator, callbacks=[log])
    log.trainer = trainer
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "summary.json"), "w") as fh:
            json.dump({"gpu_mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}, fh)


if __name__ == "__main__":
    main()
