"""The model alone on packed rows (issue 19): forward + backward of the Qwen2.5-0.5B-shaped Llama, bf16, one
micro-batch of 4 rows x 2048 tokens, for each way of keeping packed samples apart, against the same model on
full rows (no samples to keep apart). No trainer, no DeepSpeed, no optimizer: what is left between a packed
and a full row here is the attention path's own cost.

    source benchmarks/gpu/setup.sh && python3 benchmarks/gpu/packed_model.py [--profile]

Prints one JSON line per path: ms per forward + backward (median of --iters, each ended by a device sync), the ms
the host spent issuing it (close to the whole: the step waits on the CPU), the loss and the relative difference of two
layer-0 weight gradients from the first packed path's (a wrong kernel shows here), the host<->device synchronizations
one step makes (torch.cuda sync debug mode), and with --profile the top CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings


def block_causal(position_ids):
    """The attention mask of packed rows, ``[rows, 1, length, length]`` bool (True = may attend): a
    position sees the positions of its own sample up to itself. Samples start where positions are 0."""
    import torch

    sample = (position_ids == 0).cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((sample[:, :, None] == sample[:, None, :]) & causal)[:, None]


def main() -> None:
    import torch
    from attn_kernels import packed_positions  # this script's directory
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftslurm.train.kernels import varlen

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--paths", default="full_rows,sdpa,sdpa_mask,varlen,varlen_torch,flex,varlen_liger",
                    help="varlen_liger patches the model for good: keep it last")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a small model on the CPU: a smoke run of this driver")
    a = ap.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512) \
        if a.tiny else dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                            vocab_size=151936)
    config = LlamaConfig(**shape, max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=dev, dtype=torch.float32 if a.tiny else torch.bfloat16)
    model.train()
    varlen.register()
    pos = torch.tensor(packed_positions(a.rows, a.row))  # the rows attn_kernels.py times
    ids = torch.randint(0, config.vocab_size, (a.rows, a.row))
    labels = ids.clone()
    labels[pos == 0] = -100
    packed = {"input_ids": ids, "labels": labels, "position_ids": pos}
    batches = {
        "full_rows": ("sdpa", {"input_ids": ids, "labels": ids}),
        "sdpa": ("sdpa", packed),
        "sdpa_mask": ("sdpa", dict(packed, attention_mask=block_causal(pos))),
        "varlen": (varlen.NAME, dict(packed, **varlen.boundaries(pos))),  # swiftslurm's autograd node over aten's flash kernel
        "varlen_torch": (varlen.NAME, dict(packed, **varlen.boundaries(pos))),  # torch's varlen_attn (custom ops) instead
        "varlen_liger": (varlen.NAME, dict(packed, **varlen.boundaries(pos))),  # + Liger's RMSNorm/RoPE/SwiGLU (use_liger_kernel = "auto")
        "flex": ("flex_attention", packed),
    }

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    watched = {"q_proj": model.model.layers[0].self_attn.q_proj.weight, "k_proj": model.model.layers[0].self_attn.k_proj.weight}
    reference: dict = {}

    def step(batch, grads: dict | None = None):
        loss = model(**batch).loss
        loss.backward()
        if grads is not None:
            grads.update({n: w.grad.float().clone() for n, w in watched.items()})
        model.zero_grad(set_to_none=True)
        return loss.detach()

    for name in a.paths.split(","):
        impl, cpu_batch = batches[name]
        if name == "varlen_torch":
            from torch.nn.attention.varlen import varlen_attn

            varlen.use_kernel(varlen_attn)
        else:
            varlen.use_kernel(None)
        if name == "varlen_liger":
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            from swiftslurm.train.kernels.choose import LIGER_FAST

            _apply_liger_kernel_to_instance(model=model, **LIGER_FAST)
        model.set_attn_implementation(impl)
        batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in cpu_batch.items()}
        grads: dict = {}
        loss = float(step(batch, grads))
        if name != "full_rows" and not reference:
            reference.update(grads)  # the first packed path's gradients: the others are compared with them
        grad_diff = {n: round(float((g - reference[n]).norm() / reference[n].norm()), 5) for n, g in grads.items()} if reference else {}
        for _ in range(2):
            step(batch)
        sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            step(batch)
            if dev == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0][:120] for w in caught if "synchroniz" in str(w.message)]
        sync()
        times, launch = [], []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            step(batch)
            launch.append((time.perf_counter() - t0) * 1000)
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        print(json.dumps({"what": "packed_model", "path": name, "attn": impl, "rows": a.rows, "row": a.row,
                          "ms_fwd_bwd": round(statistics.median(times), 2), "host_ms": round(statistics.median(launch), 2), "loss": round(loss, 5),
                          "grad_rel_diff": grad_diff, "syncs": len(syncs), "sync_sites": sorted(set(syncs))[:5]}),
              flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(batch)
                sync()
            print(f"== {name}\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
