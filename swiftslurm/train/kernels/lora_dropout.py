"""LoRA dropout drawn inside the adapter's GEMMs (Triton; GPUs only): nothing stored, no pass of its own.

``kernels/lora.py`` with ``lora_dropout > 0`` drew a mask with ``torch.native_dropout`` (a pass over the
``[tokens, in]`` input that writes a dropped-out copy and a mask), kept the mask for the backward, and rebuilt the
dropped-out input there (another pass) for ``grad_A``, then applied the mask to the adapter's input gradient (a
third). Here the mask is a function of a seed and the element's index (Philox, ``tl.randint4x``), so each kernel
that reads ``x`` draws it again in registers:

- ``down``: ``h = s * dropout(x) @ A^T``, ``[tokens, r]``;
- ``grad_a``: ``grad_A = grad_h^T @ dropout(x)``, ``[r, in]``, the tokens split over programs, their fp32 partial
  sums added in a fixed order (deterministic);
- ``grad_x_add``: ``grad_x += dropout'(grad_h @ A)``, the mask and the 1/(1-p) applied in the add.

The mask costs arithmetic, not memory traffic: one Philox-4x32 call gives eight 16-bit draws (eight elements of a
row), so p is applied as a multiple of 1/65536 (``threshold``; 0.05 -> 0.050003) and the kept elements are scaled by
the matching ``keep_scale``. A draw per element (``tl.rand``) made the three passes cost more than the stored mask
they replace (measured: 72.7 against 62.5-64.9 ms over four 8B-shaped layers). The seed is drawn from torch's
generator on the device (``torch.randint``), so a run under ``torch.manual_seed`` repeats its masks (activation
checkpointing's recompute included) and no host sync is added; the masks are not ``torch.native_dropout``'s (the
same law: each element kept with probability 1 - p, scaled by 1/(1 - p)). ``keep_mask`` writes the mask of a seed,
for tests.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _keep(seed_ptr, rows, col0, n_cols, thr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """The keep-mask of the tile ``rows`` x ``col0 .. col0 + BLOCK_K`` (col0 a multiple of 8): one Philox call per
    8 elements of a row, each 32-bit output split into two 16-bit draws, kept where the draw >= ``thr``."""
    seed = tl.load(seed_ptr)
    groups = col0 // 8 + tl.arange(0, BLOCK_K // 8)
    offsets = (rows[:, None] * tl.cdiv(n_cols, 8) + groups[None, :]).to(tl.uint32)  # wraps past 2**32 groups: harmless
    r0, r1, r2, r3 = tl.randint4x(seed, offsets)
    u = tl.join(tl.join(tl.join(r0 & 0xFFFF, r0 >> 16), tl.join(r1 & 0xFFFF, r1 >> 16)),
                tl.join(tl.join(r2 & 0xFFFF, r2 >> 16), tl.join(r3 & 0xFFFF, r3 >> 16)))  # [T, K/8, 2, 2, 2]
    return tl.reshape(u, (BLOCK_T, BLOCK_K)).to(tl.int32) >= thr


@triton.jit
def _down(x_ptr, a_ptr, h_ptr, seed_ptr, n_rows, n_cols, rank, thr, scale,
          R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DROP: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rr = tl.arange(0, R)
    acc = tl.zeros((BLOCK_T, R), dtype=tl.float32)
    for k in range(0, n_cols, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=inside, other=0.0)
        if DROP:
            x = tl.where(_keep(seed_ptr, rows, k, n_cols, thr, BLOCK_T, BLOCK_K), x, 0.0)
        a = tl.load(a_ptr + rr[None, :] * n_cols + cols[:, None], mask=(cols[:, None] < n_cols) & (rr[None, :] < rank),
                    other=0.0)  # [K, R]
        acc = tl.dot(x, a, acc)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * rank + rr[None, :], (acc * scale).to(h_ptr.dtype.element_ty),
             mask=(rows[:, None] < n_rows) & (rr[None, :] < rank))


@triton.jit
def _grad_a(gh_ptr, x_ptr, out_ptr, seed_ptr, n_rows, n_cols, rank, rows_per_split, thr, scale,
            R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DROP: tl.constexpr):
    pid_k = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, R)
    acc = tl.zeros((R, BLOCK_K), dtype=tl.float32)
    start = split * rows_per_split
    for t in range(start, start + rows_per_split, BLOCK_T):
        rows = t + tl.arange(0, BLOCK_T)
        inside_rows = rows < n_rows
        gh = tl.load(gh_ptr + rows[None, :].to(tl.int64) * rank + rr[:, None],
                     mask=inside_rows[None, :] & (rr[:, None] < rank), other=0.0)  # [R, T]
        inside = inside_rows[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], mask=inside, other=0.0)
        if DROP:
            x = tl.where(_keep(seed_ptr, rows, pid_k * BLOCK_K, n_cols, thr, BLOCK_T, BLOCK_K), x, 0.0)
        acc = tl.dot(gh, x, acc)
    part = out_ptr + split.to(tl.int64) * rank * n_cols  # this split's partial sum; summed after, in a fixed order
    tl.store(part + rr[:, None] * n_cols + cols[None, :], acc * scale, mask=(cols[None, :] < n_cols) & (rr[:, None] < rank))


@triton.jit
def _grad_x_add(gh_ptr, a_ptr, gx_ptr, seed_ptr, n_rows, n_cols, rank, thr, scale,
                R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, DROP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rr = tl.arange(0, R)
    gh = tl.load(gh_ptr + rows[:, None].to(tl.int64) * rank + rr[None, :],
                 mask=(rows[:, None] < n_rows) & (rr[None, :] < rank), other=0.0)
    a = tl.load(a_ptr + rr[:, None] * n_cols + cols[None, :], mask=(cols[None, :] < n_cols) & (rr[:, None] < rank),
                other=0.0)
    d = tl.dot(gh, a) * scale
    if DROP:
        d = tl.where(_keep(seed_ptr, rows, tl.program_id(1) * BLOCK_K, n_cols, thr, BLOCK_T, BLOCK_K), d, 0.0)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    where = gx_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    gx = tl.load(where, mask=inside, other=0.0)
    tl.store(where, (gx.to(tl.float32) + d).to(gx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _mask(seed_ptr, out_ptr, n_rows, n_cols, thr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :],
             _keep(seed_ptr, rows, tl.program_id(1) * BLOCK_K, n_cols, thr, BLOCK_T, BLOCK_K), mask=inside)


MAX_RANK = 128  # wider adapters keep torch's dropout (a [tokens, rank] tile per program would not fit)


def supported(x: torch.Tensor, rank: int) -> bool:
    """Inputs these kernels take: a CUDA tensor in bf16/fp16 and a LoRA rank up to ``MAX_RANK`` (padded to a power
    of two, at least 16, inside the kernel)."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and 0 < rank <= MAX_RANK


