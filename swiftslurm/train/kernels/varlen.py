"""Packed rows through PyTorch's own variable-length flash kernel (CUDA, sm80+): ``attn_implementation = "varlen_attn"``.

flash-attention is rarely installed on a cluster's nodes (it builds for an hour against one CUDA), but
PyTorch ships the same variable-length kernel. Given the start of every sample in the batch
(``cu_seq_lens``: 0, 3, 5, 8, ... over all rows laid end to end) it runs causal attention inside each
sample and never computes a score across samples: no mask is built, and short samples cost what short
samples cost, not what a full row costs. transformers has no entry for it, so this module registers
one (``NAME``) in its ``AttentionInterface`` and none in its mask interface, so transformers prepares no mask
(the boundaries come with the batch; ``register`` says why, ``refuse_masks`` refuses a padding mask).
``kernels.resolve_attention``'s "auto" takes it for packed bf16/fp16 rows on a GPU that runs it.

``PackingCollator(boundaries=True)`` adds ``cu_seq_lens_q``/``_k`` and ``max_length_q``/``_k`` to every
batch (the keys transformers' own flash path reads, which the models pass through to the attention
function). Without them (a batch that did not come from the packing collator) every row is one sequence,
which is right for unpadded rows; a padding mask is refused rather than ignored.

The kernel is one autograd node over aten's variable-length flash forward and backward (``_torch_kernel``),
the two ops torch's public ``torch.nn.attention.varlen.varlen_attn`` wraps: before torch 2.12 that one takes
no fewer key/value heads than query heads (every GQA model then pays a repeated copy of K and V and its
backward), and it adds two Python custom ops per layer. The aten ops take GQA as it is. ``attention`` speaks
``varlen_attn``'s contract, whose signature moved between releases (2.10: ``is_causal``; 2.11+: ``scale``,
``window_size``; 2.12+: ``enable_gqa``), asking a kernel what it takes, so ``use_kernel`` can put torch's
own function (benchmarks/gpu/packed_model.py compares them) or, in the CPU tests, a reference implementation
in its place (there is no flash kernel on a CPU); the tests also fake the two aten ops to check the node.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

NAME = "varlen_attn"
_kernel: Callable | None = None


def available() -> bool:
    """Whether this torch has the variable-length flash kernel (CUDA only; ``kernels`` checks the GPU)."""
    import torch

    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


def use_kernel(fn: Callable | None) -> None:
    """The kernel ``attention`` calls: None = torch's ``varlen_attn`` (looked up on first use)."""
    global _kernel
    _kernel = fn


def register() -> None:
    """Make ``NAME`` a valid ``attn_implementation`` for transformers (idempotent).

    No mask function is registered with it: the kernel takes no mask, and for an implementation without one
    transformers' ``create_causal_mask`` returns at once. With one (the flash rule, as before), every forward first
    ran ``find_packed_sequence_indices`` on the position ids, whose ``.all()`` made the host wait for the GPU's queue
    to drain at the start of each step (on the 0.5B shape, the GPU then idled while the host launched the forward).
    A padding mask, which that rule handed on to ``attention`` to be refused, is refused by ``refuse_masks``'s
    hook on the model instead, before it could be dropped."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def refuse_masks(model) -> None:
    """A forward pre-hook on ``model`` that refuses an ``attention_mask``: with ``NAME`` transformers builds no mask
    (``register``), so a padded batch's mask would otherwise be dropped silently. Packed rows carry none; the check
    reads no tensor, so it costs no sync."""

    def check(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)  # forward(input_ids, attention_mask, ...)
        if mask is not None and getattr(module.config, "_attn_implementation", NAME) == NAME:
            raise ValueError(f"{NAME} reads sample boundaries from the batch and cannot apply a padding mask: "
                             "use it with packed rows (train.packing = true)")

    model.register_forward_pre_hook(check, with_kwargs=True)


def boundaries(position_ids) -> dict[str, Any]:
    """The batch keys for ``position_ids`` of packed rows ``[rows, length]``: every sample (and a row's end
    padding) starts where its position is 0; rows are laid end to end, so a row's start is one too."""
    import torch

    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position_ids must start every row at 0")
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


