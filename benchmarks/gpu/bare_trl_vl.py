"""The TRL baseline of vl_sft.py (issue 56): TRL's ``SFTTrainer`` with its vision-language collator
(``DataCollatorForVisionLanguageModeling``: the processor renders and processes each micro-batch on the fly, right-pads
it, labels every non-padding token) on swiftslurm's records, with peft LoRA on the language model's projections only.

torchrun --nproc_per_node=1 bare_trl_vl.py --model DIR --data JSONL --ds DS.json --steps 50 --out DIR [--micro 4]
    [--seq 2048] [--gradient-checkpointing] [--attn sdpa] [--fp32]

Records: swiftslurm's messages form with an ``images`` list (paths relative to the data file). Each becomes TRL's
vision row: ``images`` (PIL, through datasets' ``Image()`` feature, decoded as the loader asks) and ``messages`` whose
user turn is the list of blocks the record's text gives, each ``<image>`` an ``{"type": "image"}`` block in its place, so
the model dir's template renders the text swiftslurm renders. LoRA: r, alpha, dropout as given (swiftslurm's defaults
16 / 32 / 0.05) on q,k,v,o,gate,up,down of the language model (the module ``model.get_decoder()`` is; swiftslurm's
``train/vision.lora_targets``); peft leaves the vision tower and the projector frozen.
Writes OUT/steps.jsonl (step, time, loss, useful = non-padding tokens of the logging interval (text and image tokens:
the attention mask's sum), positions (padding included), samples) and OUT/summary.json (peak GPU memory), the rows
bare_trl_sft.py writes.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepLog(TrainerCallback):
    """A row per log: the tokens counted on the device since the last one (read here, once a log: no sync a step)."""

    def __init__(self, path):
        self.path, self.trainer = path, None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            useful, positions, samples = self.trainer.take_counts()
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": state.global_step, "time": time.time(), "loss": logs["loss"], "useful": useful,
                                     "positions": positions, "samples": samples}) + "\n")


def blocks(text):
    """A record's text as TRL's content blocks: ``<image>`` -> an image block, the rest text blocks, in order."""
    out = []
    for i, part in enumerate(text.split("<image>")):
        if i:
            out.append({"type": "image", "text": None})
        if part:
            out.append({"type": "text", "text": part})
    return out


def rows(path):
    base = Path(path).parent
    for line in open(path):
        rec = json.loads(line)
        messages = [{"role": m["role"], "content": blocks(m["content"])} for m in rec["messages"]]
        yield {"messages": messages, "images": [str(base / p) for p in rec.get("images") or []]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ds", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=int, default=32)
    ap.add_argument("--lora-dropout", type=float, default=0.05)
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--fp32", action="store_true", help="no bf16 (a CPU run)")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from datasets import Dataset, Image
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    try:
        from datasets import List
    except ImportError:  # datasets < 4
        from datasets import Sequence as List

    os.makedirs(a.out, exist_ok=True)
    with open(a.ds) as fh:
        ds_config = json.load(fh)
    processor = AutoProcessor.from_pretrained(a.model)
    data = Dataset.from_list(list(rows(a.data))).cast_column("images", List(Image()))
    dtype = torch.float32 if a.fp32 else torch.bfloat16
    model = AutoModelForImageTextToText.from_pretrained(a.model, dtype=dtype, attn_implementation=a.attn,
                                                        use_kernels=False)  # no Hub kernels (offline)
    decoder = model.get_decoder()
    language = next(name for name, m in model.named_modules() if m is decoder)
    targets = rf"{re.escape(language)}\..*\.({'|'.join(PROJECTIONS)})"
    peft_config = LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, lora_dropout=a.lora_dropout, target_modules=targets,
                             task_type="CAUSAL_LM")
    args = SFTConfig(
        output_dir=a.out, per_device_train_batch_size=a.micro, gradient_accumulation_steps=1, learning_rate=a.lr,
        lr_scheduler_type="constant", max_steps=a.steps, logging_steps=a.logging_steps, save_strategy="no", seed=42,
        data_seed=42, bf16=not a.fp32, deepspeed=ds_config, report_to="none", dataloader_num_workers=0, disable_tqdm=True,
        packing=False, padding_free=False, max_length=a.seq, gradient_checkpointing=a.gradient_checkpointing,
        use_cpu=not torch.cuda.is_available(),
    )

    class CountingSFT(SFTTrainer):
        useful, positions, samples = None, 0, 0

        def training_step(self, model, inputs, *rest, **kw):
            mask = inputs["attention_mask"]
            tokens = mask.sum()
            self.useful = tokens if self.useful is None else self.useful + tokens  # on the device: read at the log
            self.positions += mask.numel()
            self.samples += mask.shape[0]
            return super().training_step(model, inputs, *rest, **kw)

        def take_counts(self):
            counts = (int(self.useful) if self.useful is not None else 0, self.positions, self.samples)
            self.useful, self.positions, self.samples = None, 0, 0
            return counts

    log = StepLog(os.path.join(a.out, "steps.jsonl"))
    trainer = CountingSFT(model=model, args=args, train_dataset=data, processing_class=processor, peft_config=peft_config,
                          callbacks=[log])
    log.trainer = trainer
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "summary.json"), "w") as fh:
            json.dump({"gpu_mem_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
                       "gpu_mem_reserved_peak_mb": torch.cuda.max_memory_reserved() / 2**20 if torch.cuda.is_available() else None,
                       "attn": a.attn, "lora_targets": targets, "trainable_params": trainable,
                       "gradient_checkpointing": a.gradient_checkpointing, "padding": "right-padded to each micro-batch's longest",
                       "collator": type(trainer.data_collator).__name__}, fh)


if __name__ == "__main__":
    main()
