"""The training tasks behind the trainer's one seam: sft (HF Trainer + DeepSpeed + peft) and dpo (TRL)."""