@functools.cache
def _torch_kernel() -> Callable:
    """``flash_varlen``, built once (it needs torch, which this module does not import at load)."""
    import torch

    class FlashVarlen(torch.autograd.Function):
        """Causal flash attention over packed samples: aten's variable-length flash forward and backward,
        which take fewer key/value heads than query heads as they are (GQA, no repeated copies)."""

        @staticmethod
        def forward(ctx, q, k, v, cu, max_len, scale):
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False,
                                                                                scale=scale)
            ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
            ctx.max_len, ctx.scale = max_len, scale
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
            dq, dk, dv = torch.ops.aten._flash_attention_backward(grad.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len,
                                                                  0.0, True, rng, unused, scale=ctx.scale)
            return dq, dk, dv, None, None, None

    def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, scale=None, window_size=(-1, 0), enable_gqa=False):
        """torch 2.12's ``varlen_attn`` contract (causal only, self-attention: ``cu_q`` is ``cu_k``) in one
        autograd node: torch's own ``varlen_attn`` wraps the same two aten ops in Python custom ops, and before
        2.12 it needs repeated key/value heads (on an H200 the two were within noise of each other; docs/benchmarks.md)."""
        if tuple(window_size) != (-1, 0) or cu_q is not cu_k or max_q != max_k:
            raise ValueError("flash_varlen computes causal self-attention over one set of boundaries only")
        return FlashVarlen.apply(q, k, v, cu_q, max_q, scale)

    return flash_varlen


@functools.lru_cache(maxsize=8)
def _parameters(kernel: Callable) -> frozenset[str]:
    """The keyword names ``kernel`` takes (asked once per kernel, not on every layer's call)."""
    return frozenset(inspect.signature(kernel).parameters)


def attention(module, query, key, value, attention_mask, scaling: float | None = None, dropout: float = 0.0,
              cu_seq_lens_q=None, max_length_q: int | None = None, **kwargs):
    """transformers' attention-function contract: ``query [b, heads, s, d]``, ``key``/``value``
    ``[b, kv_heads, s, d]`` -> ``([b, s, heads, d], None)``."""
    import torch

    if attention_mask is not None:
        raise ValueError(f"{NAME} reads sample boundaries from the batch and cannot apply a padding mask: "
                         "use it with packed rows (train.packing = true)")
    if dropout:
        raise ValueError(f"{NAME} has no attention dropout (the model asks for {dropout})")
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    position_ids = kwargs.get("position_ids")
    if cu_seq_lens_q is None and position_ids is not None and position_ids.numel() == b * s:
        # sequence parallel: the batch was sharded without boundaries (DeepSpeed's Ulysses adapter shards every
        # tensor along the sequence), and its attention wrapper hands us the whole rows' gathered position_ids
        found = boundaries(position_ids)
        cu_seq_lens_q, max_length_q = found["cu_seq_lens_q"], found["max_length_q"]
    elif cu_seq_lens_q is None:  # not from the packing collator: every row is one sequence
        cu_seq_lens_q = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)
        max_length_q = s
    elif max_length_q is None:
        raise ValueError(f"{NAME} needs max_length_q with cu_seq_lens_q (the packing collator adds both)")
    kernel = _kernel or _torch_kernel()
    params = _parameters(kernel)
    q = query.transpose(1, 2).reshape(b * s, heads, d)
    k = key.transpose(1, 2).reshape(b * s, kv_heads, d)
    v = value.transpose(1, 2).reshape(b * s, kv_heads, d)
    options: dict[str, Any] = {}
    if kv_heads != heads:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:  # older torch: one key/value head per query head
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
    if scaling is not None:
        if "scale" in params:
            options["scale"] = scaling
        elif not math.isclose(scaling, d ** -0.5):
            q = q * (scaling * math.sqrt(d))  # the kernel applies 1/sqrt(d): fold the rest into the queries
    if "window_size" in params:
        options["window_size"] = (-1, 0)  # causal
    else:
        options["is_causal"] = True
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    out = kernel(q, k, v, cu, cu, int(max_length_q), int(max_length_q), **options)
    return out.reshape(b, s, heads, d), None
