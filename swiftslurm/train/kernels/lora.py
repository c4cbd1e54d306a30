"""``train.fused_lora``: a LoRA projection's frozen base and its adapter in one autograd function.

peft's ``lora.Linear`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: besides the two matmuls it writes
the full-width adapter output, scales it in a second pass, adds it to the base output in a third, and keeps a
dropped-out copy of ``x`` per projection for the backward (q, k and v each keep their own copy of the same input).
``LoraLinear`` computes the same function with fewer passes over ``[tokens, width]`` tensors:

- the scaling multiplies the ``[tokens, r]`` intermediate instead of the ``[tokens, out]`` output, and the adapter
  is added by the matmul itself (``addmm_`` into the base output);
- the backward adds the adapter's input gradient into the base's the same way (no dropout: ``addmm_``; with
  dropout the mask is applied by the add itself, ``addcmul_``);
- it keeps ``x`` (shared by the projections that read it) and the dropout mask (on GPUs only the mask's seed), and
  rebuilds the dropped-out input in the backward, so dropout costs at most one bool mask per projection instead of a
  mask and a copy of the input.

With ``lora_dropout > 0`` on a GPU (bf16/fp16, rank up to 128, Triton importable) the mask is drawn inside the
adapter's GEMMs from a seed (``lora_dropout.py``): nothing is stored and no pass is spent on it; the masks follow the
same law as peft's (kept with probability 1 - p, scaled by 1/(1 - p)) but are not the ones peft draws under the same
seed. Elsewhere (CPUs, other dtypes, wider ranks) the dropout draws its mask with ``torch.native_dropout``, the kernel
``nn.Dropout`` runs, after the base matmul, as peft does: under a fixed seed the masks are peft's.

Only a plain case is taken; anything else runs peft's own forward, decided at every call: adapters disabled or
merged, several active adapters, a LoRA variant (DoRA, ...), extra forward arguments, a base that is not a plain
``nn.Linear`` (quantized, tensor-parallel), ``fan_in_fan_out``, a LoRA bias, a trainable base weight, dtypes that
differ, or autocast on. Parameters partitioned by ZeRO-3 (gathered by hooks on the module's own forward) are never
patched.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

import torch
import torch.nn.functional as F


class LoraLinear(torch.autograd.Function):
    """``y = x W^T + b + s * dropout(x) A^T B^T`` with ``W``, ``b`` frozen; gradients for ``x``, ``A`` and ``B``."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, p: float):
        y = F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        kernels = _in_kernel_dropout(x, lora_a.shape[0]) if p > 0 else None
        if kernels is not None:  # the mask drawn inside the GEMMs from a seed: nothing stored (lora_dropout.py)
            flat = flat.contiguous()
            mask = kernels.new_seed(x.device)
            keep = kernels.keep_scale(p)  # 1/(1 - p) for the p the kernels apply (p on a 1/65536 grid)
            h = kernels.down(flat, lora_a.contiguous(), mask, p, scaling * keep)
        else:
            keep = 1.0 / (1.0 - p) if p > 0 else 1.0
            dropped, mask = torch.native_dropout(flat, p, True) if p > 0 else (flat, None)
            h = (dropped @ lora_a.t()).mul_(scaling)  # [tokens, r]: scaled here, not after B
        y.view(-1, y.shape[-1]).addmm_(h, lora_b.t())
        ctx.save_for_backward(x, mask, weight, lora_a, lora_b, h)
        ctx.p = p
        ctx.keep = keep
        ctx.scaling = scaling
        ctx.kernels = kernels
        return y

    @staticmethod
    def backward(ctx, grad):
        x, mask, weight, lora_a, lora_b, h = ctx.saved_tensors
        kernels, keep = ctx.kernels, ctx.keep
        g = grad.reshape(-1, grad.shape[-1])
        grad_b = g.t() @ h
        grad_h = (g @ lora_b).mul_(ctx.scaling)  # [tokens, r]
        flat = x.reshape(-1, x.shape[-1])
        if kernels is not None:  # mask is the seed
            flat = flat.contiguous()
            grad_a = kernels.grad_a(grad_h, flat, mask, ctx.p, keep)
        else:
            dropped = flat if mask is None else torch.ops.aten.native_dropout_backward(flat, mask, keep)
            grad_a = grad_h.t() @ dropped
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight
            if mask is None:
                grad_x.addmm_(grad_h, lora_a)
            elif kernels is not None:
                kernels.grad_x_add(grad_x, grad_h, lora_a.contiguous(), mask, ctx.p, keep)
            else:
                grad_x.addcmul_(grad_h @ lora_a, mask, value=keep)  # the mask applied in the add: one pass, not two
            grad_x = grad_x.view(x.shape)
        return grad_x, None, None, grad_a, grad_b, None, None


