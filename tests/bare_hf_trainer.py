"""A bare HF Trainer + DeepSpeed ZeRO-2 run, no swiftslurm runtime, trainer or checkpoint commit: what a user's
own script writes (``checkpoint-N/`` with global_stepN, latest, rng_state_<r>.pth, trainer_state.json).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python tests/bare_hf_trainer.py OUT DATA STEPS SAVE_STEPS

The tiny Llama and the tokenization are swiftslurm's (so a resume in swiftslurm sees the same model and
tokens); everything that trains and saves is plain transformers + DeepSpeed on the CPU. Logs every loss to
OUT/steps.jsonl.
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "gpu"))

from bare_trainer import StepLog  # noqa: E402  (the benchmark's per-step loss log)
from transformers import Trainer, TrainingArguments, set_seed  # noqa: E402

from swiftslurm.train.data.tokens import Collator, load_dataset  # noqa: E402
from swiftslurm.train.tinymodel import build_model, build_tokenizer  # noqa: E402


def main(out, data, steps, save_steps):
    set_seed(42)
    tok = build_tokenizer()
    model = build_model(len(tok), 128, 42)
    model.set_attn_implementation("sdpa")
    ds_config = {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "train_batch_size": "auto"}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant",
        max_steps=int(steps), save_steps=int(save_steps), save_strategy="steps", logging_steps=1, seed=42, data_seed=42,
        deepspeed=ds_config, use_cpu=True, report_to="none", remove_unused_columns=False, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=load_dataset([data], tok, 128), data_collator=Collator(tok.pad_token_id),
                      callbacks=[StepLog(os.path.join(out, "steps.jsonl"))])
    trainer.train()
    trainer.accelerator.free_memory()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
