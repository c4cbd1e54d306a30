"""A Qwen2.5-0.5B-shaped Llama (random init, no download) saved as a local model dir, plus SFT data.

The tokenizer is swiftslurm's byte-level test tokenizer (no download); every record is long enough
that each sample is truncated to exactly --seq tokens, so every step sees the same token count.
Usage: python make_assets.py OUT_DIR [--tiny]   (--tiny: a small model for a CPU smoke run)
"""

from __future__ import annotations

import argparse
import json
import random
import string
from pathlib import Path

# name: (model dir, config). Qwen2.5 shapes (tied embeddings, 151,936 vocabulary) as a Llama; Llama-3-8B untied
SHAPES = {
    "0.5b": ("qwen05b", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                             num_key_value_heads=2, vocab_size=151936)),  # 494M parameters
    "1.5b": ("qwen15b", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                             num_key_value_heads=2, vocab_size=151936)),  # 1.54B
    "3b": ("qwen3b", dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                          num_key_value_heads=2, vocab_size=151936)),  # 3.09B
    "8b": ("llama8b", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                           num_key_value_heads=8, vocab_size=128256)),  # 8.03B, untied head
    # issue 55: OLMoE-1B-7B's sizes as a Qwen3-MoE (AutoEP has a qwen3_moe preset, none for olmoe): 64 experts of 1024,
    # top-8, every layer sparse; 6.9B total, 1.3B active
    "moe": ("qwen3moe7b", dict(hidden_size=2048, intermediate_size=1024, moe_intermediate_size=1024, num_hidden_layers=16,
                               num_attention_heads=16, num_key_value_heads=16, head_dim=128, num_experts=64,
                               num_experts_per_tok=8, decoder_sparse_step=1, vocab_size=50304)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b", help="Qwen2.5-0.5B/1.5B/3B-shaped, 8b: Llama-3-8B-shaped (8.03B parameters), "
                    "moe: an OLMoE-1B-7B-sized Qwen3-MoE")
    a = ap.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from swiftslurm.train.tinymodel import build_tokenizer

    out = Path(a.out)
    model_dir = out / ("tiny" if a.tiny else SHAPES[a.shape][0])
    tok = build_tokenizer()
    if a.tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    else:
        shape = SHAPES[a.shape][1]
    moe = a.shape == "moe" and not a.tiny
    config = (Qwen3MoeConfig if moe else LlamaConfig)(
        **shape, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=a.shape not in ("8b", "moe") or a.tiny,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    causal = Qwen3MoeForCausalLM if moe else LlamaForCausalLM
    torch.manual_seed(0)
    if a.shape != "0.5b" and not a.tiny and torch.cuda.is_available():  # GBs of random bf16 weights: initialised on the GPU, in seconds
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = causal(config)
        model = model.cpu()
    else:
        model = causal(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    n = sum(p.numel() for p in model.parameters())
    from swiftslurm.train.moe import active_params

    active = active_params(model, n)  # an MoE: the parameters one token uses (the MFU's FLOPs); dense: n
    rng = random.Random(0)
    letters = string.ascii_lowercase + "     "
    data = out / "sft.jsonl"
    with open(data, "w") as fh:
        for _ in range(a.samples):
            prompt = "".join(rng.choice(letters) for _ in range(a.seq // 4))
            answer = "".join(rng.choice(letters) for _ in range(a.seq))
            fh.write(json.dumps({"instruction": prompt, "input": "", "output": answer}) + "\n")
    print(json.dumps({"model_dir": str(model_dir), "params": n, "active_params": active, "data": str(data)}))


if __name__ == "__main__":
    main()