@functools.cache
def _dropout_kernels() -> Any:
    """The ``lora_dropout`` module, or None where Triton does not import (imported once, at the first GPU call)."""
    try:
        from swiftslurm.train.kernels import lora_dropout
    except ImportError:
        return None
    return lora_dropout


def _in_kernel_dropout(x: torch.Tensor, rank: int) -> Any:
    """``lora_dropout``'s Triton kernels where they take this input (a CUDA tensor, bf16/fp16, rank up to 128) and
    Triton imports; else None (torch's dropout)."""
    if not x.is_cuda:
        return None
    kernels = _dropout_kernels()
    return kernels if kernels is not None and kernels.supported(x, rank) else None


def _dropout_p(module: Any) -> float | None:
    """The dropout probability this call applies, or None for a dropout module this path does not know."""
    if isinstance(module, torch.nn.Identity):
        return 0.0
    if type(module) is torch.nn.Dropout:
        return float(module.p) if module.training else 0.0
    return None


def _fused_forward(self, x, *args, **kwargs):
    """Replaces ``forward`` on one peft ``lora.Linear``: the fused function where the case is plain, else peft's."""
    plain = not args and not kwargs and not self.disable_adapters and not self.merged and len(self.active_adapters) == 1
    if plain:
        name = self.active_adapters[0]
        base = self.base_layer
        if name in self.lora_A and name not in self.lora_variant and not torch.is_autocast_enabled(x.device.type):
            lora_a, lora_b = self.lora_A[name], self.lora_B[name]
            p = _dropout_p(self.lora_dropout[name])
            weight = base.weight
            if (p is not None and p < 1 and lora_b.bias is None and lora_a.bias is None and not weight.requires_grad
                    and not hasattr(weight, "ds_id")  # partitioned by ZeRO-3 after fuse_lora: gathered by peft's path only
                    and (base.bias is None or not base.bias.requires_grad)
                    and x.dtype == weight.dtype == lora_a.weight.dtype == lora_b.weight.dtype):
                return LoraLinear.apply(x, weight, base.bias, lora_a.weight, lora_b.weight, float(self.scaling[name]), p)
    return type(self).forward(self, x, *args, **kwargs)


def fuse_lora(model) -> int:
    """Give every plain peft ``lora.Linear`` of ``model`` the fused forward; returns how many. ZeRO-3 partitioned
    parameters (``ds_id``) and non-``nn.Linear`` bases keep peft's forward."""
    try:
        from peft.tuners.lora.layer import Linear as PeftLoraLinear
    except ImportError:
        return 0
    fused = 0
    for module in model.modules():
        if type(module) is not PeftLoraLinear or getattr(module, "fan_in_fan_out", False):
            continue
        base = getattr(module, "base_layer", None)
        if type(base) is not torch.nn.Linear or hasattr(base.weight, "ds_id"):
            continue
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            continue
        module.forward = types.MethodType(_fused_forward, module)  # type: ignore[method-assign]
        fused += 1
    return fused


def install(model, say: bool) -> int:
    """``fuse_lora`` and, when ``say`` (rank 0) and any were fused, the log line that says how many."""
    fused = fuse_lora(model)  # not ZeRO-3: its partitioned weights are gathered by hooks on peft's own forward
    if fused and say:
        logging.getLogger("swiftslurm.train").warning(
            "train.fused_lora: %d LoRA projections run base + adapter in one autograd function", fused)
    return fused
