"""What one mixture-of-experts layer keeps for its backward, per token (issue 55): the bytes autograd saves in the
forward (``saved_tensors_hooks``, each storage once, the parameters left out), and on a GPU the rise of
``max_memory_allocated`` over the weights, for an OLMoE-1B-7B-shaped Qwen3-MoE layer stack (hidden 2048, 64 experts of
1024, top-8) with its experts frozen (LoRA on the attention, as ``MOE_LORA_TARGETS``) and trained (full fine-tuning),
with and without Liger's layers. ``sizing/memory.py`` counts an MoE layer from these terms; this is their check.

    source benchmarks/gpu/setup.sh && python3 benchmarks/gpu/moe_saved.py --out $OUT     # GPU: bf16, 8192 tokens
    .venv/bin/python benchmarks/gpu/moe_saved.py --small --out /tmp/moe-saved            # CPU: a narrower stack, fp32

Each row: saved bytes per token and layer (the difference between a stack of one layer and of two, so the embedding's and
the head's share cancel), the same in elements of the model's dtype, what ``sizing/memory.py`` counts for that layer, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OLMOE = dict(hidden_size=2048, intermediate_size=1024, moe_intermediate_size=1024, num_attention_heads=16,
             num_key_value_heads=16, head_dim=128, num_experts=64, num_experts_per_tok=8, decoder_sparse_step=1,
             vocab_size=50304)
SMALL = dict(OLMOE, hidden_size=256, moe_intermediate_size=128, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, vocab_size=1000)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def saved_bytes(model, tokens: int, device) -> tuple[int, int]:
    """(bytes autograd saved in one forward, the allocator's rise over the forward and backward; 0 on the CPU)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    rise = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else 0
    return sum(seen.values()), rise


def estimate_layer(cfg: dict, trained_experts: bool, liger: bool, b: int) -> int:
    """sizing/memory.py's bytes per token for one MoE layer of this shape (no tensor parallel, no LoRA dropout)."""
    from swiftslurm.sizing import memory as m
    from swiftslurm.sizing.shape import shape_from_config

    shape = shape_from_config(dict(cfg, model_type="qwen3_moe", num_hidden_layers=1))
    s = m.Settings(0, False, False, "full" if trained_experts else "lora", 8, ATTENTION, b == 2, False, 1, 80.0, 1,
                   liger_layers=liger)
    return m.layer_bytes(shape, s, 1)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/moe-saved")
    ap.add_argument("--small", action="store_true", help="hidden 256, experts of 128: for the CPU")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the one sequence of the step")
    a = ap.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = dict(SMALL if a.small else OLMOE)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for liger in ([False, True] if cuda else [False]):
        if liger:
            from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe
            apply_liger_kernel_to_qwen3_moe(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                            fused_linear_cross_entropy=False)
        for trained in (False, True):
            measured = []
            for layers in (1, 2):
                torch.manual_seed(0)
                with torch.device(device):
                    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg, num_hidden_layers=layers)).to(dtype)
                model.config._attn_implementation = "sdpa"
                impl = getattr(model.config, "_experts_implementation", None)
                if not trained:
                    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=ATTENTION))
                measured.append(saved_bytes(model, a.tokens, device))
                del model
                if cuda:
                    torch.cuda.empty_cache()
            (s1, r1), (s2, r2) = measured
            per = (s2 - s1) / a.tokens
            b = 2 if cuda else 4
            est = estimate_layer(cfg, trained, liger, b)
            row = {"what": "moe_saved", "device": torch.cuda.get_device_name() if cuda else "cpu", "liger": liger,
                   "experts": "trained" if trained else "frozen", "experts_impl": impl,
                   "hidden": cfg["hidden_size"], "expert_width": cfg["moe_intermediate_size"], "top_k": cfg["num_experts_per_tok"],
                   "saved_bytes_per_token_layer": round(per), "saved_elements_per_token_layer": round(per / b),
                   "estimate_bytes_per_token_layer": est, "estimate_vs_saved": round(est / per, 3),
                   "allocator_rise_bytes_per_token_layer": round((r2 - r1) / a.tokens) if cuda else None}
            with open(out / "results.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
