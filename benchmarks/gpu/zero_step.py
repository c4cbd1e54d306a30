"""DeepSpeed's ZeRO-2 bf16 optimizer step alone (issue 19): what its inf/NaN check costs, and what
swiftslurm's device-side skip (swiftslurm/train/kernels/overflow.py) leaves of it.

    source benchmarks/gpu/setup.sh && python3 benchmarks/gpu/zero_step.py

One rank, a stack of bf16 Linear/LayerNorm layers with the Qwen2.5-0.5B shape's parameter count and tensor count
(337 tensors, ~490M parameters; `--small` or no GPU: a few KB), fused torch AdamW under DeepSpeed ZeRO-2, gradient
clipping 1.0. Each variant runs in its own process, so every one builds its own engine:

- `default`: DeepSpeed as configured by default (its per-gradient scan and host test of the norm every step);
- `config_off`: `bf16.check_grad_overflow = false` (no check at all: a NaN step is applied);
- `swiftslurm`: the default engine after `skip_nonfinite_on_device` (the check moved onto the device);
- `swiftslurm_norm`: that and `norm_in_one_pass` (the gradient norm from one `torch._foreach_norm` instead of a cast
  and a norm per gradient): what swiftslurm's trainer runs.

Prints one JSON line per variant: ms per `engine.step()` (median over --steps after --warmup, each step ended
by a device sync, so the whole step's GPU work is in it), then the ratio of each variant's time to `default`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("default", "config_off", "swiftslurm", "swiftslurm_norm")


def one(variant: str, steps: int, warmup: int, small: bool) -> dict:
    import deepspeed
    import torch

    from swiftslurm.train.kernels.overflow import norm_in_one_pass, skip_nonfinite_on_device

    cuda = torch.cuda.is_available()
    hidden, ffn, layers, vocab = (896, 4864, 24, 151936) if cuda and not small else (64, 128, 4, 1000)
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = [torch.nn.Embedding(vocab, hidden)]
    for _ in range(layers):  # q, k, v, o, gate, up, down and two norms: the 0.5B shape's tensors
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, 128), torch.nn.Linear(hidden, 128),
                 torch.nn.Linear(hidden, hidden, bias=False), torch.nn.Linear(hidden, ffn, bias=False),
                 torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(ffn, hidden, bias=False),
                 torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)]
    model = torch.nn.ModuleList(mods).to(torch.bfloat16)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True, "check_grad_overflow": variant != "config_off"},
           "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    if variant.startswith("swiftslurm") and not skip_nonfinite_on_device(zero):
        raise SystemExit("skip_nonfinite_on_device did not apply (see train/overflow.py kept_reason)")
    if variant == "swiftslurm_norm" and not norm_in_one_pass(zero):
        raise SystemExit("norm_in_one_pass did not apply (DeepSpeed's get_grad_norm_direct changed shape)")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(warmup + steps):
        # a cheap loss that gives every parameter a gradient: the step, not the model, is measured
        engine.backward(sum((p.float() * 1e-3).square().mean() for p in engine.module.parameters()))
        sync()
        start = time.perf_counter()
        engine.step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    kept = sorted(times[warmup:])
    return {"variant": variant, "step_ms": round(kept[len(kept) // 2], 2), "min_ms": round(kept[0], 2),
            "tensors": sum(1 for _ in model.parameters()),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "device": "cuda" if cuda else "cpu"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a few KB of parameters (a smoke run)")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's part
    a = ap.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(one(a.variant, a.steps, a.warmup, a.small)), flush=True)
        return
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    rows = {}
    for variant in VARIANTS:
        argv = [sys.executable, __file__, "--variant", variant, "--steps", str(a.steps), "--warmup", str(a.warmup)]
        proc = subprocess.run(argv + (["--small"] if a.small else []), capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(json.dumps({"variant": variant, "rc": proc.returncode, "stderr_tail": proc.stderr[-1500:]}))
            continue
        rows[variant] = json.loads(lines[-1][len("RESULT "):])
        print(json.dumps(rows[variant]))
    if "default" in rows:
        base = rows["default"]["step_ms"]
        print(json.dumps({"what": "step_time_vs_default", **{v: round(r["step_ms"] / base, 3) for v, r in rows.items()}}))


if __name__ == "__main__":
    main()
