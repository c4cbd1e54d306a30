"""Useful tokens/s: padded per micro-batch (HF's default) vs swiftslurm's packed rows, same samples, same run.

    .venv/bin/python benchmarks/packing.py                       # CPU: tiny-llama, 400 samples, rows of 1024
    python benchmarks/packing.py --shape 0.5b --samples 4000 --max-length 8192 --rows 1 --batch 8 --bf16   # one GPU

Samples are synthetic alpaca-length token sequences (log-normal, median ~220 tokens, capped at the
row length; the first 30% of each is "prompt" without labels). Both arms train the same freshly
initialised model (same seed) with AdamW over the same samples, one forward + backward + step per
micro-batch:

- padded: ``--batch`` samples per micro-batch in a seeded random order, padded to the longest one, with
  an attention_mask (``data.Collator``), sdpa;
- packed: the same samples in rows of ``--max-length`` (``packing.PackedDataset``), ``--rows`` rows per
  micro-batch, no attention_mask (``packing.PackingCollator``), attention as ``train.attn_implementation =
  "auto"`` picks it (``--attn`` overrides).

Useful tokens = non-padding positions; the first ``--warmup`` micro-batches of each arm are not timed
(flex_attention compiles there). Prints one line per arm and the packed/padded ratio; ``--json FILE``
writes the numbers. ``--liger`` applies Liger's kernels to the packed arm (GPU, liger-kernel installed).
"""

from __future__ import annotations

import argparse
import json
import random
import time

SHAPES = {  # LlamaConfig kwargs; "0.5b" is the Qwen2.5-0.5B-shaped Llama of notes/deepspeed-and-gpu.md
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
}


def synthetic_samples(n: int, max_length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = max(8, min(max_length, int(rng.lognormvariate(5.4, 0.6))))  # median e^5.4 ~ 221
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = int(length * 0.3)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:], "attention_mask": [1] * length})
    return out


def build(shape: str, vocab: int, max_length: int, attn: str, dtype, device, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=max_length, tie_word_embeddings=False,
                         use_cache=False, **SHAPES[shape])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.set_attn_implementation(attn)
    model.train()
    return model


def run_arm(model, batches, device, warmup: int, liger: bool = False) -> dict:
    import torch

    from swiftslurm.train.health.metrics import STATS_PREFIX

    if liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    useful = total = 0
    start = None
    for i, batch in enumerate(batches):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        stats = {k: batch.pop(k) for k in [k for k in batch if k.startswith(STATS_PREFIX)]}
        real = int(stats[STATS_PREFIX + "real_tokens"].sum()) if stats else int(batch["attention_mask"].sum())
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            useful += real
            total += batch["input_ids"].numel()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start if start is not None else 0.0
    return {"useful_tokens": useful, "total_tokens": total, "seconds": seconds,
            "useful_tokens_per_s": useful / seconds if seconds else 0.0,
            "padding_ratio": 1 - useful / total if total else 0.0,
            "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="samples per padded micro-batch")
    p.add_argument("--rows", type=int, default=1, help="packed rows per micro-batch")
    p.add_argument("--attn", default="auto", help="attention of the packed arm (default: what train's auto picks)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--liger", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    import torch

    from swiftslurm.train.data import packing
    from swiftslurm.train.data.tokens import Collator, SFTDataset
    from swiftslurm.train.kernels import choose as kernels

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    vocab = a.vocab if a.shape != "tiny" or cuda else 512
    samples = SFTDataset(synthetic_samples(a.samples, a.max_length, vocab, a.seed))
    attn = kernels.resolve_attention(a.attn, True, kernels.node_facts(cuda))[0] if a.attn == "auto" else a.attn

    order = list(range(len(samples)))
    random.Random(a.seed).shuffle(order)
    padded = [Collator(0)([samples[j] for j in order[i:i + a.batch]]) for i in range(0, len(order), a.batch)]
    rows = packing.PackedDataset(samples, a.max_length, a.seed)
    collate = packing.PackingCollator(a.max_length, 0, flatten=attn.startswith("flash_attention"))
    packed = [collate([rows[r] for r in range(i, min(i + a.rows, len(rows)))]) for i in range(0, len(rows), a.rows)]

    results = {}
    for name, batches, impl, liger in (("padded", padded, "sdpa", False), ("packed", packed, attn, a.liger)):
        model = build(a.shape, vocab, a.max_length, impl, dtype, device, a.seed)
        results[name] = {"attn": impl, "liger": liger, "batches": len(batches), **run_arm(model, batches, device, a.warmup, liger)}
        del model
        if cuda:
            torch.cuda.empty_cache()
        r = results[name]
        mem = f", peak {r['peak_gpu_gb']:.1f} GB" if r["peak_gpu_gb"] is not None else ""
        print(f"{name:7s} {impl:18s} {r['batches']:5d} micro-batches  {r['useful_tokens_per_s']:10.0f} useful tokens/s  "
              f"padding {r['padding_ratio']:.1%}{mem}", flush=True)
    ratio = results["packed"]["useful_tokens_per_s"] / max(results["padded"]["useful_tokens_per_s"], 1e-9)
    print(f"packed / padded useful tokens/s: {ratio:.2f}x  ({a.samples} samples, {device.type}, shape {a.shape}, "
          f"rows of {a.max_length}, padded micro-batch {a.batch}, packed micro-batch {a.rows} row(s))")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "ratio": ratio, **results}, fh, indent=2)


if __name__ == "__main__":
    main()
