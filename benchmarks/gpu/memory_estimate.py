"""`plan`'s memory estimate against the measured peak (issue 13): ZeRO-2 and ZeRO-3 training steps of a
model shape on one GPU at several sequence lengths, through HF Trainer + DeepSpeed as swiftslurm trains
(the DeepSpeed dict from swiftslurm's presets, bf16, gradient checkpointing, packed-row batches of
exactly LENGTH tokens without an attention mask, sdpa).

GPU (the lead):   python benchmarks/gpu/memory_estimate.py --shape 0.5b --lengths 2048,4096,8192,16384 --stages 2,3
CPU smoke (here): python benchmarks/gpu/memory_estimate.py --shape tiny --lengths 64,128 --stages 2,3 --steps 2

Each (stage, length) runs in a fresh process (a clean allocator and process group). Prints one row each:
the estimate's allocator part (what torch.cuda.max_memory_allocated measures: weights, gradients and
optimizer, activations, logits), the measured peak, and the error; with --json FILE writes the rows.
The weights are random (no download): memory does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = {  # transformers config values
    "0.5b": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True},
    "3b": {"model_type": "qwen2", "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
           "num_key_value_heads": 2, "intermediate_size": 11008, "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 259, "tie_word_embeddings": False},
}


def estimate(shape_name: str, stage: int, length: int, micro: int, ckpt: bool, liger: bool = False,
             liger_layers: bool = False) -> dict:
    from swiftslurm.sizing.layout import Layout
    from swiftslurm.sizing.memory import GIB, Settings
    from swiftslurm.sizing.memory import estimate as est
    from swiftslurm.sizing.shape import shape_from_config

    shape = shape_from_config(SHAPES[shape_name], shape_name)
    e = est(shape, Settings(stage, False, False, "full", 8, "all-linear", True, ckpt, length, 80.0, 1, fused_loss=liger,
                            liger_layers=liger or liger_layers), Layout(1, 1, 1, micro, 1))
    return {"estimate_allocated_gib": e.allocated_bytes / GIB, "estimate_total_gib": e.total_bytes / GIB,
            "parts_gib": {k: round(v / GIB, 3) for k, v in e.parts.items()}}


def one(shape_name: str, stage: int, length: int, micro: int, steps: int, ckpt: bool, tiled: bool = False,
        liger: bool = False, liger_layers: bool = False) -> dict:
    """One training run in this process: the measured peak after ``steps`` steps."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29561"), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from swiftslurm import dsconfig
    from swiftslurm.train.kernels.choose import LIGER_FAST

    cfg = dict(SHAPES[shape_name])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg, max_position_embeddings=max(length, 64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if tiled:  # [parallel] tiled_mlp: the MLPs through DeepSpeed's TiledMLP, as the trainer wraps them
        from types import SimpleNamespace

        from swiftslurm.train.parallel import tile_mlps

        tile_mlps(SimpleNamespace(parallel=SimpleNamespace(tiled_mlp=True)), model)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return micro * steps

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(3, cfg["vocab_size"], (length,), generator=g)
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(length)}

    class Train:  # the spec keys dsconfig.build reads
        per_device_train_batch_size, gradient_accumulation_steps, bf16, fp16 = micro, 1, True, False

    ds, _ = dsconfig.build(dsconfig.load_preset(f"zero{stage}"), {}, Train, 1)
    args = TrainingArguments(output_dir=f"/tmp/memest-{os.getpid()}", per_device_train_batch_size=micro, max_steps=steps,
                             learning_rate=1e-5, bf16=True, gradient_checkpointing=ckpt,
                             gradient_checkpointing_kwargs={"use_reentrant": False} if ckpt else None, deepspeed=ds,
                             save_strategy="no", report_to="none", logging_steps=1, disable_tqdm=True, use_cpu=not cuda,
                             remove_unused_columns=False, dataloader_pin_memory=False, use_liger_kernel=liger or liger_layers,
                             **({"liger_kernel_config": LIGER_FAST} if liger_layers and not liger else {}))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    Trainer(model=model, args=args, train_dataset=Rows()).train()
    measured = torch.cuda.max_memory_allocated() / (1 << 30) if cuda else None
    return {"measured_gib": measured, "device": torch.cuda.get_device_name() if cuda else "cpu"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--tiled-mlp", action="store_true", help="[parallel] tiled_mlp: measure with the MLPs tiled")
    ap.add_argument("--liger", action="store_true", help="use_liger_kernel: the fused linear cross-entropy (no logits)")
    ap.add_argument("--liger-layers", action="store_true", help='use_liger_kernel = "auto" on a GPU: Liger\'s RMSNorm, RoPE, SwiGLU')
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # "stage,length": run one configuration in this process
    a = ap.parse_args()
    ckpt = not a.no_checkpointing
    if a.one:
        stage, length = map(int, a.one.split(","))
        print("RESULT " + json.dumps(one(a.shape, stage, length, a.micro, a.steps, ckpt, a.tiled_mlp, a.liger, a.liger_layers)), flush=True)
        return 0
    rows = []
    print(f"{'stage':>5} {'tokens':>7} {'estimate GiB':>12} {'measured GiB':>12} {'error':>7}  parts (GiB)")
    kinds = {"tiled_mlp": a.tiled_mlp, "liger": a.liger, "liger_layers": a.liger_layers}
    for stage in map(int, a.stages.split(",")):
        for length in map(int, a.lengths.split(",")):
            est = estimate(a.shape, stage, length, a.micro, ckpt, a.liger, a.liger_layers)
            cmd = [sys.executable, __file__, "--shape", a.shape, "--micro", str(a.micro), "--steps", str(a.steps), "--one", f"{stage},{length}"]
            cmd += (["--no-checkpointing"] if not ckpt else []) + (["--tiled-mlp"] if a.tiled_mlp else []) + (["--liger"] if a.liger else []) \
                + (["--liger-layers"] if a.liger_layers else [])
            run = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
            if run.returncode or not lines:
                tail = (run.stderr.strip().splitlines() or ["?"])[-1]
                row = {"stage": stage, "tokens": length * a.micro, **kinds, **est, "measured_gib": None,
                       "error": tail[:200]}
                print(f"{stage:>5} {length * a.micro:>7} {est['estimate_allocated_gib']:>12.2f} {'failed':>12}  {tail[:120]}")
            else:
                got = json.loads(lines[-1][len("RESULT "):])
                m = got["measured_gib"]
                err = (est["estimate_allocated_gib"] - m) / m if m else None
                row = {"stage": stage, "tokens": length * a.micro, **kinds, **est, **got, "relative_error": err}
                print(f"{stage:>5} {length * a.micro:>7} {est['estimate_allocated_gib']:>12.2f} "
                      f"{'n/a (CPU)' if m is None else f'{m:.2f}':>12} {'' if err is None else f'{err:+.0%}':>7}  {est['parts_gib']}")
            rows.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
