"""The attention kernels alone on packed rows (issue 19): forward + backward of one attention call with the
Qwen2.5-0.5B head layout (14 query heads, 2 key/value heads, head_dim 64), bf16, on rows filled with
alpaca-length samples (log-normal, median ~220 tokens), against causal attention over unpacked full rows
(the cost of a full row with no samples to keep apart). Isolates the kernel from the trainer around it.

    source benchmarks/gpu/setup.sh && python3 benchmarks/gpu/attn_kernels.py --rows 4 --row 2048

Prints one JSON line per kernel: milliseconds per forward + backward (median of --iters, CUDA events).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics


def packed_positions(rows: int, length: int, seed: int = 0) -> list[list[int]]:
    """``position_ids`` of rows filled with alpaca-length samples (log-normal, median ~220 tokens), the last
    sample of a row cut to fit (as padding would be)."""
    rng = random.Random(seed)
    positions = []
    for _ in range(rows):
        row: list[int] = []
        while len(row) < length:
            row += range(min(length - len(row), max(16, min(2048, int(rng.lognormvariate(5.4, 0.6))))))
        positions.append(row)
    return positions


def main() -> None:
    import torch
    import torch.nn.functional as F

    from swiftslurm.train.kernels import varlen

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    pos = torch.tensor(packed_positions(a.rows, a.row))
    keys = varlen.boundaries(pos)
    dev, dt = "cuda", torch.bfloat16
    cu = keys["cu_seq_lens_q"].to(dev)
    heads, kv, d = 14, 2, 64
    q = torch.randn(a.rows, heads, a.row, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(a.rows, kv, a.row, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(a.rows, kv, a.row, d, device=dev, dtype=dt, requires_grad=True)
    sample = torch.zeros(a.rows, a.row, dtype=torch.long)  # which sample each position belongs to
    sample.view(-1)[keys["cu_seq_lens_q"][1:-1].long()] = 1
    sample = sample.view(-1).cumsum(0).view(a.rows, a.row).to(dev)
    causal = torch.ones(a.row, a.row, dtype=torch.bool, device=dev).tril()
    mask = (sample[:, :, None] == sample[:, None, :]) & causal  # [rows, L, L] block-diagonal causal
    mask = mask[:, None]

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def doc_causal(b, h, qi, ki):
        return (sample[b, qi] == sample[b, ki]) & (qi >= ki)

    block = create_block_mask(doc_causal, a.rows, None, a.row, a.row, device=dev)
    flex = torch.compile(flex_attention)

    def rep(t):
        return t.repeat_interleave(heads // kv, dim=1)

    import inspect

    from torch.nn.attention.varlen import varlen_attn

    causal_kw = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}
    T = a.rows * a.row
    qt = torch.randn(T, heads, d, device=dev, dtype=dt, requires_grad=True)
    kt = torch.randn(T, heads, d, device=dev, dtype=dt, requires_grad=True)  # key/value heads already repeated
    vt = torch.randn(T, heads, d, device=dev, dtype=dt, requires_grad=True)
    kernels = {
        "varlen_attn raw (THD, heads repeated)": lambda: varlen_attn(qt, kt, vt, cu, cu, keys["max_length_q"], keys["max_length_q"],
                                                                     **causal_kw),
        "sdpa_packed_mask": lambda: F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask),
        "varlen_attn (swiftslurm wrapper)": lambda: varlen.attention(None, q, k, v, None, scaling=d ** -0.5, cu_seq_lens_q=cu,
                                                                     max_length_q=keys["max_length_q"])[0],
        "flex_attention_block_mask": lambda: flex(q, rep(k), rep(v), block_mask=block),
        "sdpa_causal_full_rows (reference)": lambda: F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True),
    }
    for name, fn in kernels.items():
        times = []
        for i in range(a.iters + 5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn().float().sum().backward()
            end.record()
            torch.cuda.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end))
        print(json.dumps({"what": "attn_kernel", "kernel": name, "rows": a.rows, "row": a.row,
                          "samples": int(cu.numel() - 1), "ms_fwd_bwd": round(statistics.median(times), 3)}), flush=True)


if __name__ == "__main__":
    main()