def threshold(p: float) -> int:
    """The 16-bit draw under which an element is dropped: p rounded to a multiple of 1/65536."""
    return min(65535, round(p * 65536))


def keep_scale(p: float) -> float:
    """1/(1 - p) for the p the kernels apply (``threshold(p) / 65536``): the kept elements' factor."""
    return 65536.0 / (65536 - threshold(p))


def _padded(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def new_seed(device) -> torch.Tensor:
    """A seed on the device, drawn from torch's generator without a host sync."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int32)


def down(x: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    """``scale * (mask * x) @ a^T`` for ``x`` ``[T, K]``, ``a`` ``[r, K]`` (both contiguous): ``[T, r]`` in x's dtype."""
    n_rows, n_cols = x.shape
    rank = a.shape[0]
    h = torch.empty((n_rows, rank), device=x.device, dtype=x.dtype)
    block_t = 64
    _down[(triton.cdiv(n_rows, block_t),)](x, a, h, seed, n_rows, n_cols, rank, threshold(p), scale,
                                           R=_padded(rank), BLOCK_T=block_t, BLOCK_K=128, DROP=p > 0)
    return h


def grad_a(grad_h: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float, scale: float) -> torch.Tensor:
    """``scale * grad_h^T @ (mask * x)``: ``[r, K]`` in x's dtype (summed in fp32 over the tokens)."""
    n_rows, n_cols = x.shape
    rank = grad_h.shape[1]
    if n_rows == 0:  # no tokens (an empty shard): nothing to split
        return torch.zeros((rank, n_cols), device=x.device, dtype=x.dtype)
    block_t, block_k = 64, 128
    col_blocks = triton.cdiv(n_cols, block_k)
    # enough programs for every SM several times over: the tokens are split, each split writes its partial sum, and
    # the splits are added in a fixed order (no atomics: the same gradient bit for bit on every run)
    splits = max(1, min(triton.cdiv(n_rows, block_t), triton.cdiv(4 * _sms(x.device), col_blocks)))
    rows_per_split = triton.cdiv(triton.cdiv(n_rows, splits), block_t) * block_t
    splits = triton.cdiv(n_rows, rows_per_split)
    parts = torch.empty((splits, rank, n_cols), device=x.device, dtype=torch.float32)
    _grad_a[(col_blocks, splits)](grad_h, x, parts, seed, n_rows, n_cols, rank, rows_per_split, threshold(p), scale,
                                  R=_padded(rank), BLOCK_T=block_t, BLOCK_K=block_k, DROP=p > 0)
    return parts.sum(0).to(x.dtype)


def grad_x_add(grad_x: torch.Tensor, grad_h: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float,
               scale: float) -> None:
    """``grad_x += scale * mask * (grad_h @ a)`` in place (``grad_x`` ``[T, K]`` contiguous)."""
    n_rows, n_cols = grad_x.shape
    rank = a.shape[0]
    block_t, block_k = 64, 128
    _grad_x_add[(triton.cdiv(n_rows, block_t), triton.cdiv(n_cols, block_k))](
        grad_h, a, grad_x, seed, n_rows, n_cols, rank, threshold(p), scale,
        R=_padded(rank), BLOCK_T=block_t, BLOCK_K=block_k, DROP=p > 0)


def keep_mask(seed: torch.Tensor, n_rows: int, n_cols: int, p: float, device) -> torch.Tensor:
    """The boolean keep-mask the kernels draw for ``seed`` (tests compare against torch with it)."""
    out = torch.empty((n_rows, n_cols), device=device, dtype=torch.bool)
    _mask[(triton.cdiv(n_rows, 64), triton.cdiv(n_cols, 64))](seed, out, n_rows, n_cols, threshold(p),
                                                              BLOCK_T=64, BLOCK_K=64)
    return out


@functools.cache
def _sms(device) -> int:
    """The device's SM count (grad_a splits its tokens to fill them); 4 elsewhere (Triton's CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
