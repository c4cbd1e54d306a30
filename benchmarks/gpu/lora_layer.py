"""The LoRA projections of Llama-3-8B-shaped layers, forward + backward: peft's ``lora.Linear`` against
``train/kernels/lora.py``'s fused function, the same weights, input and dropout masks (issue #34).

Each layer has the seven projections of a Llama-3-8B decoder layer (q, k, v, o, gate, up, down; hidden 4096, GQA 8
KV heads, MLP 14336), LoRA r16 alpha 32 on all of them, bf16, frozen bases; attention is replaced by an elementwise
mix of q, k and v (the same in both arms), so what differs is the LoRA wrapper only. Prints the median time of a
forward + backward over 8192 tokens, the peak memory, and fused/peft ratios, for lora_dropout 0.05 (the default) and 0.

    cd /tmp && python3 <repo>/benchmarks/gpu/lora_layer.py [--check] [--layers 4] [--tokens 8192] [--out DIR]
    python3 benchmarks/gpu/lora_layer.py --small       # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def __init__(self, hidden: int, kv: int, mlp: int):
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Linear(hidden, kv, bias=False)
        self.v_proj, self.o_proj = torch.nn.Linear(hidden, kv, bias=False), torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_proj, self.up_proj = torch.nn.Linear(hidden, mlp, bias=False), torch.nn.Linear(hidden, mlp, bias=False)
        self.down_proj = torch.nn.Linear(mlp, hidden, bias=False)
        self.groups = hidden // kv

    def forward(self, x):
        h = F.rms_norm(x, x.shape[-1:])
        k = self.k_proj(h).repeat_interleave(self.groups, -1)
        v = self.v_proj(h).repeat_interleave(self.groups, -1)
        x = x + self.o_proj(self.q_proj(h) * torch.sigmoid(k) + v)
        h = F.rms_norm(x, x.shape[-1:])
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def build(layers: int, hidden: int, kv: int, mlp: int, dropout: float, device, fused: bool, lora: bool = True):
    from peft import LoraConfig, get_peft_model

    from swiftslurm.train.kernels.lora import fuse_lora

    torch.manual_seed(0)
    base = torch.nn.Sequential(*[Layer(hidden, kv, mlp) for _ in range(layers)])
    for p in base.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if not lora:  # the frozen projections alone: the ceiling any LoRA wrapper can approach
        for p in base.parameters():
            p.requires_grad_(False)
        return base.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).train()
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # peft starts B at zero; nonzero so both paths do their full work
    model = model.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32).train()
    if fused:
        assert fuse_lora(model) == 7 * layers
    return model


def timed(model, x, steps: int, warmup: int, device) -> tuple[float, float]:
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        model(x).float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
        for p in model.parameters():
            p.grad = None
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return statistics.median(times) * 1000, peak


def check(device, tokens: int) -> list[dict]:
    """The in-kernel dropout (kernels/lora_dropout.py) against fp32 torch with the mask the kernels drew (their seed
    drawn again under the same torch seed): output, input gradient and both adapter gradients, a few shapes/ranks."""
    from swiftslurm.train.kernels import lora_dropout
    from swiftslurm.train.kernels.lora import LoraLinear

    rows = []
    for n_in, n_out, rank, p in ((4096, 1024, 16, 0.05), (14336, 4096, 16, 0.05), (4096, 14336, 8, 0.1),
                                 (4096, 4096, 64, 0.3), (1000, 300, 12, 0.5)):
        torch.manual_seed(0)
        x = torch.randn(tokens, n_in, device=device, dtype=torch.bfloat16)
        w = (torch.randn(n_out, n_in, device=device) * n_in ** -0.5).bfloat16()
        a = (torch.randn(rank, n_in, device=device) * n_in ** -0.5).bfloat16()
        b = (torch.randn(n_out, rank, device=device) * 0.1).bfloat16()
        g = torch.randn(tokens, n_out, device=device, dtype=torch.bfloat16)
        ins = [t.clone().requires_grad_(t is not w) for t in (x, w, a, b)]
        torch.manual_seed(7)
        y = LoraLinear.apply(ins[0], ins[1], None, ins[2], ins[3], 2.0, p)
        y.backward(g)
        torch.manual_seed(7)
        mask = lora_dropout.keep_mask(lora_dropout.new_seed(device), tokens, n_in, p, device)
        ref = [t.float().requires_grad_(t is not w) for t in (x, w, a, b)]
        y_ref = ref[0] @ ref[1].t() + 2.0 * ((ref[0] * mask * lora_dropout.keep_scale(p)) @ ref[2].t()) @ ref[3].t()
        y_ref.backward(g.float())

        def err(got, want):
            return round(float((got.float() - want).abs().max() / want.abs().max()), 5)

        row = {"check": "in_kernel_dropout", "in": n_in, "out": n_out, "rank": rank, "p": p,
               "kept": round(float(mask.float().mean()), 4), "y": err(y, y_ref), "grad_x": err(ins[0].grad, ref[0].grad),
               "grad_a": err(ins[2].grad, ref[2].grad), "grad_b": err(ins[3].grad, ref[3].grad)}
        row["ok"] = max(row["y"], row["grad_x"], row["grad_a"], row["grad_b"]) < 2e-2 and abs(row["kept"] - (1 - p)) < 0.01
        rows.append(row)
        print(json.dumps(row), flush=True)
    # under activation checkpointing the recompute must draw the forward's mask (torch restores the CUDA RNG state)
    x, w, a, b = (torch.randn(s, device=device, dtype=torch.bfloat16) * 0.05 for s in ((tokens, 4096), (1024, 4096),
                                                                                       (16, 4096), (1024, 16)))
    results = []
    for checkpointed in (False, True):
        ins = [t.clone().requires_grad_(t is not w) for t in (x, w, a, b)]
        torch.manual_seed(11)
        fn = lambda *t: LoraLinear.apply(t[0], t[1], None, t[2], t[3], 2.0, 0.1)  # noqa: E731
        y = torch.utils.checkpoint.checkpoint(fn, *ins, use_reentrant=False) if checkpointed else fn(*ins)
        y.float().square().sum().backward()
        results.append([y.detach(), ins[0].grad, ins[2].grad, ins[3].grad])
    row = {"check": "in_kernel_dropout_checkpointed", "y_equal": bool(torch.equal(results[0][0], results[1][0])),
           "grads": [round(float((g1.float() - g0.float()).abs().max() / g0.float().abs().max()), 6)
                     for g0, g1 in zip(results[0][1:], results[1][1:], strict=True)]}
    row["ok"] = row["y_equal"] and max(row["grads"]) == 0.0  # the same masks, and no atomics: bit for bit
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a CPU smoke run on a small shape")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", action="store_true", help="also print the top kernels of one fused step (dropout 0.05)")
    ap.add_argument("--check", action="store_true", help="first check the in-kernel dropout against torch (GPU)")
    a = ap.parse_args()
    device = torch.device("cpu" if a.small or not torch.cuda.is_available() else "cuda")
    if a.check:
        checked = check(device, a.tokens)
        if not all(r["ok"] for r in checked):
            raise SystemExit("in-kernel dropout differs from torch (rows above)")
    hidden, kv, mlp = (256, 64, 512) if a.small else (4096, 1024, 14336)
    tokens = 256 if a.small else a.tokens
    rows = []
    for dropout in (0.05, 0.0):
        result = {}
        for fused in (False, True):
            model = build(a.layers, hidden, kv, mlp, dropout, device, fused)
            x = torch.randn(1, tokens, hidden, device=device, dtype=next(model.parameters()).dtype, requires_grad=True)
            ms, peak = timed(model, x, 2 if a.small else a.steps, 1 if a.small else a.warmup, device)
            result["fused" if fused else "peft"] = (ms, peak)
            del model, x
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if dropout == 0.0:  # no LoRA at all (dropout is LoRA's): printed with the dropout-0 row
            model = build(a.layers, hidden, kv, mlp, dropout, device, False, lora=False)
            x = torch.randn(1, tokens, hidden, device=device, dtype=next(model.parameters()).dtype, requires_grad=True)
            result["no_lora"] = timed(model, x, 2 if a.small else a.steps, 1 if a.small else a.warmup, device)
            del model, x
        row = {"lora_dropout": dropout, "layers": a.layers, "tokens": tokens,
               "peft_ms": round(result["peft"][0], 2), "fused_ms": round(result["fused"][0], 2),
               "speedup": round(result["peft"][0] / result["fused"][0], 3),
               "peft_peak_gib": round(result["peft"][1], 2), "fused_peak_gib": round(result["fused"][1], 2)}
        if "no_lora" in result:
            row.update(no_lora_ms=round(result["no_lora"][0], 2), no_lora_peak_gib=round(result["no_lora"][1], 2))
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.profile:
        model = build(a.layers, hidden, kv, mlp, 0.05, device, True)
        x = torch.randn(1, tokens, hidden, device=device, dtype=next(model.parameters()).dtype, requires_grad=True)
        timed(model, x, 1, 2, device)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            timed(model, x, 1, 0, device)
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "lora_layer.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
